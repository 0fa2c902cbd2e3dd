#pragma once
// The trees of the interop tests (test_interop.cpp): tests/python/td_peer.py's TREES, entry for
// entry, in insertion order, and their values (pattern(), written twice: here and in td_peer.py),
// which both sides build and check leaf by leaf.

#include <tdshm/tensorclass.h>
#include <tdshm/tensordict.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tdshm::test::interop {

// The tensorclass of the "record" tree, under the name tensordict gives the Python class
// td_peer_types.InteropRecord (f"{cls.__module__}.{cls.__qualname__}").
TDSHM_TENSORCLASS(InteropRecord, "td_peer_types.InteropRecord", obs, action, reward);

struct Entry {
  std::vector<std::string> path;
  std::optional<at::ScalarType> dtype;  // a tensor leaf, else a non-tensor value
  std::vector<int64_t> shape;
  NonTensorData value;
};
struct TreeSpec {
  std::vector<int64_t> batch;
  std::vector<Entry> entries;
};

/// The spec of tree `name` (std::invalid_argument if there is none).
const TreeSpec& tree_spec(const std::string& name);
/// "a.b" of {"a", "b"}.
std::string dotted(const std::vector<std::string>& path);
/// FNV-1a, 32 bits (td_peer.py's, for the patterns' offsets).
uint32_t fnv1a32(const std::string& text);
/// td_peer.pattern: v_i = (7 i + off) % 100, off = (fnv1a32("a.b") + 13 salt) % 100; bool: v odd;
/// floating: (v - 50) / 8 (exact in every float type); integers: v.
at::Tensor pattern(const std::vector<std::string>& path, at::ScalarType dtype, const std::vector<int64_t>& shape,
                   int64_t salt);
/// Tree `name` with pattern values at `salt`, or (blank) every element 111 (true for bool),
/// which no pattern holds.
TensorDict build_tree(const std::string& name, int64_t salt, bool blank = false);
/// The tensor leaves of tree `name` at `salt`, without its non-tensor values: what update_
/// writes into a consolidated copy (update_ takes tensors only).
TensorDict tensors_of(const std::string& name, int64_t salt);
/// Every leaf and non-tensor value of tree `name` at `salt` is in `got`, and no other tensor leaf
/// (a test failure naming `what` otherwise).
void check_tree(const TensorDict& got, const std::string& name, int64_t salt, const std::string& what);

}  // namespace tdshm::test::interop
