#pragma once
/// \file
/// The metadata of a consolidated tensordict (its Schema), its versioned binary encoding and
/// its fingerprint.
///
/// A consolidated tensordict is one flat uint8 storage plus a Schema that says where each leaf
/// lives in it. The schema travels between processes (init_remote, consolidated files), so it
/// has a compact binary encoding whose decoder trusts nothing: every count, length and offset
/// is checked against the input and against the storage size, and anything out of range
/// throws tdshm::SchemaError.

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

namespace tdshm {

/// A non-tensor value stored in a tensordict. It travels in the metadata, not in the storage.
using NonTensorData = std::variant<std::string, int64_t, double, bool>;

/// One tensor leaf of a consolidated storage. Offsets are absolute in the root storage.
/// The leaf's bytes are [start, stop) where stop - start = numel * itemsize; `pad` zero bytes
/// follow so that the next leaf starts at a multiple of 8.
struct SchemaTensor {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  uint64_t start = 0;
  uint64_t stop = 0;
  uint32_t pad = 0;

  friend bool operator==(const SchemaTensor&, const SchemaTensor&) = default;
};

struct SchemaNode;

/// One entry of a node, in insertion order: a tensor leaf, a non-tensor value, or a child node.
/// Equality compares the key and the value; a child compares by the node it points to (a null
/// pointer equals only a null pointer); a double compares with == (so -0.0 == 0.0, NaN != NaN).
struct SchemaEntry {
  std::string key;
  std::variant<SchemaTensor, NonTensorData, std::shared_ptr<SchemaNode>> value;

  friend bool operator==(const SchemaEntry& a, const SchemaEntry& b);
};

/// One tensordict (or tensorclass, or lazy stack) of the tree.
struct SchemaNode {
  /// Registered tensorclass name, or empty for a plain TensorDict or a lazy stack.
  std::string class_name;
  /// Set when the node is a LazyStackedTensorDict stacked along this dimension: its entries are
  /// its members, the child nodes "0", "1", ... in order (tensordict's consolidated layout of a
  /// lazy stack), which share a batch size; batch_size is the stack's (the members' with the
  /// member count inserted at lazy_stack_dim; [0] for a stack of no members).
  std::optional<int64_t> lazy_stack_dim;
  std::vector<int64_t> batch_size;
  std::optional<c10::Device> device;
  std::vector<SchemaEntry> entries;

  friend bool operator==(const SchemaNode& a, const SchemaNode& b);
};

/// The whole metadata of a consolidated tensordict.
struct Schema {
  /// Size in bytes of the flat storage the offsets refer to (a multiple of 8).
  uint64_t total_bytes = 0;
  SchemaNode root;

  friend bool operator==(const Schema& a, const Schema& b) { return a.total_bytes == b.total_bytes && a.root == b.root; }
};

/// The newest version of the binary encoding: version 2 adds a node kind (tensordict or lazy
/// stack). encode_schema writes version 1 for a schema without lazy stacks (what earlier builds
/// read) and version 2 otherwise; decode_schema reads both.
inline constexpr uint16_t kSchemaVersion = 2;
inline constexpr uint16_t kSchemaOldestVersion = 1;

/// Limits the decoder enforces, whatever the input claims.
/// The root node is at depth 0 and a child is one deeper than its parent; a node deeper than
/// kSchemaMaxDepth is refused. A non-tensor string value has no limit of its own beyond the
/// size of the encoded input.
inline constexpr size_t kSchemaMaxDepth = 64;      ///< nesting of child nodes
inline constexpr size_t kSchemaMaxDims = 64;       ///< dimensions of one shape or batch size
inline constexpr size_t kSchemaMaxKeyBytes = 4096; ///< bytes of one key or class name

/// Encodes a schema in the versioned binary format (little-endian, with a CRC-32C checksum;
/// the layout is described in src/schema/schema_codec.cpp). Throws SchemaError if the schema
/// itself is inconsistent: it is checked with the same rules decode_schema applies after
/// parsing (keys non-empty, unique in their node and at most kSchemaMaxKeyBytes; known dtypes
/// and devices; non-negative dimensions; stop - start == numel * itemsize; start and stop + pad
/// multiples of 8 with pad <= 7; leaves in depth-first insertion order without overlap, inside
/// total_bytes; total_bytes a multiple of 8; no null child; nesting within kSchemaMaxDepth; a
/// lazy stack's entries exactly the members "0", "1", ... sharing a batch size, its stack_dim
/// and batch size consistent with them, no class name).
/// Thread safety: pure function.
std::vector<uint8_t> encode_schema(const Schema& schema);

/// Decodes bytes produced by encode_schema, possibly in another process.
/// `storage_bytes`, when given, is the size of the storage the schema will be applied to:
/// total_bytes must not exceed it. Throws SchemaError on truncated input, trailing bytes, a bad
/// magic, an unknown version, nonzero flags, a checksum mismatch, a malformed or non-minimal
/// LEB128 integer, any count, length, dimension or offset out of range, overlapping leaves, an
/// unknown dtype, device, entry kind or value type, or nesting deeper than kSchemaMaxDepth; the
/// message names the field, its byte offset or key path, and the values found. Memory use is
/// bounded by the input size whatever the counts in it claim. Thread safety: pure function.
Schema decode_schema(std::span<const uint8_t> bytes, std::optional<uint64_t> storage_bytes = std::nullopt);

/// A stable 64-bit fingerprint of the storage layout and of what the storage is: the key tree,
/// each tensor leaf's dtype, shape, offsets and pad, every batch size, total_bytes, the
/// tensorclass name of every node (empty for a plain TensorDict) and whether a node is a lazy
/// stack (and along which dimension). Equal schemas give equal
/// fingerprints in every process and build; any change of key, dtype, shape, layout or class
/// name changes it, so a consolidated tensorclass TcA is not received into a TcB of the same
/// fields, nor into a plain TensorDict. Non-tensor entries (key and value) and devices are left
/// out: they do not affect where any byte of the storage is. The hash is computed over a
/// canonical byte stream (fixed-width little-endian integers, length-prefixed keys and class
/// names, a version string first), never over pointers or std::hash. It does not validate the
/// schema, but throws SchemaError on a null child or on nesting deeper than kSchemaMaxDepth.
/// Thread safety: pure function.
uint64_t schema_fingerprint(const Schema& schema);

}  // namespace tdshm
