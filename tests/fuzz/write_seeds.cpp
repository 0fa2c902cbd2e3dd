// Writes the seed corpus of the fuzz targets: tdshm_fuzz_write_seeds <corpus-root>, for
// instance tests/fuzz/corpus from the repository root. It (re)writes
// <corpus-root>/fuzz_shm_entry/ (segment headers, entry sequences and memmap references, valid
// and not, in the format of shm_entry_format.h) and
// <corpus-root>/fuzz_schema_decode/: a handful of valid encode_schema outputs that together
// use every part of the format (each entry kind, value type and storable dtype, padding,
// devices, class names, nesting up to kSchemaMaxDepth, multi-byte LEB128 numbers), and a few
// refused ones (truncated, bad magic, other version, bad checksum, trailing byte,
// non-minimal LEB128, overlapping leaves), so that fuzzing starts at both sides of each check.
// The output is deterministic: rerunning it changes no file unless the format changed.

#include "shm_entry_format.h"

#include "schema/schema_internal.h"
#include "shm/layout/segment_layout.h"
#include "shm/layout/validate.h"

#include "tdshm/errors.h"
#include "tdshm/schema.h"

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace fs = std::filesystem;
using c10::ScalarType;
using tdshm::NonTensorData;
using tdshm::Schema;
using tdshm::SchemaEntry;
using tdshm::SchemaNode;
using tdshm::SchemaTensor;

// Lays leaves out one after the other the way consolidation does: each starts at a multiple
// of 8 and is padded to the next one.
class Layout {
 public:
  SchemaEntry leaf(std::string key, ScalarType dtype, std::vector<int64_t> shape) {
    uint64_t numel = 1;
    for (int64_t dim : shape) numel *= static_cast<uint64_t>(dim);
    SchemaTensor t{dtype, std::move(shape), cursor_, cursor_ + numel * c10::elementSize(dtype), 0};
    t.pad = static_cast<uint32_t>((8 - t.stop % 8) % 8);
    cursor_ = t.stop + t.pad;
    return SchemaEntry{std::move(key), std::move(t)};
  }
  // Leaves the next `bytes` (a multiple of 8) unused, as a storage with a gap would.
  void skip(uint64_t bytes) { cursor_ += bytes; }
  uint64_t end() const { return cursor_; }

 private:
  uint64_t cursor_ = 0;
};

SchemaEntry value(std::string key, NonTensorData v) { return SchemaEntry{std::move(key), std::move(v)}; }

SchemaEntry child(std::string key, SchemaNode n) {
  return SchemaEntry{std::move(key), std::make_shared<SchemaNode>(std::move(n))};
}

// The tensordict of the API tour (docs/api.md): {("a","b"): (2,), "c": (2,3), "_": (2,1,5), "step": 42}.
Schema readme_seed() {
  Layout l;
  Schema s;
  s.root.batch_size = {2};
  SchemaNode a;
  a.batch_size = {2};
  a.entries.push_back(l.leaf("b", ScalarType::Float, {2}));
  s.root.entries.push_back(child("a", std::move(a)));
  s.root.entries.push_back(l.leaf("c", ScalarType::Float, {2, 3}));
  s.root.entries.push_back(l.leaf("_", ScalarType::Float, {2, 1, 5}));
  s.root.entries.push_back(value("step", int64_t{42}));
  s.total_bytes = l.end();
  return s;
}

// One leaf of every storable dtype, with odd sizes (so most are padded), an empty and a 0-d one.
Schema every_dtype() {
  Layout l;
  Schema s;
  s.root.device = c10::Device(c10::DeviceType::CUDA, 1);
  s.root.entries.push_back(l.leaf("u8", ScalarType::Byte, {3}));
  s.root.entries.push_back(l.leaf("i8", ScalarType::Char, {1}));
  s.root.entries.push_back(l.leaf("i16", ScalarType::Short, {3}));
  s.root.entries.push_back(l.leaf("i32", ScalarType::Int, {5}));
  s.root.entries.push_back(l.leaf("i64", ScalarType::Long, {2}));
  s.root.entries.push_back(l.leaf("f16", ScalarType::Half, {3}));
  s.root.entries.push_back(l.leaf("empty", ScalarType::Float, {0, 4}));
  s.root.entries.push_back(l.leaf("f64", ScalarType::Double, {}));
  s.root.entries.push_back(l.leaf("c32", ScalarType::ComplexHalf, {1}));
  s.root.entries.push_back(l.leaf("c64", ScalarType::ComplexFloat, {2}));
  s.root.entries.push_back(l.leaf("c128", ScalarType::ComplexDouble, {1}));
  s.root.entries.push_back(l.leaf("b", ScalarType::Bool, {7}));
  s.root.entries.push_back(l.leaf("bf16", ScalarType::BFloat16, {5}));
  s.total_bytes = l.end();
  return s;
}

// Non-tensor values of every type, extremes included, in a tensorclass on the CPU.
Schema every_value() {
  Schema s;
  SchemaNode n;
  n.class_name = "my.Class";
  n.device = c10::Device(c10::DeviceType::CPU);
  n.entries.push_back(value("text", std::string("h\xC3\xA9llo")));
  n.entries.push_back(value("empty", std::string()));
  n.entries.push_back(value("imin", std::numeric_limits<int64_t>::min()));
  n.entries.push_back(value("imax", std::numeric_limits<int64_t>::max()));
  n.entries.push_back(value("neg", int64_t{-1}));
  n.entries.push_back(value("negzero", -0.0));
  n.entries.push_back(value("nan", std::numeric_limits<double>::quiet_NaN()));
  n.entries.push_back(value("inf", std::numeric_limits<double>::infinity()));
  n.entries.push_back(value("yes", true));
  n.entries.push_back(value("no", false));
  s.root.entries.push_back(child("n", std::move(n)));
  return s;
}

// Nested nodes with batch sizes, devices and leaves at several levels, and a gap in the storage.
Schema nested() {
  Layout l;
  Schema s;
  s.root.batch_size = {4};
  s.root.entries.push_back(l.leaf("obs", ScalarType::Float, {4, 3}));
  SchemaNode inner;
  inner.batch_size = {4, 2};
  inner.device = c10::Device(c10::DeviceType::CUDA, 0);
  inner.entries.push_back(l.leaf("mask", ScalarType::Bool, {4, 2}));
  SchemaNode leafy;
  leafy.class_name = "Pair";
  leafy.batch_size = {4, 2};
  leafy.entries.push_back(l.leaf("x", ScalarType::Long, {4, 2, 1}));
  leafy.entries.push_back(value("tag", std::string("pair")));
  inner.entries.push_back(child("pair", std::move(leafy)));
  s.root.entries.push_back(child("next", std::move(inner)));
  l.skip(16);
  s.root.entries.push_back(l.leaf("reward", ScalarType::Double, {4}));
  s.root.entries.push_back(child("empty", SchemaNode{}));
  s.total_bytes = l.end() + 8;
  return s;
}

// A lazy stack (version 2 of the encoding) of two members along dimension 1, beside a leaf.
Schema lazy_stack() {
  Layout l;
  Schema s;
  s.root.batch_size = {2};
  s.root.entries.push_back(l.leaf("obs", ScalarType::Float, {2, 3}));
  SchemaNode stack;
  stack.lazy_stack_dim = 1;
  stack.batch_size = {2, 2};
  for (const char* m : {"0", "1"}) {
    SchemaNode member;
    member.batch_size = {2};
    member.entries.push_back(l.leaf("x", ScalarType::Long, {2, 1 + (m[0] - '0')}));
    stack.entries.push_back(child(m, std::move(member)));
  }
  s.root.entries.push_back(child("ls", std::move(stack)));
  s.total_bytes = l.end();
  return s;
}

// A chain of kSchemaMaxDepth child nodes (the deepest the decoder accepts) ending in a leaf.
Schema deepest() {
  Layout l;
  SchemaNode current;
  current.entries.push_back(l.leaf("x", ScalarType::Float, {1}));
  for (size_t i = 0; i < tdshm::kSchemaMaxDepth; ++i) {
    SchemaNode parent;
    parent.entries.push_back(child("n", std::move(current)));
    current = std::move(parent);
  }
  Schema s;
  s.root = std::move(current);
  s.total_bytes = l.end();
  return s;
}

// Large numbers: kSchemaMaxDims dimensions, offsets near 2^40 (multi-byte LEB128).
Schema large_numbers() {
  Layout l;
  Schema s;
  l.skip(uint64_t{1} << 40);
  s.root.batch_size.assign(tdshm::kSchemaMaxDims, 1);
  s.root.entries.push_back(l.leaf("wide", ScalarType::Byte, std::vector<int64_t>(tdshm::kSchemaMaxDims, 1)));
  s.root.entries.push_back(l.leaf("big", ScalarType::Long, {1 << 20, 3}));
  s.total_bytes = l.end();
  return s;
}

// ---- refused inputs ------------------------------------------------------------------------

void put_le32(std::vector<uint8_t>& b, size_t at, uint32_t v) {
  for (size_t i = 0; i < 4; ++i) b.at(at + i) = static_cast<uint8_t>(v >> (8 * i));
}

// Rewrites the body length and the checksum of a frame so that only its body is wrong.
std::vector<uint8_t> reframe(std::vector<uint8_t> b) {
  constexpr size_t kFrame = tdshm::detail::kSchemaHeaderBytes + tdshm::detail::kSchemaTrailerBytes;
  put_le32(b, tdshm::detail::kSchemaBodyLengthOffset, static_cast<uint32_t>(b.size() - kFrame));
  const size_t crc_at = b.size() - tdshm::detail::kSchemaTrailerBytes;
  put_le32(b, crc_at, tdshm::detail::crc32c(std::span<const uint8_t>(b).first(crc_at)));
  return b;
}

// The empty root's class-name length 0x00 written as the non-minimal 0x80 0x00.
std::vector<uint8_t> non_minimal_leb128() {
  std::vector<uint8_t> b = tdshm::encode_schema(Schema{});
  b.insert(b.begin() + tdshm::detail::kSchemaHeaderBytes, 0x80);
  return reframe(std::move(b));
}

// Two leaves over the same bytes: well framed, refused by the validator.
std::vector<uint8_t> overlapping_leaves() {
  Schema s;
  s.total_bytes = 8;
  s.root.entries.push_back(SchemaEntry{"a", SchemaTensor{ScalarType::Float, {2}, 0, 8, 0}});
  s.root.entries.push_back(SchemaEntry{"b", SchemaTensor{ScalarType::Float, {2}, 0, 8, 0}});
  return tdshm::detail::encode_schema_unchecked(s);
}

void write(const fs::path& dir, const std::string& name, const std::vector<uint8_t>& bytes) {
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + (dir / name).string());
  std::printf("%s: %zu bytes\n", (dir / name).c_str(), bytes.size());
}

void write_schema_seeds(const fs::path& dir) {
  fs::create_directories(dir);
  const auto seed = tdshm::encode_schema(readme_seed());
  write(dir, "valid-empty", tdshm::encode_schema(Schema{}));
  write(dir, "valid-readme-seed", seed);
  write(dir, "valid-every-dtype", tdshm::encode_schema(every_dtype()));
  write(dir, "valid-every-value", tdshm::encode_schema(every_value()));
  write(dir, "valid-nested", tdshm::encode_schema(nested()));
  write(dir, "valid-deepest", tdshm::encode_schema(deepest()));
  write(dir, "valid-large-numbers", tdshm::encode_schema(large_numbers()));
  write(dir, "valid-lazy-stack", tdshm::encode_schema(lazy_stack()));

  write(dir, "bad-truncated", std::vector<uint8_t>(seed.begin(), seed.end() - 9));
  write(dir, "bad-header-only", std::vector<uint8_t>(seed.begin(), seed.begin() + 12));
  auto magic = seed;
  magic[0] = 'X';
  write(dir, "bad-magic", magic);
  auto version = seed;
  version[tdshm::detail::kSchemaVersionOffset] = 3;
  write(dir, "bad-version", version);
  auto crc = seed;
  crc[tdshm::detail::kSchemaHeaderBytes + 3] ^= 0x01;
  write(dir, "bad-checksum", crc);
  auto trailing = seed;
  trailing.push_back(0);
  write(dir, "bad-trailing-byte", trailing);
  write(dir, "bad-non-minimal-leb128", non_minimal_leb128());
  write(dir, "bad-overlapping-leaves", overlapping_leaves());
}

// ---- fuzz_shm_entry (format: shm_entry_format.h) -------------------------------------------

namespace shm = tdshm::shm;
using tdshm::fuzz::InputWriter;
using tdshm::fuzz::ShmFuzzMode;

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("a seed meant to be accepted is refused: " + what);
}

// A complete header of this layout for 2 ranks, rings of 64 entries, 16 arena slots of 4 KiB, an
// 8 KiB collective window and a loan region of 8 tickets and 16 KiB per rank.
shm::HeaderFields valid_header() {
  shm::HeaderFields h;
  h.magic = shm::kSegmentMagic;
  h.layout_version = shm::kLayoutVersion;
  h.header_bytes = sizeof(shm::SegmentHeader);
  h.world_size = 2;
  h.ring_entries = 64;
  h.slot_bytes = 4096;
  h.slots_per_rank = 16;
  h.window_bytes = 8192;
  h.loan_tickets = 8;
  h.loan_bytes = 16384;
  const shm::SegmentGeometry g =
      shm::segment_geometry(h.world_size, h.slot_bytes, h.ring_entries, h.slots_per_rank, h.window_bytes,
                            h.loan_tickets, h.loan_bytes);
  h.window_offset = g.window_offset;
  h.loan_offset = g.loan_offset;
  h.loan_region_bytes = g.loan_region_bytes;
  h.arena_offset = g.arena_offset;
  h.region_bytes = g.region_bytes;
  h.segment_bytes = g.segment_bytes;
  h.rank_table_offset = g.rank_table_offset;
  h.rings_offset = g.rings_offset;
  h.ring_bytes = g.ring_bytes;
  h.entry_bytes = g.entry_bytes;
  h.creator_pid = 4242;
  h.creator_rank = 1;
  h.creator_start_time = 123456789;
  h.incarnation = 7;
  return h;
}

std::vector<uint8_t> header_input(const shm::HeaderFields& h, uint64_t file_bytes) {
  InputWriter w;
  w.u8(static_cast<uint8_t>(ShmFuzzMode::kHeader));
  tdshm::fuzz::write_header_fields(w, h);
  w.u64(file_bytes);
  return w.data();
}

// An entry as the engine writes it: a chunk of up to kInlineBytes inline, a larger one in arena
// slot `slot`.
shm::EntryFields entry(uint32_t flags, uint64_t total, uint64_t offset, uint32_t chunk, uint8_t ndim = 1,
                       uint32_t slot = 0) {
  shm::EntryFields e;
  if (chunk <= shm::kInlineBytes) flags |= shm::kEntryInline;
  e.slot = chunk <= shm::kInlineBytes ? 0 : slot;
  e.tag = 17;
  e.total_bytes = total;
  e.chunk_offset = offset;
  e.chunk_bytes = chunk;
  e.flags = flags;
  e.dtype = 6;  // float32
  e.ndim = ndim;
  return e;
}

// A MemmapReference to `path` at `offset`: the payload of a reference entry.
std::vector<uint8_t> reference_payload(uint64_t offset, const std::string& path) {
  InputWriter w;
  w.u64(offset);
  w.u32(static_cast<uint32_t>(path.size()));
  w.u32(0);
  w.bytes(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(path.data()), path.size()));
  return w.data();
}

struct Record {
  shm::EntryFields fields;
  std::vector<uint8_t> payload;
};

// Entries of one ring; with `all_valid`, checks that the consumer accepts every one of them.
std::vector<uint8_t> entries_input(uint32_t slot, uint64_t max_message, const std::vector<Record>& records,
                                   bool all_valid) {
  InputWriter w;
  w.u8(static_cast<uint8_t>(ShmFuzzMode::kEntries));
  constexpr uint32_t kSlots = 16;
  w.u32(slot - 1);       // the target reads 1 + slot % kMaxFuzzSlotBytes
  w.u16(kSlots - 1);     // and 1 + slots
  w.u64(max_message);
  shm::RxProgress rx;
  for (const auto& r : records) {
    tdshm::fuzz::write_entry_fields(w, r.fields);
    w.u16(static_cast<uint16_t>(r.payload.size()));
    w.bytes(r.payload);
    if (!all_valid) continue;
    const std::string problem = shm::check_entry(r.fields, rx, {slot, kSlots}, max_message);
    check(problem.empty(), problem);
    const auto& e = r.fields;
    if (e.flags & shm::kEntryFirst) rx = {true, (e.flags & shm::kEntryControl) != 0, e.total_bytes, 0};
    rx.received += e.chunk_bytes;
    if (e.flags & (shm::kEntryLast | shm::kEntryReference)) rx = {};
  }
  return w.data();
}

// A batch of three records as a sender writes them (1-, 2- and 3-dimensional, a key check on
// one), then `tail` garbage bytes.
std::vector<uint8_t> batch_input(size_t tail) {
  InputWriter w;
  w.u8(static_cast<uint8_t>(ShmFuzzMode::kBatch));
  std::vector<uint8_t> out;
  auto add = [&](int64_t tag, uint32_t bytes, uint32_t flags, std::vector<int64_t> sizes) {
    shm::BatchRecord r{};
    r.tag = tag;
    r.bytes = bytes;
    r.flags = flags;
    r.dtype = 6;
    r.ndim = static_cast<uint8_t>(sizes.size());
    r.leaves = (flags & shm::kEntryKeyCheck) ? 3 : 0;
    const size_t at = out.size();
    out.resize(at + shm::batch_record_bytes(r.ndim, bytes), 0x11);
    std::memcpy(out.data() + at, &r, sizeof r);
    if (sizes.size() >= 2) std::memcpy(out.data() + at + sizeof r, sizes.data(), sizes.size() * sizeof(int64_t));
  };
  add(1, 8, 0, {2});
  add(2, 24, shm::kEntryKeyCheck, {2, 3});
  add(3, 40, shm::kEntryControl, {2, 1, 5});
  for (size_t i = 0; i < tail; ++i) out.push_back(static_cast<uint8_t>(0xA5 ^ i));
  w.bytes(out);
  return w.data();
}

std::vector<uint8_t> reference_input(uint64_t total_bytes, const std::vector<uint8_t>& payload) {
  InputWriter w;
  w.u8(static_cast<uint8_t>(ShmFuzzMode::kReference));
  w.u64(total_bytes);
  w.bytes(payload);
  return w.data();
}

void write_shm_entry_seeds(const fs::path& dir) {
  fs::create_directories(dir);
  const shm::HeaderFields h = valid_header();
  check(shm::check_header(h, h.segment_bytes).verdict == shm::HeaderVerdict::kValid, "header");
  write(dir, "header-valid", header_input(h, h.segment_bytes));
  write(dir, "header-truncated-file", header_input(h, h.segment_bytes - 4096));
  shm::HeaderFields other = h;
  other.layout_version = shm::kLayoutVersion - 1;
  write(dir, "header-other-version", header_input(other, h.segment_bytes));
  shm::HeaderFields unfinished = h;
  unfinished.layout_version = 0;
  write(dir, "header-unfinished", header_input(unfinished, h.segment_bytes));

  constexpr uint32_t F = shm::kEntryFirst, L = shm::kEntryLast, C = shm::kEntryControl, R = shm::kEntryReference;
  const std::vector<uint8_t> no_payload;
  write(dir, "entries-one-chunk", entries_input(64, 1 << 20, {{entry(F | L, 48, 0, 48), no_payload}}, true));
  write(dir, "entries-three-chunks",
        entries_input(16, 1 << 20,
                      {{entry(F, 40, 0, 16, 2), no_payload}, {entry(0, 0, 16, 16), no_payload},
                       {entry(L, 0, 32, 8), no_payload}},
                      true));
  write(dir, "entries-control-then-data",
        entries_input(64, 1 << 20,
                      {{entry(F | L | C, 0, 0, 0, shm::kShapeNotSent), no_payload},
                       {entry(F, 100, 0, 64), no_payload}, {entry(L, 0, 64, 36), no_payload}},
                      true));
  const auto ref = reference_payload(0, "/dev/shm/tdshm-w.bin");
  write(dir, "entries-reference",
        entries_input(64, 1 << 20,
                      {{entry(F | L | R, 4096, 0, static_cast<uint32_t>(ref.size())), ref},
                       {entry(F | L, 8, 0, 8), no_payload}},
                      true));
  write(dir, "entries-arena-slots",
        entries_input(256, 1 << 20,
                      {{entry(F, 600, 0, 256, 2, 3), no_payload}, {entry(0, 0, 256, 256, 1, 15), no_payload},
                       {entry(L, 0, 512, 88, 1, 0), no_payload}},
                      true));
  write(dir, "entries-slot-out-of-range",
        entries_input(256, 1 << 20, {{entry(F | L, 200, 0, 200, 1, 16), no_payload}}, false));
  write(dir, "entries-continuation-first",
        entries_input(64, 1 << 20, {{entry(L, 8, 0, 8), no_payload}}, false));
  write(dir, "entries-chunk-past-total",
        entries_input(64, 1 << 20, {{entry(F, 8, 0, 8), no_payload}, {entry(L, 0, 8, 8), no_payload}}, false));

  const auto good = reference_payload(4096, "/tmp/weights.bin");
  shm::ReferenceFields out;
  check(shm::check_reference(good.data(), good.size(), 1 << 20, out).empty(), "reference");
  write(dir, "batch-valid", batch_input(0));
  write(dir, "batch-then-garbage", batch_input(30));
  write(dir, "reference-valid", reference_input(1 << 20, good));
  write(dir, "reference-dot-dot", reference_input(1 << 20, reference_payload(0, "/tmp/../etc/passwd")));
  write(dir, "reference-relative", reference_input(8, reference_payload(0, "tmp/x")));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus-root>   (for instance tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  try {
    const fs::path root(argv[1]);
    write_schema_seeds(root / "fuzz_schema_decode");
    write_shm_entry_seeds(root / "fuzz_shm_entry");
    // Every valid seed must still decode: a format change makes stale seeds shallow.
    for (const auto& file : fs::directory_iterator(root / "fuzz_schema_decode")) {
      if (file.path().filename().string().rfind("valid-", 0) != 0) continue;
      std::ifstream in(file.path(), std::ios::binary);
      const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      (void)tdshm::decode_schema(bytes);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdshm_fuzz_write_seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
