// Unit tests of the plain-data pickle codec (src/pickle) and of the conversion between tdshm's
// Schema and tensordict's init_remote metadata dict (src/distributed/remote_metadata).
//
// Interop is checked against the real thing: /usr/bin/python3 writes pickles with protocols 2
// to 5 that tdshm must read, checks that pickle.loads of tdshm's bytes gives the same dict, and
// gives the bytes pickle.dumps writes for simple values, which tdshm's dumps must equal. Those
// tests skip only when /usr/bin/python3 is missing. Everything else is byte buffers.

#include "distributed/remote_metadata.h"
#include "pickle/pickle.h"

#include "hex.h"
#include "tdshm/errors.h"
#include "tdshm/schema.h"

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

using tdshm::SchemaError;
using tdshm::pickle::dumps;
using tdshm::pickle::Limits;
using tdshm::pickle::loads;
using tdshm::pickle::PyDict;
using tdshm::pickle::PyDictEntry;
using tdshm::pickle::PyKind;
using tdshm::pickle::PyValue;
using Bytes = std::vector<uint8_t>;
using tdshm::test::from_hex;
using tdshm::test::to_hex;

constexpr const char* kPython = "/usr/bin/python3";

// --- value builders ---
PyValue N() { return PyValue::none(); }
PyValue B(bool b) { return PyValue::boolean(b); }
PyValue I(int64_t i) { return PyValue::integer(i); }
PyValue F(double d) { return PyValue::floating(d); }
PyValue S(std::string s) { return PyValue::str(std::move(s)); }
PyValue L(std::vector<PyValue> items) { return PyValue::list(std::move(items)); }
PyValue T(std::vector<PyValue> items) { return PyValue::tuple(std::move(items)); }
PyValue D(std::initializer_list<std::pair<PyValue, PyValue>> entries) {
  PyValue d = PyValue::dict();
  for (const auto& [k, v] : entries) d.as_dict("d").entries.push_back(PyDictEntry{k, v});
  return d;
}

Bytes bytes_of(std::string_view s) { return Bytes(s.begin(), s.end()); }

// Runs `script` with /usr/bin/python3, giving it `input` as the file named by sys.argv[1];
// returns its stdout, or nullopt when python3 is missing. Fails the test on a nonzero exit.
std::optional<std::string> run_python(const std::string& script, const Bytes& input = {}) {
  if (access(kPython, X_OK) != 0) return std::nullopt;
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("tdshm_pickle_test_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const fs::path script_path = dir / "script.py";
  const fs::path input_path = dir / "input.bin";
  std::ofstream(script_path) << script;
  std::ofstream(input_path, std::ios::binary).write(reinterpret_cast<const char*>(input.data()),
                                                    static_cast<std::streamsize>(input.size()));
  const std::string cmd = std::string(kPython) + " " + script_path.string() + " " + input_path.string();
  std::string out;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "popen failed";
    return std::string();
  }
  char buf[4096];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = pclose(pipe);
  fs::remove_all(dir);
  EXPECT_EQ(status, 0) << "python failed; output:\n" << out;
  return out;
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find('\n', start);
    if (end == std::string::npos) end = s.size();
    out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// The representative metadata-like dict, in Python and as tdshm's value: nested dicts, tuples,
// floats, big/small/negative ints, unicode keys and values, None, bools. Python shares equal
// string constants, so its pickles also exercise MEMOIZE/BINPUT and BINGET.
constexpr const char* kPythonMeta = R"PY(
def meta():
    return {
        "cls": "TensorDict",
        "non_tensors": {"name": ("h\u00e9llo \u2603 \U0001d11e", [2], "cpu"), "count": (-7, [2], None),
                        "ratio": (2.5, [], None), "flag": (True, [2], "cpu")},
        "leaves": {"obs": ("torch.float32", [2, 3], 0, 24, 0), "done": ("torch.bool", [2], 24, 32, 6)},
        "cls_metadata": {"device": "cpu", "names": [None], "batch_size": [2], "is_locked": False},
        "nested": {"cls": "TensorDict", "non_tensors": {}, "leaves": {"\u00f1\u952e": ("torch.int64", [2, 1], 32, 48, 0)},
                   "cls_metadata": {"device": None, "names": None, "batch_size": [2, 1], "is_locked": True}},
        "_total_bytes": 48,
        "extras": {"big": 2**63 - 1, "small": -2**63, "i32": -2**31, "u16": 65535, "u8": 255, "zero": 0,
                   "neg": -1, "l": 2**40, "floats": [0.1, -0.0, 1e308, float("inf"), -1.5e-300],
                   "t": (1, (2, (3,)), ()), "t4": (1, 2, 3, 4), "none": None, "no": False,
                   "keys": {(1, "a"): False, 3: "three", 2.5: None, None: 1}},
    }
)PY";

PyValue cpp_meta() {
  return D({
      {S("cls"), S("TensorDict")},
      {S("non_tensors"), D({{S("name"), T({S("h\xc3\xa9llo \xe2\x98\x83 \xf0\x9d\x84\x9e"), L({I(2)}), S("cpu")})},
                            {S("count"), T({I(-7), L({I(2)}), N()})},
                            {S("ratio"), T({F(2.5), L({}), N()})},
                            {S("flag"), T({B(true), L({I(2)}), S("cpu")})}})},
      {S("leaves"), D({{S("obs"), T({S("torch.float32"), L({I(2), I(3)}), I(0), I(24), I(0)})},
                       {S("done"), T({S("torch.bool"), L({I(2)}), I(24), I(32), I(6)})}})},
      {S("cls_metadata"), D({{S("device"), S("cpu")}, {S("names"), L({N()})}, {S("batch_size"), L({I(2)})},
                             {S("is_locked"), B(false)}})},
      {S("nested"),
       D({{S("cls"), S("TensorDict")},
          {S("non_tensors"), D({})},
          {S("leaves"), D({{S("\xc3\xb1\xe9\x94\xae"), T({S("torch.int64"), L({I(2), I(1)}), I(32), I(48), I(0)})}})},
          {S("cls_metadata"), D({{S("device"), N()}, {S("names"), N()}, {S("batch_size"), L({I(2), I(1)})},
                                 {S("is_locked"), B(true)}})}})},
      {S("_total_bytes"), I(48)},
      {S("extras"),
       D({{S("big"), I(std::numeric_limits<int64_t>::max())},
          {S("small"), I(std::numeric_limits<int64_t>::min())},
          {S("i32"), I(-2147483648LL)},
          {S("u16"), I(65535)},
          {S("u8"), I(255)},
          {S("zero"), I(0)},
          {S("neg"), I(-1)},
          {S("l"), I(int64_t{1} << 40)},
          {S("floats"), L({F(0.1), F(-0.0), F(1e308), F(std::numeric_limits<double>::infinity()), F(-1.5e-300)})},
          {S("t"), T({I(1), T({I(2), T({I(3)})}), T({})})},
          {S("t4"), T({I(1), I(2), I(3), I(4)})},
          {S("none"), N()},
          {S("no"), B(false)},
          {S("keys"), D({{T({I(1), S("a")}), B(false)}, {I(3), S("three")}, {F(2.5), N()}, {N(), I(1)}})}})},
  });
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const SchemaError& e) {
    return e.what();
  }
  return "<no SchemaError>";
}

#define EXPECT_SCHEMA_ERROR(expr, substring)                                             \
  do {                                                                                    \
    const std::string tdshm_msg = error_of([&] { (void)(expr); });                        \
    EXPECT_NE(tdshm_msg.find(substring), std::string::npos) << "message: " << tdshm_msg;  \
  } while (0)

// ================================================================================================
// Pickle: round trips and interop
// ================================================================================================

TEST(PickleRoundTrip, ValuesSurviveDumpsLoads) {
  const PyValue values[] = {
      N(), B(true), B(false), I(0), I(255), I(256), I(65535), I(65536), I(-1), I(2147483647), I(2147483648LL),
      I(-2147483649LL), I(std::numeric_limits<int64_t>::max()), I(std::numeric_limits<int64_t>::min()),
      F(0.0), F(-0.0), F(1.5), F(std::nan("")), F(-std::numeric_limits<double>::infinity()), S(""), S("abc"),
      S(std::string(300, 'x')), PyValue::bytes(""), PyValue::bytes(std::string("a\0b", 3)), L({}), L({I(1)}), T({}),
      T({I(1)}), T({I(1), I(2), I(3), I(4)}), D({}), cpp_meta(), PyValue::class_ref("my.module", "MyData")};
  Limits with_refs;
  with_refs.allow_class_refs = true;
  for (const auto& v : values) {
    const Bytes b = dumps(v);
    EXPECT_EQ(loads(b, with_refs), v) << tdshm::pickle::repr(v);
  }
  // Long containers cross the batch size (1000) of APPENDS / SETITEMS and the 64 KiB frame.
  std::vector<PyValue> many;
  PyValue big_dict = PyValue::dict();
  for (int64_t i = 0; i < 30000; ++i) {
    many.push_back(S("item" + std::to_string(i)));
    if (i < 2000) big_dict.as_dict("d").entries.push_back(PyDictEntry{I(i), F(static_cast<double>(i))});
  }
  const PyValue long_list = L(std::move(many));
  EXPECT_EQ(loads(dumps(long_list)), long_list);
  EXPECT_EQ(loads(dumps(big_dict)), big_dict);
  const PyValue large_str = L({S(std::string(70000, 'z')), PyValue::bytes(std::string(66000, 'y')), I(1)});
  EXPECT_EQ(loads(dumps(large_str)), large_str);
}

TEST(PickleRoundTrip, HelpersFindSetAndTypeNames) {
  PyValue d = PyValue::dict();
  d.set("a", I(1));
  d.set("b", S("x"));
  d.set("a", I(2));  // replaces in place
  ASSERT_EQ(d.as_dict("d").entries.size(), 2u);
  EXPECT_EQ(d.as_dict("d").entries[0].key, S("a"));
  ASSERT_NE(d.find("a"), nullptr);
  EXPECT_EQ(d.find("a")->as_int("a"), 2);
  EXPECT_EQ(d.find("zz"), nullptr);
  EXPECT_STREQ(tdshm::pickle::type_name(N()), "NoneType");
  EXPECT_STREQ(tdshm::pickle::type_name(D({})), "dict");
  EXPECT_SCHEMA_ERROR(S("x").as_int("the thing"), "expected the thing to be a int, got a str");
  EXPECT_SCHEMA_ERROR(I(1).find("a"), "dict");
  EXPECT_NE(I(1), B(true));  // structural: an int is not a bool
  EXPECT_NE(F(0.0), F(-0.0));
  EXPECT_EQ(tdshm::pickle::repr(D({{S("k"), T({I(1)})}})), "{'k': (1,)}");
}

TEST(PickleInterop, ReadsWhatPythonWritesInProtocols2To5) {
  const std::string script = std::string("import pickle\n") + kPythonMeta +
                             "for p in (2, 3, 4, 5):\n    print(pickle.dumps(meta(), protocol=p).hex())\n";
  const auto out = run_python(script);
  if (!out) GTEST_SKIP() << kPython << " not found";
  const auto hex = lines(*out);
  ASSERT_EQ(hex.size(), 4u);
  const PyValue expected = cpp_meta();
  for (size_t p = 0; p < 4; ++p) {
    const Bytes b = from_hex(hex[p]);
    EXPECT_EQ(loads(b), expected) << "protocol " << p + 2 << ": " << tdshm::pickle::repr(loads(b), 400);
  }
}

TEST(PickleInterop, PythonReadsWhatTdshmWrites) {
  const Bytes ours = dumps(cpp_meta());
  const std::string script = std::string("import pickle, sys\n") + kPythonMeta +
                             "v = pickle.loads(open(sys.argv[1], 'rb').read())\n"
                             "print('EQUAL' if v == meta() and repr(v) == repr(meta()) else 'DIFF ' + repr(v))\n";
  const auto out = run_python(script, ours);
  if (!out) GTEST_SKIP() << kPython << " not found";
  EXPECT_EQ(*out, "EQUAL\n");
}

TEST(PickleInterop, BytesEqualPythonsForSimpleValues) {
  // Python expressions and the same values in C++; none shares a str or bytes object (Python
  // memoizes by identity), so CPython's bytes are the only right answer.
  std::vector<PyValue> long_list;
  for (int64_t i = 0; i < 1001; ++i) long_list.push_back(I(i));
  std::vector<PyValue> huge_list;
  for (int64_t i = 0; i < 30000; ++i) huge_list.push_back(I(i * 1000003));
  PyValue dict1000 = PyValue::dict();
  for (int64_t i = 0; i < 1000; ++i) dict1000.as_dict("d").entries.push_back(PyDictEntry{I(i), I(-i)});
  const std::vector<std::pair<std::string, PyValue>> cases = {
      {"None", N()},
      {"True", B(true)},
      {"False", B(false)},
      {"0", I(0)},
      {"255", I(255)},
      {"256", I(256)},
      {"65535", I(65535)},
      {"65536", I(65536)},
      {"-1", I(-1)},
      {"-2**31", I(-2147483648LL)},
      {"2**31", I(2147483648LL)},
      {"-2**31-1", I(-2147483649LL)},
      {"2**39", I(int64_t{1} << 39)},
      {"-2**39", I(-(int64_t{1} << 39))},
      {"2**63-1", I(std::numeric_limits<int64_t>::max())},
      {"-2**63", I(std::numeric_limits<int64_t>::min())},
      {"1.5", F(1.5)},
      {"-0.0", F(-0.0)},
      {"float('inf')", F(std::numeric_limits<double>::infinity())},
      {"''", S("")},
      {"'abc'", S("abc")},
      {"'h\\u00e9llo \\U0001d11e'", S("h\xc3\xa9llo \xf0\x9d\x84\x9e")},
      {"'\\ud800'", S("\xed\xa0\x80")},  // a lone surrogate, written with surrogatepass
      {"'x' * 300", S(std::string(300, 'x'))},
      {"'z' * 70000", S(std::string(70000, 'z'))},
      {"b'ab'", PyValue::bytes("ab")},
      {"b'y' * 300", PyValue::bytes(std::string(300, 'y'))},
      {"[]", L({})},
      {"[1]", L({I(1)})},
      {"[1, 2]", L({I(1), I(2)})},
      {"list(range(1001))", L(long_list)},
      {"[i * 1000003 for i in range(30000)]", L(huge_list)},
      {"()", T({})},
      {"(1,)", T({I(1)})},
      {"(1, 2, 3)", T({I(1), I(2), I(3)})},
      {"(1, 2, 3, 4)", T({I(1), I(2), I(3), I(4)})},
      {"{}", D({})},
      {"{'a': 1}", D({{S("a"), I(1)}})},
      {"{'a': [1, (2.5, None)], 'b': {'c': True}}", D({{S("a"), L({I(1), T({F(2.5), N()})})}, {S("b"), D({{S("c"), B(true)}})}})},
      {"{i: -i for i in range(1000)}", dict1000},
      {"{(1, 'k'): [None]}", D({{T({I(1), S("k")}), L({N()})}})},
  };
  std::string script = "import pickle\n";
  for (const auto& [expr, value] : cases) script += "print(pickle.dumps(" + expr + ", protocol=4).hex())\n";
  const auto out = run_python(script);
  if (!out) GTEST_SKIP() << kPython << " not found";
  const auto hex = lines(*out);
  ASSERT_EQ(hex.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(to_hex(dumps(cases[i].second)), hex[i]) << cases[i].first;
    EXPECT_EQ(loads(from_hex(hex[i])), cases[i].second) << cases[i].first;
  }
}

TEST(PickleInterop, DuplicateKeysFollowPython) {
  // {1: 2, True: 3}: Python keeps the first key and the last value.
  const Bytes b = {0x80, 0x04, '}', '(', 'K', 1, 'K', 2, 0x88, 'K', 3, 'G', 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 'K', 4, 'u', '.'};
  EXPECT_EQ(loads(b), D({{I(1), I(4)}}));
  const auto out = run_python("import pickle, sys\nprint(repr(pickle.loads(open(sys.argv[1], 'rb').read())))\n", b);
  if (!out) GTEST_SKIP() << kPython << " not found";
  EXPECT_EQ(*out, "{1: 4}\n");
}

TEST(PickleInterop, ClassReferencesOnlyOnRequest) {
  // What pickle writes for a nested tensorclass's type in tensordict's metadata.
  const std::string script =
      "import pickle\nclass Point: pass\n"
      "print(pickle.dumps({'cls': Point}, protocol=4).hex())\nprint(pickle.dumps({'cls': Point}, protocol=2).hex())\n";
  const auto out = run_python(script);
  if (!out) GTEST_SKIP() << kPython << " not found";
  const auto hex = lines(*out);
  ASSERT_EQ(hex.size(), 2u);
  Limits refs;
  refs.allow_class_refs = true;
  for (const auto& h : hex) {
    EXPECT_SCHEMA_ERROR(loads(from_hex(h)), "GLOBAL");
    EXPECT_EQ(loads(from_hex(h), refs), D({{S("cls"), PyValue::class_ref("__main__", "Point")}}));
  }
  EXPECT_EQ(to_hex(dumps(D({{S("cls"), PyValue::class_ref("__main__", "Point")}}))), hex[0]);
}

// ================================================================================================
// Pickle: refusals
// ================================================================================================

TEST(PickleRefuses, CodeOpcodesWithNameAndOffset) {
  const std::pair<uint8_t, const char*> refused[] = {
      {'c', "GLOBAL"}, {0x93, "STACK_GLOBAL"}, {'R', "REDUCE"},   {'b', "BUILD"}, {0x81, "NEWOBJ"},
      {0x92, "NEWOBJ_EX"}, {'i', "INST"},    {'o', "OBJ"},        {'P', "PERSID"}, {'Q', "BINPERSID"},
      {0x82, "EXT1"},    {0x83, "EXT2"},     {0x84, "EXT4"},
  };
  for (const auto& [code, name] : refused) {
    const Bytes b = {0x80, 0x04, 'N', code, '.'};
    const std::string msg = error_of([&] { loads(b); });
    EXPECT_NE(msg.find(std::string("opcode ") + name + " ("), std::string::npos) << msg;
    EXPECT_NE(msg.find("at byte 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("refused"), std::string::npos) << msg;
  }
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x02" "cos\nsystem\n(S'echo'\ntR.")), "opcode GLOBAL (0x63) at byte 2 is refused");
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x02N)R.")), "opcode REDUCE (0x52) at byte 4 is refused");
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x02}Nb.")), "opcode BUILD (0x62) at byte 4 is refused");
  // Unknown and unsupported opcodes.
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, 0xff}), "unknown opcode 0xff at byte 2");
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, 0x8f, '.'}), "opcode EMPTY_SET (0x8f) at byte 2 is not supported");
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x05, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, '.'}), "BYTEARRAY8");
  EXPECT_SCHEMA_ERROR(loads(bytes_of("I1\n.")), "opcode INT (0x49) at byte 0 is not supported");
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x06, 'N', '.'}), "protocol 6");
}

TEST(PickleRefuses, OversizedLengthsBeforeAllocating) {
  // BINUNICODE8 / BINBYTES8 claiming 2^62 bytes: refused by the limit, nothing allocated.
  Bytes huge = {0x80, 0x04, 0x8d, 0, 0, 0, 0, 0, 0, 0, 0x40};
  EXPECT_SCHEMA_ERROR(loads(huge), "claims a str of 4611686018427387904 bytes, more than the limit");
  huge[2] = 0x8e;
  EXPECT_SCHEMA_ERROR(loads(huge), "claims a bytes of");
  // Within the limit but past the input.
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, 'X', 0xe8, 0x03, 0, 0, 'a', 'b', '.'}), "truncated input: BINUNICODE at byte 2");
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, 0x95, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 'N', '.'}),
                      "truncated input: FRAME at byte 2 announces 65535 bytes");
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, 0x8b, 0xff, 0xff, 0xff, 0x7f, 0, '.'}), "truncated input: LONG4");
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, 0x8b, 0xff, 0xff, 0xff, 0xff, '.'}), "negative byte count");
  Limits small;
  small.max_str_bytes = 4;
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, 0x8c, 5, 'a', 'b', 'c', 'd', 'e', '.'}, small), "more than the limit of 4");
}

TEST(PickleRefuses, IntsBeyondInt64) {
  // 2**63 and -2**63 - 1 as LONG1.
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, 0x8a, 9, 0, 0, 0, 0, 0, 0, 0, 0x80, 0, '.'}), "does not fit in a signed 64-bit");
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, 0x8a, 9, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0xff, '.'}),
                      "does not fit");
  // Redundant sign bytes are fine (Python accepts them too).
  EXPECT_EQ(loads(Bytes{0x80, 0x04, 0x8a, 10, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, '.'}), I(1));
  EXPECT_EQ(loads(Bytes{0x80, 0x04, 0x8a, 10, 0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, '.'}), I(-2));
  EXPECT_EQ(loads(Bytes{0x80, 0x04, 0x8a, 0, '.'}), I(0));
}

TEST(PickleRefuses, TooDeepAndTooMany) {
  // 300 nested lists.
  std::string deep = "\x80\x04";
  deep += std::string(300, ']');
  deep += std::string(299, 'a');
  deep += '.';
  EXPECT_SCHEMA_ERROR(loads(bytes_of(deep)), "deeper than max_depth = 200");
  // 300 nested tuples: refused as they are built.
  std::string tuples = "\x80\x04)";
  tuples += std::string(300, '\x85');
  tuples += '.';
  EXPECT_SCHEMA_ERROR(loads(bytes_of(tuples)), "tuples nested deeper than max_depth");
  // Exactly the limit is fine.
  Limits four;
  four.max_depth = 4;
  EXPECT_EQ(loads(bytes_of("\x80\x04]]]]aaa."), four), L({L({L({L({})})})}));
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04]]]]]aaaa."), four), "deeper than max_depth = 4");
  // Too many objects while reading.
  Limits few;
  few.max_objects = 10;
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04(NNNNNNNNNNNNl."), few), "more than max_objects = 10");
  // Memo bound.
  Limits memo;
  memo.max_memo = 2;
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04N\x94\x94\x94."), memo), "more than max_memo = 2");
}

TEST(PickleRefuses, SharedObjectsCannotBlowUp) {
  // L0 = []; Lk = [L(k-1), L(k-1)] through the memo: 2^41 values if expanded.
  std::string s = "\x80\x04]\x94" "0";
  for (int k = 1; k <= 40; ++k) {
    s += "]\x94(h";
    s += static_cast<char>(k - 1);
    s += 'h';
    s += static_cast<char>(k - 1);
    s += "e0";
  }
  s += "h";
  s += static_cast<char>(40);
  s += '.';
  EXPECT_SCHEMA_ERROR(loads(bytes_of(s)), "more than max_objects");
  // A 1 MiB str used 100 times: 100 MiB of result from 1 MiB of input.
  std::string big = "\x80\x04X";
  const uint32_t n = 1 << 20;
  for (int i = 0; i < 4; ++i) big += static_cast<char>((n >> (8 * i)) & 0xff);
  big += std::string(n, 'a');
  big += "\x94" "0(";  // memoize, pop, then a list of 100 references
  for (int i = 0; i < 100; ++i) {
    big += 'h';
    big += '\0';
  }
  big += "l.";
  EXPECT_SCHEMA_ERROR(loads(bytes_of(big)), "max_total_str_bytes");
  // A list holding itself.
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, ']', 0x94, 'h', 0x00, 'a', '.'}), "recursive structure: a list contains itself");
}

TEST(PickleRefuses, TruncatedAtEveryPrefix) {
  // With a FRAME the frame length catches most prefixes; without one (protocols 2 and 3, or
  // the frame header cut out), every opcode and argument is cut somewhere.
  const Bytes framed = dumps(cpp_meta());
  ASSERT_EQ(framed[2], 0x95);
  Bytes unframed(framed.begin(), framed.begin() + 2);
  unframed.insert(unframed.end(), framed.begin() + 11, framed.end());
  EXPECT_EQ(loads(unframed), cpp_meta());
  for (const Bytes* full : {&framed, static_cast<const Bytes*>(&unframed)}) {
    for (size_t n = 0; n < full->size(); ++n) {
      const std::string msg = error_of([&] { loads(std::span<const uint8_t>(full->data(), n)); });
      EXPECT_NE(msg.find("truncated"), std::string::npos) << "prefix " << n << ": " << msg;
    }
  }
}

TEST(PickleRefuses, StructuralErrors) {
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04N.N")), "trailing bytes: 1 bytes after STOP at byte 3");
  EXPECT_SCHEMA_ERROR(loads(bytes_of(std::string("\x80\x04h\x05.", 5))), "memo miss: BINGET at byte 2 asks for memo entry 5");
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, 'j', 1, 0, 0, 0, '.'}), "memo miss: LONG_BINGET");
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04" "a.")), "stack underflow: APPEND at byte 2");
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04" ".")), "stack underflow: STOP");
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04NN.")), "2 values on the stack");
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04](N.")), "MARK mismatch: STOP at byte 5 with 1 MARK(s) still open");
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04]Ne.")), "MARK mismatch: APPENDS at byte 4 needs a MARK");
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04](a.")), "stack underflow: APPEND");  // the MARK fences the list off
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04)Na.")), "APPEND at byte 4 adds to a tuple, not a list");
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04]NNs.")), "SETITEM at byte 5 adds to a list, not a dict");
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04}(Nu.")), "odd number");
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04}]Ns.")), "unhashable type 'list' as a dict key");
  EXPECT_SCHEMA_ERROR(loads(bytes_of("\x80\x04}}\x85Ns.")), "unhashable type 'dict'");
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, '}', 'G', 0x7f, 0xf8, 0, 0, 0, 0, 0, 0, 'N', 's', '.'}), "NaN as a dict key");
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, 0x8c, 2, 0xc3, 0x28, '.'}), "not valid UTF-8");
  EXPECT_SCHEMA_ERROR(loads(Bytes{0x80, 0x04, 0x8c, 2, 0xc0, 0x80, '.'}), "not valid UTF-8");  // overlong
  EXPECT_SCHEMA_ERROR(loads(Bytes{}), "without a STOP");
  // POP, POP_MARK and DUP as CPython reads them.
  EXPECT_EQ(loads(bytes_of("\x80\x04(K\x01" "2t.")), T({I(1), I(1)}));
  EXPECT_EQ(loads(bytes_of("\x80\x04K\x01(K\x02" "1.")), I(1));
  EXPECT_EQ(loads(bytes_of("\x80\x04(0N.")), N());
}

TEST(PickleRefuses, DumpsRefusesWhatPythonCouldNotRead) {
  EXPECT_SCHEMA_ERROR(dumps(S("\xff")), "not valid UTF-8");
  EXPECT_SCHEMA_ERROR(dumps(D({{L({}), I(1)}})), "unhashable type 'list'");
  EXPECT_SCHEMA_ERROR(dumps(D({{T({I(1), D({})}), I(1)}})), "unhashable type 'dict'");
  EXPECT_SCHEMA_ERROR(dumps(PyValue::class_ref("", "X")), "empty module");
  PyValue deep = I(0);
  for (size_t i = 0; i < tdshm::pickle::kDumpsMaxDepth + 2; ++i) deep = L({std::move(deep)});
  EXPECT_SCHEMA_ERROR(dumps(deep), "deeper than");
}

// ================================================================================================
// RemoteMetadata: Schema <-> tensordict's metadata dict
// ================================================================================================

using tdshm::NonTensorData;
using tdshm::Schema;
using tdshm::SchemaEntry;
using tdshm::SchemaNode;
using tdshm::SchemaTensor;
using tdshm::detail::from_metadata;
using tdshm::detail::metadata_pickle_limits;
using tdshm::detail::metadata_storage_device;
using tdshm::detail::metadata_total_bytes;
using tdshm::detail::to_metadata;

SchemaEntry leaf_entry(std::string key, c10::ScalarType dtype, std::vector<int64_t> shape, uint64_t start,
                       uint64_t stop, uint32_t pad) {
  return SchemaEntry{std::move(key), SchemaTensor{dtype, std::move(shape), start, stop, pad}};
}
SchemaEntry value(std::string key, NonTensorData v) { return SchemaEntry{std::move(key), std::move(v)}; }
SchemaEntry child(std::string key, SchemaNode n) {
  return SchemaEntry{std::move(key), std::make_shared<SchemaNode>(std::move(n))};
}

// A tensorclass "demo.Transition" on cpu with batch [2]: non-tensors first, then leaves and
// children in depth-first insertion order, padded as tensordict's consolidate pads (every leaf
// to 8 bytes), a nested tensorclass "demo.Point" between leaves, and an empty child.
Schema sample_schema() {
  SchemaNode point;
  point.class_name = "demo.Point";
  point.batch_size = {2};
  point.entries = {leaf_entry("xy", c10::ScalarType::Float, {2, 3}, 8, 32, 0)};
  SchemaNode empty;
  empty.batch_size = {2};
  SchemaNode inner;
  inner.batch_size = {2, 1};
  inner.device = c10::Device("cpu");
  inner.entries = {value("tag", std::string("inner")),
                   leaf_entry("\xc3\xb1", c10::ScalarType::Long, {2, 1}, 40, 56, 0)};
  Schema s;
  s.root.class_name = "demo.Transition";
  s.root.batch_size = {2};
  s.root.device = c10::Device("cpu");
  s.root.entries = {value("name", std::string("h\xc3\xa9llo")),
                    value("count", int64_t{-7}),
                    value("ratio", 2.5),
                    value("flag", true),
                    leaf_entry("done", c10::ScalarType::Bool, {2}, 0, 2, 6),
                    child("point", point),
                    leaf_entry("reward", c10::ScalarType::Half, {2}, 32, 36, 4),
                    child("inner", inner),
                    child("empty", empty),
                    leaf_entry("obs", c10::ScalarType::BFloat16, {2, 0}, 56, 56, 0)};
  s.total_bytes = 56;
  return s;
}

TEST(RemoteMetadata, RoundTripThroughPickle) {
  const Schema s = sample_schema();
  for (const std::optional<std::string>& device : {std::optional<std::string>{}, std::optional<std::string>{"cpu"}}) {
    const PyValue meta = to_metadata(s, device);
    const PyValue back = loads(dumps(meta), metadata_pickle_limits());
    EXPECT_EQ(back, meta);
    EXPECT_EQ(metadata_total_bytes(back), 56u);
    EXPECT_EQ(metadata_storage_device(back), device);
    EXPECT_EQ(from_metadata(back, metadata_total_bytes(back)), s);
  }
}

TEST(RemoteMetadata, WritesTensordictsDict) {
  const PyValue meta = to_metadata(sample_schema(), std::nullopt);
  // Top-level keys in tensordict's order, children after cls_metadata, then init_remote's.
  std::vector<std::string> keys;
  for (const auto& e : meta.as_dict("meta").entries) keys.push_back(e.key.as_str("key"));
  EXPECT_EQ(keys, (std::vector<std::string>{"cls", "non_tensors", "leaves", "cls_metadata", "point", "inner", "empty",
                                            "_total_bytes", "_tensorclass_type"}));
  EXPECT_EQ(*meta.find("cls"), S("TensorDict"));
  EXPECT_EQ(*meta.find("_tensorclass_type"), S("demo.Transition"));
  // stop includes the pad, as in tensordict.
  EXPECT_EQ(*meta.find("leaves")->find("done"), T({S("torch.bool"), L({I(2)}), I(0), I(8), I(6)}));
  EXPECT_EQ(*meta.find("leaves")->find("reward"), T({S("torch.float16"), L({I(2)}), I(32), I(40), I(4)}));
  EXPECT_EQ(*meta.find("non_tensors")->find("count"), T({I(-7), L({I(2)}), S("cpu")}));
  EXPECT_EQ(*meta.find("cls_metadata"),
            D({{S("device"), S("cpu")}, {S("names"), L({N()})}, {S("batch_size"), L({I(2)})}, {S("is_locked"), B(false)}}));
  EXPECT_EQ(*meta.find("point")->find("cls"), PyValue::class_ref("demo", "Point"));
  EXPECT_EQ(*meta.find("inner")->find("cls"), S("TensorDict"));
  EXPECT_EQ(*meta.find("inner")->find("non_tensors")->find("tag"), T({S("inner"), L({I(2), I(1)}), S("cpu")}));
  // broadcast's order: _total_bytes, _storage_device, _tensorclass_type.
  const PyValue bcast = to_metadata(sample_schema(), "cpu");
  const auto& entries = bcast.as_dict("b").entries;
  ASSERT_GE(entries.size(), 3u);
  EXPECT_EQ(entries[entries.size() - 3].key, S("_total_bytes"));
  EXPECT_EQ(entries[entries.size() - 2].key, S("_storage_device"));
  EXPECT_EQ(entries[entries.size() - 1].key, S("_tensorclass_type"));
}

// {"r": float32 (2,), "ls": a lazy stack along dimension 1 of members of batch [2]: {"x": int64
// (2,)} and {"x": int64 (2, 2)}}, batch [2].
Schema lazy_schema() {
  SchemaNode m0;
  m0.batch_size = {2};
  m0.entries = {leaf_entry("x", c10::ScalarType::Long, {2}, 8, 24, 0)};
  SchemaNode m1;
  m1.batch_size = {2};
  m1.entries = {leaf_entry("x", c10::ScalarType::Long, {2, 2}, 24, 56, 0)};
  SchemaNode ls;
  ls.lazy_stack_dim = 1;
  ls.batch_size = {2, 2};
  ls.entries = {child("0", m0), child("1", m1)};
  Schema s;
  s.root.batch_size = {2};
  s.root.entries = {leaf_entry("r", c10::ScalarType::Float, {2}, 0, 8, 0), child("ls", ls)};
  s.total_bytes = 56;
  return s;
}

// A lazy stack's node is _lazy.py's: cls "LazyStackedTensorDict", cls_metadata {stack_dim,
// stack_dim_name, is_locked}, the members its children "0", "1"; read back the same.
TEST(RemoteMetadata, LazyStackNodes) {
  const PyValue meta = to_metadata(lazy_schema(), std::nullopt);
  const PyValue* ls = meta.find("ls");
  ASSERT_NE(ls, nullptr);
  EXPECT_EQ(*ls->find("cls"), S("LazyStackedTensorDict"));
  EXPECT_EQ(*ls->find("cls_metadata"), D({{S("stack_dim"), I(1)}, {S("stack_dim_name"), N()}, {S("is_locked"), B(false)}}));
  EXPECT_EQ(*ls->find("leaves"), D({}));
  EXPECT_EQ(*ls->find("1")->find("leaves")->find("x"), T({S("torch.int64"), L({I(2), I(2)}), I(24), I(56), I(0)}));
  EXPECT_EQ(from_metadata(loads(dumps(meta), metadata_pickle_limits()), 56), lazy_schema());
  // At the root too (init_remote of a lazy stack).
  Schema root = lazy_schema();
  root.root = *std::get<std::shared_ptr<SchemaNode>>(root.root.entries[1].value);
  for (auto& e : root.root.entries) {
    auto member = std::make_shared<SchemaNode>(*std::get<std::shared_ptr<SchemaNode>>(e.value));
    for (auto& l : member->entries) std::get<SchemaTensor>(l.value).start -= 8, std::get<SchemaTensor>(l.value).stop -= 8;
    e.value = member;
  }
  root.total_bytes = 48;
  EXPECT_EQ(*to_metadata(root, std::nullopt).find("cls"), S("LazyStackedTensorDict"));
  EXPECT_EQ(from_metadata(to_metadata(root, std::nullopt), 48), root);
  // Refusals, naming the stack.
  auto edited = [&](const char* field, PyValue v) {
    PyValue m = to_metadata(lazy_schema(), std::nullopt);
    const_cast<PyValue*>(m.find("ls"))->set(field, std::move(v));
    return m;
  };
  EXPECT_SCHEMA_ERROR(from_metadata(edited("cls_metadata", D({{S("is_locked"), B(false)}})), 56),
                      "\"cls_metadata\" of lazy stack 'ls' lacks \"stack_dim\"");
  EXPECT_SCHEMA_ERROR(from_metadata(edited("cls_metadata", D({{S("stack_dim"), I(3)}})), 56),
                      "lazy stack 'ls' has stack_dim 3 but its members have 1 batch dimensions");
  EXPECT_SCHEMA_ERROR(from_metadata(edited("leaves", D({{S("y"), T({S("torch.uint8"), L({I(0)}), I(56), I(56), I(0)})}})), 56),
                      "lazy stack 'ls' holds the leaf 'y'");
  const PyValue empty_member = D({{S("cls"), S("TensorDict")}, {S("non_tensors"), D({})}, {S("leaves"), D({})},
                                  {S("cls_metadata"), D({{S("batch_size"), L({I(2)})}})}});
  EXPECT_SCHEMA_ERROR(from_metadata(edited("extra", empty_member), 56),
                      "lazy stack 'ls' has the entry 'extra' at position 2: its entries are its members");
}

// What tensordict's consolidate(metadata=True) + init_remote would pickle for a tensordict
// {"z": float32 (3,), "a": {"b": int64 (2,)}} with a non-tensor and a nested tensorclass
// (a __main__ class, pickled as a global): leaves of the root come before its children in the
// dict, though "a" was inserted (and laid out) first.
constexpr const char* kPythonTensordictMeta = R"PY(
import pickle, sys
class Point: pass
meta = {
    "cls": "TensorDict",
    "non_tensors": {"note": ("hi", [], None)},
    "leaves": {"z": ("torch.float32", [3], 16, 32, 4)},
    "cls_metadata": {"device": None, "names": [], "batch_size": [], "is_locked": False},
    "a": {"cls": "TensorDict", "non_tensors": {}, "leaves": {"b": ("torch.int64", [2], 0, 16, 0)},
          "cls_metadata": {"device": None, "names": [None], "batch_size": [2], "is_locked": False}},
    "p": {"cls": Point, "non_tensors": {}, "leaves": {"x": ("torch.uint8", [5], 32, 40, 3)},
          "cls_metadata": {"device": "cpu", "names": [None], "batch_size": [5], "is_locked": False}},
    "_total_bytes": 40,
    "_tensorclass_type": "__main__.Outer",
}
for p in (2, 3, 4, 5):
    print(pickle.dumps(meta, protocol=p).hex())
)PY";

TEST(RemoteMetadata, ReadsTensordictsPickleAndRestoresInsertionOrder) {
  const auto out = run_python(kPythonTensordictMeta);
  if (!out) GTEST_SKIP() << kPython << " not found";
  const auto hex = lines(*out);
  ASSERT_EQ(hex.size(), 4u);
  SchemaNode a;
  a.batch_size = {2};
  a.entries = {leaf_entry("b", c10::ScalarType::Long, {2}, 0, 16, 0)};
  SchemaNode p;
  p.class_name = "__main__.Point";
  p.batch_size = {5};
  p.device = c10::Device("cpu");
  p.entries = {leaf_entry("x", c10::ScalarType::Byte, {5}, 32, 37, 3)};
  Schema expected;
  expected.total_bytes = 40;
  expected.root.class_name = "__main__.Outer";
  expected.root.entries = {value("note", std::string("hi")), child("a", a),
                           leaf_entry("z", c10::ScalarType::Float, {3}, 16, 28, 4), child("p", p)};
  for (const auto& h : hex) {
    const PyValue meta = loads(from_hex(h), metadata_pickle_limits());
    EXPECT_EQ(from_metadata(meta, metadata_total_bytes(meta)), expected);
  }
  // Without class references the nested tensorclass's global is refused.
  EXPECT_SCHEMA_ERROR(loads(from_hex(hex[2])), "GLOBAL");
}

TEST(RemoteMetadata, PythonReadsOurDict) {
  Schema s = sample_schema();
  // Python cannot import "demo": check the nested class reference through find_class.
  const Bytes b = dumps(to_metadata(s, std::string("cpu")));
  const std::string script = R"PY(
import pickle, sys
class U(pickle.Unpickler):
    def find_class(self, module, name):
        return ("CLASS", module, name)
m = U(open(sys.argv[1], "rb")).load()
assert m["cls"] == "TensorDict", m["cls"]
assert m["_total_bytes"] == 56 and m["_storage_device"] == "cpu" and m["_tensorclass_type"] == "demo.Transition"
assert m["point"]["cls"] == ("CLASS", "demo", "Point"), m["point"]["cls"]
assert m["leaves"]["done"] == ("torch.bool", [2], 0, 8, 6), m["leaves"]["done"]
assert m["leaves"]["obs"] == ("torch.bfloat16", [2, 0], 56, 56, 0)
assert m["non_tensors"]["ratio"] == (2.5, [2], "cpu")
assert m["inner"]["leaves"]["\u00f1"] == ("torch.int64", [2, 1], 40, 56, 0)
assert m["inner"]["cls_metadata"] == {"device": "cpu", "names": [None, None], "batch_size": [2, 1], "is_locked": False}
assert list(m) == ["cls", "non_tensors", "leaves", "cls_metadata", "point", "inner", "empty", "_total_bytes", "_storage_device", "_tensorclass_type"], list(m)
print("OK")
)PY";
  const auto out = run_python(script, b);
  if (!out) GTEST_SKIP() << kPython << " not found";
  EXPECT_EQ(*out, "OK\n");
}

TEST(RemoteMetadata, DtypeNames) {
  using tdshm::detail::dtype_from_torch_string;
  using tdshm::detail::dtype_to_torch_string;
  const c10::ScalarType all[] = {c10::ScalarType::Byte,        c10::ScalarType::Char,         c10::ScalarType::Short,
                                 c10::ScalarType::Int,         c10::ScalarType::Long,         c10::ScalarType::Half,
                                 c10::ScalarType::Float,       c10::ScalarType::Double,       c10::ScalarType::ComplexHalf,
                                 c10::ScalarType::ComplexFloat, c10::ScalarType::ComplexDouble, c10::ScalarType::Bool,
                                 c10::ScalarType::BFloat16};
  for (auto t : all) EXPECT_EQ(dtype_from_torch_string(dtype_to_torch_string(t)), t);
  EXPECT_EQ(dtype_to_torch_string(c10::ScalarType::ComplexHalf), "torch.complex32");
  EXPECT_EQ(dtype_from_torch_string("float32"), std::nullopt);
  EXPECT_EQ(dtype_from_torch_string("torch.uint16"), std::nullopt);
  EXPECT_SCHEMA_ERROR(dtype_to_torch_string(c10::ScalarType::QInt8), "not one tdshm stores");
}

// A minimal valid root dict with one float32 leaf "x" of shape [2] at [0, 8).
PyValue minimal_meta() {
  return D({{S("cls"), S("TensorDict")},
            {S("non_tensors"), D({})},
            {S("leaves"), D({{S("x"), T({S("torch.float32"), L({I(2)}), I(0), I(8), I(0)})}})},
            {S("cls_metadata"), D({{S("device"), N()}, {S("names"), L({})}, {S("batch_size"), L({})}, {S("is_locked"), B(false)}})},
            {S("_total_bytes"), I(8)}});
}

TEST(RemoteMetadata, Refusals) {
  EXPECT_NO_THROW(from_metadata(minimal_meta(), 8));
  auto with = [](const char* path1, const char* path2, PyValue v) {
    PyValue m = minimal_meta();
    if (path2 == nullptr) {
      m.set(path1, std::move(v));
    } else {
      const_cast<PyValue*>(m.find(path1))->set(path2, std::move(v));
    }
    return m;
  };
  auto leaf_x = [&](PyValue v) { return with("leaves", "x", std::move(v)); };
  EXPECT_SCHEMA_ERROR(from_metadata(minimal_meta(), 16), "_total_bytes is 8 but the storage has 16 bytes");
  EXPECT_SCHEMA_ERROR(from_metadata(I(3), 8), "expected the metadata to be a dict");
  EXPECT_SCHEMA_ERROR(from_metadata(leaf_x(T({S("torch.float8_e4m3fn"), L({I(2)}), I(0), I(8), I(0)})), 8),
                      "leaf 'x' has dtype 'torch.float8_e4m3fn', which tdshm does not store");
  EXPECT_SCHEMA_ERROR(from_metadata(leaf_x(T({S("torch.float32"), L({I(-2)}), I(0), I(8), I(0)})), 8),
                      "shape of leaf 'x' [-2] has a negative dimension");
  EXPECT_SCHEMA_ERROR(from_metadata(leaf_x(T({S("torch.float32"), L({I(3)}), I(0), I(8), I(0)})), 8),
                      "leaf 'x' spans stop - start = 8 - 0 bytes but its shape needs numel 3 * itemsize 4 + pad 0 = 12");
  EXPECT_SCHEMA_ERROR(from_metadata(leaf_x(T({S("torch.float32"), L({I(2)}), I(8), I(16), I(0)})), 8),
                      "leaf 'x' ends at byte 16, past the storage of 8 bytes");
  EXPECT_SCHEMA_ERROR(from_metadata(leaf_x(T({S("torch.float32"), L({I(2)}), I(0), I(16), I(8)})), 8), "pad at most 7");
  EXPECT_SCHEMA_ERROR(from_metadata(leaf_x(T({S("torch.float32"), L({I(2)}), I(-8), I(0), I(0)})), 8), "non-negative");
  EXPECT_SCHEMA_ERROR(from_metadata(leaf_x(T({S("torch.float32"), L({I(2)}), I(0), I(8), I(0), I(1)})), 8), "ragged");
  EXPECT_SCHEMA_ERROR(from_metadata(leaf_x(T({S("torch.float32"), L({I(2)}), I(0), I(8)})), 8), "tuple of 4 items");
  EXPECT_SCHEMA_ERROR(from_metadata(leaf_x(L({S("torch.float32"), L({I(2)}), I(0), I(8), I(0)})), 8),
                      "expected leaf 'x' to be a tuple, got a list");
  EXPECT_SCHEMA_ERROR(from_metadata(with("cls", nullptr, S("NonTensorStack")), 8),
                      "node '<root>' has \"cls\" 'NonTensorStack': tdshm reads TensorDict and tensorclasses");
  EXPECT_SCHEMA_ERROR(from_metadata(with("cls", nullptr, S("LazyStackedTensorDict")), 8),
                      "\"cls_metadata\" of lazy stack '<root>' has the unknown field 'device'");
  EXPECT_SCHEMA_ERROR(from_metadata(with("non_tensors", "n", T({N(), L({}), N()})), 8),
                      "non-tensor 'n' holds a NoneType (None); tdshm's non-tensor values are str, int, float and bool");
  EXPECT_SCHEMA_ERROR(from_metadata(with("non_tensors", "n", T({L({}), L({}), N()})), 8), "holds a list");
  EXPECT_SCHEMA_ERROR(from_metadata(with("non_tensors", "n", T({I(1), L({}), S("nowhere:x")})), 8),
                      "device of non-tensor 'n': 'nowhere:x' is not a torch device string");
  EXPECT_SCHEMA_ERROR(from_metadata(with("non_tensors", "x", T({I(1), L({}), N()})), 8), "has the key 'x' twice");
  EXPECT_SCHEMA_ERROR(from_metadata(with("foo", nullptr, I(3)), 8),
                      "node '<root>' has the entry 'foo' of type int (3): not a field of the metadata dict, nor a child");
  EXPECT_SCHEMA_ERROR(from_metadata(with("_tensorclass_type", nullptr, I(3)), 8), "expected _tensorclass_type to be a str");
  EXPECT_SCHEMA_ERROR(from_metadata(with("_storage_device", nullptr, S("bogus")), 8), "_storage_device: 'bogus'");
  EXPECT_SCHEMA_ERROR(from_metadata(with("cls_metadata", "batch_size", L({I(1), S("2")})), 8),
                      "batch_size of node '<root>' holds a str");
  EXPECT_SCHEMA_ERROR(from_metadata(with("cls_metadata", "names", L({N()})), 8), "names of node '<root>' has 1 entries for 0");
  EXPECT_SCHEMA_ERROR(from_metadata(with("cls_metadata", "color", N()), 8), "unknown field 'color'");
  EXPECT_SCHEMA_ERROR(from_metadata(with("leaves", "", T({S("torch.float32"), L({I(0)}), I(8), I(8), I(0)})), 8), "empty key");
  PyValue missing = minimal_meta();
  missing.as_dict("m").entries.erase(missing.as_dict("m").entries.begin() + 2);
  EXPECT_SCHEMA_ERROR(from_metadata(missing, 8), "node '<root>' lacks \"leaves\"");
  // Overlapping leaves: refused by validate_schema, naming both.
  PyValue overlap = minimal_meta();
  const_cast<PyValue*>(overlap.find("leaves"))->set("y", T({S("torch.float32"), L({I(2)}), I(0), I(8), I(0)}));
  EXPECT_SCHEMA_ERROR(from_metadata(overlap, 8), "leaf 'y' starts at byte 0");
  // A child nested past kSchemaMaxDepth.
  PyValue deep = minimal_meta();
  deep.as_dict("d").entries.erase(deep.as_dict("d").entries.begin() + 4);
  for (size_t i = 0; i < tdshm::kSchemaMaxDepth + 1; ++i) {
    PyValue parent = minimal_meta();
    parent.as_dict("p").entries.erase(parent.as_dict("p").entries.begin() + 4);
    const_cast<PyValue*>(parent.find("leaves"))->as_dict("l").entries.clear();
    parent.set("c", std::move(deep));
    deep = std::move(parent);
  }
  EXPECT_SCHEMA_ERROR(from_metadata(deep, 8), "levels deep, more than kSchemaMaxDepth");
  // A key path names the child.
  PyValue nested = minimal_meta();
  PyValue kid = minimal_meta();
  kid.as_dict("k").entries.pop_back();
  const_cast<PyValue*>(kid.find("leaves"))->set("x", T({S("torch.int3"), L({I(2)}), I(0), I(8), I(0)}));
  nested.set("kid", std::move(kid));
  EXPECT_SCHEMA_ERROR(from_metadata(nested, 8), "leaf 'kid.x' has dtype 'torch.int3'");
}

TEST(RemoteMetadata, ToMetadataRefusals) {
  Schema s = sample_schema();
  s.root.entries.push_back(child("leaves", SchemaNode{}));
  EXPECT_SCHEMA_ERROR(to_metadata(s, std::nullopt), "child 'leaves' cannot be sent to tensordict");
  s = sample_schema();
  s.root.entries.push_back(child("_total_bytes", SchemaNode{}));
  EXPECT_SCHEMA_ERROR(to_metadata(s, std::nullopt), "child '_total_bytes' cannot be sent");
  s = sample_schema();
  std::get<std::shared_ptr<SchemaNode>>(s.root.entries[5].value)->class_name = "Point";
  EXPECT_SCHEMA_ERROR(to_metadata(s, std::nullopt), "node 'point' is a tensorclass named 'Point'");
  s = sample_schema();
  EXPECT_SCHEMA_ERROR(to_metadata(s, std::string("bogus")), "storage device: 'bogus'");
  // A plain TensorDict root has no _tensorclass_type.
  s.root.class_name.clear();
  EXPECT_EQ(to_metadata(s, std::nullopt).find("_tensorclass_type"), nullptr);
}

}  // namespace
