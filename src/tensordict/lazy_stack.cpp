// LazyStackedTensorDict (include/tdshm/lazy_stack.h): the model. Its transfers are in
// distributed/per_leaf.cpp and distributed/transfer.cpp.

#include <tdshm/errors.h>
#include <tdshm/lazy_stack.h>

#include "common/format.h"
#include "tensordict/impl.h"

#include <ATen/ops/stack.h>

#include <algorithm>
#include <set>
#include <string>

namespace tdshm {

namespace {

std::string members_text(size_t n) { return std::to_string(n) + (n == 1 ? " member" : " members"); }

/// The keys `value_of(member, k)` every member has at this level, sorted by their string (as
/// tensordict's _key_list); recursing into keys that are a tensordict in every member.
void shared_keys(const std::vector<TensorDict>& members, const Key* prefix, bool include_nested, bool leaves_only,
                 std::vector<Key>& out) {
  if (members.empty()) return;
  std::set<std::string> shared;
  for (const std::string& k : members[0].sorted_keys()) shared.insert(k);
  for (size_t m = 1; m < members.size(); ++m) {
    std::set<std::string> mine;
    for (const std::string& k : members[m].sorted_keys()) {
      if (shared.count(k) != 0) mine.insert(k);
    }
    shared = std::move(mine);
  }
  for (const std::string& k : shared) {  // std::set: sorted by the string
    Key key = prefix ? *prefix / k : Key(k);
    const bool nested = std::all_of(members.begin(), members.end(),
                                    [&](const TensorDict& td) { return td.get_value(Key(k)).is_tensordict(); });
    if (!(leaves_only && nested)) out.push_back(key);
    if (nested && include_nested) {
      std::vector<TensorDict> children;
      children.reserve(members.size());
      for (const TensorDict& td : members) children.push_back(td.get_tensordict(Key(k)));
      shared_keys(children, &key, include_nested, leaves_only, out);
    }
  }
}

}  // namespace

Value::Value(const LazyStackedTensorDict& s) : v_(std::make_shared<const LazyStackedTensorDict>(s)) {}

LazyStackedTensorDict TensorDict::get_lazy_stack(const Key& key) const {
  const Value v = get_value(key);
  if (!v.is_lazy_stack()) throw TypeError("key " + key.str() + " holds a " + v.kind_name() + ", not a lazy stack");
  return v.lazy_stack();
}

TensorDict LazyStackedTensorDict::shell() const {
  TensorDict out(tensordicts_.empty() ? std::vector<int64_t>{} : tensordicts_[0].batch_size());
  for (size_t m = 0; m < tensordicts_.size(); ++m) out.set(std::to_string(m), tensordicts_[m]);
  return out;
}

LazyStackedTensorDict LazyStackedTensorDict::consolidate() const {
  if (consolidated_) return *this;
  // TensorDict::consolidate lays the shell's children out member after member, as tensordict
  // lays out a lazy stack (a member holding a lazy stack is its TypeError, naming the key).
  auto c = std::make_shared<const TensorDict>(shell().consolidate());
  std::vector<TensorDict> members;
  members.reserve(tensordicts_.size());
  for (size_t m = 0; m < tensordicts_.size(); ++m) members.push_back(c->get_tensordict(std::to_string(m)));
  LazyStackedTensorDict out(std::move(members), stack_dim_);
  out.consolidated_ = std::move(c);
  return out;
}

at::Tensor LazyStackedTensorDict::consolidated_storage() const {
  if (!consolidated_) throw Error("this lazy stack is not consolidated (call consolidate())");
  return consolidated_->consolidated_storage();
}

detail::LazyLeavesCache& detail::lazy_leaves_cache(const LazyStackedTensorDict& stack) noexcept {
  return *stack.leaves_cache_;
}

LazyStackedTensorDict::LazyStackedTensorDict(std::vector<TensorDict> tensordicts, int64_t stack_dim)
    : tensordicts_(std::move(tensordicts)), leaves_cache_(std::make_shared<detail::LazyLeavesCache>()) {
  const int64_t dims = tensordicts_.empty() ? 0 : tensordicts_[0].batch_dims();
  for (size_t m = 1; m < tensordicts_.size(); ++m) {
    if (tensordicts_[m].batch_size() != tensordicts_[0].batch_size()) {
      throw ShapeError("LazyStackedTensorDict: member " + std::to_string(m) + " has batch size " +
                       detail::shape_str(tensordicts_[m].batch_size()) + ", member 0 " +
                       detail::shape_str(tensordicts_[0].batch_size()) + " (members share a batch size)");
    }
  }
  // The stacked batch has dims + 1 dimensions; stack_dim is one of them.
  const int64_t d = stack_dim < 0 ? stack_dim + dims + 1 : stack_dim;
  if (d < 0 || d > dims) {
    throw ShapeError("LazyStackedTensorDict: stack_dim " + std::to_string(stack_dim) + " is outside the " +
                     std::to_string(dims + 1) + " dimensions of the stacked batch");
  }
  stack_dim_ = d;
}

std::vector<int64_t> LazyStackedTensorDict::batch_size() const {
  std::vector<int64_t> b = tensordicts_.empty() ? std::vector<int64_t>{} : tensordicts_[0].batch_size();
  b.insert(b.begin() + stack_dim_, static_cast<int64_t>(tensordicts_.size()));
  return b;
}

const TensorDict& LazyStackedTensorDict::operator[](int64_t i) const {
  const auto n = static_cast<int64_t>(tensordicts_.size());
  const int64_t j = i < 0 ? i + n : i;
  if (j < 0 || j >= n) {
    throw ShapeError("LazyStackedTensorDict: index " + std::to_string(i) + " is out of range for " +
                     members_text(tensordicts_.size()));
  }
  return tensordicts_[static_cast<size_t>(j)];
}

std::vector<Key> LazyStackedTensorDict::keys(bool include_nested, bool leaves_only) const {
  std::vector<Key> out;
  shared_keys(tensordicts_, nullptr, include_nested, leaves_only, out);
  return out;
}

LazyStackedTensorDict LazyStackedTensorDict::eq(const LazyStackedTensorDict& other) const {
  if (size() != other.size() || stack_dim_ != other.stack_dim_) {
    throw ShapeError("LazyStackedTensorDict ==: " + members_text(size()) + " stacked at dim " +
                     std::to_string(stack_dim_) + " against " + members_text(other.size()) + " at dim " +
                     std::to_string(other.stack_dim_));
  }
  std::vector<TensorDict> out;
  out.reserve(size());
  for (size_t m = 0; m < size(); ++m) out.push_back(tensordicts_[m].eq(other.tensordicts_[m]));
  return LazyStackedTensorDict(std::move(out), stack_dim_);
}

bool LazyStackedTensorDict::all() const {
  return std::all_of(tensordicts_.begin(), tensordicts_.end(), [](const TensorDict& td) { return td.all(); });
}

TensorDict LazyStackedTensorDict::to_tensordict() const {
  TensorDict out(batch_size(), tensordicts_.empty() ? std::nullopt : tensordicts_[0].device());
  if (tensordicts_.empty()) return out;
  const std::vector<Key> mine = tensordicts_[0].keys(true, true);
  for (size_t m = 1; m < size(); ++m) {
    const std::vector<Key> theirs = tensordicts_[m].keys(true, true);
    if (std::set<Key>(theirs.begin(), theirs.end()) != std::set<Key>(mine.begin(), mine.end())) {
      throw KeyError("LazyStackedTensorDict::to_tensordict: member " + std::to_string(m) +
                     " has other keys than member 0 (a heterogeneous stack has no dense form)");
    }
  }
  for (const Key& k : mine) {
    if (!tensordicts_[0].get_value(k).is_tensor()) {
      throw TypeError("LazyStackedTensorDict::to_tensordict: key " + k.str() + " is not a tensor");
    }
    std::vector<at::Tensor> leaves;
    for (size_t m = 0; m < size(); ++m) {
      leaves.push_back(tensordicts_[m].get(k));
      if (leaves.back().sizes() != leaves[0].sizes() || leaves.back().scalar_type() != leaves[0].scalar_type()) {
        throw ShapeError("LazyStackedTensorDict::to_tensordict: key " + k.str() + " is " +
                         detail::shape_str(leaves.back().sizes().vec()) + " " +
                         c10::toString(leaves.back().scalar_type()) + " in member " + std::to_string(m) + ", " +
                         detail::shape_str(leaves[0].sizes().vec()) + " " + c10::toString(leaves[0].scalar_type()) +
                         " in member 0");
      }
    }
    out.set(k, at::stack(leaves, stack_dim_));
  }
  return out;
}

LazyStackedTensorDict operator==(const LazyStackedTensorDict& a, const LazyStackedTensorDict& b) { return a.eq(b); }

}  // namespace tdshm
