// TensorDict: keys, nesting, batch size, locking and the leaf-wise operations.
// Consolidation lives in consolidate.cpp.

#include "tensordict/impl.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <sstream>

namespace tdshm {

using detail::TensorDictImpl;

namespace {

using detail::shape_str;

bool has_prefix(at::IntArrayRef shape, const std::vector<int64_t>& prefix) {
  return shape.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), shape.begin());
}

std::shared_ptr<TensorDictImpl> new_impl(std::vector<int64_t> batch_size, std::optional<c10::Device> device) {
  auto impl = std::make_shared<TensorDictImpl>();
  impl->batch_size = std::move(batch_size);
  impl->device = device;
  return impl;
}

void check_batch_size(const std::vector<int64_t>& batch_size) {
  for (int64_t d : batch_size) {
    if (d < 0) throw ShapeError("batch size " + shape_str(batch_size) + " has a negative dimension");
  }
}

// Walks to the tensordict that holds the last part of `key`, without creating anything.
// Returns nullptr when an intermediate is missing; throws KeyError when one is not a tensordict.
TensorDictImpl* walk_existing(TensorDictImpl* node, const Key& key) {
  const auto& parts = key.parts();
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    Value* v = node->find(parts[i]);
    if (v == nullptr) return nullptr;
    if (!v->is_tensordict()) {
      throw KeyError("key " + key.str() + " goes through '" + parts[i] + "', which holds a " + v->kind_name() +
                     ", not a tensordict: a key cannot be both a leaf and a subtree");
    }
    node = v->tensordict().impl().get();
  }
  return node;
}

const Value& find_or_throw(const TensorDictImpl* root, const Key& key) {
  TensorDictImpl* node = walk_existing(const_cast<TensorDictImpl*>(root), key);
  const Value* v = node ? node->find(key.back()) : nullptr;
  if (v == nullptr) throw KeyError("key " + key.str() + " not found");
  return *v;
}

// Checks `value` for a node with `batch_size`; throws what set() throws for it.
void check_value(const Key& key, const Value& value, const std::vector<int64_t>& batch_size) {
  if (value.is_tensor()) {
    const at::Tensor& t = value.tensor();
    if (!t.defined()) throw TypeError("key " + key.str() + ": the tensor is undefined");
    if (!has_prefix(t.sizes(), batch_size)) {
      throw ShapeError("batch size mismatch for key " + key.str() + ": the tensor has shape " + shape_str(t.sizes()) +
                       " but the batch size is " + shape_str(batch_size) +
                       "; every leaf's leading dimensions must equal the batch size");
    }
  } else if (value.is_tensordict()) {
    const TensorDict& td = value.tensordict();
    if (!has_prefix(td.batch_size(), batch_size)) {
      throw ShapeError("batch size mismatch for key " + key.str() + ": the nested tensordict has batch size " +
                       shape_str(td.batch_size()) + " which does not start with the batch size " +
                       shape_str(batch_size));
    }
  }
}

// Validates `value` for a node with `batch_size`/`device` and returns what to store.
Value prepare_value(const Key& key, const Value& value, const std::vector<int64_t>& batch_size,
                    const std::optional<c10::Device>& device) {
  check_value(key, value, batch_size);
  if (value.is_tensor()) {
    const at::Tensor& t = value.tensor();
    if (device && t.device() != *device) return Value(t.to(*device));
  } else if (value.is_tensordict()) {
    const TensorDict& td = value.tensordict();
    if (device && td.device() != device) return Value(td.to(*device));
  }
  return value;
}

void replace_entry(TensorDictImpl& node, const std::string& key, Value value) {
  auto it = node.index.find(key);
  if (it == node.index.end()) {
    node.append(key, std::move(value));
  } else {
    Value& old = node.entries[it->second].second;
    // A tensor replaced by a tensor keeps the keys; anything else may change them, a tensordict
    // replaced by another one too (built earlier, its keys were never announced under this key).
    if (!(old.is_tensor() && value.is_tensor())) detail::keys_changed();
    old = std::move(value);
  }
}

void rebuild_index(TensorDictImpl& node) {
  detail::keys_changed();
  node.index.clear();
  for (size_t i = 0; i < node.entries.size(); ++i) node.index.emplace(node.entries[i].first, i);
}

void check_leaf_write(const Key& key, const at::Tensor& leaf, const at::Tensor& src) {
  if (!src.defined()) throw TypeError("key " + key.str() + ": the tensor is undefined");
  if (leaf.sizes() != src.sizes()) {
    throw ShapeError("in-place write to key " + key.str() + ": the leaf has shape " + shape_str(leaf.sizes()) +
                     " but the new tensor has shape " + shape_str(src.sizes()));
  }
}

void copy_into_leaf(const Key& key, at::Tensor& leaf, const at::Tensor& src) {
  check_leaf_write(key, leaf, src);
  leaf.copy_(src);
}

// Whether `target` is `from` or one of its nested tensordicts.
bool reaches(const TensorDictImpl& from, const TensorDictImpl* target) {
  if (&from == target) return true;
  for (const auto& [k, v] : from.entries) {
    if (v.is_tensordict() && reaches(*v.tensordict().impl(), target)) return true;
  }
  return false;
}

// The checks of set() for the last part of `key`, landing in `node` (which exists) where
// `existing` is the current value (or nullptr). Nothing is modified.
void check_set_here(const TensorDictImpl& node, const Key& key, const Value* existing, const Value& value) {
  if (value.is_tensordict() && reaches(*value.tensordict().impl(), &node)) {
    throw KeyError("key " + key.str() + ": a tensordict cannot be set inside itself");
  }
  if (node.locked) {
    if (existing == nullptr) {
      throw LockedError("cannot add key " + key.str() + ": the tensordict is locked (new keys are refused, "
                        "in-place writes are allowed; unlock_() first)");
    }
    if (!existing->is_tensor() || !value.is_tensor()) {
      throw LockedError("cannot replace key " + key.str() + " (a " + existing->kind_name() + ") with a " +
                        value.kind_name() + ": the tensordict is locked; only in-place tensor writes are allowed");
    }
    check_leaf_write(key, existing->tensor(), value.tensor());
    return;
  }
  check_value(key, value, node.batch_size);
}

// The checks of update(): every set() it would make, checked before anything is written.
void check_update(const TensorDictImpl& dst, const TensorDictImpl& src, const Key* prefix) {
  for (const auto& [k, v] : src.entries) {
    Key key = prefix ? *prefix / k : Key(k);
    const Value* mine = dst.find(k);
    if (v.is_tensordict() && mine != nullptr && mine->is_tensordict()) {
      check_update(*mine->tensordict().impl(), *v.tensordict().impl(), &key);
    } else {
      check_set_here(dst, key, mine, v);
    }
  }
}

void collect_keys(const TensorDictImpl& node, const Key* prefix, bool include_nested, bool leaves_only,
                  std::vector<TensorDict::Item>& out) {
  for (const auto& [k, v] : node.entries) {
    Key key = prefix ? *prefix / k : Key(k);
    if (!(leaves_only && v.is_tensordict())) out.emplace_back(key, v);
    if (include_nested && v.is_tensordict()) {
      collect_keys(*v.tensordict().impl(), &key, include_nested, leaves_only, out);
    }
  }
}

std::vector<size_t> sorted_positions(const TensorDictImpl& node) {
  std::vector<size_t> pos(node.entries.size());
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = i;
  // std::string compares through char_traits<char>, which orders bytes as unsigned char:
  // the UTF-8 byte order, which is also Python's code point order.
  std::sort(pos.begin(), pos.end(), [&](size_t a, size_t b) { return node.entries[a].first < node.entries[b].first; });
  return pos;
}

// `path` holds the positions of the tensordicts above `node`; each leaf's path is appended to
// out.positions (SortedLeaves).
void collect_sorted_leaves(const TensorDictImpl& node, const Key* prefix, std::vector<uint32_t>& path,
                           detail::SortedLeaves& out) {
  for (size_t i : sorted_positions(node)) {
    const auto& [k, v] = node.entries[i];
    Key key = prefix ? *prefix / k : Key(k);
    path.push_back(static_cast<uint32_t>(i));
    if (v.is_tensor()) {
      out.keys.push_back(std::move(key));
      out.positions.insert(out.positions.end(), path.begin(), path.end());
      out.path_begin.push_back(static_cast<uint32_t>(out.positions.size()));
    } else if (v.is_tensordict()) {
      collect_sorted_leaves(*v.tensordict().impl(), &key, path, out);
    }
    path.pop_back();
  }
}

// Builds a new tensordict of the same structure with fn applied to each tensor leaf.
// keep_non_tensor: copy non-tensor values (apply) or drop them (comparisons).
TensorDict map_leaves(const TensorDictImpl& node, const Key* prefix,
                      const std::function<at::Tensor(const Key&, const at::Tensor&)>& fn, bool keep_non_tensor,
                      std::optional<std::vector<int64_t>> batch_size = std::nullopt) {
  auto out = new_impl(batch_size ? *batch_size : node.batch_size, node.device);
  out->class_name = node.class_name;
  for (const auto& [k, v] : node.entries) {
    Key key = prefix ? *prefix / k : Key(k);
    if (v.is_tensor()) {
      at::Tensor r = fn(key, v.tensor());
      out->append(k, prepare_value(key, Value(std::move(r)), out->batch_size, std::nullopt));
    } else if (v.is_tensordict()) {
      out->append(k, Value(map_leaves(*v.tensordict().impl(), &key, fn, keep_non_tensor)));
    } else if (keep_non_tensor) {
      out->append(k, v);
    }
  }
  return TensorDict(out);
}

bool reduce_leaves(const TensorDictImpl& node, bool want_all) {
  for (const auto& [k, v] : node.entries) {
    if (v.is_tensor()) {
      bool r = want_all ? v.tensor().all().item<bool>() : v.tensor().any().item<bool>();
      if (r != want_all) return r;
    } else if (v.is_tensordict()) {
      bool r = reduce_leaves(*v.tensordict().impl(), want_all);
      if (r != want_all) return r;
    }
  }
  return want_all;
}

// Pairs every tensor leaf of `a` with the same key of `b`; both must have the same keys.
TensorDict zip_leaves(const TensorDictImpl& a, const TensorDictImpl& b, const Key* prefix,
                      const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& fn) {
  auto out = new_impl(a.batch_size, a.device);
  for (const auto& [k, v] : a.entries) {
    Key key = prefix ? *prefix / k : Key(k);
    const Value* w = b.find(k);
    if (w == nullptr) throw KeyError("key " + key.str() + " is missing from the other tensordict");
    if (v.is_tensor() != w->is_tensor() || v.is_tensordict() != w->is_tensordict()) {
      throw TypeError("key " + key.str() + " holds a " + v.kind_name() + " here but a " + w->kind_name() +
                      " in the other tensordict");
    }
    if (v.is_tensor()) {
      out->append(k, Value(fn(v.tensor(), w->tensor())));
    } else if (v.is_tensordict()) {
      out->append(k, Value(zip_leaves(*v.tensordict().impl(), *w->tensordict().impl(), &key, fn)));
    }
  }
  for (const auto& [k, w] : b.entries) {
    if (a.find(k) == nullptr) {
      throw KeyError("key " + (prefix ? (*prefix / k).str() : Key(k).str()) + " is missing from this tensordict");
    }
  }
  return TensorDict(out);
}

bool same_structure_impl(const TensorDictImpl& a, const TensorDictImpl& b) {
  if (a.batch_size != b.batch_size || a.entries.size() != b.entries.size()) return false;
  for (const auto& [k, v] : a.entries) {
    const Value* w = b.find(k);
    if (w == nullptr || v.is_tensor() != w->is_tensor() || v.is_tensordict() != w->is_tensordict()) return false;
    if (v.is_tensor()) {
      if (v.tensor().scalar_type() != w->tensor().scalar_type() || v.tensor().sizes() != w->tensor().sizes()) {
        return false;
      }
    } else if (v.is_tensordict()) {
      if (!same_structure_impl(*v.tensordict().impl(), *w->tensordict().impl())) return false;
    }
  }
  return true;
}

void lock_impl(TensorDictImpl& node, const std::shared_ptr<const TensorDictImpl>& owner) {
  if (node.locked) return;
  node.locked = true;
  node.locked_by = owner;
  for (auto& [k, v] : node.entries) {
    if (v.is_tensordict()) lock_impl(*v.tensordict().impl(), owner);
  }
}

void unlock_impl(TensorDictImpl& node, const TensorDictImpl* owner) {
  auto by = node.locked_by.lock();
  if (!node.locked || (by && by.get() != owner)) return;
  node.locked = false;
  node.locked_by.reset();
  node.consolidation.reset();
  for (auto& [k, v] : node.entries) {
    if (v.is_tensordict()) unlock_impl(*v.tensordict().impl(), owner);
  }
}

// update_: validated in full first, then written.
void plan_update_(TensorDictImpl& dst, const TensorDictImpl& src, const Key* prefix,
                  std::vector<std::pair<at::Tensor, at::Tensor>>& plan) {
  for (const auto& [k, v] : src.entries) {
    Key key = prefix ? *prefix / k : Key(k);
    Value* d = dst.find(k);
    if (d == nullptr) {
      throw KeyError("update_: key " + key.str() + " does not exist in the destination; update_ writes in place "
                     "and cannot add keys (use update)");
    }
    if (v.is_tensordict()) {
      if (!d->is_tensordict()) throw TypeError("update_: key " + key.str() + " is a tensordict in the source but a " + d->kind_name() + " in the destination");
      plan_update_(*d->tensordict().impl(), *v.tensordict().impl(), &key, plan);
    } else if (v.is_non_tensor()) {
      throw TypeError("update_: key " + key.str() + " holds a non-tensor value; update_ writes tensors in place");
    } else {
      if (!d->is_tensor()) throw TypeError("update_: key " + key.str() + " holds a " + std::string(d->kind_name()) + " in the destination, not a tensor");
      if (d->tensor().sizes() != v.tensor().sizes()) {
        throw ShapeError("update_: key " + key.str() + " has shape " + shape_str(d->tensor().sizes()) +
                         " in the destination but " + shape_str(v.tensor().sizes()) + " in the source");
      }
      plan.emplace_back(d->tensor(), v.tensor());
    }
  }
}

void describe(const TensorDictImpl& node, int indent, std::ostringstream& os) {
  std::string pad(static_cast<size_t>(indent), ' ');
  for (const auto& [k, v] : node.entries) {
    os << pad << k << ": ";
    if (v.is_tensor()) {
      const at::Tensor& t = v.tensor();
      os << "Tensor(" << c10::toString(t.scalar_type()) << ", " << shape_str(t.sizes()) << ")";
      if (MemoryMappedTensor::info(t)) os << " memmap";
      os << "\n";
    } else if (v.is_tensordict()) {
      const auto& c = *v.tensordict().impl();
      os << (c.class_name.empty() ? "TensorDict" : c.class_name) << "(batch_size=" << shape_str(c.batch_size) << ")\n";
      describe(c, indent + 2, os);
    } else {
      std::visit([&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) {
          os << '"' << x << '"';
        } else if constexpr (std::is_same_v<T, bool>) {
          os << (x ? "true" : "false");
        } else {
          os << x;
        }
      }, v.non_tensor());
      os << "\n";
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Key

Key::Key(const char* key) : Key(std::string(key == nullptr ? "" : key)) {}
Key::Key(std::string key) : Key(std::vector<std::string>{std::move(key)}) {}
Key::Key(std::initializer_list<std::string> parts) : Key(std::vector<std::string>(parts)) {}
Key::Key(std::vector<std::string> parts) : parts_(std::move(parts)) {
  if (parts_.empty()) throw KeyError("empty key: a key needs at least one part");
  for (const auto& p : parts_) {
    if (p.empty()) throw KeyError("key " + str() + " has an empty part; every part must be a non-empty string");
  }
}

Key Key::operator/(const std::string& part) const {
  auto parts = parts_;
  parts.push_back(part);
  return Key(std::move(parts));
}

std::string Key::str() const {
  if (parts_.size() == 1) return "'" + parts_[0] + "'";
  std::string s = "(";
  for (size_t i = 0; i < parts_.size(); ++i) s += (i ? ", '" : "'") + parts_[i] + "'";
  return s + ")";
}

// ---------------------------------------------------------------------------------------------
// Value

const at::Tensor& Value::tensor() const {
  if (!is_tensor()) throw TypeError(std::string("expected a tensor, found a ") + kind_name());
  return std::get<0>(v_);
}
const TensorDict& Value::tensordict() const {
  if (!is_tensordict()) throw TypeError(std::string("expected a tensordict, found a ") + kind_name());
  return std::get<1>(v_);
}
const NonTensorData& Value::non_tensor() const {
  if (!is_non_tensor()) throw TypeError(std::string("expected a non-tensor value, found a ") + kind_name());
  return std::get<2>(v_);
}
const char* Value::kind_name() const noexcept {
  switch (v_.index()) {
    case 0: return "tensor";
    case 1: return "tensordict";
    default: return "non-tensor value";
  }
}

// ---------------------------------------------------------------------------------------------
// TensorDict: construction and access

TensorDict::TensorDict() : impl_(new_impl({}, std::nullopt)) {}

TensorDict::TensorDict(std::vector<int64_t> batch_size, std::optional<c10::Device> device)
    : impl_(new_impl(std::move(batch_size), device)) {
  check_batch_size(impl_->batch_size);
}

TensorDict::TensorDict(std::initializer_list<Item> items, std::vector<int64_t> batch_size,
                       std::optional<c10::Device> device)
    : TensorDict(std::vector<Item>(items), std::move(batch_size), device) {}

TensorDict::TensorDict(const std::vector<Item>& items, std::vector<int64_t> batch_size,
                       std::optional<c10::Device> device)
    : TensorDict(std::move(batch_size), device) {
  for (const auto& [k, v] : items) set(k, v);
}

const std::vector<int64_t>& TensorDict::batch_size() const noexcept { return impl_->batch_size; }
std::optional<c10::Device> TensorDict::device() const noexcept { return impl_->device; }
size_t TensorDict::size() const noexcept { return impl_->entries.size(); }
const std::string& TensorDict::class_name() const noexcept { return impl_->class_name; }
bool TensorDict::is_locked() const noexcept { return impl_->locked; }
bool TensorDict::is_consolidated() const noexcept { return impl_->consolidation != nullptr; }

TensorDict& TensorDict::set_class_name(std::string name) {
  impl_->class_name = std::move(name);
  return *this;
}

bool TensorDict::contains(const Key& key) const noexcept {
  // A path through a leaf cannot name anything: false, like Python's `key in td`.
  const TensorDictImpl* node = impl_.get();
  for (size_t i = 0; i + 1 < key.size(); ++i) {
    const Value* v = node->find(key.parts()[i]);
    if (v == nullptr || !v->is_tensordict()) return false;
    node = v->tensordict().impl().get();
  }
  return node->find(key.back()) != nullptr;
}

Value TensorDict::get_value(const Key& key) const { return find_or_throw(impl_.get(), key); }

at::Tensor TensorDict::get(const Key& key) const {
  const Value& v = find_or_throw(impl_.get(), key);
  if (!v.is_tensor()) throw TypeError("key " + key.str() + " holds a " + v.kind_name() + ", not a tensor");
  return v.tensor();
}

TensorDict TensorDict::get_tensordict(const Key& key) const {
  const Value& v = find_or_throw(impl_.get(), key);
  if (!v.is_tensordict()) throw TypeError("key " + key.str() + " holds a " + v.kind_name() + ", not a tensordict");
  return v.tensordict();
}

NonTensorData TensorDict::get_non_tensor(const Key& key) const {
  const Value& v = find_or_throw(impl_.get(), key);
  if (!v.is_non_tensor()) throw TypeError("key " + key.str() + " holds a " + v.kind_name() + ", not a non-tensor value");
  return v.non_tensor();
}

// ---------------------------------------------------------------------------------------------
// TensorDict: mutation

TensorDict& TensorDict::set(const Key& key, const Value& value) {
  // Phase 1: find where the key lands and check everything; nothing is modified yet.
  const auto& parts = key.parts();
  TensorDictImpl* node = impl_.get();
  size_t depth = 0;  // parts[0, depth) exist as tensordicts
  for (; depth + 1 < parts.size(); ++depth) {
    Value* v = node->find(parts[depth]);
    if (v == nullptr) break;
    if (!v->is_tensordict()) {
      throw KeyError("key " + key.str() + " goes through '" + parts[depth] + "', which holds a " + v->kind_name() +
                     ", not a tensordict: a key cannot be both a leaf and a subtree");
    }
    node = v->tensordict().impl().get();
  }
  if (depth + 1 < parts.size()) {
    // The intermediates are new: a tensordict that reaches `node` would make a cycle.
    if (value.is_tensordict() && reaches(*value.tensordict().impl(), node)) {
      throw KeyError("key " + key.str() + ": a tensordict cannot be set inside itself");
    }
    if (node->locked) {
      throw LockedError("cannot set key " + key.str() + ": the tensordict is locked and '" + parts[depth] +
                        "' would be a new key (unlock_() first)");
    }
    Value prepared = prepare_value(key, value, node->batch_size, node->device);
    // Phase 2: create the intermediates, then set.
    for (; depth + 1 < parts.size(); ++depth) {
      auto child = new_impl(node->batch_size, node->device);
      node->append(parts[depth], Value(TensorDict(child)));
      node = child.get();
    }
    node->append(parts.back(), std::move(prepared));
    return *this;
  }
  Value* existing = node->find(parts.back());
  check_set_here(*node, key, existing, value);
  if (node->locked) {  // an existing tensor leaf, written in place
    at::Tensor leaf = existing->tensor();
    leaf.copy_(value.tensor());
    return *this;
  }
  Value prepared = prepare_value(key, value, node->batch_size, node->device);
  replace_entry(*node, parts.back(), std::move(prepared));
  return *this;
}

TensorDict& TensorDict::set_(const Key& key, const at::Tensor& tensor) {
  at::Tensor leaf = get(key);
  copy_into_leaf(key, leaf, tensor);
  return *this;
}

TensorDict& TensorDict::erase(const Key& key) {
  TensorDictImpl* node = walk_existing(impl_.get(), key);
  if (node == nullptr || node->find(key.back()) == nullptr) throw KeyError("cannot delete key " + key.str() + ": not found");
  if (node->locked) throw LockedError("cannot delete key " + key.str() + ": the tensordict is locked (unlock_() first)");
  auto pos = node->index.at(key.back());
  node->entries.erase(node->entries.begin() + static_cast<std::ptrdiff_t>(pos));
  rebuild_index(*node);
  return *this;
}

// ---------------------------------------------------------------------------------------------
// TensorDict: keys

std::vector<Key> TensorDict::keys(bool include_nested, bool leaves_only) const {
  std::vector<Key> out;
  for (auto& [k, v] : items(include_nested, leaves_only)) out.push_back(k);
  return out;
}

std::vector<TensorDict::Item> TensorDict::items(bool include_nested, bool leaves_only) const {
  std::vector<Item> out;
  collect_keys(*impl_, nullptr, include_nested, leaves_only, out);
  return out;
}

std::vector<std::string> TensorDict::sorted_keys() const {
  std::vector<std::string> out;
  for (size_t i : sorted_positions(*impl_)) out.push_back(impl_->entries[i].first);
  return out;
}

std::vector<Key> TensorDict::sorted_leaf_keys() const { return detail::sorted_leaves(*this)->keys; }

std::shared_ptr<const detail::SortedLeaves> detail::sorted_leaves(const TensorDict& td) {
  // The epoch is read before the keys are: a change made while they are collected leaves a cache
  // entry that is already stale, never a stale one that looks current.
  const uint64_t epoch = keys_epoch.load(std::memory_order_acquire);
  auto& slot = td.impl()->sorted_leaves.value;
  if (auto cached = slot.load(std::memory_order_acquire); cached && cached->epoch == epoch) return cached;
  auto fresh = std::make_shared<SortedLeaves>();
  fresh->epoch = epoch;
  std::vector<uint32_t> path;
  fresh->path_begin.push_back(0);
  collect_sorted_leaves(*td.impl(), nullptr, path, *fresh);
  fresh->key_hashes.reserve(fresh->keys.size());
  for (const Key& k : fresh->keys) fresh->key_hashes.push_back(key_path_hash(k));
  slot.store(fresh, std::memory_order_release);
  return fresh;
}

at::Tensor detail::leaf_tensor(const TensorDict& td, const SortedLeaves& leaves, size_t i) {
  const TensorDictImpl* node = td.impl().get();
  const uint32_t end = leaves.path_begin[i + 1];
  for (uint32_t p = leaves.path_begin[i]; p + 1 < end; ++p) node = node->entries[leaves.positions[p]].second.tensordict().impl().get();
  return node->entries[leaves.positions[end - 1]].second.tensor();
}

// ---------------------------------------------------------------------------------------------
// TensorDict: new tensordicts

TensorDict TensorDict::clone() const {
  return map_leaves(*impl_, nullptr, [](const Key&, const at::Tensor& t) { return t.clone(); }, true);
}

TensorDict TensorDict::contiguous() const {
  return map_leaves(*impl_, nullptr, [](const Key&, const at::Tensor& t) { return t.contiguous(); }, true);
}

TensorDict TensorDict::expand(std::vector<int64_t> new_batch_size) const {
  const auto& old = impl_->batch_size;
  check_batch_size(new_batch_size);
  bool ok = new_batch_size.size() >= old.size();
  const size_t lead = ok ? new_batch_size.size() - old.size() : 0;
  for (size_t i = 0; ok && i < old.size(); ++i) ok = old[i] == new_batch_size[lead + i] || old[i] == 1;
  if (!ok) {
    throw ShapeError("cannot expand a tensordict of batch size " + shape_str(old) + " to " + shape_str(new_batch_size) +
                     ": the new batch size must end with the old one (dimensions of size 1 may grow)");
  }
  auto out = new_impl(new_batch_size, impl_->device);
  out->class_name = impl_->class_name;
  for (const auto& [k, v] : impl_->entries) {
    if (v.is_tensor()) {
      const at::Tensor& t = v.tensor();
      std::vector<int64_t> shape = new_batch_size;
      shape.insert(shape.end(), t.sizes().begin() + static_cast<std::ptrdiff_t>(old.size()), t.sizes().end());
      out->append(k, Value(t.expand(shape)));
    } else if (v.is_tensordict()) {
      const TensorDict& c = v.tensordict();
      std::vector<int64_t> shape = new_batch_size;
      shape.insert(shape.end(), c.batch_size().begin() + static_cast<std::ptrdiff_t>(old.size()), c.batch_size().end());
      out->append(k, Value(c.expand(shape)));
    } else {
      out->append(k, v);
    }
  }
  return TensorDict(out);
}

TensorDict TensorDict::apply(const std::function<at::Tensor(const at::Tensor&)>& fn) const {
  return map_leaves(*impl_, nullptr, [&](const Key&, const at::Tensor& t) { return fn(t); }, true);
}

TensorDict& TensorDict::apply_(const std::function<at::Tensor(const at::Tensor&)>& fn) {
  // Every result is computed and checked before the first write, so a failure writes nothing.
  std::vector<std::pair<at::Tensor, at::Tensor>> plan;
  for (auto& [k, v] : items(true, true)) {
    if (v.is_tensor()) {
      at::Tensor result = fn(v.tensor());
      check_leaf_write(k, v.tensor(), result);
      plan.emplace_back(v.tensor(), std::move(result));
    }
  }
  for (auto& [leaf, result] : plan) leaf.copy_(result);
  return *this;
}

TensorDict TensorDict::to(c10::Device device) const {
  auto out = map_leaves(*impl_, nullptr, [&](const Key&, const at::Tensor& t) { return t.to(device); }, true);
  std::function<void(TensorDictImpl&)> set_device = [&](TensorDictImpl& n) {
    n.device = device;
    for (auto& [k, v] : n.entries) {
      if (v.is_tensordict()) set_device(*v.tensordict().impl());
    }
  };
  set_device(*out.impl_);
  return out;
}

// ---------------------------------------------------------------------------------------------
// TensorDict: updates

TensorDict& TensorDict::update(const TensorDict& other) {
  check_update(*impl_, *other.impl_, nullptr);  // a failed update writes nothing
  for (const auto& [k, v] : other.impl_->entries) {
    Value* mine = impl_->find(k);
    if (v.is_tensordict() && mine != nullptr && mine->is_tensordict()) {
      TensorDict child = mine->tensordict();
      child.update(v.tensordict());
    } else {
      set(Key(k), v);
    }
  }
  return *this;
}

TensorDict& TensorDict::update_(const TensorDict& other) {
  std::vector<std::pair<at::Tensor, at::Tensor>> plan;
  plan_update_(*impl_, *other.impl_, nullptr, plan);
  for (auto& [dst, src] : plan) dst.copy_(src);
  return *this;
}

// ---------------------------------------------------------------------------------------------
// TensorDict: comparisons

#define TDSHM_SCALAR_CMP(name)                                                                              \
  TensorDict TensorDict::name(const at::Scalar& v) const {                                                  \
    return map_leaves(*impl_, nullptr, [&](const Key&, const at::Tensor& t) { return t.name(v); }, false); \
  }
TDSHM_SCALAR_CMP(eq)
TDSHM_SCALAR_CMP(ne)
TDSHM_SCALAR_CMP(lt)
TDSHM_SCALAR_CMP(le)
TDSHM_SCALAR_CMP(gt)
TDSHM_SCALAR_CMP(ge)
#undef TDSHM_SCALAR_CMP

TensorDict TensorDict::eq(const TensorDict& other) const {
  return zip_leaves(*impl_, *other.impl_, nullptr, [](const at::Tensor& a, const at::Tensor& b) { return a.eq(b); });
}
TensorDict TensorDict::ne(const TensorDict& other) const {
  return zip_leaves(*impl_, *other.impl_, nullptr, [](const at::Tensor& a, const at::Tensor& b) { return a.ne(b); });
}

bool TensorDict::all() const { return reduce_leaves(*impl_, true); }
bool TensorDict::any() const { return reduce_leaves(*impl_, false); }

bool TensorDict::same_structure(const TensorDict& other) const { return same_structure_impl(*impl_, *other.impl_); }

TensorDict operator==(const TensorDict& td, const at::Scalar& v) { return td.eq(v); }
TensorDict operator!=(const TensorDict& td, const at::Scalar& v) { return td.ne(v); }
TensorDict operator==(const TensorDict& a, const TensorDict& b) { return a.eq(b); }
TensorDict operator!=(const TensorDict& a, const TensorDict& b) { return a.ne(b); }

// ---------------------------------------------------------------------------------------------
// TensorDict: locking and description

TensorDict& TensorDict::lock_() {
  lock_impl(*impl_, impl_);
  return *this;
}

TensorDict& TensorDict::unlock_() {
  if (!impl_->locked) return *this;
  auto by = impl_->locked_by.lock();
  if (by && by.get() != impl_.get() && by->locked) {
    throw LockedError("cannot unlock a nested tensordict that was locked through a locked parent; unlock the parent");
  }
  impl_->locked_by.reset();
  unlock_impl(*impl_, by ? by.get() : impl_.get());
  return *this;
}

std::string TensorDict::repr() const {
  std::ostringstream os;
  os << (impl_->class_name.empty() ? "TensorDict" : impl_->class_name) << "(batch_size=" << shape_str(impl_->batch_size);
  if (impl_->device) os << ", device=" << impl_->device->str();
  if (impl_->locked) os << ", locked";
  if (impl_->consolidation) os << ", consolidated " << impl_->consolidation->schema.total_bytes << " bytes";
  os << ")\n";
  describe(*impl_, 2, os);
  return os.str();
}

}  // namespace tdshm
