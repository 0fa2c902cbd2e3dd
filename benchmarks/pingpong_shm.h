#pragma once
// The transport under test of the ping-pong benchmark (pingpong_shm.cpp): tdshm::ProcessGroupShm
// on a segment of the run, in its spinning and blocking-only modes, and the removal of a segment
// left behind.

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <string>

namespace tdshm::bench::detail {

/// ShmOptions::spin by default (what users get; the bench's spinning mode uses it).
std::chrono::microseconds default_shm_spin();
/// tdshm::ProcessGroupShm on segment `name`; `spin` is ShmOptions::spin (0: blocking only).
c10::intrusive_ptr<c10d::ProcessGroup> make_shm_group(const std::string& name, int rank,
                                                      std::chrono::microseconds spin,
                                                      std::chrono::milliseconds timeout);
/// Removes segment `name` if it was left behind (all its ranks dead). Never throws.
void remove_shm_segment(const std::string& name) noexcept;

}  // namespace tdshm::bench::detail
