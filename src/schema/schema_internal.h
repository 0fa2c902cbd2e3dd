#pragma once
// Internal: the pieces of the schema codec that tests (and later the tools) need beyond the
// public API in tdshm/schema.h: the frame layout constants, the wire codes, the checksum, the
// validator on its own, and an encoder that skips validation so tests can produce hostile
// inputs; and the c10 codes and device checks that schema_codec.cpp and schema_layout.cpp
// share. The format itself is described at the top of schema_codec.cpp.

#include "tdshm/schema.h"

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace tdshm::detail {

/// The four bytes every encoded schema starts with.
inline constexpr std::array<uint8_t, 4> kSchemaMagic = {'T', 'D', 'S', 'C'};

/// Byte offsets of the header fields of an encoded schema (all little-endian).
inline constexpr size_t kSchemaMagicOffset = 0;       ///< 4 bytes, kSchemaMagic
inline constexpr size_t kSchemaVersionOffset = 4;     ///< u16, kSchemaVersion
inline constexpr size_t kSchemaFlagsOffset = 6;       ///< u16, must be 0 in version 1
inline constexpr size_t kSchemaTotalBytesOffset = 8;  ///< u64, Schema::total_bytes
inline constexpr size_t kSchemaBodyLengthOffset = 16; ///< u32, bytes of the body
inline constexpr size_t kSchemaHeaderBytes = 20;      ///< the body starts here
inline constexpr size_t kSchemaTrailerBytes = 4;      ///< u32 CRC-32C of header + body
static_assert(kSchemaVersionOffset == kSchemaMagicOffset + kSchemaMagic.size(), "version follows the magic");
static_assert(kSchemaFlagsOffset == kSchemaVersionOffset + 2, "flags follow the u16 version");
static_assert(kSchemaTotalBytesOffset == kSchemaFlagsOffset + 2, "total_bytes follows the u16 flags");
static_assert(kSchemaTotalBytesOffset % 8 == 0, "total_bytes is 8-aligned within the header");
static_assert(kSchemaBodyLengthOffset == kSchemaTotalBytesOffset + 8, "body length follows the u64 total_bytes");
static_assert(kSchemaHeaderBytes == kSchemaBodyLengthOffset + 4, "the body follows the u32 body length");

/// Entry kind byte of the wire format (and of the fingerprint stream).
enum class WireEntryKind : uint8_t { kTensor = 0, kNonTensor = 1, kChild = 2 };

/// Type byte of a non-tensor value; the order of NonTensorData's alternatives.
enum class WireValueType : uint8_t { kString = 0, kInt64 = 1, kDouble = 2, kBool = 3 };

/// Wire codes of c10::ScalarType / c10::DeviceType (the enums' own values).
inline uint8_t dtype_code(c10::ScalarType t) { return static_cast<uint8_t>(static_cast<int8_t>(t)); }
inline uint8_t device_code(c10::DeviceType t) { return static_cast<uint8_t>(static_cast<int8_t>(t)); }

/// A device type this build of c10 knows. The enum values are dense from 0.
inline bool is_known_device_type(uint8_t code) {
  return code < static_cast<uint8_t>(c10::COMPILE_TIME_MAX_DEVICE_TYPES);
}

/// c10::Device's own invariants (it only checks them in debug builds): index -1 (none) or
/// non-negative, and a CPU device has index -1 or 0.
inline bool is_valid_device_index(c10::DeviceType type, int8_t index) {
  return index >= -1 && (type != c10::DeviceType::CPU || index <= 0);
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial and final xor 0xFFFFFFFF).
/// crc32c("123456789") == 0xE3069283. Thread safety: pure function.
uint32_t crc32c(std::span<const uint8_t> bytes) noexcept;

/// Checks every rule decode_schema enforces on a decoded schema (all but the byte-level ones).
/// Throws SchemaError naming the key path, the field and the values. Thread safety: pure.
void validate_schema(const Schema& schema, std::optional<uint64_t> storage_bytes = std::nullopt);

/// encode_schema without validate_schema: encodes whatever it is given, so tests can feed the
/// decoder well-framed but inconsistent schemas. Still throws SchemaError on a null child
/// pointer, on nesting deeper than kUncheckedMaxDepth (a cycle), or on a body over 4 GiB.
inline constexpr size_t kUncheckedMaxDepth = 1024;
std::vector<uint8_t> encode_schema_unchecked(const Schema& schema);

}  // namespace tdshm::detail
