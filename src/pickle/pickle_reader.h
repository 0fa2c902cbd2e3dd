#pragma once
// The reader of pickles: the node arena and the Unpickler, its state and small helpers.
//
// Reading builds a graph first and the value tree last. Pickle is a little stack machine whose
// memo lets one object appear in several places and lets a list or dict be filled after it was
// stored (CPython memoizes a container before its items), so the reader keeps every object it
// creates in an arena of nodes addressed by index; the stack and the memo hold indices. Only at
// STOP is the result turned into a PyValue tree, with a cycle check and a count of every value
// produced (a node reached twice is produced twice), so that sharing can neither recurse
// forever nor blow the result up. Each opcode creates at most one node and one stack entry, so
// the arena, the stack and the memo are O(input size).
//
// pickle_reader.cpp runs the opcodes (Unpickler::run, step); pickle_reader_graph.cpp interns dict
// keys and turns the arena into the result at STOP. Private to src/pickle.

#include "pickle/pickle.h"

#include "pickle/pickle_internal.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tdshm::pickle::detail {

struct Node {
  PyKind kind = PyKind::kNone;
  int64_t i = 0;                      // bool, int
  double d = 0;                       // float
  std::string s;                      // str, bytes, class module
  std::string s2;                     // class name
  std::vector<uint32_t> items;        // list, tuple; dict: key, value, key, value, ...
  std::unordered_map<uint32_t, uint32_t> index;  // dict: key class -> entry number
  int64_t key_class = -1;             // interned class of a hashable node, -1 until asked
  uint32_t tuple_depth = 0;           // tuples nested in this one, itself included
};

class Unpickler {
 public:
  Unpickler(std::span<const uint8_t> in, const Limits& limits) : in_(in), lim_(limits) {}

  PyValue run();

 private:
  // --- input ---
  void need(uint64_t n) const {
    if (n > in_.size() - pos_) {
      fail("truncated input: ", name_, " at byte ", at_, " needs ", n, " more bytes at byte ", pos_, " but only ",
           in_.size() - pos_, " remain");
    }
  }
  uint64_t read_le(size_t n) {
    need(n);
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= uint64_t{in_[pos_ + i]} << (8 * i);
    pos_ += n;
    return v;
  }
  std::string_view read_bytes(uint64_t n) {
    need(n);
    std::string_view out(reinterpret_cast<const char*>(in_.data() + pos_), static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return out;
  }
  std::string_view read_sized(size_t len_bytes, const char* what) {
    const uint64_t n = read_le(len_bytes);
    if (n > lim_.max_str_bytes) {
      fail(name_, " at byte ", at_, " claims a ", what, " of ", n, " bytes, more than the limit of ", lim_.max_str_bytes);
    }
    return read_bytes(n);
  }
  std::string check_utf8(std::string_view s) const {
    if (const size_t bad = bad_utf8_at(s); bad != std::string_view::npos) {
      fail(name_, " at byte ", at_, ": str is not valid UTF-8 (its byte ", bad, ")");
    }
    return std::string(s);
  }
  std::string_view read_line() {
    const size_t begin = pos_;
    const size_t limit = std::min(in_.size(), begin + std::min<size_t>(lim_.max_str_bytes, in_.size()) + 1);
    for (size_t i = begin; i < limit; ++i) {
      if (in_[i] == '\n') {
        pos_ = i + 1;
        return {reinterpret_cast<const char*>(in_.data() + begin), i - begin};
      }
    }
    fail("truncated input: ", name_, " at byte ", at_, " has no end of line");
  }

  // --- nodes and stack ---
  uint32_t new_node(PyKind kind) {
    if (nodes_.size() >= lim_.max_objects) {
      fail(name_, " at byte ", at_, ": more than max_objects = ", lim_.max_objects, " objects");
    }
    nodes_.emplace_back().kind = kind;
    return static_cast<uint32_t>(nodes_.size() - 1);
  }
  void push_new(PyKind kind) { stack_.push_back(new_node(kind)); }
  size_t fence() const { return marks_.empty() ? 0 : marks_.back(); }
  uint32_t pop() {
    if (stack_.size() <= fence()) fail("stack underflow: ", name_, " at byte ", at_, " finds no value to take");
    const uint32_t id = stack_.back();
    stack_.pop_back();
    return id;
  }
  uint32_t top() const {
    if (stack_.size() <= fence()) fail("stack underflow: ", name_, " at byte ", at_, " finds no value to use");
    return stack_.back();
  }
  std::vector<uint32_t> pop_mark() {
    if (marks_.empty()) fail("MARK mismatch: ", name_, " at byte ", at_, " needs a MARK but none is open");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<uint32_t> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  Node& target(PyKind kind) {
    const uint32_t id = top();
    Node& n = nodes_[id];
    if (n.kind != kind) {
      fail(name_, " at byte ", at_, " adds to a ", type_name(n.kind), ", not a ", type_name(kind));
    }
    return n;
  }
  void make_tuple(std::vector<uint32_t> items) {
    uint32_t depth = 1;
    for (uint32_t item : items) depth = std::max(depth, nodes_[item].tuple_depth + 1);
    if (depth > lim_.max_depth) fail(name_, " at byte ", at_, ": tuples nested deeper than max_depth = ", lim_.max_depth);
    const uint32_t id = new_node(PyKind::kTuple);
    nodes_[id].items = std::move(items);
    nodes_[id].tuple_depth = depth;
    stack_.push_back(id);
  }

  // --- memo ---
  void memo_put(uint64_t index) {
    if (memo_.size() >= lim_.max_memo && memo_.find(index) == memo_.end()) {
      fail(name_, " at byte ", at_, ": more than max_memo = ", lim_.max_memo, " memo entries");
    }
    memo_[index] = top();
  }
  void memo_get(uint64_t index) {
    const auto it = memo_.find(index);
    if (it == memo_.end()) {
      fail("memo miss: ", name_, " at byte ", at_, " asks for memo entry ", index, ", which was never stored");
    }
    stack_.push_back(it->second);
  }

  // --- opcodes (pickle_reader.cpp) ---
  int64_t decode_long(std::string_view b) const;
  void step();
  void push_class_ref(std::string module, std::string name);

  // --- dict keys and the result (pickle_reader_graph.cpp) ---
  uint32_t key_class(uint32_t id);
  void set_item(uint32_t dict_id, uint32_t key, uint32_t value);
  PyValue stop();
  PyValue build(uint32_t id, size_t depth);

  std::span<const uint8_t> in_;
  const Limits& lim_;
  size_t pos_ = 0;
  size_t at_ = 0;          // offset of the opcode being read
  uint8_t code_ = 0;
  const char* name_ = "";  // its name
  std::vector<Node> nodes_;
  std::vector<uint32_t> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, uint32_t> memo_;
  std::unordered_map<std::string, uint32_t> keys_;
  std::vector<uint8_t> on_path_;
  size_t produced_ = 0;
  size_t produced_bytes_ = 0;
};

}  // namespace tdshm::pickle::detail
