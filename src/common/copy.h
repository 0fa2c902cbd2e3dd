#pragma once
// Bulk byte copies for large payloads (consolidation now, the shared-memory transport later).

#include <cstddef>

namespace tdshm::detail {

/// Copies at or above this total are "streaming": the destination will not be read back soon
/// and does not fit in the L2 cache, so writing around the cache pays (see copy_bytes).
inline constexpr size_t kStreamingCopyBytes = size_t{1} << 20;

/// memcpy(dst, src, n) for non-overlapping ranges. With `streaming`, ranges of 4 KiB and more
/// are written with non-temporal stores (x86-64 SSE2, part of the base ISA): the destination's
/// cache lines are not read first and the cache keeps what it had. Measured on this project's
/// 2-core EPYC machines, 10 x 1 MiB into a cold buffer: 1.4x to 2.5x faster than memcpy.
/// Elsewhere, or without `streaming`, it is memcpy. Ends with a store fence, so the bytes are
/// visible to other threads and processes in the usual release/acquire way afterwards.
void copy_bytes(void* dst, const void* src, size_t n, bool streaming) noexcept;

}  // namespace tdshm::detail
