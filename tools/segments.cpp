// `tdshm ls`, `tdshm inspect NAME`, `tdshm gc [--dry-run] [NAME...]`: the segments in /dev/shm,
// read without mapping, locking or writing them (src/shm/reader/inspect.h), and removed only when
// proven stale (src/shm/segment/gc.h's collect_garbage, through tdshm::remove_stale_segment).
//
//   tdshm ls [--json]                   one row per name: size, world, attached/alive ranks, age, status
//   tdshm inspect NAME [--json]         header, ranks, lock file, gc verdict, layout details
//   tdshm gc [--dry-run] [--json] [NAME...]
//                                       removes what is stale and says what it removed and kept

#include "segments.h"

#include <tdshm/errors.h>

#include "board/board_gc.h"
#include "common/json.h"
#include "shm/reader/inspect.h"
#include "shm/segment/gc.h"

#include <sys/stat.h>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

namespace tdshm::tools {

namespace {

using shm::SegmentInfo;
using shm::SegmentStatus;

// ---------------------------------------------------------------------------------------------
// Formatting

std::string human_bytes(uint64_t b) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 " B", b);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  }
  return buf;
}

std::string human_age(double s) {
  if (s < 0) return "-";
  char buf[32];
  const auto t = static_cast<uint64_t>(s);
  if (t < 60) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 "s", t);
  } else if (t < 3600) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 "m%02" PRIu64 "s", t / 60, t % 60);
  } else if (t < 86400) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 "h%02" PRIu64 "m", t / 3600, t / 60 % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%" PRIu64 "d%02" PRIu64 "h", t / 86400, t / 3600 % 24);
  }
  return buf;
}

std::string hex64(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, v);
  return buf;
}

std::string mode_str(uint32_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", mode & 07777);
  return buf;
}

/// Names come from a directory listing: anything but printable ASCII is shown as \xNN.
std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

/// The STATUS column of `ls` and the status line of `inspect`: "in use", "stale", or the
/// reader's status with its reason.
std::string status_text(const SegmentInfo& info) {
  if (info.ranks_read && (info.status == SegmentStatus::kValid || info.status == SegmentStatus::kTruncated)) {
    const bool here =
        std::any_of(info.ranks.begin(), info.ranks.end(), [](const shm::RankInfo& r) { return r.alive && !r.foreign; });
    std::string s = here ? "in use" : info.alive_ranks() > 0 ? "kept: a rank of another PID namespace" : "stale";
    if (info.status == SegmentStatus::kTruncated) s += ", truncated: " + info.problem;
    return s;
  }
  if (info.ranks_read && info.status == SegmentStatus::kOtherVersion) {
    return std::string(info.alive_ranks() > 0 ? "in use" : "unused") + ", other-version: " + info.problem;
  }
  std::string s = shm::status_name(info.status);
  if (!info.problem.empty()) s += ": " + info.problem;
  return s;
}

// ---------------------------------------------------------------------------------------------
// JSON (hand-written: a few flat objects)

// Names need not be UTF-8: what is not is escaped as Python's surrogateescape reads it.
std::string json_str(const std::string& s) { return detail::json_quote(s, /*bytes=*/true); }

/// Builds one JSON object: add() in order, then str().
class JsonObject {
 public:
  JsonObject& add(const char* key, const std::string& raw_json) {
    body_ += (body_.empty() ? "" : ", ") + json_str(key) + ": " + raw_json;
    return *this;
  }
  JsonObject& str(const char* key, const std::string& v) { return add(key, json_str(v)); }
  JsonObject& num(const char* key, uint64_t v) { return add(key, std::to_string(v)); }
  JsonObject& real(const char* key, double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f", v);
    return add(key, buf);
  }
  JsonObject& boolean(const char* key, bool v) { return add(key, v ? "true" : "false"); }
  std::string done() const { return "{" + body_ + "}"; }

 private:
  std::string body_;
};

std::string json_array(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out + "]";
}

std::string json_string_array(const std::vector<std::string>& items) {
  std::vector<std::string> quoted;
  for (const std::string& item : items) quoted.push_back(json_str(item));
  return json_array(quoted);
}

std::string json_lock_process(const shm::LockProcess& p) {
  return JsonObject().num("pid", p.pid).num("rank", p.rank).boolean("alive", p.alive).done();
}

std::string json_details(const shm::LayoutDetails& d) {
  JsonObject o;
  o.num("layout_version", d.layout_version).boolean("available", d.available).str("note", d.note);
  JsonObject geometry;
  for (const auto& [k, v] : d.geometry) geometry.num(k.c_str(), v);
  o.add("geometry", geometry.done());
  std::vector<std::string> pairs;
  for (const shm::PairInfo& p : d.pairs) {
    pairs.push_back(JsonObject()
                        .num("src", p.src)
                        .num("dst", p.dst)
                        .num("head", p.head)
                        .num("tail", p.tail)
                        .num("depth", p.depth)
                        .num("messages", p.messages)
                        .num("bytes_in_flight", p.bytes_in_flight)
                        .boolean("inconsistent", p.inconsistent)
                        .str("note", p.note)
                        .done());
  }
  o.add("pairs", json_array(pairs));
  std::vector<std::string> arenas;
  for (const shm::ArenaInfo& a : d.arenas) {
    std::vector<std::string> by_dst;
    for (const auto& [dst, n] : a.taken_by_dst) by_dst.push_back(JsonObject().num("dst", dst).num("slots", n).done());
    arenas.push_back(JsonObject()
                         .num("owner", a.owner)
                         .num("slots", a.slots)
                         .num("slots_taken", a.slots_taken)
                         .num("bytes_taken", a.bytes_taken)
                         .add("taken_by_dst", json_array(by_dst))
                         .num("invalid_states", a.invalid_states)
                         .boolean("read", a.read)
                         .str("note", a.note)
                         .done());
  }
  o.add("arenas", json_array(arenas));
  std::vector<std::string> loans;
  for (const shm::ArenaInfo& a : d.loans) {
    std::vector<std::string> by_holder;
    for (const auto& [dst, n] : a.taken_by_dst)
      by_holder.push_back(JsonObject().num("holder", dst).num("loans", n).done());
    loans.push_back(JsonObject()
                        .num("owner", a.owner)
                        .num("tickets", a.slots)
                        .num("tickets_out", a.slots_taken)
                        .add("held_by", json_array(by_holder))
                        .num("invalid_states", a.invalid_states)
                        .boolean("read", a.read)
                        .str("note", a.note)
                        .done());
  }
  o.add("loans", json_array(loans));
  std::vector<std::string> counters;
  for (const shm::RankCounters& c : d.counters) {
    counters.push_back(JsonObject().num("rank", c.rank).num("wake_seq", c.wake_seq).num("sleepers", c.sleepers).done());
  }
  o.add("counters", json_array(counters));
  if (d.rank_table_offset) o.num("rank_table_offset", *d.rank_table_offset);
  return o.done();
}

std::string json_segment(const SegmentInfo& info) {
  JsonObject o;
  o.str("name", info.name).str("path", info.path).str("status", shm::status_name(info.status));
  o.str("problem", info.problem).str("summary", status_text(info));
  if (info.stat_ok) {
    o.num("file_bytes", info.file_bytes).num("uid", info.uid).str("mode", mode_str(info.mode));
    if (info.age_seconds >= 0) o.real("age_seconds", info.age_seconds);
  }
  if (info.prefix_read) {
    o.num("layout_version", info.layout_version)
        .num("header_bytes", info.header_bytes)
        .num("segment_bytes", info.segment_bytes)
        .num("world_size", info.world_size);
  }
  if (info.header_read) {
    o.add("creator", JsonObject()
                         .num("pid", info.creator_pid)
                         .num("rank", info.creator_rank)
                         .boolean("alive", info.creator_alive)
                         .done());
    o.str("incarnation", hex64(info.incarnation));
  }
  if (info.ranks_read) {
    o.num("attached_ranks", info.attached_ranks()).num("alive_ranks", info.alive_ranks());
    std::vector<std::string> ranks;
    for (const shm::RankInfo& r : info.ranks) {
      ranks.push_back(JsonObject()
                          .num("rank", r.rank)
                          .str("state", r.state_name())
                          .num("pid", r.pid)
                          .boolean("alive", r.alive)
                          .num("pid_namespace", r.pid_ns)
                          .boolean("other_pid_namespace", r.foreign)
                          .add("offers", json_string_array(r.feature_names()))
                          .done());
    }
    o.add("ranks", json_array(ranks));
  }
  JsonObject lock;
  lock.boolean("present", info.lock.present).boolean("refused", info.lock.refused).str("problem", info.lock.problem);
  if (info.lock.creator) {
    lock.add("creator", json_lock_process(*info.lock.creator)).boolean("creating", info.lock.creating);
  }
  std::vector<std::string> joiners;
  for (const shm::LockProcess& j : info.lock.joiners) joiners.push_back(json_lock_process(j));
  lock.add("joiners", json_array(joiners));
  o.add("lock", lock.done());
  const auto [removable, reason] = shm::gc_decision(info);
  o.add("gc", JsonObject().boolean("removable", removable).str("reason", reason).done());
  if (info.details) o.add("details", json_details(*info.details));
  return o.done();
}

// ---------------------------------------------------------------------------------------------
// Arguments

struct Args {
  bool json = false;
  bool dry_run = false;
  bool help = false;
  std::vector<std::string> names;
  std::string error;
};

Args parse(int argc, char** argv, bool allow_dry_run) {
  Args a;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json") {
      a.json = true;
    } else if (arg == "--dry-run" && allow_dry_run) {
      a.dry_run = true;
    } else if (arg == "--help" || arg == "-h") {
      a.help = true;
    } else if (!arg.empty() && arg[0] == '-') {
      a.error = "unknown option '" + arg + "'";
    } else {
      a.names.push_back(arg);
    }
  }
  return a;
}

int usage_error(const char* cmd, const std::string& what) {
  std::fprintf(stderr, "tdshm %s: %s\n", cmd, what.c_str());
  print_segments_usage(stderr);
  return 2;
}

// ---------------------------------------------------------------------------------------------
// inspect's text form

void print_inspect(const SegmentInfo& info) {
  std::printf("name       %s\n", printable(info.name).c_str());
  std::printf("path       %s\n", printable(info.path).c_str());
  std::string status = status_text(info);
  if (info.ranks_read) {
    status += " (" + std::to_string(info.alive_ranks()) + " of " + std::to_string(info.ranks.size()) +
              " ranks alive, " + std::to_string(info.attached_ranks()) + " attached)";
  }
  std::printf("status     %s\n", status.c_str());
  if (info.stat_ok) {
    std::printf("file       %s (%" PRIu64 " bytes), mode %s, uid %u, age %s\n", human_bytes(info.file_bytes).c_str(),
                info.file_bytes, mode_str(info.mode).c_str(), info.uid, human_age(info.age_seconds).c_str());
  }
  if (info.prefix_read) {
    std::printf("header     layout version %u, header %u B, segment %" PRIu64 " B, world size %u\n",
                info.layout_version, info.header_bytes, info.segment_bytes, info.world_size);
  }
  if (info.header_read) {
    std::printf("creator    rank %u, pid %u (%s), incarnation %s\n", info.creator_rank, info.creator_pid,
                info.creator_alive ? "alive" : "gone", hex64(info.incarnation).c_str());
  }
  if (!info.lock.present) {
    std::printf("lock file  none\n");
  } else if (!info.lock.problem.empty()) {
    std::printf("lock file  %s.lock: %s\n", printable(info.path).c_str(), info.lock.problem.c_str());
  } else {
    std::string what;
    if (info.lock.creator) {
      what = "last creator pid " + std::to_string(info.lock.creator->pid) + " rank " +
             std::to_string(info.lock.creator->rank) + " (" + (info.lock.creator->alive ? "alive" : "gone") + "), " +
             (info.lock.creating ? "creation in progress or interrupted" : "creation complete");
    } else {
      what = "no creator record";
    }
    for (const shm::LockProcess& j : info.lock.joiners) {
      what += "; joining: rank " + std::to_string(j.rank) + " pid " + std::to_string(j.pid) +
              (j.alive ? " (alive)" : " (gone)");
    }
    std::printf("lock file  %s\n", what.c_str());
  }
  const auto [removable, reason] = shm::gc_decision(info);
  std::printf("gc         %s: %s\n", removable ? "would remove" : "keeps", reason.c_str());

  if (info.ranks_read) {
    std::printf("\nranks\n  %-6s %-10s %-10s %-38s %s\n", "RANK", "STATE", "PID", "ALIVE", "OFFERS");
    for (const shm::RankInfo& r : info.ranks) {
      std::string offers;
      for (const std::string& f : r.feature_names()) offers += (offers.empty() ? "" : ",") + f;
      std::printf("  %-6u %-10s %-10s %-38s %s\n", r.rank, r.state_name().c_str(),
                  r.state == shm::kRankFree ? "-" : std::to_string(r.pid).c_str(),
                  r.foreign ? "unknown (another PID namespace: kept)"
                  : r.alive ? "yes"
                            : "no",
                  offers.empty() ? "-" : offers.c_str());
    }
  }
  if (!info.details) return;
  const shm::LayoutDetails& d = *info.details;
  std::printf("\nlayout version %u details\n", d.layout_version);
  if (!d.available) {
    std::printf("  %s\n", d.note.c_str());
    return;
  }
  std::string geometry;
  for (const auto& [k, v] : d.geometry) geometry += (geometry.empty() ? "" : ", ") + k + " " + std::to_string(v);
  std::printf("  %s\n", geometry.c_str());
  if (!d.pairs.empty()) {
    // Every pair of a small world; of a larger one, those that ever carried an entry.
    const bool all = d.pairs.size() <= 16;
    size_t idle = 0;
    std::printf("  %-10s %12s %12s %6s %9s %14s\n", "PAIR", "HEAD", "TAIL", "DEPTH", "MESSAGES", "BYTES");
    for (const shm::PairInfo& p : d.pairs) {
      if (!all && p.head == 0 && p.note.empty()) {
        ++idle;
        continue;
      }
      const std::string pair = std::to_string(p.src) + "->" + std::to_string(p.dst);
      std::printf("  %-10s %12" PRIu64 " %12" PRIu64 " %6" PRIu64 " %9" PRIu64 " %14" PRIu64 "%s%s\n", pair.c_str(),
                  p.head, p.tail, p.depth, p.messages, p.bytes_in_flight, p.note.empty() ? "" : "  ", p.note.c_str());
    }
    if (idle > 0) std::printf("  (%zu pairs that never carried an entry not shown)\n", idle);
  }
  if (!d.arenas.empty()) {
    // Every rank's arena in a small world; in a larger one, those with a slot in use or a note.
    const bool all = d.arenas.size() <= 16;
    size_t idle = 0;
    for (const shm::ArenaInfo& a : d.arenas) {
      if (!all && a.slots_taken == 0 && a.note.empty()) {
        ++idle;
        continue;
      }
      std::string line = "  arena of rank " + std::to_string(a.owner) + ": ";
      if (!a.read) {
        std::printf("%s%s\n", line.c_str(), a.note.c_str());
        continue;
      }
      line += std::to_string(a.slots_taken) + " of " + std::to_string(a.slots) + " slots in use";
      if (a.slots_taken != 0) line += ", " + human_bytes(a.bytes_taken) + " reserved";
      std::string to;
      for (const auto& [dst, n] : a.taken_by_dst) {
        to += (to.empty() ? "" : ", ") + std::to_string(n) + " for rank " + std::to_string(dst);
      }
      if (!to.empty()) line += " (" + to + ")";
      if (!a.note.empty()) line += "; " + a.note;
      std::printf("%s\n", line.c_str());
    }
    if (idle > 0) std::printf("  (%zu ranks with no arena slot in use not shown)\n", idle);
  }
  // Loans lent and not yet given back (layout 8): only ranks with some out, or a note.
  for (const shm::ArenaInfo& a : d.loans) {
    if (a.read && a.slots_taken == 0 && a.note.empty()) continue;
    std::string line = "  loans of rank " + std::to_string(a.owner) + ": ";
    if (!a.read) {
      std::printf("%s%s\n", line.c_str(), a.note.c_str());
      continue;
    }
    line += std::to_string(a.slots_taken) + " of " + std::to_string(a.slots) + " tickets out";
    std::string held;
    for (const auto& [holder, n] : a.taken_by_dst) {
      held += (held.empty() ? "" : ", ") + std::to_string(n) + " held by rank " + std::to_string(holder);
    }
    if (!held.empty()) line += " (" + held + ")";
    if (!a.note.empty()) line += "; " + a.note;
    std::printf("%s\n", line.c_str());
  }
  if (!d.counters.empty()) {
    std::printf("  %-6s %12s %9s\n", "RANK", "WAKE_SEQ", "SLEEPERS");
    for (const shm::RankCounters& c : d.counters) std::printf("  %-6u %12u %9u\n", c.rank, c.wake_seq, c.sleepers);
  }
  if (!d.note.empty()) std::printf("  note: %s\n", d.note.c_str());
}

// A board (/dev/shm/tdshm-board.*) as `tdshm ls` shows it: its file, and what gc would do.
struct BoardRow {
  detail::BoardGcItem gc;  // decided as a dry run
  std::string path;
  uint64_t bytes = 0;
  double age_seconds = 0;
};

std::vector<BoardRow> list_boards() {
  std::vector<BoardRow> rows;
  for (detail::BoardGcItem& item : detail::collect_stale_boards(/*dry_run=*/true)) {
    BoardRow row;
    row.path = std::string(shm::kSegmentDir) + "/tdshm-board." + item.name;
    struct stat st {};
    if (::lstat(row.path.c_str(), &st) == 0) {
      row.bytes = static_cast<uint64_t>(st.st_size);
      row.age_seconds = std::max(0.0, static_cast<double>(std::time(nullptr) - st.st_mtime));
    }
    row.gc = std::move(item);
    rows.push_back(std::move(row));
  }
  return rows;
}

void print_boards(const std::vector<BoardRow>& boards) {
  if (boards.empty()) return;
  size_t width = 5;
  for (const BoardRow& b : boards) width = std::max(width, printable(b.gc.name).size());
  const int w = static_cast<int>(std::min<size_t>(width, 60));
  std::printf("%-*s  %10s  %7s  %s\n", w, "BOARD", "SIZE", "AGE", "STATUS (what tdshm gc would do)");
  for (const BoardRow& b : boards) {
    std::printf("%-*s  %10s  %7s  %s: %s\n", w, printable(b.gc.name).c_str(), human_bytes(b.bytes).c_str(),
                human_age(b.age_seconds).c_str(), b.gc.removable ? "stale, removes it" : "keeps it",
                b.gc.reason.c_str());
  }
  std::printf("(%zu board%s: /dev/shm/tdshm-board.NAME)\n\n", boards.size(), boards.size() == 1 ? "" : "s");
}

}  // namespace

void print_segments_usage(FILE* out) {
  std::fprintf(out,
               "usage: tdshm ls [--json]\n"
               "       tdshm inspect NAME [--json]\n"
               "       tdshm gc [--dry-run] [--json] [NAME...]\n"
               "  ls       every /dev/shm/tdshm.* segment: size, world, attached/alive ranks, age, status;\n"
               "           and every board (/dev/shm/tdshm-board.*): size, age, whether gc would remove it\n"
               "  inspect  one segment: header, ranks, lock file, what gc would do, and per ordered pair\n"
               "           the ring depth with messages and bytes in flight, per rank the arena slots in use\n"
               "           (exit 0: a valid segment; 3: the name exists but is not one; 1: no such name)\n"
               "  gc       removes segments whose ranks are all dead or left, segments whose creation was\n"
               "           interrupted, and lock files without a segment, with their lock files; keeps\n"
               "           anything in use or not provably stale (another user's file, a link, a file open\n"
               "           to group/other, a corrupt header, another layout version); --dry-run only says.\n"
               "           Without names it also removes boards (/dev/shm/tdshm-board.*) whose writer is\n"
               "           gone and that no live reader has open\n"
               "  Nothing is mapped, locked or written but what gc removes.\n");
}

int run_ls(int argc, char** argv) {
  const Args args = parse(argc, argv, false);
  if (!args.error.empty()) return usage_error("ls", args.error);
  if (!args.names.empty()) return usage_error("ls", "takes no names (tdshm inspect NAME shows one)");
  if (args.help) {
    print_segments_usage(stdout);
    return 0;
  }
  const std::vector<SegmentInfo> infos = shm::list_segments();
  const std::vector<BoardRow> boards = list_boards();
  if (args.json) {
    std::vector<std::string> items, board_items;
    for (const SegmentInfo& info : infos) items.push_back(json_segment(info));
    for (const BoardRow& b : boards) {
      board_items.push_back(JsonObject()
                                .str("name", b.gc.name)
                                .str("path", b.path)
                                .num("file_bytes", b.bytes)
                                .real("age_seconds", b.age_seconds)
                                .boolean("stale", b.gc.removable)
                                .str("reason", b.gc.reason)
                                .done());
    }
    std::printf("%s\n", JsonObject()
                            .str("dir", shm::kSegmentDir)
                            .add("segments", json_array(items))
                            .add("boards", json_array(board_items))
                            .done()
                            .c_str());
    return 0;
  }
  print_boards(boards);
  if (infos.empty()) {
    std::printf("no tdshm segments in %s\n", shm::kSegmentDir);
    return 0;
  }
  size_t width = 4;
  for (const SegmentInfo& info : infos) width = std::max(width, printable(info.name).size());
  width = std::min<size_t>(width, 60);
  const int w = static_cast<int>(width);
  std::printf("%-*s  %10s  %5s  %-12s  %7s  %s\n", w, "NAME", "SIZE", "WORLD", "ATT/ALIVE", "AGE", "STATUS");
  for (const SegmentInfo& info : infos) {
    const std::string size = info.stat_ok ? human_bytes(info.file_bytes) : "-";
    const std::string world = info.prefix_read ? std::to_string(info.world_size) : "-";
    const std::string ranks =
        info.ranks_read ? std::to_string(info.attached_ranks()) + "/" + std::to_string(info.alive_ranks()) : "-";
    std::printf("%-*s  %10s  %5s  %-12s  %7s  %s\n", w, printable(info.name).c_str(), size.c_str(), world.c_str(),
                ranks.c_str(), human_age(info.age_seconds).c_str(), status_text(info).c_str());
  }
  std::printf("(%zu names; ATT/ALIVE: ranks attached / alive)\n", infos.size());
  return 0;
}

int run_inspect(int argc, char** argv) {
  const Args args = parse(argc, argv, false);
  if (!args.error.empty()) return usage_error("inspect", args.error);
  if (args.help) {
    print_segments_usage(stdout);
    return 0;
  }
  if (args.names.size() != 1) return usage_error("inspect", "needs exactly one segment name");
  SegmentInfo info;
  try {
    info = shm::inspect_segment(args.names[0], {.details = true});
  } catch (const SegmentError& e) {
    std::fprintf(stderr, "tdshm inspect: %s\n", e.what());
    // With --json, a program reading stdout is told too.
    if (args.json) std::printf("%s\n", JsonObject().str("name", args.names[0]).str("error", e.what()).done().c_str());
    return 1;
  }
  if (args.json) {
    std::printf("%s\n", json_segment(info).c_str());
  } else if (info.status == SegmentStatus::kMissing) {
    struct stat board {};
    const bool is_board =
        ::lstat((std::string(shm::kSegmentDir) + "/tdshm-board." + args.names[0]).c_str(), &board) == 0;
    std::fprintf(stderr, "tdshm inspect: no segment '%s' (%s does not exist)%s\n", printable(info.name).c_str(),
                 printable(info.path).c_str(),
                 is_board ? "; a board of that name exists (boards show in tdshm ls)" : "");
  } else {
    print_inspect(info);
  }
  if (info.status == SegmentStatus::kMissing) return 1;
  return info.status == SegmentStatus::kValid ? 0 : 3;
}

int run_gc(int argc, char** argv) {
  const Args args = parse(argc, argv, true);
  if (!args.error.empty()) return usage_error("gc", args.error);
  if (args.help) {
    print_segments_usage(stdout);
    return 0;
  }
  std::vector<shm::GcItem> items;
  try {
    items = shm::collect_garbage({.dry_run = args.dry_run, .names = args.names});
  } catch (const SegmentError& e) {
    std::fprintf(stderr, "tdshm gc: %s\n", e.what());
    if (args.json)
      std::printf("%s\n", JsonObject().boolean("dry_run", args.dry_run).str("error", e.what()).done().c_str());
    return 1;
  }
  // Boards (/dev/shm/tdshm-board.*) are looked at when gc is given no names: segment names only.
  std::vector<detail::BoardGcItem> boards;
  if (args.names.empty()) boards = detail::collect_stale_boards(args.dry_run);
  size_t removed = 0, kept = 0, errors = 0, vanished = 0;
  std::vector<std::string> json_items;
  for (const shm::GcItem& item : items) {
    const bool gone = item.removed_segment || item.removed_lock;
    std::string action;
    if (!item.error.empty()) {
      action = "error";
      ++errors;
    } else if (item.removable && args.dry_run) {
      action = "would-remove";
      ++removed;
    } else if (item.removable && !gone) {
      action = "gone";  // another process removed it between the listing and the removal
      ++vanished;
    } else if (item.removable) {
      action = "removed";
      ++removed;
    } else {
      action = args.dry_run ? "would-keep" : "kept";
      ++kept;
    }
    if (args.json) {
      json_items.push_back(JsonObject()
                               .str("name", item.name)
                               .str("status", shm::status_name(item.status))
                               .str("action", action)
                               .str("reason", item.reason)
                               .boolean("removed_segment", item.removed_segment)
                               .boolean("removed_lock", item.removed_lock)
                               .str("error", item.error)
                               .done());
      continue;
    }
    const std::string name = printable(item.name);
    if (!item.error.empty()) {
      std::printf("error        %s: %s\n", name.c_str(), item.error.c_str());
    } else if (item.removable && args.dry_run) {
      std::printf("would remove %s: %s\n", name.c_str(), item.reason.c_str());
    } else if (item.removable && !gone) {
      std::printf("gone         %s: another process removed it meanwhile\n", name.c_str());
    } else if (item.removable) {
      std::string what;
      if (item.removed_segment) what = "/dev/shm/tdshm." + name;
      if (item.removed_lock) what += std::string(what.empty() ? "" : " and ") + "/dev/shm/tdshm." + name + ".lock";
      std::printf("removed      %s (%s): %s\n", name.c_str(), what.c_str(), item.reason.c_str());
    } else {
      std::printf("%-12s %s: %s\n", args.dry_run ? "would keep" : "kept", name.c_str(), item.reason.c_str());
    }
  }
  for (const detail::BoardGcItem& b : boards) {
    const std::string action = !b.error.empty() ? "error"
                               : b.removable    ? (args.dry_run ? "would-remove" : "removed")
                                                : (args.dry_run ? "would-keep" : "kept");
    (!b.error.empty() ? errors : b.removable ? removed : kept) += 1;
    if (args.json) {
      json_items.push_back(JsonObject()
                               .str("name", b.name)
                               .str("kind", "board")
                               .str("action", action)
                               .str("reason", b.reason)
                               .boolean("removed", b.removed)
                               .str("error", b.error)
                               .done());
      continue;
    }
    const std::string name = printable(b.name);
    if (!b.error.empty()) {
      std::printf("error        board %s: %s\n", name.c_str(), b.error.c_str());
    } else if (b.removable) {
      std::printf("%-12s board %s (/dev/shm/tdshm-board.%s): %s\n", args.dry_run ? "would remove" : "removed",
                  name.c_str(), name.c_str(), b.reason.c_str());
    } else {
      std::printf("%-12s board %s: %s\n", args.dry_run ? "would keep" : "kept", name.c_str(), b.reason.c_str());
    }
  }
  if (args.json) {
    std::printf("%s\n", JsonObject()
                            .boolean("dry_run", args.dry_run)
                            .num(args.dry_run ? "would_remove" : "removed", removed)
                            .num("kept", kept)
                            .num("gone", vanished)
                            .num("errors", errors)
                            .add("items", json_array(json_items))
                            .done()
                            .c_str());
  } else {
    std::printf("%zu %s, %zu kept%s%s\n", removed, args.dry_run ? "would be removed (dry run)" : "removed", kept,
                vanished ? (", " + std::to_string(vanished) + " gone meanwhile").c_str() : "",
                errors ? (", " + std::to_string(errors) + " errors").c_str() : "");
  }
  return errors == 0 ? 0 : 1;
}

}  // namespace tdshm::tools
