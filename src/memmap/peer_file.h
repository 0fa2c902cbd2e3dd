#pragma once
// Internal: the files a peer names, and what a receiver opens for it. A memory-mapped leaf sent
// by reference (a ring entry's memmap reference, or init_remote's reference table) names a path
// the sender chose; the receiver reads it, or maps it, only under these rules (docs/trust.md):
//  * the path is absolute, without '.' or '..' parts;
//  * no symbolic link is followed, at any level: the path is walked one directory at a time,
//    each opened with O_NOFOLLOW (a legitimate sender names its file's canonical path);
//  * the file is a regular file owned by this process's effective uid (the group's members are
//    one user); anything else (a FIFO, a device, a directory, another user's file) is refused
//    from its lstat, before it is opened, so that opening never blocks and has no side effects;
//  * it is opened read-only unless the caller asked to write (the receiver's choice, never the
//    sender's).

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace tdshm::detail {

/// Opens `path` under the rules above: a descriptor the caller closes, or -1 with `problem`
/// saying why ("is a symbolic link", "is not a regular file (a FIFO)", "is owned by uid 0", ...).
int open_peer_file(const std::string& path, bool writable, std::string& problem) noexcept;

/// The name to send a peer for a file this process maps as `path`: its canonical form (no links,
/// no '.' or '..'), or `path` itself when it cannot be resolved (the peer then refuses it).
std::string peer_path(const std::string& path);

/// Maps `shape` x `dtype` at `offset` of a file a peer named, opened by open_peer_file (shared and
/// writable only when `writable`, else a private copy-on-write mapping that still sees the file).
/// MemmapError saying why when the rules refuse it or the file is too short.
at::Tensor map_peer_file(const std::string& path, c10::ScalarType dtype, c10::IntArrayRef shape, int64_t offset,
                         bool writable);

}  // namespace tdshm::detail
