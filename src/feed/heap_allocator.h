#pragma once
// Torch's CPU allocator, redirected into a feed producer's loan heap for the threads that ask
// (FeedProducer::allocate_in_heap): a tensor the producer's own code makes (a dataset's batch)
// then already lies in the heap, and put() sends it by reference instead of copying it in.
//
// The redirect is installed into c10 once per process, on the first scope, and passes every
// other allocation (other threads, smaller ones, no room, a forked child) to the allocator it
// replaced. A heap allocation's DataPtr carries its own address as context, as the default
// allocator's do, so that c10's raw_allocate / raw_deallocate keep working; the loan tensor that
// owns the bytes is kept in a process-wide table until that DataPtr is deleted.

#include <ATen/core/Tensor.h>

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>

namespace tdshm::feed {

/// Where one thread's large allocations go while a scope is open.
struct HeapSource {
  /// Allocations smaller than this go to the replaced allocator.
  size_t min_bytes = size_t{64} << 10;
  /// The process that opened the scope: a child forked inside it allocates as usual (the heap is
  /// shared with the parent, its bookkeeping is not).
  pid_t pid = 0;
  /// A loan of that many bytes (kByte), or an undefined tensor (no heap, no room, or enough of
  /// the heap held by allocations not freed yet). Never waits.
  std::function<at::Tensor(uint64_t bytes)> take{};
};

/// Makes `source` (null: none) the calling thread's source, installing the redirect first when
/// needed; returns the previous one (scopes nest). False in `installed` when c10 kept another
/// allocator (one registered with a higher priority): allocations are then never redirected.
const HeapSource* set_thread_heap_source(const HeapSource* source, bool* installed = nullptr);

/// The bytes of redirected allocations not freed yet, in this process.
uint64_t heap_allocations_live_bytes();
/// The bytes of the redirected allocation that starts at `data`; 0 when none does.
uint64_t redirected_bytes(const void* data);

}  // namespace tdshm::feed
