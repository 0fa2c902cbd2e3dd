// Consolidation: every tensor leaf in one flat uint8 storage, and the way back from a storage
// plus its schema (in memory, or from a consolidated file).
//
// Consolidated file layout (consolidate({.filename})), all integers little-endian:
//
//   0                 total_bytes          +schema_len              +24
//   +-----------------+--------------------+------------------------+
//   | storage         | encoded schema     | u64 schema_len          |
//   | (leaves, padded)| (encode_schema)    | u64 total_bytes         |
//   |                 |                    | 8 bytes magic "TDSHMCF1"|
//   +-----------------+--------------------+------------------------+
//
// The storage starts the file so that it is page aligned when mapped; the trailer sits at the
// end so a reader finds it from the file size alone.

#include "common/copy.h"
#include "common/log.h"
#include "schema/schema_internal.h"
#include "tensordict/impl.h"

#include <tdshm/lazy_stack.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace tdshm {

using detail::Consolidation;
using detail::TensorDictImpl;

namespace {

constexpr char kFileMagic[8] = {'T', 'D', 'S', 'H', 'M', 'C', 'F', '1'};
constexpr size_t kTrailerBytes = 24;

struct LeafCopy {
  at::Tensor src;
  uint64_t start = 0;
  uint64_t nbytes = 0;
  uint32_t pad = 0;
};

uint64_t leaf_bytes(const at::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(t.element_size());
}

// Lays out `node` depth first in insertion order, from `offset`, recording the copies to make.
void plan_node(const TensorDictImpl& node, SchemaNode& out, uint64_t& offset, std::vector<LeafCopy>& copies) {
  out.class_name = node.class_name;
  out.batch_size = node.batch_size;
  out.device = node.device;
  out.entries.reserve(node.entries.size());
  for (const auto& [k, v] : node.entries) {
    SchemaEntry e;
    e.key = k;
    if (v.is_tensor()) {
      const at::Tensor& t = v.tensor();
      const uint64_t n = leaf_bytes(t);
      const auto pad = static_cast<uint32_t>((8 - n % 8) % 8);
      e.value = SchemaTensor{t.scalar_type(), t.sizes().vec(), offset, offset + n, pad};
      copies.push_back({t, offset, n, pad});
      offset += n + pad;
    } else if (v.is_tensordict()) {
      auto child = std::make_shared<SchemaNode>();
      plan_node(*v.tensordict().impl(), *child, offset, copies);
      e.value = std::move(child);
    } else if (v.is_lazy_stack()) {
      // tensordict's layout: the members as the children "0", "1", ..., member after member.
      const LazyStackedTensorDict& stack = v.lazy_stack();
      auto child = std::make_shared<SchemaNode>();
      child->lazy_stack_dim = stack.stack_dim();
      child->batch_size = stack.batch_size();
      for (size_t m = 0; m < stack.size(); ++m) {
        auto member = std::make_shared<SchemaNode>();
        plan_node(*stack.tensordicts()[m].impl(), *member, offset, copies);
        child->entries.push_back(SchemaEntry{std::to_string(m), std::move(member)});
      }
      e.value = std::move(child);
    } else {
      e.value = v.non_tensor();
    }
    out.entries.push_back(std::move(e));
  }
}

}  // namespace

at::Tensor detail::view_into(const at::Tensor& storage, uint64_t start, c10::ScalarType dtype, at::IntArrayRef shape) {
  const auto itemsize = static_cast<uint64_t>(c10::elementSize(dtype));
  const uint64_t byte_offset = static_cast<uint64_t>(storage.storage_offset()) + start;
  if (byte_offset % itemsize == 0) {
    // Direct TensorImpl construction: a dispatcher-free view, ~20x cheaper than empty().set_().
    auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage.storage()), storage.key_set(),
                                                      c10::scalarTypeToTypeMeta(dtype));
    t.unsafeGetTensorImpl()->set_storage_offset(static_cast<int64_t>(byte_offset / itemsize));
    t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
    return t;
  }
  // A 16-byte dtype at an offset that is a multiple of 8 but not of 16: same bytes, own handle.
  at::Tensor keep = storage;
  return at::from_blob(static_cast<uint8_t*>(storage.data_ptr()) + start, shape, [keep](void*) {},
                       storage.options().dtype(dtype));
}

namespace {

void copy_leaves(const at::Tensor& storage, const std::vector<LeafCopy>& copies) {
  auto* base = static_cast<uint8_t*>(storage.data_ptr());
  const bool storage_on_cpu = storage.device().is_cpu();
  // A storage that outgrows the caches is written around them (non-temporal stores).
  const bool streaming = static_cast<size_t>(storage.numel()) >= detail::kStreamingCopyBytes;
  for (const LeafCopy& c : copies) {
    if (storage_on_cpu && c.src.device().is_cpu() && c.src.is_contiguous()) {
      if (c.nbytes != 0) detail::copy_bytes(base + c.start, c.src.data_ptr(), c.nbytes, streaming);
    } else {
      detail::view_into(storage, c.start, c.src.scalar_type(), c.src.sizes()).copy_(c.src);
    }
    if (c.pad != 0) {
      if (storage_on_cpu) {
        std::memset(base + c.start + c.nbytes, 0, c.pad);
      } else {
        storage.narrow(0, static_cast<int64_t>(c.start + c.nbytes), c.pad).zero_();
      }
    }
  }
}

std::shared_ptr<TensorDictImpl> build_node(const SchemaNode& node, const at::Tensor& storage, const Key* prefix);

// The lazy stack of `node` (validated: its entries are its members "0", "1", ...).
LazyStackedTensorDict build_lazy_stack(const SchemaNode& node, const at::Tensor& storage, const Key& key) {
  std::vector<TensorDict> members;
  members.reserve(node.entries.size());
  for (const auto& e : node.entries) {
    const Key member_key = key / e.key;
    members.emplace_back(build_node(*std::get<std::shared_ptr<SchemaNode>>(e.value), storage, &member_key));
  }
  return LazyStackedTensorDict(std::move(members), *node.lazy_stack_dim);
}

// Builds the tree of `node` with leaves viewing `storage`.
std::shared_ptr<TensorDictImpl> build_node(const SchemaNode& node, const at::Tensor& storage, const Key* prefix) {
  auto impl = std::make_shared<TensorDictImpl>();
  impl->class_name = node.class_name;
  impl->batch_size = node.batch_size;
  if (node.device) impl->device = storage.device();
  for (const auto& e : node.entries) {
    Key key = prefix ? *prefix / e.key : Key(e.key);
    if (impl->find(e.key) != nullptr) throw SchemaError("schema has the key " + key.str() + " twice");
    if (const auto* t = std::get_if<SchemaTensor>(&e.value)) {
      if (t->shape.size() < node.batch_size.size() ||
          !std::equal(node.batch_size.begin(), node.batch_size.end(), t->shape.begin())) {
        throw SchemaError("schema leaf " + key.str() + " has shape " + detail::shape_str(t->shape) +
                          " that does not start with the batch size " + detail::shape_str(node.batch_size));
      }
      impl->append_fresh(e.key, Value(detail::view_into(storage, t->start, t->dtype, t->shape)));
    } else if (const auto* child = std::get_if<std::shared_ptr<SchemaNode>>(&e.value)) {
      if (!*child) throw SchemaError("schema node " + key.str() + " is null");
      if ((*child)->lazy_stack_dim) {
        impl->append_fresh(e.key, Value(build_lazy_stack(**child, storage, key)));
      } else {
        impl->append_fresh(e.key, Value(TensorDict(build_node(**child, storage, &key))));
      }
    } else {
      impl->append_fresh(e.key, Value(std::get<NonTensorData>(e.value)));
    }
  }
  return impl;
}

[[noreturn]] void throw_errno(const std::string& what, const std::string& path) {
  throw MemmapError(what + " '" + path + "': " + std::strerror(errno));
}

void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

TensorDict TensorDict::consolidate(const ConsolidateOptions& options) const {
  if (impl_->consolidation && options.filename.empty()) return *this;

  auto cons = std::make_shared<Consolidation>();
  std::vector<LeafCopy> copies;
  uint64_t total = 0;
  plan_node(*impl_, cons->schema.root, total, copies);
  cons->schema.total_bytes = total;

  const auto n = static_cast<int64_t>(total);
  if (options.filename.empty()) {
    auto opts = at::TensorOptions().dtype(at::kByte).device(impl_->device.value_or(c10::Device(c10::kCPU)));
    cons->storage = at::empty({n}, opts);
  } else {
    const std::vector<uint8_t> encoded = encode_schema(cons->schema);
    const auto file_bytes = static_cast<int64_t>(total + encoded.size() + kTrailerBytes);
    at::Tensor file = MemoryMappedTensor::empty({file_bytes}, at::kByte, options.filename).tensor();
    auto* tail = static_cast<uint8_t*>(file.data_ptr()) + total;
    if (!encoded.empty()) std::memcpy(tail, encoded.data(), encoded.size());
    put_u64(tail + encoded.size(), encoded.size());
    put_u64(tail + encoded.size() + 8, total);
    std::memcpy(tail + encoded.size() + 16, kFileMagic, sizeof kFileMagic);
    cons->storage = file.narrow(0, 0, n);
  }
  copy_leaves(cons->storage, copies);
  cons->fingerprint = tdshm::schema_fingerprint(cons->schema);

  TensorDict out(build_node(cons->schema.root, cons->storage, nullptr));
  out.impl_->device = impl_->device;
  out.impl_->consolidation = std::move(cons);
  out.lock_();
  return out;
}

at::Tensor TensorDict::consolidated_storage() const {
  if (!impl_->consolidation) throw Error("this tensordict is not consolidated (call consolidate())");
  return impl_->consolidation->storage;
}

const Schema& TensorDict::schema() const {
  if (!impl_->consolidation) throw Error("this tensordict is not consolidated (call consolidate())");
  return impl_->consolidation->schema;
}

uint64_t TensorDict::schema_fingerprint() const {
  if (!impl_->consolidation) throw Error("this tensordict is not consolidated (call consolidate())");
  return impl_->consolidation->fingerprint;
}

TensorDict TensorDict::from_consolidated(const at::Tensor& storage, Schema schema) {
  if (!storage.defined() || storage.dim() != 1 || storage.scalar_type() != at::kByte || !storage.is_contiguous()) {
    throw SchemaError("a consolidated storage must be a defined, contiguous 1-D uint8 tensor");
  }
  // The decoder's own rules (offsets, sizes, order, total within the storage); throws SchemaError.
  detail::validate_schema(schema, static_cast<uint64_t>(storage.numel()));
  if (schema.root.lazy_stack_dim) {
    throw SchemaError("the schema's root is a lazy stack, not a tensordict (a lazy stack's consolidated storage is "
                      "received by LazyStackedTensorDict)");
  }
  const uint64_t fingerprint = tdshm::schema_fingerprint(schema);
  return detail::from_checked_consolidated(storage, std::move(schema), fingerprint);
}

TensorDict detail::from_checked_consolidated(const at::Tensor& storage, Schema schema, uint64_t fingerprint) {
  auto cons = std::make_shared<Consolidation>();
  cons->storage = storage.numel() == static_cast<int64_t>(schema.total_bytes)
                      ? storage
                      : storage.narrow(0, 0, static_cast<int64_t>(schema.total_bytes));
  cons->fingerprint = fingerprint;
  cons->schema = std::move(schema);
  TensorDict out(build_node(cons->schema.root, cons->storage, nullptr));
  out.impl()->consolidation = std::move(cons);
  out.lock_();
  return out;
}

TensorDict TensorDict::from_consolidated_file(const std::string& path, MemmapMode mode) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_errno("cannot open consolidated file", path);
  struct FdGuard {
    int fd;
    ~FdGuard() { ::close(fd); }
  } guard{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_errno("cannot stat consolidated file", path);
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < kTrailerBytes) {
    throw MemmapError("consolidated file '" + path + "' is too small (" + std::to_string(size) +
                      " bytes; a consolidated file ends with a " + std::to_string(kTrailerBytes) + "-byte trailer)");
  }
  uint8_t trailer[kTrailerBytes];
  if (::pread(fd, trailer, kTrailerBytes, static_cast<off_t>(size - kTrailerBytes)) != static_cast<ssize_t>(kTrailerBytes)) {
    throw_errno("cannot read the trailer of consolidated file", path);
  }
  if (std::memcmp(trailer + 16, kFileMagic, sizeof kFileMagic) != 0) {
    throw SchemaError("'" + path + "' is not a tdshm consolidated file (bad trailer magic)");
  }
  const uint64_t schema_len = get_u64(trailer);
  const uint64_t total = get_u64(trailer + 8);
  if (schema_len > size || total > size || schema_len + total + kTrailerBytes != size) {
    throw SchemaError("consolidated file '" + path + "' is inconsistent: storage " + std::to_string(total) +
                      " + schema " + std::to_string(schema_len) + " + trailer " + std::to_string(kTrailerBytes) +
                      " bytes != file size " + std::to_string(size));
  }
  std::vector<uint8_t> encoded(schema_len);
  if (schema_len != 0 &&
      ::pread(fd, encoded.data(), schema_len, static_cast<off_t>(total)) != static_cast<ssize_t>(schema_len)) {
    throw_errno("cannot read the schema of consolidated file", path);
  }
  Schema schema = decode_schema(encoded, total);
  at::Tensor storage =
      MemoryMappedTensor::from_filename(path, at::kByte, {static_cast<int64_t>(total)}, 0, mode).tensor();
  detail::log().debug("rebuilt a consolidated tensordict of {} bytes from '{}'", total, path);
  return from_consolidated(storage, std::move(schema));
}

}  // namespace tdshm
