#pragma once
// The interop tests' worlds (test_interop.cpp): C++ ranks (forked children that call
// tdshm::init_process_group) and Python ranks (td_peer.py, started from the warm interpreter)
// in one world over one file:// store, every wait with a deadline, and what a world leaves in
// /dev/shm removed and reported.

#include <tdshm/distributed.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dist/dist_support.h"

namespace tdshm::test::interop {

/// Deadline of every group of the interop worlds (rendezvous and waits), C++ and Python.
inline constexpr std::chrono::milliseconds kTimeout{15000};
/// Deadline of one world, start to end.
inline constexpr std::chrono::seconds kWorldDeadline{50};

/// The python3 of the interop tests: TDSHM_INTEROP_PYTHON from the environment, else the one
/// found at configure time (tests/CMakeLists.txt); empty when there is none.
std::string python_exe();

/// How td_peer.py's side of a transfer calls (its --api).
enum class Api { kSync, kAsync, kEarly };
const char* api_arg(Api a);

/// One world: `size` ranks, each either C++ (a body run after init_process_group and, when
/// group_ranks is set, new_group(group_ranks); given that group, not defined() on a
/// non-member) or Python (td_peer.py scenario arguments).
struct World {
  std::string backend = "gloo";
  int size = 2;
  std::vector<int> group_ranks{};
  std::map<int, std::function<void(const Group&)>> cpp{};
  std::map<int, std::vector<std::string>> py{};
};

/// A file's contents ("" if it cannot be read).
std::string read_file(const std::string& path);
/// The last `n` characters of `s`, after "..." when cut.
std::string tail(const std::string& s, size_t n = 6000);

/// A Python rank running td_peer.py with `args`, stdout and stderr into `log`, forked from the
/// warm interpreter (dist/python_launcher.h) with the tests' environment for Python ranks.
class PyProcess {
 public:
  PyProcess(const std::vector<std::string>& args, const std::string& log);

  Child& child() { return *child_; }
  std::string command() const;
  std::string output() const { return read_file(log_); }

 private:
  std::string log_;
  std::vector<std::string> args_;
  std::unique_ptr<Child> child_;
};

class InteropTest : public DistTest {
 protected:
  void SetUp() override;
  /// Runs the world; every rank must succeed. A rank that fails gets the others killed after
  /// a grace of 3 s (they would otherwise wait for it until their own deadline).
  void run(const World& w);
};

}  // namespace tdshm::test::interop
