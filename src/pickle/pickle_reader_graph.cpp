// Reading pickles: the arena's dict keys, equal as in Python, and the value tree built at STOP.
//
// Dict keys follow Python: a key must be hashable, and equal keys (1, 1.0 and True; equal
// tuples) are one entry, the first key kept and the last value winning. Equality of keys is
// decided by interning: every hashable node gets a class id for its normalized form (numbers
// that compare equal share one form; a tuple's form is the class ids of its items), so two keys
// are equal exactly when their ids are, with no recursive comparison.

#include "pickle/pickle_reader.h"

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tdshm::pickle::detail {

// The interned class of a hashable node: equal Python keys get equal classes.
uint32_t Unpickler::key_class(uint32_t id) {
  if (nodes_[id].key_class >= 0) return static_cast<uint32_t>(nodes_[id].key_class);
  std::string form;
  auto put_int = [&form](int64_t v) {
    form += 'I';
    for (size_t i = 0; i < 8; ++i) form += static_cast<char>(static_cast<uint64_t>(v) >> (8 * i));
  };
  const Node& n = nodes_[id];
  switch (n.kind) {
    case PyKind::kNone: form = "N"; break;
    case PyKind::kBool:
    case PyKind::kInt: put_int(n.i); break;
    case PyKind::kFloat: {
      if (std::isnan(n.d)) fail(name_, " at byte ", at_, ": a float NaN as a dict key is refused");
      // -2^63 <= d < 2^63 and integral: equal to that int (and -0.0 to 0).
      if (n.d >= -9223372036854775808.0 && n.d < 9223372036854775808.0 && std::trunc(n.d) == n.d) {
        put_int(static_cast<int64_t>(n.d));
      } else {
        form = 'F';
        const auto bits = std::bit_cast<uint64_t>(n.d);
        for (size_t i = 0; i < 8; ++i) form += static_cast<char>(bits >> (8 * i));
      }
      break;
    }
    case PyKind::kStr: form = "S" + n.s; break;
    case PyKind::kBytes: form = "B" + n.s; break;
    case PyKind::kClassRef:
      form = "C" + std::to_string(n.s.size()) + ":" + n.s + n.s2;
      break;
    case PyKind::kTuple: {
      form = "T";
      const std::vector<uint32_t> items = n.items;  // key_class may grow nothing, but be safe
      for (uint32_t item : items) {
        const uint32_t c = key_class(item);
        for (size_t i = 0; i < 4; ++i) form += static_cast<char>(c >> (8 * i));
      }
      break;
    }
    case PyKind::kList:
    case PyKind::kDict:
      fail(name_, " at byte ", at_, ": unhashable type '", type_name(n.kind), "' as a dict key");
  }
  const auto [it, inserted] = keys_.try_emplace(std::move(form), static_cast<uint32_t>(keys_.size()));
  (void)inserted;
  nodes_[id].key_class = it->second;
  return it->second;
}

void Unpickler::set_item(uint32_t dict_id, uint32_t key, uint32_t value) {
  const uint32_t c = key_class(key);
  Node& d = nodes_[dict_id];
  const auto [it, inserted] = d.index.try_emplace(c, static_cast<uint32_t>(d.items.size() / 2));
  if (inserted) {
    d.items.push_back(key);
    d.items.push_back(value);
  } else {
    d.items[2 * size_t{it->second} + 1] = value;  // Python keeps the first key, takes the last value
  }
}

PyValue Unpickler::stop() {
  if (!marks_.empty()) fail("MARK mismatch: STOP at byte ", at_, " with ", marks_.size(), " MARK(s) still open");
  if (stack_.size() != 1) {
    if (stack_.empty()) fail("stack underflow: STOP at byte ", at_, " finds no value to return");
    fail("STOP at byte ", at_, " finds ", stack_.size(), " values on the stack, expected exactly 1");
  }
  if (pos_ != in_.size()) fail("trailing bytes: ", in_.size() - pos_, " bytes after STOP at byte ", at_);
  on_path_.assign(nodes_.size(), 0);
  return build(stack_[0], 0);
}

PyValue Unpickler::build(uint32_t id, size_t depth) {
  if (++produced_ > lim_.max_objects) {
    fail("the result has more than max_objects = ", lim_.max_objects, " values (memoized objects count once per use)");
  }
  const Node& n = nodes_[id];
  switch (n.kind) {
    case PyKind::kNone: return PyValue::none();
    case PyKind::kBool: return PyValue::boolean(n.i != 0);
    case PyKind::kInt: return PyValue::integer(n.i);
    case PyKind::kFloat: return PyValue::floating(n.d);
    case PyKind::kStr:
    case PyKind::kBytes:
    case PyKind::kClassRef:
      produced_bytes_ += n.s.size() + n.s2.size();
      if (produced_bytes_ > lim_.max_total_str_bytes) {
        fail("the result holds more than max_total_str_bytes = ", lim_.max_total_str_bytes,
             " bytes of str and bytes (memoized objects count once per use)");
      }
      if (n.kind == PyKind::kStr) return PyValue::str(n.s);
      if (n.kind == PyKind::kBytes) return PyValue::bytes(n.s);
      return PyValue::class_ref(n.s, n.s2);
    case PyKind::kList:
    case PyKind::kTuple:
    case PyKind::kDict:
      break;
  }
  if (depth + 1 > lim_.max_depth) fail("the value nests containers deeper than max_depth = ", lim_.max_depth);
  if (on_path_[id] != 0) fail("recursive structure: a ", type_name(n.kind), " contains itself");
  on_path_[id] = 1;
  PyValue out;
  if (n.kind == PyKind::kDict) {
    PyDict d;
    d.entries.reserve(n.items.size() / 2);
    for (size_t i = 0; i < n.items.size(); i += 2) {
      PyValue key = build(n.items[i], depth + 1);
      PyValue value = build(n.items[i + 1], depth + 1);
      d.entries.push_back(PyDictEntry{std::move(key), std::move(value)});
    }
    out = PyValue(PyValue::Variant(std::move(d)));
  } else {
    std::vector<PyValue> items;
    items.reserve(n.items.size());
    for (uint32_t item : n.items) items.push_back(build(item, depth + 1));
    out = n.kind == PyKind::kList ? PyValue::list(std::move(items)) : PyValue::tuple(std::move(items));
  }
  on_path_[id] = 0;
  return out;
}

}  // namespace tdshm::pickle::detail
