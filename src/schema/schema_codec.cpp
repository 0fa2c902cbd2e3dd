// Schema codec: the binary encoding of a consolidated tensordict's metadata, its validation,
// and its layout fingerprint.
//
// Binary format, version 1 (kSchemaVersion). Every fixed-width integer is little-endian.
//
//   offset  size  field
//   ------  ----  ------------------------------------------------------------------
//        0     4  magic        "TDSC"
//        4     2  version      u16, 1
//        6     2  flags        u16, 0 (no flag is defined in version 1)
//        8     8  total_bytes  u64, size of the flat storage the offsets refer to
//       16     4  body_length  u32, B
//       20     B  body         the root node (below)
//   20 + B     4  checksum     u32, CRC-32C of bytes [0, 20 + B)
//
//   +------+---+---+-----------+----+------------------ ... ---+-------+
//   | TDSC |ver|flg|total_bytes| B  |  body: root node (B bytes)  | crc32c|
//   +------+---+---+-----------+----+------------------ ... ---+-------+
//
// Inside the body, `uleb` is unsigned LEB128 (1..10 bytes, minimal), `sleb` is zigzag LEB128
// of an int64, and `str` is uleb(length) followed by that many bytes:
//
//   node      := class_name:str  device  batch_size  entry_count:uleb  entry*
//   device    := 0x00                                    (no device)
//              | 0x01  type:u8 (c10::DeviceType)  index:i8 (c10::DeviceIndex)
//   batch_size:= count:uleb  dim:sleb * count
//   entry     := kind:u8  key:str  payload
//   payload   := kind 0 (tensor):     dtype:u8 (c10::ScalarType)  ndim:uleb  dim:sleb * ndim
//                                     start:uleb  stop:uleb  pad:uleb
//              | kind 1 (non-tensor): type:u8  value
//              | kind 2 (child):      node
//   value     := type 0 (string): str     | type 1 (int64): sleb
//              | type 2 (double): 8 bytes, the IEEE-754 bits as u64 | type 3 (bool): u8 0 or 1
//
// Entries are in insertion order; leaves in depth-first order occupy increasing offsets.
//
// The decoder trusts nothing. In this order it checks: the length of the frame, the magic,
// the version (before anything else of the header, since another version may lay it out
// differently), the flags, that body_length accounts for every byte, and the checksum. It then
// parses the body with a bounds-checked reader (every count is compared with what the remaining
// bytes could hold before it is looped over, nothing is reserved from an untrusted count, and
// the nesting depth is a counter, so neither memory nor stack can be exhausted) and finally runs
// the same validator encode_schema runs: dtypes, shapes, offsets, padding, ordering, keys.

#include "common/format.h"
#include "common/hash.h"
#include "schema/schema_internal.h"
#include "schema/wire.h"

#include "tdshm/errors.h"
#include "tdshm/schema.h"

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace tdshm {

namespace {

using detail::WireEntryKind;
using detail::WireValueType;
using detail::wire::ByteReader;
using detail::wire::ByteWriter;
using detail::wire::fail;

static_assert(std::is_same_v<std::underlying_type_t<c10::ScalarType>, int8_t>,
              "the wire stores c10::ScalarType in one byte");
static_assert(std::is_same_v<std::underlying_type_t<c10::DeviceType>, int8_t>,
              "the wire stores c10::DeviceType in one byte");
static_assert(std::is_same_v<c10::DeviceIndex, int8_t>, "the wire stores c10::DeviceIndex in one byte");
static_assert(std::is_same_v<NonTensorData, std::variant<std::string, int64_t, double, bool>> &&
                  std::variant_size_v<NonTensorData> == 4,
              "WireValueType follows the alternatives of NonTensorData");
static_assert(std::numeric_limits<double>::is_iec559 && sizeof(double) == 8, "doubles travel as IEEE-754 binary64");

// The fewest bytes one entry can take on the wire: kind (1) + key length (1) + a key of at
// least one byte (1) + the smallest payload, a non-tensor value (type 1 + 1-byte value).
// Larger counts than remaining / kMinEntryBytes are refused before any entry is read.
constexpr size_t kMinEntryBytes = 5;

// Wire codes of c10::ScalarType / c10::DeviceType (the enums' own values).
uint8_t dtype_code(c10::ScalarType t) { return static_cast<uint8_t>(static_cast<int8_t>(t)); }
uint8_t device_code(c10::DeviceType t) { return static_cast<uint8_t>(static_cast<int8_t>(t)); }

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

// A device type this build of c10 knows. The enum values are dense from 0.
bool is_known_device_type(uint8_t code) { return code < static_cast<uint8_t>(c10::COMPILE_TIME_MAX_DEVICE_TYPES); }

// c10::Device's own invariants (it only checks them in debug builds): index -1 (none) or
// non-negative, and a CPU device has index -1 or 0.
bool is_valid_device_index(c10::DeviceType type, int8_t index) {
  return index >= -1 && (type != c10::DeviceType::CPU || index <= 0);
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
// CRC-32C
// ------------------------------------------------------------------------------------------

constexpr std::array<uint32_t, 256> make_crc32c_table() {
  constexpr uint32_t kReflectedPoly = 0x82F63B78u;
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) != 0 ? (c >> 1) ^ kReflectedPoly : c >> 1;
    table[i] = c;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();
static_assert(kCrc32cTable[1] == 0xF26B8303u, "CRC-32C table (Castagnoli) entry 1");
static_assert(kCrc32cTable[128] == 0x82F63B78u, "CRC-32C table entry 128 is the reflected polynomial");

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
// Encoding
// ------------------------------------------------------------------------------------------

void encode_node(ByteWriter& w, const SchemaNode& n, size_t depth) {
  if (depth > detail::kUncheckedMaxDepth) {
    fail("cannot encode nesting deeper than ", detail::kUncheckedMaxDepth, " levels (is there a cycle?)");
  }
  w.str(n.class_name);
  if (n.device) {
    w.u8(1);
    w.u8(device_code(n.device->type()));
    w.u8(static_cast<uint8_t>(n.device->index()));
  } else {
    w.u8(0);
  }
  w.uleb(n.batch_size.size());
  for (int64_t dim : n.batch_size) w.sleb(dim);
  w.uleb(n.entries.size());
  for (const auto& entry : n.entries) {
    if (const auto* t = std::get_if<SchemaTensor>(&entry.value)) {
      w.u8(static_cast<uint8_t>(WireEntryKind::kTensor));
      w.str(entry.key);
      w.u8(dtype_code(t->dtype));
      w.uleb(t->shape.size());
      for (int64_t dim : t->shape) w.sleb(dim);
      w.uleb(t->start);
      w.uleb(t->stop);
      w.uleb(t->pad);
    } else if (const auto* v = std::get_if<NonTensorData>(&entry.value)) {
      w.u8(static_cast<uint8_t>(WireEntryKind::kNonTensor));
      w.str(entry.key);
      if (const auto* s = std::get_if<std::string>(v)) {
        w.u8(static_cast<uint8_t>(WireValueType::kString));
        w.str(*s);
      } else if (const auto* i = std::get_if<int64_t>(v)) {
        w.u8(static_cast<uint8_t>(WireValueType::kInt64));
        w.sleb(*i);
      } else if (const auto* d = std::get_if<double>(v)) {
        w.u8(static_cast<uint8_t>(WireValueType::kDouble));
        w.u64(std::bit_cast<uint64_t>(*d));
      } else {
        w.u8(static_cast<uint8_t>(WireValueType::kBool));
        w.u8(std::get<bool>(*v) ? 1 : 0);
      }
    } else {
      const auto& child = std::get<std::shared_ptr<SchemaNode>>(entry.value);
      if (!child) fail("cannot encode child node '", entry.key, "': it is a null pointer");
      w.u8(static_cast<uint8_t>(WireEntryKind::kChild));
      w.str(entry.key);
      encode_node(w, *child, depth + 1);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Decoding
// ------------------------------------------------------------------------------------------

class Parser {
 public:
  explicit Parser(ByteReader& r) : r_(r) {}

  SchemaNode node(size_t depth) {
    if (depth > kSchemaMaxDepth) {
      fail("node at byte ", r_.position(), " is nested ", depth, " levels deep, more than kSchemaMaxDepth = ",
           kSchemaMaxDepth);
    }
    SchemaNode n;
    n.class_name = std::string(r_.str("class name", kSchemaMaxKeyBytes));
    n.device = device();
    n.batch_size = dims("batch size");
    const size_t count_at = r_.position();
    const uint64_t count = r_.uleb("entry count");
    if (count > r_.remaining() / kMinEntryBytes) {
      fail("entry count ", count, " at byte ", count_at, " is more than the remaining ", r_.remaining(),
           " bytes can hold (at least ", kMinEntryBytes, " bytes per entry)");
    }
    // No reserve(count): memory grows only with entries actually read.
    for (uint64_t i = 0; i < count; ++i) n.entries.push_back(entry(depth));
    return n;
  }

 private:
  std::optional<c10::Device> device() {
    const size_t at = r_.position();
    const uint8_t present = r_.u8("device flag");
    if (present == 0) return std::nullopt;
    if (present != 1) fail("device flag at byte ", at, " is ", int{present}, ", expected 0 or 1");
    const uint8_t code = r_.u8("device type");
    const auto index = static_cast<int8_t>(r_.u8("device index"));
    if (!is_known_device_type(code)) fail("device type code ", int{code}, " at byte ", at + 1, " is unknown");
    const auto type = static_cast<c10::DeviceType>(static_cast<int8_t>(code));
    if (!is_valid_device_index(type, index)) {
      fail("device index ", int{index}, " at byte ", at + 2, " is invalid for device type code ", int{code});
    }
    return c10::Device(type, index);
  }

  std::vector<int64_t> dims(const char* field) {
    const size_t at = r_.position();
    const uint64_t count = r_.uleb(field);
    if (count > kSchemaMaxDims) {
      fail(field, " at byte ", at, " has ", count, " dimensions, more than kSchemaMaxDims = ", kSchemaMaxDims);
    }
    r_.need(count, field);  // each dimension takes at least one byte
    std::vector<int64_t> out(static_cast<size_t>(count));
    for (auto& dim : out) {
      const size_t dim_at = r_.position();
      dim = r_.sleb(field);
      if (dim < 0) fail(field, " at byte ", dim_at, " has negative dimension ", dim);
    }
    return out;
  }

  SchemaEntry entry(size_t depth) {
    const size_t at = r_.position();
    const uint8_t kind = r_.u8("entry kind");
    SchemaEntry e;
    const size_t key_at = r_.position();
    e.key = std::string(r_.str("key", kSchemaMaxKeyBytes));
    if (e.key.empty()) fail("key at byte ", key_at, " is empty");
    switch (static_cast<WireEntryKind>(kind)) {
      case WireEntryKind::kTensor:
        e.value = tensor();
        break;
      case WireEntryKind::kNonTensor:
        e.value = value();
        break;
      case WireEntryKind::kChild:
        e.value = std::make_shared<SchemaNode>(node(depth + 1));
        break;
      default:
        fail("entry kind ", int{kind}, " at byte ", at, " (key '", e.key,
             "') is unknown: expected 0 (tensor), 1 (non-tensor) or 2 (child)");
    }
    return e;
  }

  SchemaTensor tensor() {
    SchemaTensor t;
    const uint8_t code = r_.u8("dtype");
    // Any byte is a value of the int8-based enum; the validator refuses unknown ones.
    t.dtype = static_cast<c10::ScalarType>(static_cast<int8_t>(code));
    t.shape = dims("shape");
    t.start = r_.uleb("start");
    t.stop = r_.uleb("stop");
    const size_t pad_at = r_.position();
    const uint64_t pad = r_.uleb("pad");
    if (pad > std::numeric_limits<uint32_t>::max()) fail("pad ", pad, " at byte ", pad_at, " is out of range");
    t.pad = static_cast<uint32_t>(pad);
    return t;
  }

  NonTensorData value() {
    const size_t at = r_.position();
    const uint8_t type = r_.u8("non-tensor type");
    switch (static_cast<WireValueType>(type)) {
      case WireValueType::kString:
        // A value, not a key: bounded only by the input itself.
        return std::string(r_.str("string value", r_.remaining()));
      case WireValueType::kInt64:
        return r_.sleb("int64 value");
      case WireValueType::kDouble:
        return std::bit_cast<double>(r_.u64("double value"));
      case WireValueType::kBool: {
        const size_t bool_at = r_.position();
        const uint8_t b = r_.u8("bool value");
        if (b > 1) fail("bool value at byte ", bool_at, " is ", int{b}, ", expected 0 or 1");
        return b == 1;
      }
      default:
        fail("non-tensor type ", int{type}, " at byte ", at,
             " is unknown: expected 0 (string), 1 (int64), 2 (double) or 3 (bool)");
    }
  }

  ByteReader& r_;
};

// ------------------------------------------------------------------------------------------
// Fingerprint
// ------------------------------------------------------------------------------------------

using LayoutHasher = detail::StableHasher;  // (common/hash.h)

void hash_node(LayoutHasher& h, const SchemaNode& n, size_t depth) {
  if (depth > kSchemaMaxDepth) fail("cannot fingerprint nesting deeper than kSchemaMaxDepth = ", kSchemaMaxDepth);
  // The tensorclass name: a consolidated TcA must not be received into a TcB of the same fields.
  h.str(n.class_name);
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
  return a.class_name == b.class_name && a.batch_size == b.batch_size && a.device == b.device &&
         a.entries == b.entries;
}

namespace detail {

uint32_t crc32c(std::span<const uint8_t> bytes) noexcept {
  uint32_t c = 0xFFFFFFFFu;
  for (uint8_t b : bytes) c = kCrc32cTable[(c ^ b) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

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

std::vector<uint8_t> encode_schema_unchecked(const Schema& schema) {
  ByteWriter w;
  for (uint8_t b : kSchemaMagic) w.u8(b);
  w.u16(kSchemaVersion);
  w.u16(0);  // flags
  w.u64(schema.total_bytes);
  w.u32(0);  // body length, patched below
  encode_node(w, schema.root, 0);
  const size_t body = w.size() - kSchemaHeaderBytes;
  if (body > std::numeric_limits<uint32_t>::max()) {
    fail("encoded body is ", body, " bytes, more than the u32 body length can express");
  }
  w.patch_u32(kSchemaBodyLengthOffset, static_cast<uint32_t>(body));
  w.u32(crc32c(w.view()));
  return std::move(w).take();
}

}  // namespace detail

std::vector<uint8_t> encode_schema(const Schema& schema) {
  detail::validate_schema(schema);
  return detail::encode_schema_unchecked(schema);
}

Schema decode_schema(std::span<const uint8_t> bytes, std::optional<uint64_t> storage_bytes) {
  constexpr size_t kFrame = detail::kSchemaHeaderBytes + detail::kSchemaTrailerBytes;
  if (bytes.size() < kFrame) {
    fail("input is ", bytes.size(), " bytes, shorter than the ", kFrame, "-byte minimum (",
         detail::kSchemaHeaderBytes, "-byte header + ", detail::kSchemaTrailerBytes, "-byte checksum)");
  }
  if (!std::equal(detail::kSchemaMagic.begin(), detail::kSchemaMagic.end(), bytes.begin())) {
    std::ostringstream found;
    found << std::hex;
    for (size_t i = 0; i < detail::kSchemaMagic.size(); ++i) found << (i ? " " : "") << int{bytes[i]};
    fail("bad magic (bytes ", found.str(), " hex, expected \"TDSC\"): this is not an encoded tdshm schema");
  }
  ByteReader header(bytes, detail::kSchemaVersionOffset);
  const uint16_t version = header.u16("version");
  if (version != kSchemaVersion) {
    fail("found schema format version ", version, ", but this build supports only version ", kSchemaVersion,
         ": encode and decode with the same tdshm version");
  }
  const uint16_t flags = header.u16("flags");
  if (flags != 0) fail("flags are ", flags, ", but version ", kSchemaVersion, " defines none (expected 0)");
  const uint64_t total_bytes = header.u64("total_bytes");
  const uint32_t body_length = header.u32("body length");
  const size_t actual_body = bytes.size() - kFrame;
  if (body_length != actual_body) {
    fail("body length field says ", body_length, " bytes but the input holds ", actual_body,
         " bytes between header and checksum (", body_length > actual_body ? "truncated input" : "trailing bytes", ")");
  }
  const size_t crc_at = bytes.size() - detail::kSchemaTrailerBytes;
  ByteReader trailer(bytes, crc_at);
  const uint32_t stored_crc = trailer.u32("checksum");
  const uint32_t computed_crc = detail::crc32c(bytes.first(crc_at));
  if (stored_crc != computed_crc) {
    fail("checksum mismatch (stored ", stored_crc, ", computed ", computed_crc, "): the bytes are corrupt");
  }

  ByteReader body(bytes.first(crc_at), detail::kSchemaHeaderBytes);
  Schema schema;
  schema.total_bytes = total_bytes;
  schema.root = Parser(body).node(0);
  if (body.remaining() != 0) {
    fail("the root node ends at byte ", body.position(), " but the body runs to byte ", crc_at, " (",
         body.remaining(), " unparsed bytes)");
  }
  detail::validate_schema(schema, storage_bytes);
  return schema;
}

uint64_t schema_fingerprint(const Schema& schema) {
  LayoutHasher h;
  h.str("tdshm.schema.layout.v2");  // v2: class names of the nodes
  h.u64(schema.total_bytes);
  hash_node(h, schema.root, 0);
  return h.finish();
}

}  // namespace tdshm
