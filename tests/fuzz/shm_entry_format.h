#pragma once
// The input format of the fuzz target fuzz_shm_entry, shared with the seed writer so that the
// committed seeds and the target agree. Little-endian fixed-width fields; a read past the end
// of the input gives zeros, so every input is a valid one.
//
//   input   := mode:u8  rest
//   mode % 3 == 0 (header):    HeaderFields (the fields in declaration order)  file_bytes:u64
//   mode % 3 == 1 (entries):   slot:u32  slots:u16  max_message_bytes:u64  record*
//                              record := EntryFields (in declaration order)  n:u16  payload[n]
//                              (the slot is 1 + slot % kMaxFuzzSlotBytes bytes, a rank has
//                              1 + slots arena slots)
//   mode % 3 == 2 (reference): total_bytes:u64  payload (the rest of the input)

#include "shm/layout/validate.h"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace tdshm::fuzz {

enum class ShmFuzzMode : uint8_t { kHeader = 0, kEntries = 1, kReference = 2, kBatch = 3 };

/// Slots are at most this large in the fuzz target (a payload buffer of one slot is allocated).
inline constexpr uint32_t kMaxFuzzSlotBytes = 1u << 16;

class InputReader {
 public:
  explicit InputReader(std::span<const uint8_t> data) : data_(data) {}

  bool done() const { return pos_ >= data_.size(); }
  std::span<const uint8_t> rest() const { return done() ? std::span<const uint8_t>() : data_.subspan(pos_); }

  uint64_t uint(size_t bytes) {
    uint64_t v = 0;
    for (size_t i = 0; i < bytes; ++i, ++pos_) {
      if (pos_ < data_.size()) v |= static_cast<uint64_t>(data_[pos_]) << (8 * i);
    }
    return v;
  }
  uint8_t u8() { return static_cast<uint8_t>(uint(1)); }
  uint16_t u16() { return static_cast<uint16_t>(uint(2)); }
  uint32_t u32() { return static_cast<uint32_t>(uint(4)); }
  uint64_t u64() { return uint(8); }

 private:
  std::span<const uint8_t> data_;
  size_t pos_ = 0;
};

class InputWriter {
 public:
  void uint(uint64_t v, size_t bytes) {
    for (size_t i = 0; i < bytes; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  void u8(uint8_t v) { uint(v, 1); }
  void u16(uint16_t v) { uint(v, 2); }
  void u32(uint32_t v) { uint(v, 4); }
  void u64(uint64_t v) { uint(v, 8); }
  void bytes(std::span<const uint8_t> b) { out_.insert(out_.end(), b.begin(), b.end()); }
  const std::vector<uint8_t>& data() const { return out_; }

 private:
  std::vector<uint8_t> out_;
};

inline shm::HeaderFields read_header_fields(InputReader& r) {
  shm::HeaderFields h;
  h.magic = r.u64();
  h.layout_version = r.u32();
  h.header_bytes = r.u32();
  h.segment_bytes = r.u64();
  h.world_size = r.u32();
  h.ring_entries = r.u32();
  h.slot_bytes = r.u64();
  h.rank_table_offset = r.u64();
  h.rings_offset = r.u64();
  h.ring_bytes = r.u64();
  h.entry_bytes = r.u64();
  h.creator_pid = r.u32();
  h.creator_rank = r.u32();
  h.creator_start_time = r.u64();
  h.incarnation = r.u64();
  h.arena_offset = r.u64();
  h.region_bytes = r.u64();
  h.slots_per_rank = r.u32();
  h.window_offset = r.u64();
  h.window_bytes = r.u64();
  h.loan_offset = r.u64();
  h.loan_region_bytes = r.u64();
  h.loan_bytes = r.u64();
  h.loan_tickets = r.u32();
  return h;
}

inline void write_header_fields(InputWriter& w, const shm::HeaderFields& h) {
  w.u64(h.magic);
  w.u32(h.layout_version);
  w.u32(h.header_bytes);
  w.u64(h.segment_bytes);
  w.u32(h.world_size);
  w.u32(h.ring_entries);
  w.u64(h.slot_bytes);
  w.u64(h.rank_table_offset);
  w.u64(h.rings_offset);
  w.u64(h.ring_bytes);
  w.u64(h.entry_bytes);
  w.u32(h.creator_pid);
  w.u32(h.creator_rank);
  w.u64(h.creator_start_time);
  w.u64(h.incarnation);
  w.u64(h.arena_offset);
  w.u64(h.region_bytes);
  w.u32(h.slots_per_rank);
  w.u64(h.window_offset);
  w.u64(h.window_bytes);
  w.u64(h.loan_offset);
  w.u64(h.loan_region_bytes);
  w.u64(h.loan_bytes);
  w.u32(h.loan_tickets);
}

inline shm::EntryFields read_entry_fields(InputReader& r) {
  shm::EntryFields e;
  e.tag = static_cast<int64_t>(r.u64());
  e.total_bytes = r.u64();
  e.chunk_offset = r.u64();
  e.chunk_bytes = r.u32();
  e.flags = r.u32();
  e.dtype = r.u8();
  e.ndim = r.u8();
  e.check = r.u32();
  e.leaves = r.u16();
  e.slot = r.u32();
  return e;
}

inline void write_entry_fields(InputWriter& w, const shm::EntryFields& e) {
  w.u64(static_cast<uint64_t>(e.tag));
  w.u64(e.total_bytes);
  w.u64(e.chunk_offset);
  w.u32(e.chunk_bytes);
  w.u32(e.flags);
  w.u8(e.dtype);
  w.u8(e.ndim);
  w.u32(e.check);
  w.u16(e.leaves);
  w.u32(e.slot);
}

}  // namespace tdshm::fuzz
