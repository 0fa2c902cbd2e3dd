// libFuzzer target: tdshm::decode_schema on arbitrary bytes.
//
// The contract checked: decode_schema either returns a Schema or throws tdshm::SchemaError.
// Any other exception, a crash, a sanitizer report, a hang (-timeout) or a huge allocation
// (-malloc_limit_mb, -rss_limit_mb) is a bug. When decoding succeeds:
//   - encode_schema accepts the schema (both apply the same rules) and gives back the very
//     input bytes (the decoder accepts only canonical encodings);
//   - decoding those bytes again gives an equal schema (unless a double value is NaN, which
//     compares unequal to itself) with the same fingerprint;
//   - a storage of total_bytes is accepted, and one byte less is refused with SchemaError.
//
// Every input is decoded twice: as it is (which exercises the frame checks: length, magic,
// version, flags, body length, checksum) and with its body length and CRC-32C rewritten to
// match (so that mutations of the body reach the body parser and the validator instead of
// stopping at the checksum). Inputs are plain encodings, so the seed corpus holds real
// encode_schema output.

#include "schema/schema_internal.h"

#include "tdshm/errors.h"
#include "tdshm/schema.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <typeinfo>
#include <variant>
#include <vector>

namespace {

using tdshm::Schema;
using tdshm::SchemaError;
using tdshm::SchemaNode;

[[noreturn]] void bug(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "fuzz_schema_decode: contract broken: %s%s%s\n", what, detail.empty() ? "" : ": ",
               detail.c_str());
  std::abort();
}

bool has_nan(const SchemaNode& n) {
  for (const auto& entry : n.entries) {
    if (const auto* v = std::get_if<tdshm::NonTensorData>(&entry.value)) {
      if (const auto* d = std::get_if<double>(v); d != nullptr && std::isnan(*d)) return true;
    } else if (const auto* child = std::get_if<std::shared_ptr<SchemaNode>>(&entry.value)) {
      if (*child && has_nan(**child)) return true;
    }
  }
  return false;
}

// Decodes, returning false on SchemaError (the documented refusal).
bool try_decode(std::span<const uint8_t> bytes, std::optional<uint64_t> storage, Schema& out) {
  try {
    out = tdshm::decode_schema(bytes, storage);
    return true;
  } catch (const SchemaError&) {
    return false;
  }
}

void check(std::span<const uint8_t> input) {
  Schema schema;
  if (!try_decode(input, std::nullopt, schema)) return;

  std::vector<uint8_t> again;
  try {
    again = tdshm::encode_schema(schema);
  } catch (const SchemaError& e) {
    bug("encode_schema refuses a schema that decode_schema accepted", e.what());
  }
  if (!std::equal(again.begin(), again.end(), input.begin(), input.end())) {
    bug("re-encoding an accepted input gives other bytes (a non-canonical encoding was accepted)",
        std::to_string(input.size()) + " bytes in, " + std::to_string(again.size()) + " bytes out");
  }
  Schema back;
  if (!try_decode(again, std::nullopt, back)) bug("decode_schema refuses what encode_schema wrote");
  if (!(back == schema) && !has_nan(schema.root)) bug("decode(encode(schema)) differs from schema");
  if (tdshm::schema_fingerprint(back) != tdshm::schema_fingerprint(schema)) bug("the fingerprint changed");

  Schema with_storage;
  if (!try_decode(input, schema.total_bytes, with_storage)) bug("refused with a storage of exactly total_bytes");
  if (schema.total_bytes > 0 && try_decode(input, schema.total_bytes - 1, with_storage)) {
    bug("accepted with a storage smaller than total_bytes");
  }
}

// The input with its body length and checksum rewritten to match its bytes.
std::vector<uint8_t> reframed(std::span<const uint8_t> input) {
  constexpr size_t kFrame = tdshm::detail::kSchemaHeaderBytes + tdshm::detail::kSchemaTrailerBytes;
  std::vector<uint8_t> out(input.begin(), input.end());
  if (out.size() < kFrame) return out;
  const auto body = static_cast<uint32_t>(out.size() - kFrame);
  for (size_t i = 0; i < 4; ++i) {
    out[tdshm::detail::kSchemaBodyLengthOffset + i] = static_cast<uint8_t>(body >> (8 * i));
  }
  const size_t crc_at = out.size() - tdshm::detail::kSchemaTrailerBytes;
  const uint32_t crc = tdshm::detail::crc32c(std::span<const uint8_t>(out).first(crc_at));
  for (size_t i = 0; i < 4; ++i) out[crc_at + i] = static_cast<uint8_t>(crc >> (8 * i));
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> input(data, size);
  try {
    check(input);
    const std::vector<uint8_t> fixed = reframed(input);
    if (!std::equal(fixed.begin(), fixed.end(), input.begin(), input.end())) check(fixed);
  } catch (const std::exception& e) {
    bug("an exception other than tdshm::SchemaError escaped", std::string(typeid(e).name()) + ": " + e.what());
  } catch (...) {
    bug("a non-std::exception escaped");
  }
  return 0;
}
