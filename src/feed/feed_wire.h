#pragma once
// What a feed's producer and consumer say to each other (include/tdshm/feed.h), and the group
// they say it over.
//
// Every item is one frame message (uint8, by value) followed by its tensors, one message each,
// all with kFrameTag on the producer's group, in order. A frame starts with a FrameHead:
//   kItem    the item's `tensors` tensors: `inline_tensors` of them (small ones) inside the frame,
//            the others as the messages that follow, in order. After the FrameHead: one
//            InlineTensor per inline tensor, then their bytes (each padded to 8), then the
//            user's header bytes to the frame's end.
//   kGrow    the producer's heap outgrew: the next frames come over generation `generation`
//            ("<name>-<k>-g<generation>") with `heap_bytes` and `loan_tickets`.
//   kClose   the producer ended its items.
// A consumer trusts nothing in a frame: wrong magic, kind, generation or counts out of range are
// a TransportError naming the producer.

#include <tdshm/errors.h>
#include <tdshm/feed.h>
#include <tdshm/process_group.h>

#include "process_group/shm_group_seam.h"

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace tdshm::feed {

inline constexpr int kFrameTag = 7;
inline constexpr uint32_t kFrameMagic = 0x44464454;  // "TDFD"
inline constexpr uint32_t kMaxTensors = 1u << 20;
inline constexpr uint64_t kMaxHeapBytes = uint64_t{1} << 36;
inline constexpr uint32_t kMaxTickets = 1u << 16;
inline constexpr uint32_t kFirstTickets = 64;  // generation 0's loan tickets, known to both sides
// The magic of a FeedItem header written by FeedProducer::put(TensorDict): then the schema.
inline constexpr uint32_t kTensorDictMagic = 0x53445454;  // "TTDS"

enum class FrameKind : uint8_t { kItem = 1, kGrow = 2, kClose = 3 };

struct FrameHead {
  uint32_t magic = kFrameMagic;
  FrameKind kind = FrameKind::kItem;
  uint8_t reserved[3] = {};
  uint32_t tensors = 0;
  uint32_t generation = 0;
  uint64_t heap_bytes = 0;
  uint32_t loan_tickets = 0;
  uint32_t inline_tensors = 0;  // kItem
};
static_assert(sizeof(FrameHead) == 32);

/// The dimensions an inline tensor may have (a tensor with more goes as a message).
inline constexpr uint8_t kInlineDims = 6;

/// One tensor carried inside its item's frame.
struct InlineTensor {
  uint32_t index = 0;  // among the item's tensors; increasing along the table
  uint8_t dtype = 0;   // c10::ScalarType
  uint8_t ndim = 0;
  uint16_t reserved = 0;
  uint64_t bytes = 0;  // numel x element size
  int64_t sizes[kInlineDims] = {};
};
static_assert(sizeof(InlineTensor) == 64);

inline constexpr uint64_t pad8(uint64_t n) { return (n + 7) / 8 * 8; }

/// The segment name of producer `k`'s group of generation `gen`.
inline std::string group_name(const std::string& feed, int k, uint32_t gen) {
  return feed + "-" + std::to_string(k) + "-g" + std::to_string(gen);
}

/// The options of a feed's group: items travel in loans, a slot carries a frame or a tensor sent
/// by value. Few slots and a small collective window (none runs) keep a group small (8 producers
/// fit Docker's 64 MiB /dev/shm).
inline ShmOptions group_options(const FeedOptions& o, uint64_t heap_bytes, uint32_t tickets) {
  ShmOptions so;
  so.spin = o.spin;
  so.loan_bytes = heap_bytes;
  so.loan_tickets = tickets;
  so.slots_per_rank = 8;
  so.window_bytes = size_t{64} << 10;
  return so;
}

/// Joins (or creates) producer k's group as `rank` (consumer 0, producer 1), waiting in slices of
/// at most 200 ms so that `gone()`, FeedOptions::check (the other side's process ended) and the deadline are checked
/// between them. PeerLostError from `gone`, TimeoutError at the deadline.
template <class Gone>
c10::intrusive_ptr<ProcessGroupShm> join_group(const std::string& name, int rank, const FeedOptions& o,
                                               uint64_t heap_bytes, uint32_t tickets, Gone&& gone) {
  using Clock = std::chrono::steady_clock;
  const bool forever = o.timeout.count() <= 0;
  const auto deadline = Clock::now() + o.timeout;
  ShmOptions so = group_options(o, heap_bytes, tickets);
  // Between two tries: what check throws, then PeerLostError once the other side's process is
  // gone. In that order: Ctrl-C in a terminal ends the other side too, and is what to report.
  const auto before_next_try = [&] {
    if (o.check) o.check();
    if (const std::string why = gone(); !why.empty()) throw PeerLostError("feed group '" + name + "': " + why);
  };
  // A slice covers the creator's sizing of the segment under its lock (posix_fallocate: 841 MiB in
  // 0.22 s here, alone); with 200 ms alone a heap for 70 MiB batches was made anew at every slice
  // and the group never formed. 2 ms a MiB more is ~8x that speed (a loaded machine's margin).
  // A producer's slices are short: its check is how it learns that the consumer stops (a loader's
  // `break` waited for a worker's slice), and the consumer, whose slices are long, joins the
  // incarnation it finds at once.
  const auto base_slice =
      std::chrono::milliseconds((rank == 0 ? 200 : 20) + 2 * static_cast<int64_t>(heap_bytes >> 20));
  // And before the first: the other side may have said it stops while this side made its last
  // item (a grow frame put into slots of a group the other side just left).
  if (o.check) o.check();
  while (true) {
    auto slice = base_slice;
    if (!forever) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) {
        throw TimeoutError("feed group '" + name + "': the other side did not join within " +
                           std::to_string(o.timeout.count()) + " ms");
      }
      slice = std::min(slice, left);
    }
    // The group's timeout is the rendezvous slice: every later wait of the feed gives its own.
    so.timeout = slice;
    try {
      auto pg = c10::make_intrusive<ProcessGroupShm>(name, rank, 2, so);
      // Both sides are in and nobody joins a feed's group again: its name goes now (both sides
      // try; the first does it), so a loader killed whole (SIGTERM or SIGKILL to its process
      // group, as `timeout` and schedulers stop a job) leaves nothing in /dev/shm.
      detail::ShmGroupSeam::unlink_segment_name(*pg);
      return pg;
    } catch (const TimeoutError&) {
      before_next_try();
    } catch (const RendezvousAbandonedError&) {
      // The other side's slice ran out just as this side attached: it gave the rendezvous up and
      // joins again (seen under load: a worker failed its first put). Any other loss is real.
      before_next_try();
    }
  }
}

/// Ends the wait of a producer that made producer group `name` (heap_bytes, tickets: its first
/// generation's) and waits there for a consumer that is shutting down instead: one short try to
/// join as the consumer, left at once. Formed, the producer's first put finds the consumer gone;
/// not formed, the producer finds the rendezvous abandoned. Either way it looks at its
/// FeedOptions::check at once, not after its slice. A producer that comes later finds the stop
/// at its check before it joins, or after its first slice (20 ms).
inline void refuse_group(const std::string& name, const FeedOptions& o, uint64_t heap_bytes,
                         uint32_t tickets) noexcept {
  ShmOptions so = group_options(o, heap_bytes, tickets);
  so.timeout = std::chrono::milliseconds(1);
  try {
    auto pg = c10::make_intrusive<ProcessGroupShm>(name, 0, 2, so);
    detail::ShmGroupSeam::unlink_segment_name(*pg);
    pg->shutdown();
  } catch (...) {
    // Timed out alone, abandoned, or no resources: the producer's slice ends its wait.
  }
}

/// A wait's limit: the feed's timeout, or (zero) a year. Never kNoTimeout: that is the group's
/// timeout, which here is only the rendezvous slice.
inline std::chrono::milliseconds wait_limit(const FeedOptions& o) {
  return o.timeout.count() > 0 ? o.timeout : std::chrono::milliseconds(std::chrono::hours(24 * 365));
}

inline uint64_t page_up(uint64_t n) { return (n + 4095) / 4096 * 4096; }
inline uint64_t page_down(uint64_t n) { return n / 4096 * 4096; }

/// Waits for `work` (a ProcessGroupShm work) up to wait_limit(o), in slices of 100 ms with
/// o.check between them; TimeoutError at the limit (the work withdrawn), and what check throws
/// (the work withdrawn too). Rethrows the work's error.
void wait_in_slices(const c10::intrusive_ptr<c10d::Work>& work, const FeedOptions& o);

/// Removes each of `names` whose ranks are all gone (a side that died without leaving leaves its
/// segment behind); one still in use is left alone.
inline void sweep(const std::vector<std::string>& names) noexcept {
  for (const std::string& n : names) {
    try {
      remove_stale_segment(n);
    } catch (...) {
    }
  }
}

/// "" while process `pid` runs (0: not watched), else why it is taken for gone.
std::string process_gone(pid_t pid);

}  // namespace tdshm::feed
