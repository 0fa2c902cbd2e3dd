// The interop tests' worlds of C++ and Python ranks (interop_world.h).

#include "interop/interop_world.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include "dist/python_launcher.h"

// Where python3 and the peer are: compile definitions from tests/CMakeLists.txt (the environment
// variable TDSHM_INTEROP_PYTHON overrides the interpreter).
#ifndef TDSHM_INTEROP_PYTHON
#define TDSHM_INTEROP_PYTHON ""
#endif
#ifndef TDSHM_INTEROP_PEER
#define TDSHM_INTEROP_PEER ""
#endif
#ifndef TDSHM_INTEROP_PYTHONPATH
#define TDSHM_INTEROP_PYTHONPATH ""
#endif

namespace tdshm::test::interop {

using namespace std::chrono_literals;

namespace {

/// Removes the entries of /dev/shm whose names start with `prefix` and that were changed (made)
/// at or after `since`, and returns their names.
std::vector<std::string> remove_shm_entries_since(const std::string& prefix, std::filesystem::file_time_type since) {
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("tdshm." + prefix, 0) != 0) continue;
    const auto changed = std::filesystem::last_write_time(e.path(), ec);
    if (ec || changed < since) continue;
    if (std::filesystem::remove(e.path(), ec)) removed.push_back(name);
  }
  return removed;
}

}  // namespace

std::string python_exe() {
  if (const char* e = std::getenv("TDSHM_INTEROP_PYTHON"); e != nullptr && *e != '\0') return e;
  return TDSHM_INTEROP_PYTHON;
}

const char* api_arg(Api a) { return a == Api::kSync ? "sync" : a == Api::kAsync ? "async" : "early"; }

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string tail(const std::string& s, size_t n) { return s.size() <= n ? s : "..." + s.substr(s.size() - n); }

PyProcess::PyProcess(const std::vector<std::string>& args, const std::string& log) : log_(log), args_(args) {
  std::string pythonpath = std::string(TDSHM_INTEROP_PYTHONPATH);
  if (const char* outer = std::getenv("PYTHONPATH"); outer != nullptr && *outer != '\0') {
    pythonpath += std::string(":") + outer;
  }
  const std::vector<std::string> env = environment_with({"PYTHONPATH=" + pythonpath, "OMP_NUM_THREADS=1",
                                                         "PYTHONDONTWRITEBYTECODE=1", "GLOO_SOCKET_IFNAME=lo"});
  child_ = std::make_unique<Child>(start_python(python_exe(), {TDSHM_INTEROP_PEER, args, env, log}));
}

std::string PyProcess::command() const {
  std::string s = python_exe() + " " + TDSHM_INTEROP_PEER;
  for (const std::string& a : args_) s += " " + a;
  return s;
}

void InteropTest::SetUp() {
  DistTest::SetUp();
  set_deadline(kWorldDeadline + 20s);
  if (python_exe().empty()) {
    GTEST_SKIP() << "no python3 with torch and numpy was found at configure time (set TDSHM_INTEROP_PYTHON)";
  }
}

void InteropTest::run(const World& w) {
const auto started = std::filesystem::file_time_type::clock::now();  // before any rank exists
// One file:// store for both backends: torch.distributed (Python) only rendezvouses through
// a store, and tdshm's shm backend, registered with torch by the tdshm package, takes its
// segment's name from it; C++ ranks join the same store.
const std::string init = "file://" + dir_.path() + "/store" + std::to_string(++files_);
std::map<int, std::unique_ptr<PyProcess>> py;
for (const auto& [rank, scenario] : w.py) {
  std::vector<std::string> args = {"--rank", std::to_string(rank), "--world", std::to_string(w.size),
                                   "--init-method", init, "--backend", w.backend, "--timeout",
                                   std::to_string(kTimeout.count() / 1000)};
  if (!w.group_ranks.empty()) {
    std::string g;
    for (const int r : w.group_ranks) g += (g.empty() ? "" : ",") + std::to_string(r);
    args.insert(args.end(), {"--group-ranks", g});
  }
  args.insert(args.end(), scenario.begin(), scenario.end());
  py[rank] = std::make_unique<PyProcess>(args, dir_.path() + "/py" + std::to_string(rank) + ".log");
}
std::map<int, std::unique_ptr<Child>> cpp;
for (const auto& [rank, body] : w.cpp) {
  cpp[rank] = std::make_unique<Child>([&w, &init, rank = rank, &body = body] {
    InitOptions o;
    o.rank = rank;
    o.world_size = w.size;
    o.init_method = init;
    o.timeout = kTimeout;
    ::setenv("GLOO_SOCKET_IFNAME", "lo", 1);
    init_process_group(w.backend, o);
    Group g;
    if (!w.group_ranks.empty()) g = new_group(w.group_ranks);
    body(g);
    default_group().backend().barrier()->wait(kTimeout);
    destroy_process_group();
  });
}
std::vector<Child*> all;
for (auto& [r, p] : py) all.push_back(&p->child());
for (auto& [r, c] : cpp) all.push_back(c.get());
const auto deadline = Clock::now() + kWorldDeadline;
std::optional<Clock::time_point> grace_end;
for (;;) {
  bool done = true, failed = false;
  for (Child* c : all) {
    if (!c->poll()) {
      done = false;
    } else if (!c->ok()) {
      failed = true;
    }
  }
  if (done) break;
  if (failed && !grace_end) grace_end = Clock::now() + 3s;
  if (Clock::now() >= deadline || (grace_end && Clock::now() >= *grace_end)) {
    for (Child* c : all) c->kill();
    for (Child* c : all) c->wait(5s);
    break;
  }
  std::this_thread::sleep_for(5ms);
}
for (auto& [rank, c] : cpp) {
  if (!c->ok()) ADD_FAILURE() << "C++ rank " << rank << ": " << c->describe();
}
// A shm group made over a store lives on the segment "pg-<pid of its creator>-<random>":
// nothing of one may be left in /dev/shm once every rank has left (removed either way). Only
// entries made since this world started count: a pid is reused, and a segment of another
// test's process that once had a rank's pid is that test's (it may still be in use).
for (Child* c : all) {
  const std::vector<std::string> left = remove_shm_entries_since("pg-" + std::to_string(c->pid()) + "-", started);
  if (!left.empty() && !HasFailure()) {
    std::string list;
    for (const std::string& l : left) list += " /dev/shm/" + l;
    ADD_FAILURE() << "left behind in /dev/shm (now removed):" << list;
  }
}
for (auto& [rank, p] : py) {
  const std::string out = p->output();
  if (!p->child().ok()) {
    ADD_FAILURE() << "Python rank " << rank << ": " << p->child().describe() << "\n$ " << p->command() << "\n"
                  << tail(out);
  } else if (out.find("\"metadata_notes\": [\"") != std::string::npos) {
    std::cout << "[ note     ] Python rank " << rank << ": " << tail(out, 2000) << std::endl;
  }
}
}

}  // namespace tdshm::test::interop
