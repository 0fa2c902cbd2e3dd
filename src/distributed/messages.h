#pragma once
// What every transfer protocol does before and around its messages: resolve the peer, post one
// message through the group's transport (with the shm key or schema check riding along), the
// per-leaf wire of a tree (tags and checks), and the checks of a leaf that is sent or received
// in place. Internal to the distributed layer.
//
// Wire (see docs/wire.md): by default exactly tensordict's. Over shm, what tdshm checks rides
// inside the transport's own entries (MessageCheck: a key hash per leaf, a schema hash per
// consolidated storage), so no message is added. Over gloo, two tdshm ranks that both advertised
// it when the group was formed (Group::checked_wire_with) use the checked protocol: a layout
// descriptor before per-leaf leaves, a header before a consolidated storage.

#include <tdshm/distributed.h>
#include <tdshm/memmap.h>

#include "common/format.h"
#include "process_group/transport.h"

#include <ATen/MemoryOverlap.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tdshm::detail {

/// The most bytes a peer may announce for one storage (1 TiB): a corrupt or hostile peer makes
/// a transfer fail, never an absurd allocation.
inline constexpr uint64_t kMaxStorageBytes = uint64_t{1} << 40;

/// The peer of a transfer: a rank of `group`, the caller's own group (referred to, not copied: a
/// copy costs four reference-count operations per transfer) or the default group (held here).
/// Lives on the stack of the call that resolved it, which holds the caller's options.
class Peer {
 public:
  Peer(const Group* given, Group fallback, int group_rank) noexcept
      : fallback_(std::move(fallback)), group(given != nullptr ? *given : fallback_), rank(group_rank) {}
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;

 private:
  Group fallback_;  // (declared first: `group` may refer to it)

 public:
  const Group& group;
  const int rank;  // in group
};

/// Resolves exactly one of `global` / `in_group` (docs/semantics.md, "Peers"), before any message.
Peer resolve_peer(const char* global_name, const char* group_name, std::optional<int> global,
                  std::optional<int> in_group, const Group& given);
/// The group to use: `g`, or the default group when `g` is "no group". Throws Error for a
/// non-member.
Group group_or_default(const Group& g);
/// The group rank of global rank `src` (Error when it is not a member).
int root_in_group(const Group& g, int src);

/// Whether group rank `peer` runs tdshm's transfer layer (protocols only tdshm speaks need it),
/// from whichever source knows: the checked wire it advertised when the group formed (gloo, or a
/// rank of another host), or the transport (shared memory: the segment's rank features). False
/// when neither knows (a Python peer, or a tdshm rank that advertised nothing over gloo).
bool peer_runs_tdshm(const Group& g, int peer);

/// A transfer tag as c10d takes it. Throws Error outside [0, INT_MAX].
int c10d_tag(int64_t tag);

/// Posts one message; `check` rides with it where the transport can carry it
/// (Transport::Can::check_messages), else it is ignored.
WorkPtr send_one(const Group& g, at::Tensor t, int peer, int tag, MessageCheck check = {});
WorkPtr recv_one(const Group& g, at::Tensor t, int peer, int tag, MessageCheck check = {});
void recv_now(const Group& g, const at::Tensor& t, int peer, int tag);
void broadcast_now(const Group& g, const at::Tensor& t, int root);

at::Tensor int64_tensor(std::vector<int64_t> values);
at::Tensor bytes_tensor(int64_t n);

/// 32 bits of a 64-bit hash (key hash, schema fingerprint) for a MessageCheck.
inline uint32_t fold32(uint64_t h) noexcept { return static_cast<uint32_t>(h ^ (h >> 32)); }
/// The MessageCheck of the leaf whose key has key_hash `hash` (SortedLeaves::key_hashes) in a
/// transfer of `leaves` leaves (shm only; the same in every process and build; a count past
/// 65535 is sent as unknown).
MessageCheck key_check_of_hash(uint64_t hash, size_t leaves) noexcept;
/// The MessageCheck of a consolidated storage with schema fingerprint `fingerprint`.
inline MessageCheck schema_check(uint64_t fingerprint) noexcept {
  return {MessageCheck::Kind::kSchema, fold32(fingerprint)};
}

struct SortedLeaves;  // tensordict/impl.h

/// The per-leaf wire of a tree's leaves for one init_tag and pseudo_rand: the tags (checked as
/// c10d takes them) and the shm key checks, which every transfer of an unchanged tree repeats.
/// SortedLeaves (tensordict/impl.h) holds the last one used.
struct PerLeafWire {
  int64_t init_tag = 0;
  bool pseudo_rand = false;
  std::vector<int64_t> tags;
  std::vector<int> c10d_tags;
  std::vector<MessageCheck> checks;  // the shm key check of each leaf
};
/// `sorted`'s wire for init_tag / pseudo_rand, from its cache (SortedLeaves::default_wire, or
/// the last used). Valid while `sorted` lives and `keep` holds what it was given.
const PerLeafWire& wire_of(const SortedLeaves& sorted, int64_t init_tag, bool pseudo_rand,
                           std::shared_ptr<const PerLeafWire>& keep);

/// A leaf that can be a message: a defined, dense CPU tensor. `what()` names it ("key 'c'"),
/// built only on error. Throws TypeError.
template <class Name>
void check_leaf(const at::Tensor& t, const Name& what) {
  if (!t.device().is_cpu()) {
    throw TypeError(what() + ": only CPU tensors can be transferred, this leaf is on " + t.device().str());
  }
  if (t.layout() != at::kStrided) throw TypeError(what() + ": only dense (strided) tensors can be transferred");
}

/// A tensor a message can land in, in place: a leaf check_leaf accepts whose elements do not
/// overlap (TypeError: an expanded tensor, stride 0, would receive several elements into one
/// place) and that is not a read-only MemoryMappedTensor (MemmapError: its writes are private
/// copy-on-write pages, they would never reach the file). Checked before any receive is posted.
template <class Name>
void check_receive_target(const at::Tensor& t, const Name& what) {
  check_leaf(t, what);
  // (A contiguous tensor cannot overlap, and only a mapped one can be read-only: the common
  // leaf costs two inline checks, not a call into ATen and a copy of the mapping's file name.)
  if (!t.is_contiguous() && at::has_internal_overlap(t) == at::MemOverlap::Yes) {
    throw TypeError(what() + ": its elements overlap in memory (shape " + detail::shape_str(t.sizes()) + ", strides " +
                    detail::shape_str(t.strides()) +
                    ", an expanded tensor?), so it cannot receive in place; give the "
                    "receiver a tensor of its own (clone() or contiguous()); nothing was received");
  }
  if (!MemoryMappedTensor::is_mapped(t)) return;
  if (const auto info = MemoryMappedTensor::info(t); info && !info->writable) {
    throw MemmapError(what() + ": it maps '" + info->filename +
                      "' read-only (MemmapMode::kReadOnly), so received bytes would never reach the file; map it "
                      "with MemmapMode::kReadWrite or receive into another tensor; nothing was received");
  }
}

}  // namespace tdshm::detail
