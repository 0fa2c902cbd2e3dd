// TensorDict::gather_and_stack (docs/semantics.md, "gather_and_stack"): tensordict gathers every
// rank's pickled tensordict with gather_object, stacks all but dst's own and writes the stack
// into dst's tensordict. tdshm moves the leaves instead, straight into their place:
//
//  1. Every rank checks that every member of the group runs tdshm's transfers (over shm the
//     segment says so, ShmOptions::tdshm_transfers; over gloo the checked-wire advertisement):
//     with a Python (tensordict) rank, whose gather_object we do not read, every tdshm rank
//     refuses before any message (Error). The ranks agree, since they read the same facts.
//  2. dst checks its batch (first dimension = group size - 1) and sends each other rank one
//     int64 with tag kGatherTag: 1 (go) or 0 (refused: dst raises ShapeError, the others Error).
//  3. On go, rank r sends its tree per leaf (init_tag kGatherTag + 1, tensordict's per-leaf
//     wire with tdshm's checks); dst receives rank r's leaves into entry j of its own (the j-th
//     rank other than itself) along the first batch dimension: views, no staging copy.

#include "distributed/messages.h"
#include "distributed/transfer_work.h"
#include "tensordict/impl.h"

namespace tdshm {

using namespace detail;

namespace {

// Tags of gather_and_stack's messages: apart from the per-leaf transfers' usual small tags.
constexpr int kGatherTag = 1 << 24;

bool every_member_runs_tdshm(const Group& g) {
  for (int r = 0; r < g.size(); ++r) {
    if (!peer_runs_tdshm(g, r)) return false;
  }
  return true;
}

}  // namespace

std::optional<TensorDict> TensorDict::gather_and_stack(const GatherAndStackOptions& o) {
  if (o.dst.has_value() == o.group_dst.has_value()) {
    throw Error("gather_and_stack: exactly one of `dst` and `group_dst` must be given");
  }
  if (o.group_dst && !o.group.defined()) throw Error("gather_and_stack: `group_dst` requires `group`");
  const Group g = group_or_default(o.group);
  if (o.group_dst && (*o.group_dst < 0 || *o.group_dst >= g.size())) {
    throw Error("gather_and_stack: group_dst " + std::to_string(*o.group_dst) + " is not a rank of the group (size " +
                std::to_string(g.size()) + ")");
  }
  const int dst = o.group_dst ? *o.group_dst : root_in_group(g, *o.dst);
  const std::string dst_name = o.group_dst ? "group rank " + std::to_string(dst) : "rank " + std::to_string(*o.dst);
  if (!every_member_runs_tdshm(g)) {
    throw Error("gather_and_stack: a rank of this group is a Python (tensordict) rank, whose gather_and_stack "
                "pickles the whole tensordict (gather_object); tdshm ranks do not read that: gather with "
                "per-leaf send/recv instead, or keep gather_and_stack among tdshm ranks");
  }
  const int others = g.size() - 1;
  if (g.rank() != dst) {
    at::Tensor go = int64_tensor({0});
    recv_now(g, go, dst, kGatherTag);
    if (go.data_ptr<int64_t>()[0] != 1) {
      throw Error("gather_and_stack: " + dst_name +
                  " refused: its tensordict's first batch dimension is not the group size - 1 (" +
                  std::to_string(others) + ")");
    }
    send({.group = g, .group_dst = dst, .init_tag = kGatherTag + 1});
    return std::nullopt;
  }
  const bool fits = batch_dims() >= 1 && batch_size()[0] == others;
  std::vector<WorkPtr> answers;
  for (int r = 0; r < g.size(); ++r) {
    if (r != dst) answers.push_back(send_one(g, int64_tensor({fits ? 1 : 0}), r, kGatherTag));
  }
  wait_all(answers);
  if (!fits) {
    throw ShapeError("gather_and_stack: this tensordict's batch size " + shape_str(batch_size()) +
                     " must start with the group size - 1 (" + std::to_string(others) + ")");
  }
  std::vector<Transfer> pending;
  for (int r = 0, j = 0; r < g.size(); ++r) {
    if (r == dst) continue;
    TensorDict entry = select_first(*this, j++);
    pending.push_back(entry.irecv({.group = g, .group_src = r, .init_tag = kGatherTag + 1, .return_premature = true}));
  }
  for (const Transfer& t : pending) t.wait();
  return *this;
}

}  // namespace tdshm
