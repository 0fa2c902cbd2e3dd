#pragma once
/// \file
/// The loader scenario's batch (scenarios.h): its tensordict, a raw view of its four leaves (in a
/// tensordict, or in the in-place reference's shared buffer), and the production and consumption
/// every transport pays alike: the worker writes every byte of a batch once, main reads every
/// byte once and checks it.

#include "copy_channel.h"

#include <tdshm/tensordict.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace tdshm::bench {

inline constexpr int64_t kBatch = 32;
inline constexpr int64_t kImageBytes = kBatch * 3 * 64 * 64;
inline constexpr size_t kBatchBytes = static_cast<size_t>(kImageBytes) + 3 * kBatch * sizeof(int64_t);

/// {"image": uint8 [32,3,64,64], "label": int64 [32], "meta": {"idx", "worker": int64 [32]}},
/// batch size [32], zeros.
TensorDict make_batch();

/// Where a batch's leaves are.
struct BatchView {
  uint8_t* image;
  int64_t* label;
  int64_t* idx;
  int64_t* worker;
};
BatchView view(const TensorDict& td);
/// The in-place reference's buffer as a batch: image, label, idx, worker, one after the other.
BatchView view(const InplaceChannel& ch);

/// Batch `seq` of worker `w` (seq keeps growing across measurements): every byte written once.
void fill_batch(const BatchView& v, int w, int64_t seq);
/// Reads every byte of the batch once and checks it; std::runtime_error naming `where`, the
/// batch and the first value that differs.
void check_batch(const BatchView& v, int w, int64_t seq, const std::string& where);

}  // namespace tdshm::bench
