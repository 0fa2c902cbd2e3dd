#pragma once
// The files tdshm opens in /dev/shm and the checks before it trusts one: a valid segment name,
// no symbolic link followed, a regular file of this process's uid with no group/other bits.
//
// Trust model. Trusted: processes of the same user (effective uid) that joined the group.
// Everything else is refused, never joined, truncated or written:
//  * the segment /dev/shm/tdshm.<name> and its lock file /dev/shm/tdshm.<name>.lock must be
//    regular files owned by the caller's effective uid with no group/other permission bits (they
//    are created 0600 with O_EXCL); both are opened with O_NOFOLLOW, so a symlink planted at
//    either path is an error, never followed;
//  * a segment whose size disagrees with its header is never mapped past the file's end; a file
//    truncated later, while mapped, is survived (bus_guard.h);
//  * a member may still be buggy: every value the engine reads from the segment is read once,
//    bounded and validated (validate.h), and a bad entry fails that pair's transfers with a
//    TransportError.

#include <tdshm/errors.h>

#include <sys/stat.h>

#include <string>

namespace tdshm::shm {

/// Where segments live, and the prefix of their file names.
inline constexpr const char* kSegmentDir = "/dev/shm";
inline constexpr const char* kSegmentFilePrefix = "tdshm.";
/// The prefix of the probe files a forming world makes beside them (process_group/locality.h):
/// "tdshm-probe.<pid>.<32 hex digits>", not "tdshm.<...>", so that no reader takes one for a
/// segment; `tdshm gc` removes those whose process is gone (collect_probes).
inline constexpr const char* kProbeFilePrefix = "tdshm-probe.";

/// /dev/shm/tdshm.<name>, and its lock file /dev/shm/tdshm.<name>.lock.
std::string segment_path(const std::string& name);
std::string lock_path(const std::string& name);

/// Why open(path) failed with `err`, in words that point the user the right way (`what`: "segment",
/// "lock file").
SegmentError open_error(const std::string& path, const std::string& what, int err);

/// Checks that `fd` (opened from `path`) is a regular file of this uid, private to it; throws
/// SegmentError otherwise. `out`, when given, receives its fstat.
void check_owned(int fd, const std::string& path, const std::string& what, struct stat* out = nullptr);

/// Opens the segment file of `name` read-write, refusing links and other users' files; returns
/// -1 when there is none. `st` receives its fstat.
int open_segment(const std::string& name, struct stat& st);

}  // namespace tdshm::shm
