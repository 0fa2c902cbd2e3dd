// TensorDict's whole-tree walks: key listings, sorted leaves, leaf-wise results, comparisons, repr.
// A lazy stack held at a key is walked member after member, member i under the key part "i"
// (how tensordict names them when it walks a lazy stack's members: _fast_apply on
// _NESTED_TENSORS_AS_LISTS), so its leaves come in its members' order, as its transfers send them.

#include "tensordict/tensordict_internal.h"

#include <tdshm/lazy_stack.h>

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <sstream>

namespace tdshm {

using detail::TensorDictImpl;

namespace {

using detail::check_batch_size;
using detail::check_leaf_write;
using detail::new_impl;
using detail::prepare_value;
using detail::shape_str;

// A lazy stack is a collection, not a leaf. With include_nested its own keys follow it (the keys
// every member has, as tensordict lists them) when `lazy_keys`: keys() lists them, items() does
// not (their values would be stacked copies).
void collect_keys(const TensorDictImpl& node, const Key* prefix, bool include_nested, bool leaves_only,
                  bool lazy_keys, std::vector<TensorDict::Item>& out) {
  for (const auto& [k, v] : node.entries) {
    Key key = prefix ? *prefix / k : Key(k);
    const bool collection = v.is_tensordict() || v.is_lazy_stack();
    if (!(leaves_only && collection)) out.emplace_back(key, v);
    if (include_nested && v.is_tensordict()) {
      collect_keys(*v.tensordict().impl(), &key, include_nested, leaves_only, lazy_keys, out);
    }
    if (include_nested && lazy_keys && v.is_lazy_stack()) {
      for (const Key& inner : v.lazy_stack().keys(true, leaves_only)) {
        std::vector<std::string> parts = key.parts();
        parts.insert(parts.end(), inner.parts().begin(), inner.parts().end());
        out.emplace_back(Key(std::move(parts)), v);  // keys() reads the key only
      }
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
    } else if (v.is_lazy_stack()) {  // member after member; the member's index is its position
      const auto& members = v.lazy_stack().tensordicts();
      for (size_t m = 0; m < members.size(); ++m) {
        const Key member_key = key / std::to_string(m);
        path.push_back(static_cast<uint32_t>(m));
        collect_sorted_leaves(*members[m].impl(), &member_key, path, out);
        path.pop_back();
      }
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
      out->append_fresh(k, prepare_value(key, Value(std::move(r)), out->batch_size, std::nullopt));
    } else if (v.is_tensordict()) {
      out->append_fresh(k, Value(map_leaves(*v.tensordict().impl(), &key, fn, keep_non_tensor)));
    } else if (v.is_lazy_stack()) {
      const LazyStackedTensorDict& stack = v.lazy_stack();
      std::vector<TensorDict> members;
      members.reserve(stack.size());
      for (size_t m = 0; m < stack.size(); ++m) {
        const Key member_key = key / std::to_string(m);
        members.push_back(map_leaves(*stack.tensordicts()[m].impl(), &member_key, fn, keep_non_tensor));
      }
      out->append_fresh(k, Value(LazyStackedTensorDict(std::move(members), stack.stack_dim())));
    } else if (keep_non_tensor) {
      out->append_fresh(k, v);
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
    } else if (v.is_lazy_stack()) {
      for (const TensorDict& m : v.lazy_stack().tensordicts()) {
        bool r = reduce_leaves(*m.impl(), want_all);
        if (r != want_all) return r;
      }
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
    if (v.is_tensor() != w->is_tensor() || v.is_tensordict() != w->is_tensordict() ||
        v.is_lazy_stack() != w->is_lazy_stack()) {
      throw TypeError("key " + key.str() + " holds a " + v.kind_name() + " here but a " + w->kind_name() +
                      " in the other tensordict");
    }
    if (v.is_tensor()) {
      out->append_fresh(k, Value(fn(v.tensor(), w->tensor())));
    } else if (v.is_tensordict()) {
      out->append_fresh(k, Value(zip_leaves(*v.tensordict().impl(), *w->tensordict().impl(), &key, fn)));
    } else if (v.is_lazy_stack()) {
      const LazyStackedTensorDict &x = v.lazy_stack(), &y = w->lazy_stack();
      if (x.size() != y.size() || x.stack_dim() != y.stack_dim()) {
        throw ShapeError("key " + key.str() + " holds a lazy stack of " + std::to_string(x.size()) + " members (stack_dim " +
                         std::to_string(x.stack_dim()) + ") here but of " + std::to_string(y.size()) + " (stack_dim " +
                         std::to_string(y.stack_dim()) + ") in the other tensordict");
      }
      std::vector<TensorDict> members;
      for (size_t m = 0; m < x.size(); ++m) {
        const Key member_key = key / std::to_string(m);
        members.push_back(zip_leaves(*x.tensordicts()[m].impl(), *y.tensordicts()[m].impl(), &member_key, fn));
      }
      out->append_fresh(k, Value(LazyStackedTensorDict(std::move(members), x.stack_dim())));
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
    if (w == nullptr || v.is_tensor() != w->is_tensor() || v.is_tensordict() != w->is_tensordict() ||
        v.is_lazy_stack() != w->is_lazy_stack()) {
      return false;
    }
    if (v.is_tensor()) {
      if (v.tensor().scalar_type() != w->tensor().scalar_type() || v.tensor().sizes() != w->tensor().sizes()) {
        return false;
      }
    } else if (v.is_tensordict()) {
      if (!same_structure_impl(*v.tensordict().impl(), *w->tensordict().impl())) return false;
    } else if (v.is_lazy_stack()) {
      const LazyStackedTensorDict &x = v.lazy_stack(), &y = w->lazy_stack();
      if (x.size() != y.size() || x.stack_dim() != y.stack_dim()) return false;
      for (size_t m = 0; m < x.size(); ++m) {
        if (!same_structure_impl(*x.tensordicts()[m].impl(), *y.tensordicts()[m].impl())) return false;
      }
    }
  }
  return true;
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
    } else if (v.is_lazy_stack()) {
      const LazyStackedTensorDict& stack = v.lazy_stack();
      os << "LazyStackedTensorDict(batch_size=" << shape_str(stack.batch_size()) << ", stack_dim=" << stack.stack_dim()
         << ")\n";
      for (size_t m = 0; m < stack.size(); ++m) {
        const auto& c = *stack.tensordicts()[m].impl();
        os << pad << "  " << m << ": TensorDict(batch_size=" << shape_str(c.batch_size) << ")\n";
        describe(c, indent + 4, os);
      }
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
// TensorDict: keys

std::vector<Key> TensorDict::keys(bool include_nested, bool leaves_only) const {
  std::vector<Item> items;
  collect_keys(*impl_, nullptr, include_nested, leaves_only, true, items);
  std::vector<Key> out;
  out.reserve(items.size());
  for (auto& [k, v] : items) out.push_back(k);
  return out;
}

std::vector<TensorDict::Item> TensorDict::items(bool include_nested, bool leaves_only) const {
  std::vector<Item> out;
  collect_keys(*impl_, nullptr, include_nested, leaves_only, false, out);
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
  // Insertion order (depth first) is the lexicographic order of the leaves' position paths.
  fresh->insertion_order.resize(fresh->keys.size());
  for (size_t i = 0; i < fresh->keys.size(); ++i) fresh->insertion_order[i] = static_cast<uint32_t>(i);
  auto path_of = [&](uint32_t i) {
    return c10::ArrayRef<uint32_t>(fresh->positions.data() + fresh->path_begin[i],
                                   fresh->path_begin[i + 1] - fresh->path_begin[i]);
  };
  std::sort(fresh->insertion_order.begin(), fresh->insertion_order.end(), [&](uint32_t a, uint32_t b) {
    const auto pa = path_of(a), pb = path_of(b);
    return std::lexicographical_compare(pa.begin(), pa.end(), pb.begin(), pb.end());
  });
  slot.store(fresh, std::memory_order_release);
  return fresh;
}

at::Tensor detail::leaf_tensor(const TensorDict& td, const SortedLeaves& leaves, size_t i) {
  const TensorDictImpl* node = td.impl().get();
  const uint32_t end = leaves.path_begin[i + 1];
  for (uint32_t p = leaves.path_begin[i]; p + 1 < end; ++p) {
    const Value& v = node->entries[leaves.positions[p]].second;
    if (v.is_lazy_stack()) {  // the next position is the member's index
      node = v.lazy_stack().tensordicts()[leaves.positions[++p]].impl().get();
    } else {
      node = v.tensordict().impl().get();
    }
  }
  return node->entries[leaves.positions[end - 1]].second.tensor();
}

TensorDict detail::with_leaves(const TensorDict& td, const SortedLeaves& leaves, c10::ArrayRef<at::Tensor> tensors) {
  TORCH_INTERNAL_ASSERT(tensors.size() == leaves.keys.size() && leaves.insertion_order.size() == tensors.size());
  size_t j = 0;  // map_leaves visits the leaves in insertion order
  return map_leaves(
      *td.impl(), nullptr, [&](const Key&, const at::Tensor&) { return tensors[leaves.insertion_order[j++]]; }, true);
}

namespace {

std::shared_ptr<TensorDictImpl> select_first_node(const TensorDictImpl& node, int64_t i) {
  auto out = new_impl(std::vector<int64_t>(node.batch_size.begin() + 1, node.batch_size.end()), node.device);
  out->class_name = node.class_name;
  for (const auto& [k, v] : node.entries) {
    if (v.is_tensor()) {
      out->append_fresh(k, Value(v.tensor().select(0, i)));
    } else if (v.is_tensordict()) {
      out->append_fresh(k, Value(TensorDict(select_first_node(*v.tensordict().impl(), i))));
    } else if (v.is_lazy_stack()) {
      // Along the stack dimension: member i itself; along another: each member's entry i.
      const LazyStackedTensorDict& stack = v.lazy_stack();
      if (stack.stack_dim() == 0) {
        out->append_fresh(k, Value(stack.tensordicts()[static_cast<size_t>(i)]));
      } else {
        std::vector<TensorDict> members;
        for (const TensorDict& m : stack.tensordicts()) members.push_back(TensorDict(select_first_node(*m.impl(), i)));
        out->append_fresh(k, Value(LazyStackedTensorDict(std::move(members), stack.stack_dim() - 1)));
      }
    } else {
      out->append_fresh(k, v);
    }
  }
  return out;
}

}  // namespace

TensorDict detail::select_first(const TensorDict& td, int64_t i) { return TensorDict(select_first_node(*td.impl(), i)); }

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
      out->append_fresh(k, Value(t.expand(shape)));
    } else if (v.is_lazy_stack()) {
      throw TypeError("expand: key '" + k + "' holds a lazy stack, which tdshm does not expand");
    } else if (v.is_tensordict()) {
      const TensorDict& c = v.tensordict();
      std::vector<int64_t> shape = new_batch_size;
      shape.insert(shape.end(), c.batch_size().begin() + static_cast<std::ptrdiff_t>(old.size()), c.batch_size().end());
      out->append_fresh(k, Value(c.expand(shape)));
    } else {
      out->append_fresh(k, v);
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
  const auto leaves = detail::sorted_leaves(*this);
  for (size_t i = 0; i < leaves->keys.size(); ++i) {
    const at::Tensor leaf = detail::leaf_tensor(*this, *leaves, i);
    at::Tensor result = fn(leaf);
    check_leaf_write(leaves->keys[i], leaf, result);
    plan.emplace_back(leaf, std::move(result));
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
      if (v.is_lazy_stack()) {
        for (const TensorDict& m : v.lazy_stack().tensordicts()) set_device(*m.impl());
      }
    }
  };
  set_device(*out.impl_);
  return out;
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
// TensorDict: description

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
