#pragma once
// One message of a ProcessGroupShm batch (send_batch / recv_batch) without a Work of its own: a
// per-leaf irecv's LeafWork (distributed/per_leaf.cpp) holds the batch's Work and the message's
// index, so a transfer of n leaves builds n Works instead of 2n (shm_batch_messages builds one
// per message). `batch` must be a Work that send_batch or recv_batch returned. Internal.

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>

namespace tdshm::detail::shm_batch {

/// Polls once (never waits); true once message i completed, with or without an error.
bool completed(c10d::Work& batch, size_t i);
/// Message i completed without an error.
bool succeeded(const c10d::Work& batch, size_t i);
/// Message i's error, null while it is pending or when it succeeded.
std::exception_ptr error(const c10d::Work& batch, size_t i);
/// Waits for message i alone (ShmOptions::timeout for kNoTimeout), rethrowing its error.
void wait(c10d::Work& batch, size_t i, std::chrono::milliseconds timeout);
/// Fails message i if it is still pending (Work::abort).
void abort(c10d::Work& batch, size_t i);
/// shm_sender_leaf_count of message i.
uint16_t sender_leaves(const c10d::Work& batch, size_t i);

}  // namespace tdshm::detail::shm_batch
