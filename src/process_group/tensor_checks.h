#pragma once
// Argument checks shared by ProcessGroupShm's point-to-point calls (process_group_shm.cpp) and
// its collectives (process_group_shm_collectives.cpp).

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace tdshm::detail {

/// A defined, dense (strided) CPU tensor; else c10::Error naming ProcessGroupShm::`op`.
inline void check_cpu_dense(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), "ProcessGroupShm::", op, ": a tensor is undefined");
  TORCH_CHECK(t.device().is_cpu(), "ProcessGroupShm::", op, ": only CPU tensors are supported, got ", t.device());
  TORCH_CHECK(t.layout() == at::kStrided, "ProcessGroupShm::", op, ": only dense (strided) tensors are supported");
}

}  // namespace tdshm::detail
