// Element-wise reductions of the shm collectives (reduce.h).

#include "shm/collective/reduce.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/complex.h>

#include <cmath>
#include <stdexcept>
#include <type_traits>

namespace tdshm::detail {

namespace {

template <class T>
inline constexpr bool kComplex = std::is_same_v<T, c10::complex<float>> || std::is_same_v<T, c10::complex<double>>;
template <class T>
inline constexpr bool kReduced = std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>;

// Calls f(T{}) with the C++ type of `dtype`; false for a dtype the collectives do not reduce.
template <class F>
bool with_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kBool: f(bool{}); return true;
    case at::kByte: f(uint8_t{}); return true;
    case at::kChar: f(int8_t{}); return true;
    case at::kShort: f(int16_t{}); return true;
    case at::kInt: f(int32_t{}); return true;
    case at::kLong: f(int64_t{}); return true;
    case at::kHalf: f(c10::Half{}); return true;
    case at::kBFloat16: f(c10::BFloat16{}); return true;
    case at::kFloat: f(float{}); return true;
    case at::kDouble: f(double{}); return true;
    case at::kComplexFloat: f(c10::complex<float>{}); return true;
    case at::kComplexDouble: f(c10::complex<double>{}); return true;
    default: return false;
  }
}

template <class T, class Op>
void loop(T* out, const T* a, const T* b, size_t n, Op op) {
  for (size_t i = 0; i < n; ++i) out[i] = op(a[i], b[i]);
}

// Half and BFloat16 compute in float and round once per operation.
template <class T>
struct Wide {
  using type = T;
};
template <>
struct Wide<c10::Half> {
  using type = float;
};
template <>
struct Wide<c10::BFloat16> {
  using type = float;
};

template <class T>
void reduce_typed(T* out, const T* a, const T* b, size_t n, ReduceKind op) {
  using W = typename Wide<T>::type;
  if constexpr (std::is_same_v<T, bool>) {
    switch (op) {
      case ReduceKind::kSum:
      case ReduceKind::kMax:
      case ReduceKind::kBor: return loop(out, a, b, n, [](bool x, bool y) { return x || y; });
      case ReduceKind::kProduct:
      case ReduceKind::kMin:
      case ReduceKind::kBand: return loop(out, a, b, n, [](bool x, bool y) { return x && y; });
      case ReduceKind::kBxor: return loop(out, a, b, n, [](bool x, bool y) { return x != y; });
      case ReduceKind::kAvg: break;
    }
  } else {
    switch (op) {
      case ReduceKind::kSum:
      case ReduceKind::kAvg:
        if constexpr (std::is_integral_v<T>) {
          // Integers wrap around, as torch's do: computed in uint64_t, where overflow is defined.
          return loop(out, a, b, n,
                      [](T x, T y) { return static_cast<T>(static_cast<uint64_t>(x) + static_cast<uint64_t>(y)); });
        } else {
          return loop(out, a, b, n, [](T x, T y) { return static_cast<T>(static_cast<W>(x) + static_cast<W>(y)); });
        }
      case ReduceKind::kProduct:
        if constexpr (std::is_integral_v<T>) {
          return loop(out, a, b, n,
                      [](T x, T y) { return static_cast<T>(static_cast<uint64_t>(x) * static_cast<uint64_t>(y)); });
        } else {
          return loop(out, a, b, n, [](T x, T y) { return static_cast<T>(static_cast<W>(x) * static_cast<W>(y)); });
        }
      case ReduceKind::kMin:
      case ReduceKind::kMax:
        if constexpr (!kComplex<T>) {
          // NaN wins, as in torch.minimum / torch.maximum.
          const bool min = op == ReduceKind::kMin;
          return loop(out, a, b, n, [min](T x, T y) {
            const W wx = static_cast<W>(x), wy = static_cast<W>(y);
            if constexpr (std::is_floating_point_v<W>) {
              if (std::isnan(wx)) return x;
              if (std::isnan(wy)) return y;
            }
            return (min ? wy < wx : wy > wx) ? y : x;
          });
        }
        break;
      case ReduceKind::kBand:
      case ReduceKind::kBor:
      case ReduceKind::kBxor:
        if constexpr (std::is_integral_v<T>) {
          if (op == ReduceKind::kBand) return loop(out, a, b, n, [](T x, T y) { return static_cast<T>(x & y); });
          if (op == ReduceKind::kBor) return loop(out, a, b, n, [](T x, T y) { return static_cast<T>(x | y); });
          return loop(out, a, b, n, [](T x, T y) { return static_cast<T>(x ^ y); });
        }
        break;
    }
  }
  throw std::logic_error(std::string("reduce_into: ") + reduce_name(op) +
                         " on this dtype (reduce_problem not checked)");
}

}  // namespace

const char* reduce_name(ReduceKind op) noexcept {
  switch (op) {
    case ReduceKind::kSum: return "SUM";
    case ReduceKind::kAvg: return "AVG";
    case ReduceKind::kProduct: return "PRODUCT";
    case ReduceKind::kMin: return "MIN";
    case ReduceKind::kMax: return "MAX";
    case ReduceKind::kBand: return "BAND";
    case ReduceKind::kBor: return "BOR";
    case ReduceKind::kBxor: return "BXOR";
  }
  return "?";
}

std::string reduce_problem(ReduceKind op, at::ScalarType dtype) {
  std::string problem;
  const bool known = with_type(dtype, [&](auto v) {
    using T = decltype(v);
    const bool bitwise = op == ReduceKind::kBand || op == ReduceKind::kBor || op == ReduceKind::kBxor;
    if (bitwise && !std::is_integral_v<T>) {
      problem = std::string(reduce_name(op)) + " needs an integer or bool dtype, not " + c10::toString(dtype);
    } else if ((op == ReduceKind::kMin || op == ReduceKind::kMax) && kComplex<T>) {
      problem = std::string(reduce_name(op)) + " is not defined for complex numbers (" + c10::toString(dtype) + ")";
    } else if (op == ReduceKind::kAvg && !(std::is_floating_point_v<T> || kReduced<T> || kComplex<T>)) {
      problem = std::string("AVG needs a floating-point or complex dtype, not ") + c10::toString(dtype);
    }
  });
  if (!known) return std::string("the shm collectives do not reduce dtype ") + c10::toString(dtype);
  return problem;
}

void reduce_into(void* out, const void* a, const void* b, size_t n, at::ScalarType dtype, ReduceKind op) {
  with_type(dtype, [&](auto v) {
    using T = decltype(v);
    reduce_typed(static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n, op);
  });
}

void divide_by(void* data, size_t n, at::ScalarType dtype, int64_t divisor) {
  with_type(dtype, [&](auto v) {
    using T = decltype(v);
    if constexpr (std::is_floating_point_v<T> || kReduced<T> || kComplex<T>) {
      using W = typename Wide<T>::type;
      auto* p = static_cast<T*>(data);
      const auto d = static_cast<W>(divisor);
      for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(static_cast<W>(p[i]) / d);
    }
  });
}

}  // namespace tdshm::detail
