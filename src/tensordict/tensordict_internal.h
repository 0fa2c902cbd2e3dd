#pragma once
// What tensordict.cpp and tensordict_leaves.cpp share: a new empty node and the checks of what
// is stored in one (all defined in tensordict.cpp). Private to src/tensordict.

#include "tensordict/impl.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace tdshm::detail {

/// A node with this batch size and device, and no entries.
std::shared_ptr<TensorDictImpl> new_impl(std::vector<int64_t> batch_size, std::optional<c10::Device> device);

/// Throws ShapeError if a dimension of `batch_size` is negative.
void check_batch_size(const std::vector<int64_t>& batch_size);

/// Checks `value` for key `key` of a node with `batch_size` (what set() throws for it) and
/// returns what to store there: a tensor or tensordict moved to `device` when one is given.
Value prepare_value(const Key& key, const Value& value, const std::vector<int64_t>& batch_size,
                    const std::optional<c10::Device>& device);

/// Throws unless `src` may be copied into the leaf `leaf` of key `key` in place (defined, same shape).
void check_leaf_write(const Key& key, const at::Tensor& leaf, const at::Tensor& src);

}  // namespace tdshm::detail
