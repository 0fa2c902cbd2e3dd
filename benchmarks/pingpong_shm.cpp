// The transport under test: tdshm::ProcessGroupShm, in its spinning and blocking-only modes.

#include "pingpong_shm.h"

#include <tdshm/process_group.h>

namespace tdshm::bench::detail {

std::chrono::microseconds default_shm_spin() { return ShmOptions{}.spin; }

c10::intrusive_ptr<c10d::ProcessGroup> make_shm_group(const std::string& name, int rank,
                                                      std::chrono::microseconds spin,
                                                      std::chrono::milliseconds timeout) {
  ShmOptions options;
  options.spin = spin;
  options.timeout = timeout;
  return c10::make_intrusive<ProcessGroupShm>(name, rank, 2, options);
}

void remove_shm_segment(const std::string& name) noexcept {
  try {
    remove_stale_segment(name);
  } catch (...) {
    // A segment still in use by a live rank is not ours to remove; nothing else can be done.
  }
}

}  // namespace tdshm::bench::detail
