// The schema's layout: the rules validate_schema checks, equality and the layout fingerprint.

#include "common/format.h"
#include "common/hash.h"
#include "schema/schema_internal.h"
#include "schema/wire.h"

#include "tdshm/schema.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace tdshm {

namespace {

using detail::WireEntryKind;
using detail::device_code;
using detail::dtype_code;
using detail::is_known_device_type;
using detail::is_valid_device_index;
using detail::wire::fail;

// The dtypes a leaf may have: real, fixed-size, dense element types. Quantized and
// sub-byte types (and Undefined, NumOptions) are refused.
bool is_storable_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Byte:
    case c10::ScalarType::Char:
    case c10::ScalarType::Short:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Half:
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::ComplexHalf:
    case c10::ScalarType::ComplexFloat:
    case c10::ScalarType::ComplexDouble:
    case c10::ScalarType::Bool:
    case c10::ScalarType::BFloat16:
      return true;
    default:
      return false;
  }
}

std::string join_path(const std::vector<std::string_view>& parts) {
  if (parts.empty()) return "<root>";
  std::string out;
  for (const auto& part : parts) {
    if (!out.empty()) out += '.';
    out.append(part);
  }
  return out;
}

// ------------------------------------------------------------------------------------------
// Validation (shared by encode and decode)
// ------------------------------------------------------------------------------------------

// A key path joined only when a message streams it. Joining the path of every leaf up front
// costs up to depth * kSchemaMaxKeyBytes bytes per leaf, which made validation quadratic in the
// input (a hostile schema of long keys nested deep with many leaves took minutes).
struct LazyPath {
  const std::vector<std::string_view>& parts;
  friend std::ostream& operator<<(std::ostream& os, const LazyPath& p) { return os << join_path(p.parts); }
};

class Validator {
 public:
  explicit Validator(uint64_t total_bytes) : total_bytes_(total_bytes) {}

  void node(const SchemaNode& n, size_t depth) {
    if (depth > kSchemaMaxDepth) {
      fail("node '", where(), "' is nested ", depth, " levels deep, more than kSchemaMaxDepth = ", kSchemaMaxDepth);
    }
    if (n.class_name.size() > kSchemaMaxKeyBytes) {
      fail("class name of node '", where(), "' is ", n.class_name.size(), " bytes, more than kSchemaMaxKeyBytes = ",
           kSchemaMaxKeyBytes);
    }
    if (n.batch_size.size() > kSchemaMaxDims) {
      fail("batch size of node '", where(), "' has ", n.batch_size.size(), " dimensions, more than kSchemaMaxDims = ",
           kSchemaMaxDims);
    }
    for (size_t i = 0; i < n.batch_size.size(); ++i) {
      if (n.batch_size[i] < 0) {
        fail("batch size of node '", where(), "' ", detail::shape_str(n.batch_size), " has negative dimension ", i);
      }
    }
    if (n.device) {
      const uint8_t code = device_code(n.device->type());
      if (!is_known_device_type(code)) {
        fail("device of node '", where(), "' has unknown device type code ", int{code});
      }
      if (!is_valid_device_index(n.device->type(), n.device->index())) {
        fail("device of node '", where(), "' (type code ", int{code}, ") has invalid index ", int{n.device->index()});
      }
    }
    check_keys(n);
    if (n.lazy_stack_dim) lazy_stack(n);
    for (const auto& entry : n.entries) {
      path_.push_back(entry.key);
      if (const auto* tensor = std::get_if<SchemaTensor>(&entry.value)) {
        leaf(*tensor);
      } else if (const auto* child = std::get_if<std::shared_ptr<SchemaNode>>(&entry.value)) {
        if (!*child) fail("child node '", where(), "' is a null pointer");
        node(**child, depth + 1);
      }
      path_.pop_back();
    }
  }

 private:
  std::string where() const { return join_path(path_); }

  // A lazy stack: its members "0", "1", ... in order, sharing a batch size, and the stack's
  // batch size theirs with the member count inserted at stack_dim (tensordict's layout).
  void lazy_stack(const SchemaNode& n) {
    if (!n.class_name.empty()) fail("lazy stack '", where(), "' has the class name '", n.class_name, "' (expected none)");
    const std::vector<int64_t>* member_batch = nullptr;
    for (size_t i = 0; i < n.entries.size(); ++i) {
      const SchemaEntry& e = n.entries[i];
      const auto* child = std::get_if<std::shared_ptr<SchemaNode>>(&e.value);
      if (e.key != std::to_string(i) || child == nullptr || !*child) {
        fail("lazy stack '", where(), "' has the entry '", e.key, "' at position ", i,
             ": its entries are its members, the child nodes '0', '1', ... in order");
      }
      if (member_batch == nullptr) {
        member_batch = &(*child)->batch_size;
      } else if ((*child)->batch_size != *member_batch) {
        fail("lazy stack '", where(), "' has member ", i, " of batch size ", detail::shape_str((*child)->batch_size),
             " and member 0 of ", detail::shape_str(*member_batch), " (members share a batch size)");
      }
    }
    const int64_t dim = *n.lazy_stack_dim;
    std::vector<int64_t> expected = member_batch != nullptr ? *member_batch : std::vector<int64_t>{};
    if (dim < 0 || dim > static_cast<int64_t>(expected.size()) || (member_batch == nullptr && dim != 0)) {
      fail("lazy stack '", where(), "' has stack_dim ", dim, ", outside the ", expected.size() + 1,
           " dimensions of its stacked batch");
    }
    expected.insert(expected.begin() + dim, static_cast<int64_t>(n.entries.size()));
    if (n.batch_size != expected) {
      fail("lazy stack '", where(), "' has batch size ", detail::shape_str(n.batch_size), " but its ", n.entries.size(),
           " members stacked along dimension ", dim, " make ", detail::shape_str(expected));
    }
  }

  void check_keys(const SchemaNode& n) {
    std::vector<std::string_view> keys;
    keys.reserve(n.entries.size());
    for (const auto& entry : n.entries) {
      if (entry.key.empty()) fail("node '", where(), "' has an entry with an empty key");
      if (entry.key.size() > kSchemaMaxKeyBytes) {
        fail("node '", where(), "' has a key of ", entry.key.size(), " bytes, more than kSchemaMaxKeyBytes = ",
             kSchemaMaxKeyBytes);
      }
      keys.push_back(entry.key);
    }
    std::sort(keys.begin(), keys.end());
    if (auto dup = std::adjacent_find(keys.begin(), keys.end()); dup != keys.end()) {
      fail("node '", where(), "' has the key '", *dup, "' twice");
    }
  }

  void leaf(const SchemaTensor& t) {
    const LazyPath key{path_};
    if (!is_storable_dtype(t.dtype)) {
      fail("leaf '", key, "' has dtype code ", int{dtype_code(t.dtype)},
           ", which is not a storable dtype (allowed: uint8, int8, int16, int32, int64, float16, float32, float64, "
           "complex32, complex64, complex128, bool, bfloat16)");
    }
    if (t.shape.size() > kSchemaMaxDims) {
      fail("leaf '", key, "' has ", t.shape.size(), " dimensions, more than kSchemaMaxDims = ", kSchemaMaxDims);
    }
    uint64_t numel = 1;
    bool empty = false;
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (t.shape[i] < 0) fail("leaf '", key, "' shape ", detail::shape_str(t.shape), " has negative dimension ", i);
      if (t.shape[i] == 0) empty = true;
    }
    if (empty) {
      numel = 0;
    } else {
      for (int64_t dim : t.shape) {
        if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel)) {
          fail("leaf '", key, "' shape ", detail::shape_str(t.shape), " has more elements than fit in 64 bits");
        }
      }
    }
    const uint64_t itemsize = c10::elementSize(t.dtype);
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, itemsize, &nbytes)) {
      fail("leaf '", key, "' shape ", detail::shape_str(t.shape), " times itemsize ", itemsize, " overflows 64 bits");
    }
    if (t.start % 8 != 0) fail("leaf '", key, "' starts at byte ", t.start, ", which is not a multiple of 8");
    if (t.stop < t.start) fail("leaf '", key, "' has stop ", t.stop, " before start ", t.start);
    if (t.stop - t.start != nbytes) {
      fail("leaf '", key, "' spans stop - start = ", t.stop, " - ", t.start, " = ", t.stop - t.start,
           " bytes but its shape ", detail::shape_str(t.shape), " of ", c10::toString(t.dtype), " needs numel ", numel,
           " * itemsize ", itemsize, " = ", nbytes);
    }
    if (t.pad > 7) fail("leaf '", key, "' has pad ", t.pad, ", more than 7");
    uint64_t end = 0;
    if (__builtin_add_overflow(t.stop, uint64_t{t.pad}, &end)) {
      fail("leaf '", key, "' has stop ", t.stop, " + pad ", t.pad, " overflowing 64 bits");
    }
    if (end % 8 != 0) {
      fail("leaf '", key, "' ends at stop ", t.stop, " + pad ", t.pad, " = ", end, ", which is not a multiple of 8");
    }
    if (end > total_bytes_) {
      fail("leaf '", key, "' ends at stop ", t.stop, " + pad ", t.pad, " = ", end, ", past total_bytes ", total_bytes_);
    }
    if (t.start < cursor_) {
      fail("leaf '", key, "' starts at byte ", t.start, ", before the end (stop + pad = ", cursor_,
           ") of the previous leaf '", LazyPath{previous_leaf_},
           "': leaves overlap or are out of depth-first insertion order");
    }
    cursor_ = end;
    previous_leaf_ = path_;  // O(depth) views, no key bytes copied
  }

  uint64_t total_bytes_;
  uint64_t cursor_ = 0;        // the first byte the next leaf may start at
  std::vector<std::string_view> previous_leaf_;  // its key path, for the overlap message
  std::vector<std::string_view> path_;
};

// ------------------------------------------------------------------------------------------
// Fingerprint
// ------------------------------------------------------------------------------------------

using LayoutHasher = detail::StableHasher;  // (common/hash.h)

void hash_node(LayoutHasher& h, const SchemaNode& n, size_t depth) {
  if (depth > kSchemaMaxDepth) fail("cannot fingerprint nesting deeper than kSchemaMaxDepth = ", kSchemaMaxDepth);
  // The tensorclass name: a consolidated TcA must not be received into a TcB of the same fields.
  h.str(n.class_name);
  if (n.lazy_stack_dim) {
    // No batch size has that many dimensions, so a lazy stack never hashes as a tensordict.
    h.u64(std::numeric_limits<uint64_t>::max());
    h.u64(static_cast<uint64_t>(*n.lazy_stack_dim));
  }
  h.u64(n.batch_size.size());
  for (int64_t dim : n.batch_size) h.u64(static_cast<uint64_t>(dim));
  const auto layout_entries = std::count_if(n.entries.begin(), n.entries.end(), [](const SchemaEntry& e) {
    return !std::holds_alternative<NonTensorData>(e.value);
  });
  h.u64(static_cast<uint64_t>(layout_entries));
  for (const auto& entry : n.entries) {
    if (const auto* t = std::get_if<SchemaTensor>(&entry.value)) {
      h.byte(static_cast<uint8_t>(WireEntryKind::kTensor));
      h.str(entry.key);
      h.byte(dtype_code(t->dtype));
      h.u64(t->shape.size());
      for (int64_t dim : t->shape) h.u64(static_cast<uint64_t>(dim));
      h.u64(t->start);
      h.u64(t->stop);
      h.u64(t->pad);
    } else if (const auto* child = std::get_if<std::shared_ptr<SchemaNode>>(&entry.value)) {
      if (!*child) fail("cannot fingerprint child node '", entry.key, "': it is a null pointer");
      h.byte(static_cast<uint8_t>(WireEntryKind::kChild));
      h.str(entry.key);
      hash_node(h, **child, depth + 1);
    }
  }
}

}  // namespace

bool operator==(const SchemaEntry& a, const SchemaEntry& b) {
  if (a.key != b.key || a.value.index() != b.value.index()) return false;
  const auto* ca = std::get_if<std::shared_ptr<SchemaNode>>(&a.value);
  if (ca == nullptr) return a.value == b.value;  // tensor or non-tensor: member-wise
  const auto& cb = std::get<std::shared_ptr<SchemaNode>>(b.value);
  if (!*ca || !cb) return !*ca && !cb;  // null equals only null
  return **ca == *cb;
}

bool operator==(const SchemaNode& a, const SchemaNode& b) {
  return a.class_name == b.class_name && a.lazy_stack_dim == b.lazy_stack_dim && a.batch_size == b.batch_size &&
         a.device == b.device && a.entries == b.entries;
}

namespace detail {

void validate_schema(const Schema& schema, std::optional<uint64_t> storage_bytes) {
  if (schema.total_bytes % 8 != 0) fail("total_bytes ", schema.total_bytes, " is not a multiple of 8");
  if (schema.total_bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    fail("total_bytes ", schema.total_bytes, " does not fit in int64 (no storage can be that large)");
  }
  if (storage_bytes && schema.total_bytes > *storage_bytes) {
    fail("total_bytes ", schema.total_bytes, " exceeds the ", *storage_bytes, "-byte storage it would be applied to");
  }
  Validator(schema.total_bytes).node(schema.root, 0);
}

}  // namespace detail

uint64_t schema_fingerprint(const Schema& schema) {
  LayoutHasher h;
  h.str("tdshm.schema.layout.v2");  // v2: class names of the nodes
  h.u64(schema.total_bytes);
  hash_node(h, schema.root, 0);
  return h.finish();
}

}  // namespace tdshm

