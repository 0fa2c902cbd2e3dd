// The schema's binary encoding: encode_schema and decode_schema, the frame, the body and its CRC.
//
// Binary format, versions 1 and 2 (kSchemaVersion). Every fixed-width integer is little-endian.
//
//   offset  size  field
//   ------  ----  ------------------------------------------------------------------
//        0     4  magic        "TDSC"
//        4     2  version      u16, 1 or 2
//        6     2  flags        u16, 0 (no flag is defined)
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
//   node      := class_name:str  [kind]  device  batch_size  entry_count:uleb  entry*
//   kind      := 0x00                                    (a tensordict; version 2 only)
//              | 0x01  stack_dim:uleb                    (a lazy stack; version 2 only)
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
// Version 1 has no kind byte (every node is a tensordict); the encoder writes version 1 unless
// the schema holds a lazy stack, so that what earlier builds could read they still can.
//
// The decoder trusts nothing. In this order it checks: the length of the frame, the magic,
// the version (before anything else of the header, since another version may lay it out
// differently), the flags, that body_length accounts for every byte, and the checksum. It then
// parses the body with a bounds-checked reader (every count is compared with what the remaining
// bytes could hold before it is looped over, nothing is reserved from an untrusted count, and
// the nesting depth is a counter, so neither memory nor stack can be exhausted) and finally runs
// the same validator encode_schema runs: dtypes, shapes, offsets, padding, ordering, keys.
//
// The validator, the equality of schemas and the layout fingerprint are in schema_layout.cpp.

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
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace tdshm {

namespace {

using detail::WireEntryKind;
using detail::WireValueType;
using detail::device_code;
using detail::dtype_code;
using detail::is_known_device_type;
using detail::is_valid_device_index;
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
// Encoding
// ------------------------------------------------------------------------------------------

constexpr uint8_t kNodeTensorDict = 0;
constexpr uint8_t kNodeLazyStack = 1;

bool has_lazy_stack(const SchemaNode& n, size_t depth) {
  if (depth > detail::kUncheckedMaxDepth) {
    fail("cannot encode nesting deeper than ", detail::kUncheckedMaxDepth, " levels (is there a cycle?)");
  }
  if (n.lazy_stack_dim) return true;
  for (const auto& e : n.entries) {
    const auto* child = std::get_if<std::shared_ptr<SchemaNode>>(&e.value);
    if (child != nullptr && *child && has_lazy_stack(**child, depth + 1)) return true;
  }
  return false;
}

void encode_node(ByteWriter& w, const SchemaNode& n, size_t depth, uint16_t version) {
  if (depth > detail::kUncheckedMaxDepth) {
    fail("cannot encode nesting deeper than ", detail::kUncheckedMaxDepth, " levels (is there a cycle?)");
  }
  w.str(n.class_name);
  if (version >= 2) {
    if (n.lazy_stack_dim) {
      if (*n.lazy_stack_dim < 0) fail("cannot encode the negative stack_dim ", *n.lazy_stack_dim);
      w.u8(kNodeLazyStack);
      w.uleb(static_cast<uint64_t>(*n.lazy_stack_dim));
    } else {
      w.u8(kNodeTensorDict);
    }
  }
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
      encode_node(w, *child, depth + 1, version);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Decoding
// ------------------------------------------------------------------------------------------

class Parser {
 public:
  Parser(ByteReader& r, uint16_t version) : r_(r), version_(version) {}

  SchemaNode node(size_t depth) {
    if (depth > kSchemaMaxDepth) {
      fail("node at byte ", r_.position(), " is nested ", depth, " levels deep, more than kSchemaMaxDepth = ",
           kSchemaMaxDepth);
    }
    SchemaNode n;
    n.class_name = std::string(r_.str("class name", kSchemaMaxKeyBytes));
    if (version_ >= 2) {
      const size_t at = r_.position();
      const uint8_t kind = r_.u8("node kind");
      if (kind == kNodeLazyStack) {
        const size_t dim_at = r_.position();
        const uint64_t dim = r_.uleb("stack_dim");
        if (dim > kSchemaMaxDims) fail("stack_dim ", dim, " at byte ", dim_at, " is more than kSchemaMaxDims = ", kSchemaMaxDims);
        n.lazy_stack_dim = static_cast<int64_t>(dim);
      } else if (kind != kNodeTensorDict) {
        fail("node kind ", int{kind}, " at byte ", at, " is unknown: expected 0 (tensordict) or 1 (lazy stack)");
      }
    }
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
  uint16_t version_;
};

}  // namespace

namespace detail {

uint32_t crc32c(std::span<const uint8_t> bytes) noexcept {
  uint32_t c = 0xFFFFFFFFu;
  for (uint8_t b : bytes) c = kCrc32cTable[(c ^ b) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

std::vector<uint8_t> encode_schema_unchecked(const Schema& schema) {
  const uint16_t version = has_lazy_stack(schema.root, 0) ? kSchemaVersion : kSchemaOldestVersion;
  ByteWriter w;
  for (uint8_t b : kSchemaMagic) w.u8(b);
  w.u16(version);
  w.u16(0);  // flags
  w.u64(schema.total_bytes);
  w.u32(0);  // body length, patched below
  encode_node(w, schema.root, 0, version);
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
  if (version < kSchemaOldestVersion || version > kSchemaVersion) {
    fail("found schema format version ", version, ", but this build supports versions ", kSchemaOldestVersion, " to ",
         kSchemaVersion, ": encode and decode with the same tdshm version");
  }
  const uint16_t flags = header.u16("flags");
  if (flags != 0) fail("flags are ", flags, ", but version ", version, " defines none (expected 0)");
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
  schema.root = Parser(body, version).node(0);
  if (body.remaining() != 0) {
    fail("the root node ends at byte ", body.position(), " but the body runs to byte ", crc_at, " (",
         body.remaining(), " unparsed bytes)");
  }
  // Encodings are canonical (decode then encode gives the same bytes), as the LEB128 rule is.
  if (version > kSchemaOldestVersion && !has_lazy_stack(schema.root, 0)) {
    fail("a version ", version, " frame holds no lazy stack: such a schema is encoded in version ", kSchemaOldestVersion);
  }
  detail::validate_schema(schema, storage_bytes);
  return schema;
}

}  // namespace tdshm
