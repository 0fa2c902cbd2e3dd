// TensorDict's entries: building the tree, and reading, writing, updating and locking it key by key.
// Consolidation lives in consolidate.cpp; key listings, leaf-wise operations, comparisons and
// repr in tensordict_leaves.cpp.

#include <tdshm/lazy_stack.h>
#include "tensordict/tensordict_internal.h"

#include <ATen/core/Tensor.h>

#include <algorithm>

namespace tdshm {

using detail::TensorDictImpl;

namespace {

using detail::check_batch_size;
using detail::check_leaf_write;
using detail::new_impl;
using detail::prepare_value;
using detail::shape_str;

bool has_prefix(at::IntArrayRef shape, const std::vector<int64_t>& prefix) {
  return shape.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), shape.begin());
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
  } else if (value.is_lazy_stack()) {
    const std::vector<int64_t> stacked = value.lazy_stack().batch_size();
    if (!has_prefix(stacked, batch_size)) {
      throw ShapeError("batch size mismatch for key " + key.str() + ": the lazy stack has batch size " +
                       shape_str(stacked) + " which does not start with the batch size " + shape_str(batch_size));
    }
  }
}

}  // namespace

// Shared with tensordict_leaves.cpp (tensordict_internal.h).
namespace detail {

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

void check_leaf_write(const Key& key, const at::Tensor& leaf, const at::Tensor& src) {
  if (!src.defined()) throw TypeError("key " + key.str() + ": the tensor is undefined");
  if (leaf.sizes() != src.sizes()) {
    throw ShapeError("in-place write to key " + key.str() + ": the leaf has shape " + shape_str(leaf.sizes()) +
                     " but the new tensor has shape " + shape_str(src.sizes()));
  }
}

}  // namespace detail

namespace {

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

void copy_into_leaf(const Key& key, at::Tensor& leaf, const at::Tensor& src) {
  check_leaf_write(key, leaf, src);
  leaf.copy_(src);
}

// Whether `target` is `from` or one of its nested tensordicts.
bool reaches(const TensorDictImpl& from, const TensorDictImpl* target) {
  if (&from == target) return true;
  for (const auto& [k, v] : from.entries) {
    if (v.is_tensordict() && reaches(*v.tensordict().impl(), target)) return true;
    if (v.is_lazy_stack()) {
      for (const TensorDict& m : v.lazy_stack().tensordicts()) {
        if (reaches(*m.impl(), target)) return true;
      }
    }
  }
  return false;
}

// Whether setting `value` into `node` would put `node` inside itself.
bool would_nest_itself(const TensorDictImpl& node, const Value& value) {
  if (value.is_tensordict()) return reaches(*value.tensordict().impl(), &node);
  if (value.is_lazy_stack()) {
    for (const TensorDict& m : value.lazy_stack().tensordicts()) {
      if (reaches(*m.impl(), &node)) return true;
    }
  }
  return false;
}

// The checks of set() for the last part of `key`, landing in `node` (which exists) where
// `existing` is the current value (or nullptr). Nothing is modified.
void check_set_here(const TensorDictImpl& node, const Key& key, const Value* existing, const Value& value) {
  if (would_nest_itself(node, value)) {
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

void lock_impl(TensorDictImpl& node, const std::shared_ptr<const TensorDictImpl>& owner) {
  if (node.locked) return;
  node.locked = true;
  node.locked_by = owner;
  for (auto& [k, v] : node.entries) {
    if (v.is_tensordict()) lock_impl(*v.tensordict().impl(), owner);
    if (v.is_lazy_stack()) {
      for (const TensorDict& m : v.lazy_stack().tensordicts()) lock_impl(*m.impl(), owner);
    }
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
    if (v.is_lazy_stack()) {
      for (const TensorDict& m : v.lazy_stack().tensordicts()) unlock_impl(*m.impl(), owner);
    }
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
const LazyStackedTensorDict& Value::lazy_stack() const {
  if (!is_lazy_stack()) throw TypeError(std::string("expected a lazy stack, found a ") + kind_name());
  return *std::get<3>(v_);
}
const char* Value::kind_name() const noexcept {
  switch (v_.index()) {
    case 0: return "tensor";
    case 1: return "tensordict";
    case 2: return "non-tensor value";
    default: return "lazy stack";
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
    if (would_nest_itself(*node, value)) {
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
// TensorDict: locking

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

}  // namespace tdshm
