#pragma once
// Internal: a small Python-pickle codec for plain data, torch-free.
//
// tensordict's init_remote / from_remote_init / broadcast send their metadata as a Python
// pickle of a dict of str, int, float, bool, None, list, tuple and dict (docs/wire.md, "The
// metadata"). This codec writes and reads exactly those types, and nothing that can name or call
// code:
//
//   - dumps() writes protocol 4 as CPython's C pickler does (PROTO 4, one FRAME per 64 KiB,
//     MEMOIZE after every str, bytes, list, non-empty tuple and dict, batches of 1000 in
//     APPENDS / SETITEMS), so the bytes equal pickle.dumps(value, protocol=4) for a value in
//     which no str or bytes object is shared (Python memoizes by object identity, which a
//     value tree does not have; the result is equal either way).
//   - loads() reads protocols 2 to 5 as CPython writes them for these types. The input is
//     untrusted: GLOBAL, STACK_GLOBAL, REDUCE, BUILD, NEWOBJ(_EX), INST, OBJ, PERSID, BINPERSID,
//     EXT1/2/4, out-of-band buffers, sets, bytearrays and every unknown opcode are refused with
//     tdshm::SchemaError naming the opcode and its byte offset. Every length is compared with
//     the bytes that remain before anything is allocated; the nesting depth, the number of
//     objects, the memo and the size of the result (where a memoized object used twice counts
//     twice) are bounded by Limits. Memory use is O(input size) plus those fixed limits.
//
// The one exception to "no globals": with Limits::allow_class_refs, GLOBAL and STACK_GLOBAL
// are read as a PyClassRef, a pair of strings (module, qualified name) that is never imported
// or resolved. tensordict writes a nested tensorclass's type object into its metadata ("cls"),
// which Python pickles as a global; see distributed/remote_metadata.h.
//
// Every error is a tdshm::SchemaError whose message starts with "tdshm pickle: ".
// Thread safety: every function is pure; values are plain data.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace tdshm::pickle {

struct PyValue;
struct PyDictEntry;

/// Python's None.
struct PyNone {
  friend bool operator==(PyNone, PyNone) { return true; }
};

/// Python bytes (kept apart from str, which is std::string).
struct PyBytes {
  std::string data;
  friend bool operator==(const PyBytes&, const PyBytes&) = default;
};

/// A Python list.
struct PyList {
  std::vector<PyValue> items;
  friend bool operator==(const PyList& a, const PyList& b);
};

/// A Python tuple.
struct PyTuple {
  std::vector<PyValue> items;
  friend bool operator==(const PyTuple& a, const PyTuple& b);
};

/// A Python dict: entries in insertion order. Keys are hashable values (None, bool, int,
/// float, str, bytes, a tuple of hashable values, a class reference); loads() never yields two
/// keys that Python considers equal (1, 1.0 and True are one key, as in Python).
struct PyDict {
  std::vector<PyDictEntry> entries;
  friend bool operator==(const PyDict& a, const PyDict& b);
};

/// A reference to a Python class by name (what pickle writes for a type object), kept as two
/// strings and never resolved. Only read when Limits::allow_class_refs is set.
struct PyClassRef {
  std::string module;
  std::string name;  ///< the qualified name within the module
  friend bool operator==(const PyClassRef&, const PyClassRef&) = default;
};

/// Which alternative a PyValue holds; the order of PyValue::Variant.
enum class PyKind : uint8_t { kNone, kBool, kInt, kFloat, kStr, kBytes, kList, kTuple, kDict, kClassRef };

/// A Python value of the plain-data types above.
///
/// Equality is structural: same kind (an int is never equal to a bool or a float here), dict
/// entries in the same order, doubles by bit pattern (NaN equals itself, -0.0 differs from 0.0).
struct PyValue {
  using Variant = std::variant<PyNone, bool, int64_t, double, std::string, PyBytes, PyList, PyTuple, PyDict, PyClassRef>;
  Variant v;

  PyValue();  ///< None
  explicit PyValue(Variant value);

  static PyValue none();
  static PyValue boolean(bool b);
  static PyValue integer(int64_t i);
  static PyValue floating(double d);
  static PyValue str(std::string s);
  static PyValue bytes(std::string data);
  static PyValue list(std::vector<PyValue> items);
  static PyValue tuple(std::vector<PyValue> items);
  static PyValue dict();
  static PyValue class_ref(std::string module, std::string name);

  PyKind kind() const noexcept { return static_cast<PyKind>(v.index()); }
  bool is_none() const noexcept { return kind() == PyKind::kNone; }

  /// Typed access: throws SchemaError "expected <what>, got <type name>" on another kind, where
  /// `what` names the value for the message (e.g. "batch_size of 'a.b'").
  bool as_bool(std::string_view what) const;
  int64_t as_int(std::string_view what) const;
  double as_float(std::string_view what) const;
  const std::string& as_str(std::string_view what) const;
  const PyList& as_list(std::string_view what) const;
  const PyTuple& as_tuple(std::string_view what) const;
  const PyDict& as_dict(std::string_view what) const;
  PyDict& as_dict(std::string_view what);

  /// The entry with the str key `key` of a dict value, or nullptr; throws SchemaError if this
  /// is not a dict. Linear in the number of entries.
  const PyValue* find(std::string_view key) const;
  /// Appends (key, value) to a dict value, or replaces the value of an existing str key `key`
  /// (keeping its place, as Python does). Throws SchemaError if this is not a dict.
  void set(std::string key, PyValue value);

  friend bool operator==(const PyValue& a, const PyValue& b);
};

struct PyDictEntry {
  PyValue key;
  PyValue value;
  friend bool operator==(const PyDictEntry& a, const PyDictEntry& b) { return a.key == b.key && a.value == b.value; }
};

// Defined here, where PyDictEntry (held by the variant through PyDict) is complete.
inline PyValue::PyValue() = default;
inline PyValue::PyValue(Variant value) : v(std::move(value)) {}
inline PyValue PyValue::none() { return PyValue(); }
inline PyValue PyValue::boolean(bool b) { return PyValue(Variant(std::in_place_type<bool>, b)); }
inline PyValue PyValue::integer(int64_t i) { return PyValue(Variant(std::in_place_type<int64_t>, i)); }
inline PyValue PyValue::floating(double d) { return PyValue(Variant(std::in_place_type<double>, d)); }
inline PyValue PyValue::str(std::string s) { return PyValue(Variant(std::in_place_type<std::string>, std::move(s))); }
inline PyValue PyValue::bytes(std::string data) { return PyValue(Variant(PyBytes{std::move(data)})); }
inline PyValue PyValue::class_ref(std::string module, std::string name) {
  return PyValue(Variant(PyClassRef{std::move(module), std::move(name)}));
}
inline PyValue PyValue::list(std::vector<PyValue> items) { return PyValue(Variant(PyList{std::move(items)})); }
inline PyValue PyValue::tuple(std::vector<PyValue> items) { return PyValue(Variant(PyTuple{std::move(items)})); }
inline PyValue PyValue::dict() { return PyValue(Variant(PyDict{})); }

/// Python's name of the value's type, for messages: NoneType, bool, int, float, str, bytes,
/// list, tuple, dict, type (a class reference).
const char* type_name(PyKind kind) noexcept;
inline const char* type_name(const PyValue& value) noexcept { return type_name(value.kind()); }

/// A short Python-like rendering of a value for messages (strings quoted, long output cut).
std::string repr(const PyValue& value, size_t max_chars = 80);

/// What loads() accepts, whatever the input claims. The defaults are far above what
/// tensordict's metadata needs and keep the worst case at some hundreds of MiB.
struct Limits {
  /// Containers nested inside each other (a scalar inside the outermost container is at depth 1).
  size_t max_depth = 200;
  /// Objects created while reading, and values in the result (a memoized object used n times
  /// counts n times, so that sharing cannot blow the result up).
  size_t max_objects = size_t{1} << 20;
  /// Entries in the memo.
  size_t max_memo = size_t{1} << 20;
  /// Bytes of one str or bytes object.
  size_t max_str_bytes = size_t{16} << 20;
  /// Bytes of every str and bytes in the result together (shared ones counted per use).
  size_t max_total_str_bytes = size_t{64} << 20;
  /// Read GLOBAL / STACK_GLOBAL as PyClassRef instead of refusing them.
  bool allow_class_refs = false;
};

/// The deepest value dumps() writes (deeper values are refused: a cycle in a caller's data
/// cannot exist, but a recursion this deep would exhaust the stack).
inline constexpr size_t kDumpsMaxDepth = 1000;

/// Pickles `value` with protocol 4, as CPython's pickle.dumps(value, protocol=4) does.
/// Throws SchemaError if a str is not valid UTF-8 (surrogate code points, which Python writes
/// with "surrogatepass", are accepted), if a dict key is unhashable (a list or dict, also inside
/// a tuple), if a class reference has an empty or multi-line part, or if the value is nested
/// deeper than kDumpsMaxDepth. Thread safety: pure function.
std::vector<uint8_t> dumps(const PyValue& value);

/// Unpickles bytes written by Python's pickle (protocols 2 to 5) holding only the types above.
/// Throws SchemaError, naming what was wrong and the byte offset, on a refused or unknown
/// opcode, a truncated input, a missing STOP or bytes after it, a stack underflow, a MARK
/// mismatch (none open, or one left open at STOP), an APPEND/SETITEM onto something that is not
/// a list/dict, a memo miss, an unhashable or NaN dict key, an int outside int64, a str that is
/// not UTF-8, a protocol above 5, a recursive structure (a container inside itself), and any
/// limit in `limits` exceeded. Thread safety: pure function.
PyValue loads(std::span<const uint8_t> bytes, const Limits& limits = {});

}  // namespace tdshm::pickle
