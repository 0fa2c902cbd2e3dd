// The transport under test: tdshm::ProcessGroupShm, in its spinning and blocking-only modes.
//
// Stub until ProcessGroupShm is implemented: its constructor does not link yet, so "shm" and
// "shm-blocking" report that they cannot be set up.

#include "pingpong_internal.h"

namespace tdshm::bench::detail {

c10::intrusive_ptr<c10d::ProcessGroup> make_shm_group(const std::string& /*name*/, int /*rank*/,
                                                      std::chrono::microseconds /*spin*/,
                                                      std::chrono::milliseconds /*timeout*/) {
  throw std::runtime_error("ProcessGroupShm is not implemented in this build yet");
}

void remove_shm_segment(const std::string& /*name*/) noexcept {}

}  // namespace tdshm::bench::detail
