// MemoryMappedTensor leaves of init_remote passed by reference (remote_memmaps.h).

#include "distributed/remote_memmaps.h"

#include "memmap/peer_file.h"

#include <tdshm/errors.h>
#include <tdshm/lazy_stack.h>
#include <tdshm/memmap.h>

#include <ATen/ops/empty.h>

#include <cstring>
#include <map>

namespace tdshm::detail {

namespace {

// The table: "TDMR", u32 count, then per reference u64 start, u64 stop, i64 offset,
// u32 writable, u32 path bytes, the path (no terminator). Host byte order: both ends map the
// same files, so they run on one host.
constexpr char kMagic[4] = {'T', 'D', 'M', 'R'};
constexpr size_t kHeaderBytes = 8;
constexpr size_t kEntryBytes = 32;
constexpr uint32_t kMaxPathBytes = 4096;

struct Leaf {
  Key key;
  const SchemaTensor* tensor;
};

void collect_leaves(const SchemaNode& node, const Key* prefix, std::vector<Leaf>& out) {
  for (const SchemaEntry& e : node.entries) {
    Key key = prefix ? *prefix / e.key : Key(e.key);
    if (const auto* t = std::get_if<SchemaTensor>(&e.value)) {
      out.push_back({std::move(key), t});
    } else if (const auto* child = std::get_if<std::shared_ptr<SchemaNode>>(&e.value); child && *child) {
      collect_leaves(**child, &key, out);
    }
  }
}

std::vector<Leaf> leaves_of(const Schema& schema) {
  std::vector<Leaf> out;
  collect_leaves(schema.root, nullptr, out);
  return out;
}

template <class T>
void put(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof v);
  std::memcpy(out.data() + at, &v, sizeof v);
}

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  template <class T>
  T get(const char* what) {
    T v;
    need(sizeof v, what);
    std::memcpy(&v, data_ + at_, sizeof v);
    at_ += sizeof v;
    return v;
  }
  std::string bytes(size_t n, const char* what) {
    need(n, what);
    std::string s(reinterpret_cast<const char*>(data_ + at_), n);
    at_ += n;
    return s;
  }
  bool done() const noexcept { return at_ == size_; }

 private:
  void need(size_t n, const char* what) const {
    if (n > size_ - at_) {
      throw SchemaError("from_remote_init: the sender's memmap table ends inside " + std::string(what));
    }
  }
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

// The references of `td`'s leaves, walking `node` (td's consolidated layout: the same tree, a
// lazy stack's members being its children "0", "1", ...) beside it.
void collect_references(const TensorDict& td, const SchemaNode& node, std::vector<MemmapReference>& refs) {
  for (const SchemaEntry& e : node.entries) {
    if (const auto* leaf = std::get_if<SchemaTensor>(&e.value)) {
      if (leaf->stop == leaf->start) continue;  // no bytes: nothing to spare
      const at::Tensor t = td.get(e.key);
      if (!MemoryMappedTensor::is_mapped(t) || !t.is_contiguous()) continue;
      const std::optional<MemmapInfo> info = MemoryMappedTensor::info(t);
      if (!info || info->filename.empty() || info->filename.size() > kMaxPathBytes) continue;  // anonymous: by value
      // The canonical path: the receiver follows no link (memmap/peer_file.h).
      std::string file = peer_path(info->filename);
      if (file.size() > kMaxPathBytes) continue;
      refs.push_back({leaf->start, leaf->stop, std::move(file), info->offset, info->writable});
    } else if (const auto* child = std::get_if<std::shared_ptr<SchemaNode>>(&e.value); child && *child) {
      const Value v = td.get_value(e.key);
      if (!(*child)->lazy_stack_dim) {
        collect_references(v.tensordict(), **child, refs);
        continue;
      }
      const std::vector<TensorDict>& members = v.lazy_stack().tensordicts();
      for (size_t m = 0; m < members.size(); ++m) {
        collect_references(members[m], *std::get<std::shared_ptr<SchemaNode>>((*child)->entries[m].value), refs);
      }
    }
  }
}

}  // namespace

std::vector<MemmapReference> memmap_references(const TensorDict& td, const Schema& schema) {
  std::vector<MemmapReference> refs;
  collect_references(td, schema.root, refs);
  std::sort(refs.begin(), refs.end(), [](const auto& a, const auto& b) { return a.start < b.start; });
  return refs;
}

at::Tensor encode_references(const std::vector<MemmapReference>& refs) {
  std::vector<uint8_t> out(kMagic, kMagic + sizeof kMagic);
  put(out, static_cast<uint32_t>(refs.size()));
  for (const MemmapReference& r : refs) {
    put(out, r.start);
    put(out, r.stop);
    put(out, r.offset);
    put(out, static_cast<uint32_t>(r.writable));
    put(out, static_cast<uint32_t>(r.file.size()));
    out.insert(out.end(), r.file.begin(), r.file.end());
  }
  at::Tensor t = at::empty({static_cast<int64_t>(out.size())}, at::kByte);
  std::memcpy(t.data_ptr(), out.data(), out.size());
  return t;
}

std::vector<MemmapReference> decode_references(const at::Tensor& bytes, const Schema& schema) {
  Reader in(bytes.data_ptr<uint8_t>(), static_cast<size_t>(bytes.numel()));
  if (in.bytes(sizeof kMagic, "its header") != std::string(kMagic, sizeof kMagic)) {
    throw SchemaError("from_remote_init: the sender's memmap table does not start with its magic");
  }
  std::map<uint64_t, const SchemaTensor*> by_start;  // the leaves a reference may name
  for (const Leaf& leaf : leaves_of(schema)) {
    if (leaf.tensor->stop > leaf.tensor->start) by_start.emplace(leaf.tensor->start, leaf.tensor);
  }
  const uint32_t count = in.get<uint32_t>("its header");
  if (count > by_start.size()) {
    throw SchemaError("from_remote_init: the sender's memmap table names " + std::to_string(count) +
                      " leaves; its tree has " + std::to_string(by_start.size()) + " with bytes");
  }
  std::vector<MemmapReference> refs;
  uint64_t end = 0;
  for (uint32_t i = 0; i < count; ++i) {
    MemmapReference r;
    r.start = in.get<uint64_t>("an entry");
    r.stop = in.get<uint64_t>("an entry");
    r.offset = in.get<int64_t>("an entry");
    r.writable = in.get<uint32_t>("an entry") != 0;
    const uint32_t path_bytes = in.get<uint32_t>("an entry");
    const auto leaf = by_start.find(r.start);
    if (leaf == by_start.end() || leaf->second->stop != r.stop || (i > 0 && r.start < end)) {
      throw SchemaError("from_remote_init: the sender's memmap table entry " + std::to_string(i) + " (bytes " +
                        std::to_string(r.start) + " to " + std::to_string(r.stop) +
                        ") is not one leaf of its tree, in order");
    }
    if (r.offset < 0 || path_bytes == 0 || path_bytes > kMaxPathBytes) {
      throw SchemaError("from_remote_init: the sender's memmap table entry " + std::to_string(i) +
                        " has offset " + std::to_string(r.offset) + " and a path of " + std::to_string(path_bytes) +
                        " bytes");
    }
    r.file = in.bytes(path_bytes, "a path");
    if (r.file[0] != '/' || r.file.find('\0') != std::string::npos) {
      throw SchemaError("from_remote_init: the sender's memmap table entry " + std::to_string(i) +
                        " is not an absolute path");
    }
    if (const std::string tail = r.file + "/"; tail.find("/../") != std::string::npos || tail.find("/./") != std::string::npos) {
      throw SchemaError("from_remote_init: the sender's memmap table entry " + std::to_string(i) +
                        " has '.' or '..' parts in its path");
    }
    end = r.stop;
    refs.push_back(std::move(r));
  }
  if (!in.done()) throw SchemaError("from_remote_init: the sender's memmap table has bytes after its entries");
  return refs;
}

std::vector<std::pair<uint64_t, uint64_t>> storage_ranges(uint64_t total, const std::vector<MemmapReference>& refs) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  uint64_t from = 0;
  for (const MemmapReference& r : refs) {
    if (r.start > from) ranges.emplace_back(from, r.start);
    from = r.stop;
  }
  if (total > from) ranges.emplace_back(from, total);
  return ranges;
}

TensorDict rebuild_with_references(const at::Tensor& storage, const Schema& schema,
                                   const std::vector<MemmapReference>& refs, bool may_write) {
  TensorDict td = TensorDict::from_consolidated(storage, schema);
  if (refs.empty()) return td;
  std::map<uint64_t, const MemmapReference*> by_start;
  for (const MemmapReference& r : refs) by_start.emplace(r.start, &r);
  std::map<uint64_t, Key> keys;  // for messages
  for (const Leaf& leaf : leaves_of(schema)) keys.emplace(leaf.tensor->start, leaf.key);
  // The same tree, not consolidated, each referenced leaf (found by where its bytes start in the
  // storage; every leaf has bytes: decode_references) the sender's file instead.
  const auto* base = static_cast<const uint8_t*>(storage.data_ptr());
  TensorDict out = td.apply([&](const at::Tensor& t) -> at::Tensor {
    if (t.numel() == 0) return t;
    const auto start = static_cast<uint64_t>(static_cast<const uint8_t*>(t.data_ptr()) - base);
    const auto it = by_start.find(start);
    if (it == by_start.end()) return t;
    const MemmapReference& r = *it->second;
    try {
      return map_peer_file(r.file, t.scalar_type(), t.sizes(), r.offset, r.writable && may_write);
    } catch (const MemmapError& e) {
      throw MemmapError("from_remote_init: leaf " + keys.at(start).str() +
                        " is the sender's file, which this rank cannot map: " + e.what());
    }
  });
  if (td.is_locked()) out.lock_();  // as from_consolidated returns it
  return out;
}

}  // namespace tdshm::detail
