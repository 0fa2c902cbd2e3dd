#pragma once
// The argument checks of both process groups, ProcessGroupShm (process_group_shm.cpp,
// process_group_shm_collectives.cpp) and a world across hosts (process_group_hosts*.cpp): one
// set, so that the same bad argument fails the same way on either. Each throws c10::Error, as
// c10d's backends do, with a message that starts with `who` (the group) and the call's name.

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tdshm::detail {

inline constexpr const char* kShmGroup = "ProcessGroupShm::";
inline constexpr const char* kHostsGroup = "the shm backend across hosts: ";

/// A defined, dense (strided) CPU tensor.
inline void check_cpu_dense(const at::Tensor& t, const char* op, const char* who = kShmGroup) {
  TORCH_CHECK(t.defined(), who, op, ": a tensor is undefined");
  TORCH_CHECK(t.device().is_cpu(), who, op, ": only CPU tensors are supported, got ", t.device());
  TORCH_CHECK(t.layout() == at::kStrided, who, op, ": only dense (strided) tensors are supported");
}

/// c10d's calls take lists: the one tensor of a call that takes exactly one.
inline const at::Tensor& one_tensor(const std::vector<at::Tensor>& tensors, const char* op,
                                    const char* who = kShmGroup) {
  TORCH_CHECK(tensors.size() == 1, who, op, " takes exactly one tensor, got ", tensors.size());
  return tensors[0];
}

/// A collective's tensor: check_cpu_dense, and its elements do not overlap (most collectives
/// write their tensors in place; an expanded view would take several elements in one place).
inline void check_collective_tensor(const at::Tensor& t, const char* op, const char* who = kShmGroup) {
  check_cpu_dense(t, op, who);
  if (t.numel() > 1) {
    TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, who, op,
                ": a tensor's elements overlap in memory (an expanded view); pass a tensor of its own");
  }
}

/// The one tensor of a collective that takes exactly one.
inline const at::Tensor& one_collective_tensor(const std::vector<at::Tensor>& tensors, const char* op,
                                               const char* who = kShmGroup) {
  check_collective_tensor(one_tensor(tensors, op, who), op, who);
  return tensors[0];
}

/// A collective's list tensor (`what`: "output", "input") with the dtype and number of elements
/// of `like`, the call's one tensor.
inline void check_like(const at::Tensor& t, const at::Tensor& like, const char* op, const char* what,
                       const char* who = kShmGroup) {
  check_collective_tensor(t, op, who);
  TORCH_CHECK(t.scalar_type() == like.scalar_type() && t.numel() == like.numel(), who, op, ": every ", what,
              " must match the call's one tensor in dtype and number of elements (", like.scalar_type(), ", ",
              like.numel(), "), got ", t.scalar_type(), ", ", t.numel());
}

/// A root rank inside the group.
inline void check_root(int64_t root, int size, const char* op, const char* who = kShmGroup) {
  TORCH_CHECK(root >= 0 && root < size, who, op, ": root rank ", root, " is outside [0, ", size, ")");
}

/// One list of `size` tensors like `like` (`what`: "output", "input"), as all_gather takes.
inline void check_list(const std::vector<std::vector<at::Tensor>>& lists, int size, const at::Tensor& like,
                       const char* op, const char* what, const char* who = kShmGroup) {
  TORCH_CHECK(lists.size() == 1 && lists[0].size() == static_cast<size_t>(size), who, op, ": expected one list of ",
              size, " ", what, " tensors");
  for (const auto& t : lists[0]) check_like(t, like, op, what, who);
}

/// The lists of a gather (`what`: "output") or scatter ("input"): check_list on the root, none
/// elsewhere.
inline void check_root_list(const std::vector<std::vector<at::Tensor>>& lists, bool root, int size,
                            const at::Tensor& like, const char* op, const char* what, const char* who = kShmGroup) {
  if (root) {
    check_list(lists, size, like, op, what, who);
  } else {
    TORCH_CHECK(lists.empty(), who, op, ": only the root passes ", what, " tensors");
  }
}

}  // namespace tdshm::detail
