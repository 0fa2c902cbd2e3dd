#pragma once
// The layout descriptor of a per-leaf transfer: what the sender says about its leaves (key,
// dtype, shape) so that the receiver can check its own leaves before it posts a receive into
// them. How the descriptor travels (a header message under the first leaf's tag, see
// transfer.cpp) is apart from what it says and how it is checked (this file), so that the
// transport of the check can change without touching the check.
//
// Header (kHeaderWords int64, one message):
//
//   word  0        1       2 .. 31
//        +--------+-------+-----------------------------------------------+
//        | magic  | words | descriptor when words <= kInlineWords, else 0 |
//        +--------+-------+-----------------------------------------------+
//
// Descriptor (inline above, or a second message of `words` int64 under the same tag), per leaf
// in sorted_leaf_keys() order:
//
//        +----------+--------------------+-------+-----+--------------+
//        | key hash | dtype + 256 * ndim | dim 0 | ... | dim ndim - 1 |
//        +----------+--------------------+-------+-----+--------------+
//
// A leaf of n dimensions takes 2 + n words, so the 30 inline words hold a few small leaves (the
// seed tree's three leaves take 12). The key hash is key_hash() of the leaf's full key path.
// Version 1 ("tdsmlay1") had no key hash and separate dtype and ndim words; a receiver refuses
// it with an error that says so.

#include <tdshm/errors.h>
#include <tdshm/tensordict.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/format.h"
#include "common/hash.h"
#include "tensordict/impl.h"

namespace tdshm::detail {

inline constexpr int64_t kLayoutMagic = 0x7464736d6c617932;    // "tdsmlay2"
inline constexpr int64_t kLayoutMagicV1 = 0x7464736d6c617931;  // "tdsmlay1": no key hashes
inline constexpr int64_t kHeaderWords = 32;
inline constexpr int64_t kInlineWords = kHeaderWords - 2;
/// Bound on what a peer's header may announce (a corrupt or hostile peer makes a transfer fail,
/// never an absurd allocation): descriptors are metadata, never this large.
inline constexpr int64_t kMaxDescriptorWords = int64_t{1} << 24;
/// Bound on the bytes of one leaf a descriptor may announce (a refused transfer drains the
/// sender's leaves into scratch tensors of their size).
inline constexpr int64_t kMaxLeafBytes = int64_t{1} << 40;

/// A 64-bit hash of a key's full path, the same in every process and build: FNV-1a over the
/// number of parts, then each part's byte length and bytes (lengths as 8 little-endian bytes, so
/// ("a", "b") differs from ("ab") and from "a.b"), followed by a 64-bit mixing step. Pinned by
/// TransferLayout.KeyHashIsPinned.
inline uint64_t key_hash(const Key& key) { return key_path_hash(key); }

/// The descriptor of leaves `tensors` with keys `keys` (same length, sorted_leaf_keys() order).
inline std::vector<int64_t> describe_leaves(const std::vector<Key>& keys, std::span<const at::Tensor> tensors) {
  std::vector<int64_t> d;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    d.push_back(static_cast<int64_t>(key_hash(keys[i])));
    d.push_back(static_cast<int64_t>(t.scalar_type()) + 256 * t.dim());
    for (int64_t s : t.sizes()) d.push_back(s);
  }
  return d;
}

/// The header for `desc`, built with plain stores (small metadata tensors through ATen ops would
/// cost more than the messages themselves).
inline at::Tensor descriptor_header(const std::vector<int64_t>& desc) {
  auto header = at::empty({kHeaderWords}, at::TensorOptions().dtype(at::kLong));
  auto* h = header.data_ptr<int64_t>();
  std::fill(h, h + kHeaderWords, 0);
  h[0] = kLayoutMagic;
  h[1] = static_cast<int64_t>(desc.size());
  if (static_cast<int64_t>(desc.size()) <= kInlineWords) std::copy(desc.begin(), desc.end(), h + 2);
  return header;
}

/// Checks a received header's magic and length; returns the descriptor's length in words.
/// Throws TransportError for anything but a version-2 descriptor header.
inline int64_t descriptor_words(const at::Tensor& header) {
  const int64_t magic = header.data_ptr<int64_t>()[0], words = header.data_ptr<int64_t>()[1];
  if (magic == kLayoutMagicV1) {
    throw TransportError("the sender's layout descriptor is of version 1 (an older tdshm, without key names); this "
                         "tdshm reads version 2 only: run the same tdshm version on both peers");
  }
  if (magic != kLayoutMagic || words < 0 || words > kMaxDescriptorWords) {
    throw TransportError("the sender's per-leaf header is not a tdshm layout descriptor (is the sender using the same "
                         "mode, per-leaf or consolidated, and tdshm?)");
  }
  return words;
}

/// One of the sender's leaves, as its descriptor says.
struct LeafLayout {
  uint64_t key_hash = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::vector<int64_t> shape;
};

/// Parses a peer's descriptor of `n` words, checking every value (it came from another process).
/// Throws TransportError if it is malformed.
inline std::vector<LeafLayout> parse_descriptor(const int64_t* d, int64_t n) {
  std::vector<LeafLayout> out;
  int64_t i = 0;
  auto bad = [](const std::string& what) { return TransportError("malformed layout descriptor from the sender: " + what); };
  while (i < n) {
    if (n - i < 2) throw bad("truncated");
    const int64_t packed = d[i + 1];
    if (packed < 0) throw bad("dtype and ndim word " + std::to_string(packed));
    const int64_t dtype = packed % 256, ndim = packed / 256;
    if (dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions) ||
        dtype == static_cast<int64_t>(c10::ScalarType::Undefined)) {
      throw bad("dtype " + std::to_string(dtype));
    }
    if (ndim > n - i - 2) throw bad("ndim " + std::to_string(ndim));
    LeafLayout l{static_cast<uint64_t>(d[i]), static_cast<c10::ScalarType>(dtype), {d + i + 2, d + i + 2 + ndim}};
    int64_t bytes = static_cast<int64_t>(c10::elementSize(l.dtype));
    for (int64_t s : l.shape) {
      if (s < 0 || (s != 0 && bytes > kMaxLeafBytes / s)) throw bad("dimension " + std::to_string(s));
      bytes *= s;
    }
    out.push_back(std::move(l));
    i += 2 + ndim;
  }
  return out;
}

/// The first difference between the sender's leaves `theirs` and the receiver's (`keys[i]` holds
/// `tensors[i]`, sorted_leaf_keys() order), as a message naming the receiver's key where there is
/// one; empty when they agree. Per leaf the key comes first, then dtype and shape.
inline std::string layout_problem(const std::vector<LeafLayout>& theirs, const std::vector<Key>& keys,
                                  std::span<const at::Tensor> tensors) {
  std::vector<uint64_t> mine;
  mine.reserve(keys.size());
  for (const Key& k : keys) mine.push_back(key_hash(k));
  // The receiver's name for one of the sender's keys, when it has that key at all.
  const auto known_as = [&](uint64_t h) -> std::string {
    const auto it = std::find(mine.begin(), mine.end(), h);
    return it == mine.end() ? std::string() : keys[static_cast<size_t>(it - mine.begin())].str();
  };
  const std::string counts = "it sends " + std::to_string(theirs.size()) + " leaves, this tensordict has " +
                             std::to_string(keys.size());
  for (size_t i = 0; i < std::max(theirs.size(), keys.size()); ++i) {
    if (i >= theirs.size()) return "key " + keys[i].str() + ": the sender has no leaf for it (" + counts + ")";
    if (i >= keys.size()) {
      const std::string name = known_as(theirs[i].key_hash);
      return "the sender sends " + std::to_string(theirs.size()) + " leaves, this tensordict has " +
             std::to_string(keys.size()) + " (the sender's leaf " + std::to_string(i + 1) + " is " +
             (name.empty() ? std::string("a key this tensordict does not have") : name) + ")";
    }
    if (theirs[i].key_hash != mine[i]) {
      const std::string name = known_as(theirs[i].key_hash);
      return "key " + keys[i].str() + ": the sender sends " +
             (name.empty() ? std::string("a key this tensordict does not have") : name) +
             " in its place (the sender's keys differ from this tensordict's; " + counts + ")";
    }
    if (theirs[i].dtype != tensors[i].scalar_type() || !tensors[i].sizes().equals(theirs[i].shape)) {
      return "key " + keys[i].str() + ": the sender's leaf has dtype " + c10::toString(theirs[i].dtype) + " and shape " +
             shape_str(theirs[i].shape) + ", this one " + c10::toString(tensors[i].scalar_type()) + " and " +
             shape_str(tensors[i].sizes());
    }
  }
  return {};
}

}  // namespace tdshm::detail
