// Reading pickles: loads() runs the opcodes, refusing every one that is not plain data.

#include "pickle/pickle_reader.h"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tdshm::pickle {

namespace detail {

namespace {

struct OpInfo {
  const char* name;
  // 0: read here; 1: refused, it names or calls code; 2: not supported (another type or a
  // text-protocol form).
  int refusal;
};

OpInfo op_info(uint8_t code) {
  switch (code) {
    case '(': return {"MARK", 0};
    case '.': return {"STOP", 0};
    case '0': return {"POP", 0};
    case '1': return {"POP_MARK", 0};
    case '2': return {"DUP", 0};
    case 'F': return {"FLOAT", 2};
    case 'I': return {"INT", 2};
    case 'J': return {"BININT", 0};
    case 'K': return {"BININT1", 0};
    case 'L': return {"LONG", 2};
    case 'M': return {"BININT2", 0};
    case 'N': return {"NONE", 0};
    case 'P': return {"PERSID", 1};
    case 'Q': return {"BINPERSID", 1};
    case 'R': return {"REDUCE", 1};
    case 'S': return {"STRING", 2};
    case 'T': return {"BINSTRING", 2};
    case 'U': return {"SHORT_BINSTRING", 2};
    case 'V': return {"UNICODE", 2};
    case 'X': return {"BINUNICODE", 0};
    case 'a': return {"APPEND", 0};
    case 'b': return {"BUILD", 1};
    case 'c': return {"GLOBAL", 1};
    case 'd': return {"DICT", 0};
    case '}': return {"EMPTY_DICT", 0};
    case 'e': return {"APPENDS", 0};
    case 'g': return {"GET", 2};
    case 'h': return {"BINGET", 0};
    case 'i': return {"INST", 1};
    case 'j': return {"LONG_BINGET", 0};
    case 'l': return {"LIST", 0};
    case ']': return {"EMPTY_LIST", 0};
    case 'o': return {"OBJ", 1};
    case 'p': return {"PUT", 2};
    case 'q': return {"BINPUT", 0};
    case 'r': return {"LONG_BINPUT", 0};
    case 's': return {"SETITEM", 0};
    case 't': return {"TUPLE", 0};
    case ')': return {"EMPTY_TUPLE", 0};
    case 'u': return {"SETITEMS", 0};
    case 'G': return {"BINFLOAT", 0};
    case 0x80: return {"PROTO", 0};
    case 0x81: return {"NEWOBJ", 1};
    case 0x82: return {"EXT1", 1};
    case 0x83: return {"EXT2", 1};
    case 0x84: return {"EXT4", 1};
    case 0x85: return {"TUPLE1", 0};
    case 0x86: return {"TUPLE2", 0};
    case 0x87: return {"TUPLE3", 0};
    case 0x88: return {"NEWTRUE", 0};
    case 0x89: return {"NEWFALSE", 0};
    case 0x8a: return {"LONG1", 0};
    case 0x8b: return {"LONG4", 0};
    case 'B': return {"BINBYTES", 0};
    case 'C': return {"SHORT_BINBYTES", 0};
    case 0x8c: return {"SHORT_BINUNICODE", 0};
    case 0x8d: return {"BINUNICODE8", 0};
    case 0x8e: return {"BINBYTES8", 0};
    case 0x8f: return {"EMPTY_SET", 2};
    case 0x90: return {"ADDITEMS", 2};
    case 0x91: return {"FROZENSET", 2};
    case 0x92: return {"NEWOBJ_EX", 1};
    case 0x93: return {"STACK_GLOBAL", 1};
    case 0x94: return {"MEMOIZE", 0};
    case 0x95: return {"FRAME", 0};
    case 0x96: return {"BYTEARRAY8", 2};
    case 0x97: return {"NEXT_BUFFER", 2};
    case 0x98: return {"READONLY_BUFFER", 2};
    default: return {nullptr, 2};
  }
}

std::string hex_byte(uint8_t b) {
  static constexpr char kDigits[] = "0123456789abcdef";
  return std::string("0x") + kDigits[b >> 4] + kDigits[b & 15];
}

}  // namespace

PyValue Unpickler::run() {
  while (true) {
    if (pos_ >= in_.size()) fail("input ends at byte ", in_.size(), " without a STOP opcode (truncated)");
    at_ = pos_;
    code_ = in_[pos_++];
    const OpInfo info = op_info(code_);
    name_ = info.name;
    if (info.name == nullptr) {
      fail("unknown opcode ", hex_byte(code_), " at byte ", at_, " (not a pickle, or corrupt)");
    }
    if (code_ == op::STOP) return stop();
    if (info.refusal == 1 && !((code_ == op::GLOBAL || code_ == op::STACK_GLOBAL) && lim_.allow_class_refs)) {
      fail("opcode ", info.name, " (", hex_byte(code_), ") at byte ", at_,
           " is refused: it names or calls Python code, and only plain data (None, bool, int, float, str, bytes, "
           "list, tuple, dict) is read");
    }
    if (info.refusal == 2) {
      fail("opcode ", info.name, " (", hex_byte(code_), ") at byte ", at_,
           " is not supported: only protocols 2 to 5 and the types None, bool, int, float, str, bytes, list, tuple, "
           "dict are read");
    }
    step();
  }
}

int64_t Unpickler::decode_long(std::string_view b) const {
  const size_t n = b.size();
  if (n == 0) return 0;
  const bool negative = (static_cast<uint8_t>(b[n - 1]) & 0x80) != 0;
  const uint8_t ext = negative ? 0xff : 0x00;
  if (n > 8) {
    bool fits = ((static_cast<uint8_t>(b[7]) & 0x80) != 0) == negative;
    for (size_t i = 8; i < n && fits; ++i) fits = static_cast<uint8_t>(b[i]) == ext;
    if (!fits) {
      fail(name_, " at byte ", at_, ": the int (", n, " bytes) does not fit in a signed 64-bit integer");
    }
  }
  uint64_t u = negative ? ~uint64_t{0} : 0;
  const size_t m = std::min<size_t>(n, 8);
  for (size_t i = 0; i < m; ++i) {
    u &= ~(uint64_t{0xff} << (8 * i));
    u |= uint64_t{static_cast<uint8_t>(b[i])} << (8 * i);
  }
  return static_cast<int64_t>(u);
}

void Unpickler::step() {
  switch (code_) {
    case op::PROTO: {
      const auto v = read_le(1);
      if (v < 2 || v > 5) fail("PROTO at byte ", at_, " asks for protocol ", v, "; protocols 2 to 5 are read");
      return;
    }
    case op::FRAME: {
      const uint64_t n = read_le(8);
      if (n > in_.size() - pos_) {
        fail("truncated input: FRAME at byte ", at_, " announces ", n, " bytes but only ", in_.size() - pos_, " remain");
      }
      return;
    }
    case op::MARK: marks_.push_back(stack_.size()); return;
    case op::POP:
      if (!marks_.empty() && marks_.back() == stack_.size()) {
        marks_.pop_back();  // CPython's POP takes an empty MARK
      } else {
        pop();
      }
      return;
    case op::POP_MARK: pop_mark(); return;
    case op::DUP: stack_.push_back(top()); return;
    case op::NONE: push_new(PyKind::kNone); return;
    case op::NEWTRUE:
    case op::NEWFALSE:
      push_new(PyKind::kBool);
      nodes_.back().i = code_ == op::NEWTRUE ? 1 : 0;
      return;
    case op::BININT1:
    case op::BININT2:
    case op::BININT: {
      const size_t n = code_ == op::BININT1 ? 1 : code_ == op::BININT2 ? 2 : 4;
      const uint64_t raw = read_le(n);
      push_new(PyKind::kInt);
      nodes_.back().i = n == 4 ? int64_t{static_cast<int32_t>(static_cast<uint32_t>(raw))} : static_cast<int64_t>(raw);
      return;
    }
    case op::LONG1:
    case op::LONG4: {
      uint64_t n = read_le(code_ == op::LONG1 ? 1 : 4);
      if (code_ == op::LONG4 && (n & 0x80000000u) != 0) fail("LONG4 at byte ", at_, " has a negative byte count");
      const int64_t v = decode_long(read_bytes(n));
      push_new(PyKind::kInt);
      nodes_.back().i = v;
      return;
    }
    case op::BINFLOAT: {
      need(8);
      uint64_t bits = 0;
      for (size_t i = 0; i < 8; ++i) bits = (bits << 8) | in_[pos_ + i];  // big-endian
      pos_ += 8;
      push_new(PyKind::kFloat);
      nodes_.back().d = std::bit_cast<double>(bits);
      return;
    }
    case op::SHORT_BINUNICODE:
    case op::BINUNICODE:
    case op::BINUNICODE8: {
      const size_t len_bytes = code_ == op::SHORT_BINUNICODE ? 1 : code_ == op::BINUNICODE ? 4 : 8;
      std::string s = check_utf8(read_sized(len_bytes, "str"));
      push_new(PyKind::kStr);
      nodes_.back().s = std::move(s);
      return;
    }
    case op::SHORT_BINBYTES:
    case op::BINBYTES:
    case op::BINBYTES8: {
      const size_t len_bytes = code_ == op::SHORT_BINBYTES ? 1 : code_ == op::BINBYTES ? 4 : 8;
      const std::string_view b = read_sized(len_bytes, "bytes");
      push_new(PyKind::kBytes);
      nodes_.back().s.assign(b);
      return;
    }
    case op::EMPTY_LIST: push_new(PyKind::kList); return;
    case op::EMPTY_DICT: push_new(PyKind::kDict); return;
    case op::EMPTY_TUPLE: make_tuple({}); return;
    case op::LIST: {
      std::vector<uint32_t> items = pop_mark();
      const uint32_t id = new_node(PyKind::kList);
      nodes_[id].items = std::move(items);
      stack_.push_back(id);
      return;
    }
    case op::TUPLE: make_tuple(pop_mark()); return;
    case op::TUPLE1:
    case op::TUPLE2:
    case op::TUPLE3: {
      const size_t n = size_t{code_} - op::TUPLE1 + 1;
      std::vector<uint32_t> items(n);
      for (size_t i = n; i > 0; --i) items[i - 1] = pop();
      make_tuple(std::move(items));
      return;
    }
    case op::DICT: {
      const std::vector<uint32_t> items = pop_mark();
      if (items.size() % 2 != 0) fail("DICT at byte ", at_, " has an odd number (", items.size(), ") of keys and values");
      const uint32_t id = new_node(PyKind::kDict);
      stack_.push_back(id);
      for (size_t i = 0; i < items.size(); i += 2) set_item(id, items[i], items[i + 1]);
      return;
    }
    case op::APPEND: {
      const uint32_t value = pop();
      target(PyKind::kList).items.push_back(value);
      return;
    }
    case op::APPENDS: {
      const std::vector<uint32_t> items = pop_mark();
      auto& list = target(PyKind::kList).items;
      list.insert(list.end(), items.begin(), items.end());
      return;
    }
    case op::SETITEM: {
      const uint32_t value = pop();
      const uint32_t key = pop();
      target(PyKind::kDict);
      set_item(top(), key, value);
      return;
    }
    case op::SETITEMS: {
      const std::vector<uint32_t> items = pop_mark();
      if (items.size() % 2 != 0) {
        fail("SETITEMS at byte ", at_, " has an odd number (", items.size(), ") of keys and values");
      }
      target(PyKind::kDict);
      const uint32_t id = top();
      for (size_t i = 0; i < items.size(); i += 2) set_item(id, items[i], items[i + 1]);
      return;
    }
    case op::MEMOIZE: memo_put(memo_.size()); return;
    case op::BINPUT: memo_put(read_le(1)); return;
    case op::LONG_BINPUT: memo_put(read_le(4)); return;
    case op::BINGET: memo_get(read_le(1)); return;
    case op::LONG_BINGET: memo_get(read_le(4)); return;
    case op::GLOBAL: {  // only with allow_class_refs
      std::string module = check_utf8(read_line());
      std::string name = check_utf8(read_line());
      push_class_ref(std::move(module), std::move(name));
      return;
    }
    case op::STACK_GLOBAL: {  // only with allow_class_refs
      const uint32_t name = pop();
      const uint32_t module = pop();
      if (nodes_[module].kind != PyKind::kStr || nodes_[name].kind != PyKind::kStr) {
        fail("STACK_GLOBAL at byte ", at_, " needs two str, got ", type_name(nodes_[module].kind), " and ",
             type_name(nodes_[name].kind));
      }
      push_class_ref(nodes_[module].s, nodes_[name].s);
      return;
    }
    default:
      fail("internal: opcode ", hex_byte(code_), " at byte ", at_, " has no handler");
  }
}

void Unpickler::push_class_ref(std::string module, std::string name) {
  if (module.empty() || name.empty()) fail(name_, " at byte ", at_, ": class reference with an empty module or name");
  push_new(PyKind::kClassRef);
  nodes_.back().s = std::move(module);
  nodes_.back().s2 = std::move(name);
}

}  // namespace detail

PyValue loads(std::span<const uint8_t> bytes, const Limits& limits) { return detail::Unpickler(bytes, limits).run(); }

}  // namespace tdshm::pickle
