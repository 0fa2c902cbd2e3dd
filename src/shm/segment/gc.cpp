// `tdshm gc`: the reader's verdict on each name (proven stale or kept, and why), and the removal
// of what it proves stale, re-checked under the lock file by tdshm::remove_stale_segment; and the
// probe files of worlds that never finished forming (collect_probes).

#include "shm/segment/gc.h"

#include "shm/parts/trust.h"

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <iterator>
#include <string>
#include <tuple>

namespace tdshm::shm {

std::pair<bool, std::string> gc_decision(const SegmentInfo& info) {
  const auto keep = [](std::string why) { return std::pair<bool, std::string>{false, std::move(why)}; };
  const auto remove = [](std::string why) { return std::pair<bool, std::string>{true, std::move(why)}; };
  if (!info.name_valid) return keep("not a segment name tdshm uses");
  if (info.lock.refused) return keep("its lock file is refused (" + info.lock.problem + ")");
  if (info.lock.creating && info.lock.creator && info.lock.creator->alive) {
    return keep("being created by pid " + std::to_string(info.lock.creator->pid));
  }
  for (const LockProcess& j : info.lock.joiners) {
    if (j.alive) return keep("pid " + std::to_string(j.pid) + " is joining it as rank " + std::to_string(j.rank));
  }
  switch (info.status) {
    case SegmentStatus::kValid:
    case SegmentStatus::kTruncated: {
      if (!info.ranks_read)
        return keep("its rank table cannot be read (" + info.problem + "): cannot tell whether it is in use");
      for (const RankInfo& r : info.ranks) {
        if (r.alive && !r.foreign)
          return keep("in use: rank " + std::to_string(r.rank) + " (pid " + std::to_string(r.pid) + ") is alive");
      }
      for (const RankInfo& r : info.ranks) {
        // Its pid means another process here (or none): whether it runs cannot be told.
        if (r.alive) {
          return keep("rank " + std::to_string(r.rank) + " (pid " + std::to_string(r.pid) +
                      " there) runs in another PID namespace: whether it is alive cannot be told from here");
        }
      }
      std::string states;
      for (const RankInfo& r : info.ranks) {
        if (r.rank >= 8) {
          states += ", ...";
          break;
        }
        states += (states.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r.rank) + " " + r.state_name();
      }
      return remove("no live rank (" + states + ")");
    }
    case SegmentStatus::kIncomplete:
      if (info.lock.creator && info.lock.creating && !info.lock.creator->alive) {
        return remove("its creation was interrupted: creator pid " + std::to_string(info.lock.creator->pid) + " died");
      }
      return keep("incomplete (" + info.problem + ") and no record of an interrupted creation: not provably stale");
    case SegmentStatus::kLockOnly: return remove("a lock file without a segment, with no live creator or joiner");
    case SegmentStatus::kCreating: return keep("being created");
    case SegmentStatus::kOtherVersion: {
      // Never removed from here: remove_stale_segment's re-check under the lock cannot read
      // another version's ranks, so a group of that version re-created meanwhile would go too.
      const std::string version = "layout version " + std::to_string(info.layout_version) + ", not this tdshm's " +
                                  std::to_string(kLayoutVersion);
      if (!info.ranks_read) return keep(version + ": its ranks cannot be read");
      for (const RankInfo& r : info.ranks) {
        if (r.alive) {
          return keep("in use (" + version + "): rank " + std::to_string(r.rank) + " (pid " + std::to_string(r.pid) +
                      ") is alive");
        }
      }
      return keep(version +
                  ": no live rank, but only a tdshm of that version removes it; if no process uses it, "
                  "delete " +
                  info.path + " and " + info.path + ".lock");
    }
    case SegmentStatus::kNotTdshm:
    case SegmentStatus::kCorrupt:
    case SegmentStatus::kRefused:
    case SegmentStatus::kUnreadable:
      return keep(std::string(status_name(info.status)) + " (" + info.problem +
                  "): not provably stale; remove it by hand if it is yours and unused");
    case SegmentStatus::kMissing: return keep("no such segment");
  }
  return keep("unknown status");
}

std::vector<GcItem> collect_probes(bool dry_run) {
  std::vector<GcItem> items;
  DIR* dir = ::opendir(kSegmentDir);
  if (dir == nullptr) return items;
  const std::string prefix = kProbeFilePrefix;
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(dir)) {
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) names.emplace_back(e->d_name);
  }
  ::closedir(dir);
  for (const std::string& name : names) {
    GcItem item;
    item.name = name;
    item.status = SegmentStatus::kNotTdshm;
    const std::string rest = name.substr(prefix.size());
    const size_t dot = rest.find('.');
    long pid = 0;
    try {
      pid = dot == std::string::npos ? 0 : std::stol(rest.substr(0, dot));
    } catch (const std::exception&) {
    }
    if (pid <= 0) {
      item.reason = "not a probe name tdshm makes";
    } else if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM) {
      item.reason = "a locality probe of pid " + std::to_string(pid) + ", which runs";
    } else {
      item.removable = true;
      item.reason = "a locality probe of pid " + std::to_string(pid) +
                    ", which no longer runs (its world never finished forming)";
      if (!dry_run) {
        if (::unlink((std::string(kSegmentDir) + "/" + name).c_str()) == 0 || errno == ENOENT) {
          item.removed_segment = true;
        } else {
          item.error = std::string("cannot remove it: ") + std::strerror(errno);
        }
      }
    }
    items.push_back(std::move(item));
  }
  return items;
}

std::vector<GcItem> collect_garbage(const GcOptions& options) {
  std::vector<SegmentInfo> infos;
  if (options.names.empty()) {
    infos = list_segments();
  } else {
    for (const std::string& name : options.names) infos.push_back(inspect_segment(name));
  }
  std::vector<GcItem> items;
  for (const SegmentInfo& info : infos) {
    GcItem item;
    item.name = info.name;
    item.status = info.status;
    std::tie(item.removable, item.reason) = gc_decision(info);
    if (item.removable && !options.dry_run) {
      const std::string lock = info.path + ".lock";
      struct stat st {};
      const bool had_lock = ::lstat(lock.c_str(), &st) == 0;
      try {
        // Re-checks under the lock file: throws SegmentError if a rank lives by now.
        item.removed_segment = tdshm::remove_stale_segment(info.name);
        item.removed_lock = had_lock && ::lstat(lock.c_str(), &st) != 0 && errno == ENOENT;
      } catch (const SegmentError& e) {
        item.removable = false;
        item.reason = std::string("kept at removal: ") + e.what();
      } catch (const TimeoutError& e) {  // its lock held for 5 s
        item.removable = false;
        item.reason = std::string("kept at removal: ") + e.what();
        item.error = e.what();
      } catch (const std::exception& e) {
        item.error = e.what();
      }
    }
    items.push_back(std::move(item));
  }
  if (options.names.empty()) {
    std::vector<GcItem> probes = collect_probes(options.dry_run);
    items.insert(items.end(), std::make_move_iterator(probes.begin()), std::make_move_iterator(probes.end()));
  }
  return items;
}

}  // namespace tdshm::shm
