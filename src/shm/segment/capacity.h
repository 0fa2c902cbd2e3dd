#pragma once
// Room in /dev/shm for a new segment. When there is too little, the error counts the stale
// segments that `tdshm gc` would remove there: this part reads them through the operator reader
// (inspect.h), which is why it sits above it, apart from the other segment parts.

#include <cstdint>
#include <string>

namespace tdshm::shm {

/// Throws SegmentError when /dev/shm has fewer than `bytes` free for the segment `name` (not
/// measurable: no error; the reservation still fails cleanly).
void check_capacity(uint64_t bytes, const std::string& name);

/// What segments that `tdshm gc` would remove hold in /dev/shm, `except` left out, as the end of
/// an error about its free space: "; N stale tdshm segments ... hold M MiB there: ...", or ""
/// when there are none.
std::string stale_segments_hint(const std::string& except);

}  // namespace tdshm::shm
