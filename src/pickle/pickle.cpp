// The plain-data Python-pickle codec (see pickle.h for the contract).
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
// Dict keys follow Python: a key must be hashable, and equal keys (1, 1.0 and True; equal
// tuples) are one entry, the first key kept and the last value winning. Equality of keys is
// decided by interning: every hashable node gets a class id for its normalized form (numbers
// that compare equal share one form; a tuple's form is the class ids of its items), so two keys
// are equal exactly when their ids are, with no recursive comparison.

#include "pickle/pickle.h"

#include "tdshm/errors.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <unordered_map>

namespace tdshm::pickle {

namespace {

static_assert(std::numeric_limits<double>::is_iec559 && sizeof(double) == 8, "BINFLOAT is IEEE-754 binary64");

template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  os << "tdshm pickle: ";
  (os << ... << args);
  throw SchemaError(os.str());
}

// --- opcodes (CPython Lib/pickle.py) ---------------------------------------------------------
namespace op {
constexpr uint8_t MARK = '(', STOP = '.', POP = '0', POP_MARK = '1', DUP = '2', BININT = 'J', BININT1 = 'K',
                  BININT2 = 'M', NONE = 'N', BINUNICODE = 'X', APPEND = 'a', DICT = 'd', EMPTY_DICT = '}',
                  APPENDS = 'e', BINGET = 'h', LONG_BINGET = 'j', LIST = 'l', EMPTY_LIST = ']', BINPUT = 'q',
                  LONG_BINPUT = 'r', SETITEM = 's', TUPLE = 't', EMPTY_TUPLE = ')', SETITEMS = 'u', BINFLOAT = 'G',
                  GLOBAL = 'c', BINBYTES = 'B', SHORT_BINBYTES = 'C';
constexpr uint8_t PROTO = 0x80, TUPLE1 = 0x85, TUPLE2 = 0x86, TUPLE3 = 0x87, NEWTRUE = 0x88, NEWFALSE = 0x89,
                  LONG1 = 0x8a, LONG4 = 0x8b, SHORT_BINUNICODE = 0x8c, BINUNICODE8 = 0x8d, BINBYTES8 = 0x8e,
                  STACK_GLOBAL = 0x93, MEMOIZE = 0x94, FRAME = 0x95;
}  // namespace op

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

// UTF-8 as Python's "surrogatepass" handler reads and writes it: well-formed UTF-8 where the
// encoded surrogates U+D800..U+DFFF are also allowed. Returns the offset of the first bad byte,
// or npos.
size_t bad_utf8_at(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const uint8_t c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    uint8_t lo = 0x80, hi = 0xbf;  // range of the second byte
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      if (c == 0xe0) lo = 0xa0;  // no overlong forms; 0xed (surrogates) is allowed in full
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;  // nothing above U+10FFFF
    } else {
      return i;
    }
    if (n - i < len) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return i;
    }
    i += len;
  }
  return std::string_view::npos;
}

// ------------------------------------------------------------------------------------------
// Writing
// ------------------------------------------------------------------------------------------

// CPython's framing constants (Modules/_pickle.c, Lib/pickle.py).
constexpr size_t kFrameHeaderBytes = 9;
constexpr size_t kFrameSizeMin = 4;
constexpr size_t kFrameSizeTarget = 64 * 1024;
constexpr size_t kBatchSize = 1000;

class Pickler {
 public:
  std::vector<uint8_t> run(const PyValue& value) {
    out_ = {op::PROTO, 4};
    save(value, 0);
    write1(op::STOP);
    commit_frame();
    return std::move(out_);
  }

 private:
  static constexpr size_t kNoFrame = std::numeric_limits<size_t>::max();

  void ensure_frame() {
    if (frame_start_ == kNoFrame) {
      frame_start_ = out_.size();
      out_.resize(out_.size() + kFrameHeaderBytes);
    }
  }
  // A frame of at least kFrameSizeMin bytes gets its FRAME header; a shorter one is written
  // bare (its reserved header bytes are dropped), as CPython does.
  void commit_frame() {
    if (frame_start_ == kNoFrame) return;
    const size_t len = out_.size() - frame_start_ - kFrameHeaderBytes;
    if (len >= kFrameSizeMin) {
      out_[frame_start_] = op::FRAME;
      for (size_t i = 0; i < 8; ++i) out_[frame_start_ + 1 + i] = static_cast<uint8_t>(uint64_t{len} >> (8 * i));
    } else {
      out_.erase(out_.begin() + static_cast<std::ptrdiff_t>(frame_start_),
                 out_.begin() + static_cast<std::ptrdiff_t>(frame_start_ + kFrameHeaderBytes));
    }
    frame_start_ = kNoFrame;
  }
  void write1(uint8_t b) {
    ensure_frame();
    out_.push_back(b);
  }
  void write(const uint8_t* data, size_t n) {
    ensure_frame();
    out_.insert(out_.end(), data, data + n);
  }
  void write_le(uint64_t v, size_t n) {
    uint8_t buf[8];
    for (size_t i = 0; i < n; ++i) buf[i] = static_cast<uint8_t>(v >> (8 * i));
    write(buf, n);
  }
  // A str or bytes payload: from kFrameSizeTarget bytes on, CPython ends the current frame and
  // writes header and payload outside any frame.
  void write_payload(const uint8_t* header, size_t header_len, std::string_view payload) {
    if (payload.size() >= kFrameSizeTarget) {
      commit_frame();
      out_.insert(out_.end(), header, header + header_len);
      out_.insert(out_.end(), payload.begin(), payload.end());
    } else {
      write(header, header_len);
      write(reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
    }
  }
  void sized_header(std::string_view payload, uint8_t op1, uint8_t op4, uint8_t op8) {
    uint8_t header[9];
    size_t header_len = 0;
    const uint64_t n = payload.size();
    if (n <= 0xff) {
      header[0] = op1;
      header[1] = static_cast<uint8_t>(n);
      header_len = 2;
    } else if (n <= 0xffffffffu) {
      header[0] = op4;
      for (size_t i = 0; i < 4; ++i) header[1 + i] = static_cast<uint8_t>(n >> (8 * i));
      header_len = 5;
    } else {
      header[0] = op8;
      for (size_t i = 0; i < 8; ++i) header[1 + i] = static_cast<uint8_t>(n >> (8 * i));
      header_len = 9;
    }
    write_payload(header, header_len, payload);
    write1(op::MEMOIZE);
  }

  void save_int(int64_t v) {
    if (v >= 0 && v <= 0xff) {
      write1(op::BININT1);
      write_le(static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v <= 0xffff) {
      write1(op::BININT2);
      write_le(static_cast<uint64_t>(v), 2);
    } else if (v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max()) {
      write1(op::BININT);
      write_le(static_cast<uint64_t>(v), 4);
    } else {
      // The shortest two's-complement little-endian form (what CPython's save_long writes).
      size_t n = 8;
      const auto u = static_cast<uint64_t>(v);
      while (n > 1) {
        const auto top = static_cast<uint8_t>(u >> (8 * (n - 1)));
        const bool next_sign = ((u >> (8 * (n - 1) - 1)) & 1) != 0;
        if ((top == 0x00 && !next_sign) || (top == 0xff && next_sign)) {
          --n;
        } else {
          break;
        }
      }
      write1(op::LONG1);
      write_le(n, 1);
      write_le(u, n);
    }
  }

  static void check_hashable(const PyValue& key, size_t depth) {
    if (depth > kDumpsMaxDepth) fail("dumps: a dict key is nested deeper than ", kDumpsMaxDepth, " levels");
    switch (key.kind()) {
      case PyKind::kList:
      case PyKind::kDict:
        fail("dumps: unhashable type '", type_name(key), "' as a dict key");
      case PyKind::kTuple:
        for (const auto& item : std::get<PyTuple>(key.v).items) check_hashable(item, depth + 1);
        return;
      default:
        return;
    }
  }

  void save(const PyValue& value, size_t depth) {
    if (depth > kDumpsMaxDepth) fail("dumps: the value is nested deeper than ", kDumpsMaxDepth, " levels");
    // CPython ends a frame once it holds kFrameSizeTarget bytes, at the start of an object.
    if (frame_start_ != kNoFrame && out_.size() - frame_start_ - kFrameHeaderBytes >= kFrameSizeTarget) commit_frame();
    switch (value.kind()) {
      case PyKind::kNone:
        write1(op::NONE);
        return;
      case PyKind::kBool:
        write1(std::get<bool>(value.v) ? op::NEWTRUE : op::NEWFALSE);
        return;
      case PyKind::kInt:
        save_int(std::get<int64_t>(value.v));
        return;
      case PyKind::kFloat: {
        const auto bits = std::bit_cast<uint64_t>(std::get<double>(value.v));
        uint8_t buf[9] = {op::BINFLOAT};
        for (size_t i = 0; i < 8; ++i) buf[1 + i] = static_cast<uint8_t>(bits >> (8 * (7 - i)));  // big-endian
        write(buf, sizeof buf);
        return;
      }
      case PyKind::kStr: {
        const auto& s = std::get<std::string>(value.v);
        if (const size_t at = bad_utf8_at(s); at != std::string_view::npos) {
          fail("dumps: str of ", s.size(), " bytes is not valid UTF-8 (byte ", at, ")");
        }
        sized_header(s, op::SHORT_BINUNICODE, op::BINUNICODE, op::BINUNICODE8);
        return;
      }
      case PyKind::kBytes:
        sized_header(std::get<PyBytes>(value.v).data, op::SHORT_BINBYTES, op::BINBYTES, op::BINBYTES8);
        return;
      case PyKind::kList: {
        const auto& items = std::get<PyList>(value.v).items;
        write1(op::EMPTY_LIST);
        write1(op::MEMOIZE);
        if (items.size() == 1) {
          save(items[0], depth + 1);
          write1(op::APPEND);
        } else if (items.size() > 1) {
          // Batches of kBatchSize, as batch_list_exact in Modules/_pickle.c.
          size_t total = 0;
          do {
            write1(op::MARK);
            for (size_t n = 0; n < kBatchSize && total < items.size(); ++n) save(items[total++], depth + 1);
            write1(op::APPENDS);
          } while (total < items.size());
        }
        return;
      }
      case PyKind::kTuple: {
        const auto& items = std::get<PyTuple>(value.v).items;
        if (items.empty()) {
          write1(op::EMPTY_TUPLE);
          return;
        }
        if (items.size() <= 3) {
          for (const auto& item : items) save(item, depth + 1);
          write1(static_cast<uint8_t>(op::TUPLE1 + items.size() - 1));
        } else {
          write1(op::MARK);
          for (const auto& item : items) save(item, depth + 1);
          write1(op::TUPLE);
        }
        write1(op::MEMOIZE);
        return;
      }
      case PyKind::kDict: {
        const auto& entries = std::get<PyDict>(value.v).entries;
        for (const auto& e : entries) check_hashable(e.key, depth + 1);
        write1(op::EMPTY_DICT);
        write1(op::MEMOIZE);
        if (entries.size() == 1) {
          save(entries[0].key, depth + 1);
          save(entries[0].value, depth + 1);
          write1(op::SETITEM);
        } else if (entries.size() > 1) {
          // Batches of kBatchSize, as batch_dict_exact in Modules/_pickle.c (which writes one
          // more, empty, batch when the size is a multiple of kBatchSize).
          size_t total = 0;
          size_t n = 0;
          do {
            write1(op::MARK);
            for (n = 0; n < kBatchSize && total < entries.size(); ++n, ++total) {
              save(entries[total].key, depth + 1);
              save(entries[total].value, depth + 1);
            }
            write1(op::SETITEMS);
          } while (n == kBatchSize);
        }
        return;
      }
      case PyKind::kClassRef: {
        const auto& ref = std::get<PyClassRef>(value.v);
        if (ref.module.empty() || ref.name.empty()) fail("dumps: class reference with an empty module or name");
        save(PyValue::str(ref.module), depth + 1);
        save(PyValue::str(ref.name), depth + 1);
        write1(op::STACK_GLOBAL);
        write1(op::MEMOIZE);
        return;
      }
    }
  }

  std::vector<uint8_t> out_;
  size_t frame_start_ = kNoFrame;
};

// ------------------------------------------------------------------------------------------
// Reading
// ------------------------------------------------------------------------------------------

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

  PyValue run() {
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

  // The interned class of a hashable node: equal Python keys get equal classes.
  uint32_t key_class(uint32_t id) {
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
  void set_item(uint32_t dict_id, uint32_t key, uint32_t value) {
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
  int64_t decode_long(std::string_view b) const {
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

  void step() {
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
  void push_class_ref(std::string module, std::string name) {
    if (module.empty() || name.empty()) fail(name_, " at byte ", at_, ": class reference with an empty module or name");
    push_new(PyKind::kClassRef);
    nodes_.back().s = std::move(module);
    nodes_.back().s2 = std::move(name);
  }

  PyValue stop() {
    if (!marks_.empty()) fail("MARK mismatch: STOP at byte ", at_, " with ", marks_.size(), " MARK(s) still open");
    if (stack_.size() != 1) {
      if (stack_.empty()) fail("stack underflow: STOP at byte ", at_, " finds no value to return");
      fail("STOP at byte ", at_, " finds ", stack_.size(), " values on the stack, expected exactly 1");
    }
    if (pos_ != in_.size()) fail("trailing bytes: ", in_.size() - pos_, " bytes after STOP at byte ", at_);
    on_path_.assign(nodes_.size(), 0);
    return build(stack_[0], 0);
  }

  PyValue build(uint32_t id, size_t depth) {
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

void repr_into(std::string& out, const PyValue& v, size_t max_chars, size_t depth) {
  if (out.size() > max_chars) return;
  if (depth > 32) {
    out += "...";
    return;
  }
  switch (v.kind()) {
    case PyKind::kNone: out += "None"; return;
    case PyKind::kBool: out += std::get<bool>(v.v) ? "True" : "False"; return;
    case PyKind::kInt: out += std::to_string(std::get<int64_t>(v.v)); return;
    case PyKind::kFloat: {
      std::ostringstream os;
      os.precision(17);
      os << std::get<double>(v.v);
      out += os.str();
      return;
    }
    case PyKind::kStr: out += "'" + std::get<std::string>(v.v).substr(0, max_chars) + "'"; return;
    case PyKind::kBytes: out += "b'" + std::get<PyBytes>(v.v).data.substr(0, max_chars) + "'"; return;
    case PyKind::kClassRef: {
      const auto& r = std::get<PyClassRef>(v.v);
      out += "<class '" + r.module + "." + r.name + "'>";
      return;
    }
    case PyKind::kList:
    case PyKind::kTuple: {
      const auto& items = v.kind() == PyKind::kList ? std::get<PyList>(v.v).items : std::get<PyTuple>(v.v).items;
      out += v.kind() == PyKind::kList ? "[" : "(";
      for (size_t i = 0; i < items.size() && out.size() <= max_chars; ++i) {
        if (i != 0) out += ", ";
        repr_into(out, items[i], max_chars, depth + 1);
      }
      if (v.kind() == PyKind::kTuple && items.size() == 1) out += ",";
      out += v.kind() == PyKind::kList ? "]" : ")";
      return;
    }
    case PyKind::kDict: {
      const auto& entries = std::get<PyDict>(v.v).entries;
      out += "{";
      for (size_t i = 0; i < entries.size() && out.size() <= max_chars; ++i) {
        if (i != 0) out += ", ";
        repr_into(out, entries[i].key, max_chars, depth + 1);
        out += ": ";
        repr_into(out, entries[i].value, max_chars, depth + 1);
      }
      out += "}";
      return;
    }
  }
}

}  // namespace

bool operator==(const PyList& a, const PyList& b) { return a.items == b.items; }
bool operator==(const PyTuple& a, const PyTuple& b) { return a.items == b.items; }
bool operator==(const PyDict& a, const PyDict& b) { return a.entries == b.entries; }

bool operator==(const PyValue& a, const PyValue& b) {
  if (a.v.index() != b.v.index()) return false;
  if (a.kind() == PyKind::kFloat) {
    return std::bit_cast<uint64_t>(std::get<double>(a.v)) == std::bit_cast<uint64_t>(std::get<double>(b.v));
  }
  return a.v == b.v;
}

const char* type_name(PyKind kind) noexcept {
  switch (kind) {
    case PyKind::kNone: return "NoneType";
    case PyKind::kBool: return "bool";
    case PyKind::kInt: return "int";
    case PyKind::kFloat: return "float";
    case PyKind::kStr: return "str";
    case PyKind::kBytes: return "bytes";
    case PyKind::kList: return "list";
    case PyKind::kTuple: return "tuple";
    case PyKind::kDict: return "dict";
    case PyKind::kClassRef: return "type";
  }
  return "?";
}

std::string repr(const PyValue& value, size_t max_chars) {
  std::string out;
  repr_into(out, value, max_chars, 0);
  if (out.size() > max_chars) out = out.substr(0, max_chars) + "...";
  return out;
}

namespace {
template <class T>
const T& get_as(const PyValue& v, PyKind kind, std::string_view what) {
  if (v.kind() != kind) fail("expected ", what, " to be a ", type_name(kind), ", got a ", type_name(v), ": ", repr(v));
  return std::get<T>(v.v);
}
}  // namespace

bool PyValue::as_bool(std::string_view what) const { return get_as<bool>(*this, PyKind::kBool, what); }
int64_t PyValue::as_int(std::string_view what) const { return get_as<int64_t>(*this, PyKind::kInt, what); }
double PyValue::as_float(std::string_view what) const { return get_as<double>(*this, PyKind::kFloat, what); }
const std::string& PyValue::as_str(std::string_view what) const {
  return get_as<std::string>(*this, PyKind::kStr, what);
}
const PyList& PyValue::as_list(std::string_view what) const { return get_as<PyList>(*this, PyKind::kList, what); }
const PyTuple& PyValue::as_tuple(std::string_view what) const { return get_as<PyTuple>(*this, PyKind::kTuple, what); }
const PyDict& PyValue::as_dict(std::string_view what) const { return get_as<PyDict>(*this, PyKind::kDict, what); }
PyDict& PyValue::as_dict(std::string_view what) {
  return const_cast<PyDict&>(static_cast<const PyValue&>(*this).as_dict(what));
}

const PyValue* PyValue::find(std::string_view key) const {
  for (const auto& e : as_dict("the value searched by key").entries) {
    if (const auto* s = std::get_if<std::string>(&e.key.v); s != nullptr && *s == key) return &e.value;
  }
  return nullptr;
}

void PyValue::set(std::string key, PyValue value) {
  auto& entries = as_dict("the value given a key").entries;
  for (auto& e : entries) {
    if (const auto* s = std::get_if<std::string>(&e.key.v); s != nullptr && *s == key) {
      e.value = std::move(value);
      return;
    }
  }
  entries.push_back(PyDictEntry{PyValue::str(std::move(key)), std::move(value)});
}

std::vector<uint8_t> dumps(const PyValue& value) { return Pickler().run(value); }

PyValue loads(std::span<const uint8_t> bytes, const Limits& limits) { return Unpickler(bytes, limits).run(); }

}  // namespace tdshm::pickle
