// `tdshm bench --world` (segment_sizes.h).

#include "segment_sizes.h"

#include <tdshm/process_group.h>

#include <sys/statvfs.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace tdshm::bench {

namespace {

std::string mib_label(uint64_t bytes) {
  char buf[64];
  if (bytes >= (uint64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / double(uint64_t{1} << 30));
  } else {
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / double(uint64_t{1} << 20));
  }
  return buf;
}

}  // namespace

std::vector<Row> print_segment_sizes(const std::vector<int>& worlds) {
  const ShmOptions defaults{};
  std::printf("\nshm segment size per world size, default ShmOptions (slot %zu KiB, %u ring entries), from\n"
              "tdshm::shm_segment_bytes:\n",
              defaults.slot_bytes >> 10, defaults.ring_entries);
  struct statvfs fs {};
  const bool have_fs = ::statvfs("/dev/shm", &fs) == 0;
  const uint64_t free_bytes = have_fs ? static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize : 0;
  std::printf("%7s %16s %12s  %s\n", "world", "segment bytes", "size",
              have_fs ? ("fits /dev/shm (" + mib_label(free_bytes) + " free now)").c_str() : "");
  std::vector<Row> rows;
  for (const int world : worlds) {
    const size_t bytes = shm_segment_bytes(world, defaults);
    std::printf("%7d %16zu %12s  %s\n", world, bytes, mib_label(bytes).c_str(),
                have_fs ? (bytes <= free_bytes ? "yes" : "no") : "");
    Row r;
    r.set("scenario", "segment").set_int("world", world).set_int("segment_bytes", static_cast<int64_t>(bytes));
    rows.push_back(std::move(r));
  }
  std::fflush(stdout);
  return rows;
}

}  // namespace tdshm::bench
