#pragma once
// Collectives over the segment's windows (collective/steps.h: the steps).
//
// Protocol. Each rank owns a window of the segment (ShmOptions::window_bytes) split in
// kWindowParts (4) parts, and words in its RankSlot: `published`, `consumed` and
// `step_check[4]`. Every rank runs the same numbered steps. In step s a rank
//   1. waits until every peer's `consumed` >= s - 4 (the part s % 4 it is about to overwrite was
//      last read in step s - 4), writes into part s % 4 and the step's word (what the collective
//      is, its sizes, s) into step_check[s % 4];
//   2. stores `published` = s (release) and wakes sleeping peers;
//   3. waits until every peer's `published` >= s, and checks every peer's word against its own
//      (TransportError: the ranks called different collectives or with other sizes); after the
//      first step of a rooted collective has matched, its later steps wait only for the ranks
//      whose parts they read (the root, or everyone on the root);
//   4. reads the peers' parts it needs, straight from their windows, and stores `consumed` = s.
// A writer may run up to 3 steps ahead of its slowest reader, so with more ranks than cores a
// rank that gets the CPU can do several steps before it has to wait. A peer's part is read only
// at fixed offsets of its own window, whatever the peer wrote in its words; values are data.
// A step that fails (a peer lost, a timeout, a mismatch, a cut segment) leaves the group's steps
// out of step: every later collective of the group fails with that error.
//
// Results are the same on every rank, bit for bit: every element of a reduction is computed once,
// by one rank, in rank order (rank 0 op rank 1 op ...), or by every rank in that same order.

#include "shm/collective/reduce.h"
#include "shm/engine/engine.h"

#include <c10/core/ScalarType.h>

#include <chrono>
#include <cstdint>
#include <span>

namespace tdshm::detail {

using Deadline = std::chrono::steady_clock::time_point;

/// Every rank has entered it.
void shm_barrier(ShmEngine& e, Deadline deadline);

/// `bytes` of `data` from `root` to every rank.
void shm_broadcast(ShmEngine& e, uint8_t* data, uint64_t bytes, int root, Deadline deadline);

/// Reduces `n` elements of `dtype` in place: on every rank (root < 0, all_reduce) or on `root`
/// only (the others' data is left as it was). `op` must pass reduce_problem.
void shm_reduce(ShmEngine& e, uint8_t* data, uint64_t n, at::ScalarType dtype, ReduceKind op, int root,
                Deadline deadline);

/// Every rank's `in` (`bytes` each) into outs[rank] on every rank (root < 0) or on `root` only
/// (outs is then ignored elsewhere). outs has world entries where it is used.
void shm_gather(ShmEngine& e, const uint8_t* in, uint64_t bytes, std::span<uint8_t* const> outs, int root,
                Deadline deadline);

/// ins[r] (`bytes` each, on `root` only) into `out` of rank r.
void shm_scatter(ShmEngine& e, std::span<const uint8_t* const> ins, uint8_t* out, uint64_t bytes, int root,
                 Deadline deadline);

/// out (n elements) of rank r = ins[r] of rank 0 op ins[r] of rank 1 op ...
void shm_reduce_scatter(ShmEngine& e, std::span<const uint8_t* const> ins, uint8_t* out, uint64_t n,
                        at::ScalarType dtype, ReduceKind op, Deadline deadline);

/// Rank r sends send_bytes[d] bytes of `in` (consecutive, in rank order) to each rank d, and
/// receives recv_bytes[s] bytes from each rank s into `out` (consecutive, in rank order). Every
/// rank checks every pair's sizes (TransportError on all ranks when a pair disagrees).
void shm_alltoall(ShmEngine& e, const uint8_t* in, std::span<const uint64_t> send_bytes, uint8_t* out,
                  std::span<const uint64_t> recv_bytes, Deadline deadline);

}  // namespace tdshm::detail
