#pragma once
// The transport under test of the ping-pong benchmark (pingpong_shm.cpp): tdshm::ProcessGroupShm
// on a segment of the run, in its spinning and blocking-only modes, and the removal of a segment
// left behind.

#include "pingpong_transport.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>

#include <chrono>
#include <string>

namespace tdshm::bench::detail {

/// ShmOptions::spin by default (what users get; the bench's spinning mode uses it).
std::chrono::microseconds default_shm_spin();
/// tdshm::ProcessGroupShm on segment `name`; `spin` is ShmOptions::spin (0: blocking only).
c10::intrusive_ptr<c10d::ProcessGroup> make_shm_group(const std::string& name, int rank,
                                                      std::chrono::microseconds spin,
                                                      std::chrono::milliseconds timeout);
/// The loan path of tdshm::ProcessGroupShm (docs/loans.md) on segment `name`, with a loan heap of
/// `max_bytes`: each rank sends a loan it filled once (a reference, no copy) and receives the
/// other's as a view (recv_view), which it checks (first, middle and last byte) and drops, so
/// that the sender's ticket comes back. No byte of the payload is copied by the transport: the
/// one-way time does not grow with the size.
std::unique_ptr<PingPong> make_loan_pingpong(const std::string& name, int rank, size_t max_bytes,
                                             std::chrono::milliseconds timeout);
/// Removes segment `name` if it was left behind (all its ranks dead). Never throws.
void remove_shm_segment(const std::string& name) noexcept;

}  // namespace tdshm::bench::detail
