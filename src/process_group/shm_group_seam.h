#pragma once
// What tdshm's own layers ask of a ProcessGroupShm beyond its public API (the transfer layer's
// transport, the feed, the tests): messages that carry a MessageCheck, a per-leaf transfer's
// messages to one peer as one batch, and a tree's view receives as one batch. Each returns the
// Work type its callers use (a batch answers for each message: batch_work.h), so nothing is cast
// back. Arguments are checked as ProcessGroupShm::send / recv check theirs (c10::Error). And the
// hook through which a group built over this one has its work progressed by this one's waits.

#include <tdshm/process_group.h>

#include "process_group/batch_work.h"
#include "shm/p2p/message_check.h"
#include "shm/parts/wait_hook.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <span>
#include <vector>

namespace tdshm::detail {

struct ShmGroupSeam {
  /// ProcessGroupShm::send / recv of `t` with `check`.
  static c10::intrusive_ptr<c10d::Work> send(ProcessGroupShm& pg, const at::Tensor& t, int dst, int tag,
                                             MessageCheck check);
  static c10::intrusive_ptr<c10d::Work> recv(ProcessGroupShm& pg, const at::Tensor& t, int src, int tag,
                                             MessageCheck check);
  /// The messages of one send per tensor (tensors[i] with tags[i] and checks[i], in order), posted
  /// under one lock and the peer woken once. Null when every message is already in the segment.
  static c10::intrusive_ptr<BatchWork> send_batch(ProcessGroupShm& pg, std::span<const at::Tensor> tensors, int dst,
                                                  const std::vector<int>& tags,
                                                  const std::vector<MessageCheck>& checks);
  /// The receiving side: one recv per tensor, posted under one lock. wait() returns once every
  /// message is in, or throws the first error as soon as one receive failed (the others may then
  /// still be pending: BatchWork::messages).
  static c10::intrusive_ptr<BatchWork> recv_batch(ProcessGroupShm& pg, std::span<const at::Tensor> tensors, int src,
                                                  const std::vector<int>& tags,
                                                  const std::vector<MessageCheck>& checks);
  /// One irecv_view per tags[i] (with checks[i]) from `src`, posted under one lock (a tree's
  /// views): result() is the received tensors in order once wait() returned.
  static c10::intrusive_ptr<BatchWork> recv_views(ProcessGroupShm& pg, int src, const std::vector<int>& tags,
                                                  const std::vector<MessageCheck>& checks);
  /// Adds `hook` to what the group's waits run before they may block (shm/parts/wait_hook.h): a group
  /// built over `pg` (a world across hosts) hands its own collective queue to pg's waits so.
  static void add_wait_hook(ProcessGroupShm& pg, std::shared_ptr<shm::WaitHook> hook);
  /// Removes the name of `pg`'s segment and its lock file once the group has formed (no process
  /// joins it again): what its members leave in /dev/shm is then nothing, however they end.
  static void unlink_segment_name(ProcessGroupShm& pg) noexcept;
};

}  // namespace tdshm::detail
