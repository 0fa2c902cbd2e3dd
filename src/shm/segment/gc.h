#pragma once
// `tdshm gc`: what the read-only reader (reader/inspect.h) proves stale is removed, re-checked
// under the segment's lock file by tdshm::remove_stale_segment (liveness.h); the probe files of
// worlds that never finished forming too. Part of the segment's lifecycle: it sits above the
// reader, which never removes anything.
//
// collect_garbage (`tdshm gc`) removes, through tdshm::remove_stale_segment (which re-checks under
// the segment's lock file, so a group created or joined meanwhile is never removed), only what
// the reader proves stale: a segment of this layout version whose ranks are all dead, left or
// abandoned and that no live creator is still creating; a segment whose creation was interrupted
// (no header published, and the lock file records a creator that died creating it); and a lock
// file without a segment whose recorded creator and joiners are all dead. Anything else (another
// uid's file, group/other mode bits, a link, no tdshm magic, a corrupt header, another layout
// version, a truncated file whose rank table is cut) is kept and reported: it cannot be proven
// stale from here, and an operator removes it by hand. (Another layout version's segment is kept
// even with all its ranks dead: remove_stale_segment's check under the lock cannot read that
// version's ranks, so a group of the old version re-created under the name meanwhile would be
// removed with it.)

#include "shm/reader/inspect.h"

#include <string>
#include <utility>
#include <vector>

namespace tdshm::shm {

/// What gc does with one name.
struct GcItem {
  std::string name;
  SegmentStatus status = SegmentStatus::kMissing;
  bool removable = false;  // proven stale by the reader (dry run: would be removed)
  std::string reason;      // why removable, or why kept
  bool removed_segment = false;
  bool removed_lock = false;
  std::string error;  // a removal that failed unexpectedly (the lock timed out, ...)
};

struct GcOptions {
  bool dry_run = false;
  std::vector<std::string> names;  // only these names; empty: everything list_segments finds
};

/// The reader's verdict on one name: whether gc may try to remove it, and why (or why not).
std::pair<bool, std::string> gc_decision(const SegmentInfo& info);

/// Removes the stale segments and lock files (see the top of this file); a dry run only decides.
/// A removable name is removed with tdshm::remove_stale_segment, which re-checks under the lock
/// file and throws SegmentError if a rank lives by then: that name is then kept (reason: its
/// message), not an error.
std::vector<GcItem> collect_garbage(const GcOptions& options);

/// The locality probe files in the segment directory (kProbeFilePrefix): removable when the pid
/// in the name runs no process here (its world never finished forming; a probe of another PID
/// namespace is never a host-mate's, so removing it changes no partition), kept otherwise; a dry
/// run only decides. collect_garbage calls it when it is given no names.
std::vector<GcItem> collect_probes(bool dry_run);

}  // namespace tdshm::shm
