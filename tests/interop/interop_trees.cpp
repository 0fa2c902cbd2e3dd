// The interop tests' trees and their values (interop_trees.h).

#include "interop/interop_trees.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <sstream>
#include <stdexcept>
#include <variant>

#include "dist/dist_support.h"

namespace tdshm::test::interop {

namespace {

Entry T(std::vector<std::string> path, at::ScalarType dtype, std::vector<int64_t> shape) {
  return {std::move(path), dtype, std::move(shape), NonTensorData(false)};
}
Entry N(std::vector<std::string> path, NonTensorData value) { return {std::move(path), std::nullopt, {}, std::move(value)}; }

}  // namespace

const TreeSpec& tree_spec(const std::string& name) {
  using at::kBFloat16, at::kBool, at::kByte, at::kChar, at::kDouble, at::kFloat, at::kHalf, at::kInt, at::kLong,
      at::kShort;
  static const std::map<std::string, TreeSpec> trees = {
      {"seed", {{2}, {T({"a", "b"}, kFloat, {2}), T({"c"}, kFloat, {2, 3}), T({"_"}, kFloat, {2, 1, 5})}}},
      {"u8only", {{}, {T({"x"}, kByte, {3}), T({"n", "y"}, kByte, {5}), T({"z"}, kByte, {1})}}},
      {"mixed",
       {{2},
        {
            T({"obs"}, kFloat, {2, 3}),
            N({"name"}, std::string("h\xc3\xa9llo w\xc3\xb6rld")),
            T({"a", "b"}, kFloat, {2}),
            T({"_"}, kHalf, {2, 1, 5}),
            N({"count"}, int64_t{(int64_t{1} << 40) + 7}),
            T({"Z"}, kLong, {2}),
            T({"a", "x", "y"}, kShort, {2, 3}),
            N({"a", "label"}, std::string("nested")),
            T({"mask"}, kBool, {2, 3}),
            N({"ratio"}, 0.1),
            T({"u8"}, kByte, {2, 5}),
            T({"d"}, kDouble, {2}),
            N({"flag"}, true),
            T({"i8"}, kChar, {2, 7}),
            T({"bf"}, kBFloat16, {2, 3}),
            T({"a", "i32"}, kInt, {2}),
            N({"neg"}, int64_t{-5}),
        }}},
      {"reducible",
       {{2},
        {T({"obs"}, kFloat, {2, 3}), T({"n", "x"}, kLong, {2, 5}), T({"_"}, kDouble, {2, 1}),
         N({"label"}, std::string("r")), T({"n", "deep", "y"}, kInt, {2, 7}), T({"Z"}, kByte, {2, 3})}}},
      {"record", {{3}, {T({"obs"}, kFloat, {3, 4}), T({"action"}, kLong, {3}), T({"reward"}, kFloat, {3, 1})}}},
      {"probe", {{2}, {T({"alpha"}, kFloat, {2}), T({"nest", "victim_key"}, kFloat, {2, 3}), T({"omega"}, kFloat, {2})}}},
  };
  const auto it = trees.find(name);
  if (it == trees.end()) throw std::invalid_argument("no tree " + name);
  return it->second;
}

std::string dotted(const std::vector<std::string>& path) {
  std::string s;
  for (const std::string& p : path) s += (s.empty() ? "" : ".") + p;
  return s;
}

uint32_t fnv1a32(const std::string& text) {
  uint32_t h = 2166136261u;
  for (const unsigned char c : text) {
    h ^= c;
    h *= 16777619u;
  }
  return h;
}

at::Tensor pattern(const std::vector<std::string>& path, at::ScalarType dtype, const std::vector<int64_t>& shape,
                   int64_t salt) {
  int64_t n = 1;
  for (const int64_t s : shape) n *= s;
  const int64_t off = (static_cast<int64_t>(fnv1a32(dotted(path))) + 13 * salt) % 100;
  const at::Tensor v = (at::arange(n, at::kLong) * 7 + off).remainder(100);
  at::Tensor out;
  if (dtype == at::kBool) {
    out = v.remainder(2).eq(1);
  } else if (at::isFloatingType(dtype)) {
    out = ((v - 50).to(at::kDouble) / 8).to(dtype);
  } else {
    out = v.to(dtype);
  }
  return out.reshape(shape);
}

TensorDict build_tree(const std::string& name, int64_t salt, bool blank) {
  const TreeSpec& spec = tree_spec(name);
  TensorDict td(spec.batch);
  for (const Entry& e : spec.entries) {
    if (e.dtype) {
      td.set(Key(e.path), blank ? at::full(e.shape, 111, at::TensorOptions().dtype(*e.dtype))
                                : pattern(e.path, *e.dtype, e.shape, salt));
    } else {
      td.set(Key(e.path), Value(e.value));
    }
  }
  return td;
}

TensorDict tensors_of(const std::string& name, int64_t salt) {
  const TreeSpec& spec = tree_spec(name);
  TensorDict td(spec.batch);
  for (const Entry& e : spec.entries) {
    if (e.dtype) td.set(Key(e.path), pattern(e.path, *e.dtype, e.shape, salt));
  }
  return td;
}

namespace {

std::string describe(const NonTensorData& v) {
  return std::visit(
      [](const auto& x) {
        std::ostringstream os;
        os << x;
        return os.str();
      },
      v);
}

}  // namespace

void check_tree(const TensorDict& got, const std::string& name, int64_t salt, const std::string& what) {
  const TreeSpec& spec = tree_spec(name);
  std::ostringstream errors;
  if (got.batch_size() != spec.batch) errors << "; batch size differs";
  size_t tensors = 0;
  for (const Entry& e : spec.entries) {
    const Key key(e.path);
    if (!got.contains(key)) {
      errors << "; " << dotted(e.path) << " missing";
      continue;
    }
    const Value v = got.get_value(key);
    if (e.dtype) {
      ++tensors;
      if (!v.is_tensor()) {
        errors << "; " << dotted(e.path) << " is a " << v.kind_name();
        continue;
      }
      const at::Tensor t = v.tensor();
      const at::Tensor want = pattern(e.path, *e.dtype, e.shape, salt);
      if (t.scalar_type() != *e.dtype || t.sizes() != want.sizes()) {
        errors << "; " << dotted(e.path) << " is " << t.scalar_type() << " " << t.sizes() << ", expected " << *e.dtype
               << " " << want.sizes();
      } else if (!at::equal(t, want)) {
        errors << "; " << dotted(e.path) << " holds other values (first: " << t.flatten()[0].item<double>()
               << ", expected " << want.flatten()[0].item<double>() << ")";
      }
    } else if (!v.is_non_tensor()) {
      errors << "; " << dotted(e.path) << " is a " << v.kind_name() << ", not a non-tensor value";
    } else if (!(v.non_tensor() == e.value)) {
      errors << "; " << dotted(e.path) << " = " << describe(v.non_tensor()) << " (index " << v.non_tensor().index()
             << "), expected " << describe(e.value) << " (index " << e.value.index() << ")";
    }
  }
  const size_t leaves = got.sorted_leaf_keys().size();
  if (leaves != tensors) errors << "; " << leaves << " tensor leaves, expected " << tensors;
  SHM_CHECK(errors.str().empty(), what << ": " << errors.str().substr(2));
}

}  // namespace tdshm::test::interop
