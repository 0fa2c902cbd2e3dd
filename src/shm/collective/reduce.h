#pragma once
// Element-wise reductions of the shm collectives: out[i] = a[i] op b[i] over raw buffers of one
// dtype. Each element is one operation, so the result does not depend on how the loop is
// vectorised: ranks that reduce the same inputs in the same order (rank 0, 1, ...) get
// bit-identical results.

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace tdshm::detail {

enum class ReduceKind : uint8_t { kSum, kAvg, kProduct, kMin, kMax, kBand, kBor, kBxor };

/// "SUM", "AVG", ...
const char* reduce_name(ReduceKind op) noexcept;

/// Why `op` cannot reduce `dtype` ("" if it can): bitwise ops need integers or bool, MIN and MAX
/// need an ordered type (not complex), AVG needs floating point or complex.
std::string reduce_problem(ReduceKind op, at::ScalarType dtype);

/// out[i] = a[i] op b[i] for `n` elements (AVG sums); `out` may be `a`. `dtype` must pass
/// reduce_problem.
void reduce_into(void* out, const void* a, const void* b, size_t n, at::ScalarType dtype, ReduceKind op);

/// data[i] /= divisor (AVG's last step; floating point and complex dtypes).
void divide_by(void* data, size_t n, at::ScalarType dtype, int64_t divisor);

}  // namespace tdshm::detail
