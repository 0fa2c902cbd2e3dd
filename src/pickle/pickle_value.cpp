// The plain-data values of the pickle codec: equality, type names, repr, typed access and dict keys.

#include "pickle/pickle.h"

#include "pickle/pickle_internal.h"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace tdshm::pickle {

namespace {

using detail::fail;

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

}  // namespace tdshm::pickle
