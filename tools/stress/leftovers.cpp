// What the runs of `tdshm stress` leave behind: the /dev/shm entries of a segment name (a leak
// unless they are gone after the cleanup) and the worker logs of a run that needs none.

#include "stress_internal.h"

#include <algorithm>
#include <system_error>

namespace tdshm::tools::stress {

std::vector<std::string> shm_entries(const std::string& prefix_or_name, bool prefix) {
  std::vector<std::string> out;
  std::error_code ec;
  const std::string base = "tdshm." + prefix_or_name;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string n = e.path().filename().string();
    if (prefix ? n.rfind(base, 0) == 0 : (n == base || n.rfind(base + ".", 0) == 0)) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void unlink_entries(const std::vector<std::string>& names) {
  for (const std::string& n : names) {
    std::error_code ec;
    std::filesystem::remove(std::filesystem::path("/dev/shm") / n, ec);
  }
}

void remove_logs(const Driver& d, const std::string& name) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(d.log_dir, ec)) {
    if (e.path().filename().string().rfind(name + ".", 0) == 0) std::filesystem::remove(e.path(), ec);
  }
}

}  // namespace tdshm::tools::stress
