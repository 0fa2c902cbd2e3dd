// Room in /dev/shm for a new segment, and the stale segments there that gc would remove.

#include "shm/segment/capacity.h"

#include <tdshm/errors.h>

#include "shm/parts/trust.h"
#include "shm/segment/gc.h"

#include <sys/statvfs.h>

namespace tdshm::shm {

// Groups whose processes were all killed leave their segments behind, and a job whose names are
// fresh each run (the Python backend's are random) never replaces them. Only read (inspect.h):
// nothing is removed without the user's say.
std::string stale_segments_hint(const std::string& except) {
  uint64_t count = 0, held = 0;
  try {
    for (const SegmentInfo& info : list_segments()) {
      if (info.name == except || !gc_decision(info).first) continue;
      ++count;
      held += info.file_bytes;
    }
  } catch (...) {
    return "";  // a hint only
  }
  if (count == 0) return "";
  return "; " + std::to_string(count) + " stale tdshm segment" + (count == 1 ? "" : "s") + " (every rank dead) hold " +
         std::to_string(held >> 20) + " MiB there: `tdshm gc` removes " + (count == 1 ? "it" : "them") +
         " (tdshm::remove_stale_segment(name) from code)";
}

void check_capacity(uint64_t bytes, const std::string& name) {
  struct statvfs fs {};
  if (::statvfs(kSegmentDir, &fs) != 0) return;  // not measurable: the reservation at creation still guards
  const uint64_t avail = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  if (bytes > avail) {
    throw SegmentError("segment '" + name + "' needs " + std::to_string(bytes) + " bytes (" +
                       std::to_string(bytes >> 20) + " MiB) but " + kSegmentDir + " has " + std::to_string(avail) +
                       " bytes free: enlarge it (docker run --shm-size=" + std::to_string((bytes >> 20) + 64) +
                       "m, or mount -o remount,size=... " + kSegmentDir +
                       ") or make ShmOptions::slot_bytes / slots_per_rank / ring_entries smaller" +
                       stale_segments_hint(name));
  }
}

}  // namespace tdshm::shm
