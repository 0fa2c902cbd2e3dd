// What every transport of the ping-pong benchmark shares (pingpong_transport.h): the lookups in
// the table of transports, the row of a plain message, and the payload pattern.

#include "pingpong_transport.h"

#include <stdexcept>

namespace tdshm::bench::detail {

const TransportInfo& transport_info(const std::string& name) {
  for (const auto& t : kTransports) {
    if (name == t.name) return t;
  }
  throw std::invalid_argument("unknown transport '" + name + "'");
}

std::vector<std::string> transport_names(bool td) {
  std::vector<std::string> v;
  for (const auto& t : kTransports) {
    if (td ? t.td : t.sizes) v.emplace_back(t.name);
  }
  return v;
}

Workload message_workload(size_t bytes) {
  Workload w;
  w.bytes = bytes;
  return w;
}

ExternalRound PingPong::external_round(int, int) {
  throw std::logic_error("external_round() of a transport that the benchmark measures itself");
}

std::vector<size_t> leaf_messages(const Workload& workload) {
  switch (workload.consolidated ? Workload::Tree::message : workload.tree) {
    case Workload::Tree::seed:
      return {2 * sizeof(float), 2 * 3 * sizeof(float), 2 * 1 * 5 * sizeof(float)};  // as pingpong_td.cpp builds it
    case Workload::Tree::lazy_seed: {
      std::vector<size_t> four;
      for (int m = 0; m < 4; ++m) four.insert(four.end(), {2 * sizeof(float), 2 * 3 * sizeof(float), 2 * 1 * 5 * sizeof(float)});
      return four;
    }
    case Workload::Tree::uniform:
    case Workload::Tree::memmap:
      return std::vector<size_t>(static_cast<size_t>(workload.leaves), workload.leaf_bytes);
    case Workload::Tree::message:
      break;
  }
  return {workload.bytes};
}

// ---- the payload pattern ----

namespace {
uint8_t pattern_byte(size_t i, size_t seed) noexcept { return static_cast<uint8_t>((i * 131 + seed * 7 + 1) & 0xff); }
}  // namespace

void fill_pattern(uint8_t* p, size_t n, size_t seed) noexcept {
  for (size_t i = 0; i < n; ++i) p[i] = pattern_byte(i, seed);
}

bool has_pattern(const uint8_t* p, size_t n, size_t seed) noexcept {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != pattern_byte(i, seed)) return false;
  }
  return true;
}

}  // namespace tdshm::bench::detail
