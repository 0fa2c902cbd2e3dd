// libFuzzer target: tdshm::pickle::loads on arbitrary bytes, and the metadata conversion
// (distributed/remote_metadata) on whatever it accepts.
//
// The contract checked: loads either returns a value or throws tdshm::SchemaError. Any other
// exception, a crash, a sanitizer report, a hang (-timeout) or a huge allocation
// (-malloc_limit_mb, -rss_limit_mb) is a bug. When loading succeeds:
//   - dumps accepts the value (loads yields only valid UTF-8, hashable keys, bounded depth) and
//     loads of those bytes, under the same limits, gives an equal value;
//   - from_metadata either returns a Schema or throws SchemaError; a Schema it returns goes
//     through to_metadata, dumps, loads and from_metadata again unchanged (unless a non-tensor
//     double is NaN, which compares unequal to itself).
// Every input is read twice: with the default refusal of globals and with class references
// allowed (as metadata is read). The limits are smaller than the defaults so that an input
// whose memo references expand it stays fast; the contract holds for any limits.
//
// The conversion is compiled into this translation unit (it is one source file, and needs c10's
// headers and libc10, which tdshm_fuzz_schema brings with the schema validator); the codec, of
// several source files and torch-free, is the library tdshm_fuzz_pickle. So the target is one
// tdshm_add_fuzzer line.

#include "distributed/remote_metadata.cpp"  // NOLINT(bugprone-suspicious-include)

#include "distributed/remote_metadata.h"
#include "pickle/pickle.h"

#include "tdshm/errors.h"
#include "tdshm/schema.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <typeinfo>
#include <variant>

namespace {

using tdshm::SchemaError;
namespace pk = tdshm::pickle;

[[noreturn]] void bug(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "fuzz_pickle_loads: contract broken: %s%s%s\n", what, detail.empty() ? "" : ": ", detail.c_str());
  std::abort();
}

bool has_nan(const tdshm::SchemaNode& n) {
  for (const auto& entry : n.entries) {
    if (const auto* v = std::get_if<tdshm::NonTensorData>(&entry.value)) {
      if (const auto* d = std::get_if<double>(v); d != nullptr && std::isnan(*d)) return true;
    } else if (const auto* child = std::get_if<std::shared_ptr<tdshm::SchemaNode>>(&entry.value)) {
      if (*child && has_nan(**child)) return true;
    }
  }
  return false;
}

void check_metadata(const pk::PyValue& value) {
  uint64_t storage = 0;
  tdshm::Schema schema;
  try {
    storage = tdshm::detail::metadata_total_bytes(value);
  } catch (const SchemaError&) {
    storage = 64;  // still exercise the reader
  }
  try {
    schema = tdshm::detail::from_metadata(value, storage);
  } catch (const SchemaError&) {
    return;
  }
  pk::PyValue again;
  try {
    again = tdshm::detail::to_metadata(schema, std::nullopt);
  } catch (const SchemaError& e) {
    bug("to_metadata refused a schema from_metadata returned", e.what());
  }
  tdshm::Schema back;
  try {
    back = tdshm::detail::from_metadata(pk::loads(pk::dumps(again), tdshm::detail::metadata_pickle_limits()),
                                        schema.total_bytes);
  } catch (const SchemaError& e) {
    bug("from_metadata refused what to_metadata wrote", e.what());
  }
  if (!has_nan(schema.root) && !(back == schema)) bug("from_metadata(to_metadata(schema)) != schema");
}

void run(std::span<const uint8_t> input, bool class_refs) {
  pk::Limits limits;
  limits.max_objects = size_t{1} << 16;
  limits.max_memo = size_t{1} << 16;
  limits.max_str_bytes = size_t{1} << 20;
  limits.max_total_str_bytes = size_t{1} << 22;
  limits.allow_class_refs = class_refs;
  pk::PyValue value;
  try {
    value = pk::loads(input, limits);
  } catch (const SchemaError&) {
    return;
  }
  std::vector<uint8_t> bytes;
  try {
    bytes = pk::dumps(value);
  } catch (const SchemaError& e) {
    bug("dumps refused a value loads returned", e.what());
  }
  pk::PyValue again;
  try {
    again = pk::loads(bytes, limits);
  } catch (const SchemaError& e) {
    bug("loads refused what dumps wrote", e.what());
  }
  if (!(again == value)) bug("loads(dumps(v)) != v", pk::repr(value, 200) + " vs " + pk::repr(again, 200));
  if (class_refs) check_metadata(value);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const std::span<const uint8_t> input(data, size);
    run(input, false);
    run(input, true);
  } catch (const std::exception& e) {
    bug("an exception other than SchemaError escaped", std::string(typeid(e).name()) + ": " + e.what());
  }
  return 0;
}
