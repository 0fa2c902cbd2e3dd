#pragma once
/// MemoryMappedTensor leaves of init_remote / from_remote_init passed by reference, between two
/// ranks whose transport says both map the same files and run tdshm's from_remote_init
/// (Transport::memmap_by_reference_with). tensordict's wire is kept as it is — the metadata
/// dict, then the storage — with one message more after the metadata: the reference table, an
/// int64 byte count then the bytes (as the metadata goes). The storage then travels as the
/// ranges no reference covers, one message each, so a leaf's file bytes never cross the
/// segment; the receiver's leaf maps the sender's file (docs/semantics.md).
///
/// The table is read like every byte from a peer: bounded before anything is allocated, every
/// entry checked against the schema the metadata described (a reference must cover exactly one
/// tensor leaf's bytes, in order, without overlap), the path absolute, bounded and without '.'
/// or '..' parts; the file is opened by the rules of memmap/peer_file.h (no link followed, a
/// regular file of this user, as large as needed, writable only if the receiver asked).

#include <tdshm/schema.h>
#include <tdshm/tensordict.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tdshm::detail {

/// One leaf passed by reference: the storage bytes [start, stop) it holds in the schema, and
/// the file the receiver maps instead.
struct MemmapReference {
  uint64_t start = 0;
  uint64_t stop = 0;
  std::string file;  // absolute path
  int64_t offset = 0;  // of the leaf's first byte in the file
  bool writable = false;  // mapped read-write by the sender (MemmapMode)
};

/// The leaves of `td` that view a named MemoryMappedTensor (contiguous, with a file), located
/// by `schema` (td.consolidate()'s), in storage order.
std::vector<MemmapReference> memmap_references(const TensorDict& td, const Schema& schema);

/// The table as bytes (uint8), and back: decode_references checks every entry against `schema`
/// (SchemaError naming what is wrong).
at::Tensor encode_references(const std::vector<MemmapReference>& refs);
std::vector<MemmapReference> decode_references(const at::Tensor& bytes, const Schema& schema);

/// The parts of [0, total) that no reference covers, in order, empty ones left out: the storage
/// messages of a transfer with references.
std::vector<std::pair<uint64_t, uint64_t>> storage_ranges(uint64_t total, const std::vector<MemmapReference>& refs);

/// The tree of `schema` over `storage`, with each referenced leaf a MemoryMappedTensor of its
/// file, opened by the rules of memmap/peer_file.h (MemmapError naming the leaf when they refuse
/// it or it cannot be mapped): shared and writable when the sender's is and `may_write`
/// (FromRemoteInitOptions::memmap_writable), else read-only. Not consolidated: those leaves are
/// not in the storage.
TensorDict rebuild_with_references(const at::Tensor& storage, const Schema& schema,
                                   const std::vector<MemmapReference>& refs, bool may_write);

/// The most bytes a table may announce (the receiver bounds it before allocating).
inline constexpr int64_t kMaxReferenceTableBytes = int64_t{64} << 20;

}  // namespace tdshm::detail
