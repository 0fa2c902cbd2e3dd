// Collectives of ProcessGroupShm: every collective against a reference computed in one process
// (every op and dtype, odd sizes, small and default windows, strided inputs, world sizes 1 to 5,
// bit-identical results on every rank), bad arguments, ranks that disagree, a rank that never
// comes or is killed, collectives mixed with point-to-point and with another group, the ones it
// refuses; and the behaviour of its Work handles: completion, wait with a timeout, the group's
// deadline, futures, and the TransportError of a message that does not fit the tensor it lands in.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <c10/util/Exception.h>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "shm_test_support.h"

namespace tdshm::test {
namespace {

class ShmCollectiveThreads : public ShmTest {};
class ShmCollectiveProcs : public ShmTest {};
class ShmWorkThreads : public ShmTest {};

// ---------------------------------------------------------------------------------------------
// Broadcast

/// Scenario (3 ranks): broadcasts from rank 0 and from rank 2, back to back, of a small and a
/// chunked tensor, contiguous and not (non-roots receive into strided or transposed views).
void broadcast_scenario(const std::string& name, int rank, const ShmOptions& opts) {
  ProcessGroupShm pg(name, rank, 3, opts);
  const auto slot = static_cast<int64_t>(opts.slot_bytes);
  int round = 0;
  for (int root : {0, 2, 2, 0, 1}) {
    for (auto [dtype, numel] : {std::pair{at::kFloat, int64_t{2}}, std::pair{at::kByte, 3 * slot + 7},
                                std::pair{at::kDouble, (3 * slot + 7) / 8 + 1}}) {
      ++round;
      const at::Tensor values = pattern(dtype, numel, static_cast<uint64_t>(round * 31 + root));
      const Layout layout = rank % 2 == 0 ? Layout::kContiguous : Layout::kStrided;
      const at::Tensor t = rank == root ? with_layout(values, layout) : blank_like(values, layout);
      std::vector<at::Tensor> v{t};
      c10d::BroadcastOptions bopts;
      bopts.rootRank = root;
      pg.broadcast(v, bopts)->wait();
      SHM_CHECK(same_bytes(t, values), "broadcast " << round << " from rank " << root << " of " << numel << " "
                                                    << c10::toString(dtype) << " differs on rank " << rank);
    }
  }
  // 2-D, transposed at the root and at the receivers.
  const at::Tensor values = pattern(at::kInt, 37 * 29, 4242).reshape({37, 29});
  const at::Tensor t = rank == 2 ? with_layout(values, Layout::kTransposed) : blank_like(values, Layout::kTransposed);
  std::vector<at::Tensor> v{t};
  c10d::BroadcastOptions bopts;
  bopts.rootRank = 2;
  pg.broadcast(v, bopts)->wait();
  SHM_CHECK(same_bytes(t, values), "transposed broadcast differs on rank " << rank);
}

TEST_F(ShmCollectiveThreads, BroadcastFromAnyRoot) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) { broadcast_scenario(name, r, small_options()); }));
}

TEST_F(ShmCollectiveProcs, BroadcastFromAnyRoot) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 3, [&](int r) { broadcast_scenario(name, r, small_options()); }));
}

TEST_F(ShmCollectiveThreads, BroadcastBlockingOnly) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) { broadcast_scenario(name, r, small_options(0us)); }));
}

// ---------------------------------------------------------------------------------------------
// Barrier

constexpr int kBarrierRounds = 6;
constexpr int kBarrierRanks = 3;
constexpr auto kLateBy = 150ms;

struct BarrierTimes {
  std::atomic<int64_t> enter[kBarrierRounds][kBarrierRanks];
  std::atomic<int64_t> leave[kBarrierRounds][kBarrierRanks];
};

/// Scenario: in round k, rank k % 3 comes late; every rank notes when it entered and left.
void barrier_scenario(const std::string& name, int rank, const ShmOptions& opts, BarrierTimes& times) {
  ProcessGroupShm pg(name, rank, kBarrierRanks, opts);
  for (int round = 0; round < kBarrierRounds; ++round) {
    if (round % kBarrierRanks == rank) std::this_thread::sleep_for(kLateBy);
    times.enter[round][rank].store(monotonic_ns());
    pg.barrier()->wait();
    times.leave[round][rank].store(monotonic_ns());
  }
}

void expect_barriers_held(const BarrierTimes& times) {
  for (int round = 0; round < kBarrierRounds; ++round) {
    int64_t last_enter = 0;
    int64_t first_leave = INT64_MAX;
    for (int r = 0; r < kBarrierRanks; ++r) {
      ASSERT_NE(times.enter[round][r].load(), 0) << "round " << round << " rank " << r << " never entered";
      ASSERT_NE(times.leave[round][r].load(), 0) << "round " << round << " rank " << r << " never left";
      last_enter = std::max(last_enter, times.enter[round][r].load());
      first_leave = std::min(first_leave, times.leave[round][r].load());
    }
    EXPECT_GE(first_leave, last_enter) << "round " << round << ": a rank left the barrier "
                                       << (last_enter - first_leave) / 1000 << " us before the late rank "
                                       << round % kBarrierRanks << " entered it";
  }
}

TEST_F(ShmCollectiveThreads, BarrierHoldsEveryoneUntilTheLastArrives) {
  const std::string name = unique_name();
  Shared<BarrierTimes> times;
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kThreads, kBarrierRanks, [&](int r) { barrier_scenario(name, r, small_options(), *times); }));
  expect_barriers_held(*times);
}

TEST_F(ShmCollectiveProcs, BarrierHoldsEveryoneUntilTheLastArrives) {
  const std::string name = unique_name();
  Shared<BarrierTimes> times;
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kProcesses, kBarrierRanks, [&](int r) { barrier_scenario(name, r, small_options(), *times); }));
  expect_barriers_held(*times);
}

TEST_F(ShmCollectiveProcs, BarrierBlockingOnly) {
  const std::string name = unique_name();
  Shared<BarrierTimes> times;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, kBarrierRanks,
                                [&](int r) { barrier_scenario(name, r, small_options(0us), *times); }));
  expect_barriers_held(*times);
}

TEST_F(ShmCollectiveThreads, BarrierAndP2PInterleave) {
  // A barrier between point-to-point messages must not be confused with them (nor they with it).
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    for (int i = 0; i < 20; ++i) {
      const at::Tensor values = pattern(at::kByte, i % 2 == 0 ? 8 : 3 * 4096 + 1, static_cast<uint64_t>(i));
      if (r == 0) {
        auto s = post_send(pg, values, 1, 0);
        pg.barrier()->wait();
        s->wait();
      } else {
        pg.barrier()->wait();
        const at::Tensor got = at::zeros_like(values);
        post_recv(pg, got, 0, 0)->wait();
        SHM_CHECK(same_bytes(got, values), "message " << i << " differs");
      }
    }
  }));
}

TEST_F(ShmCollectiveThreads, SingleRankGroup) {
  const std::string name = unique_name();
  ProcessGroupShm pg(name, 0, 1, small_options());
  EXPECT_EQ(pg.getRank(), 0);
  EXPECT_EQ(pg.getSize(), 1);
  EXPECT_EQ(pg.getBackendName(), "shm");
  EXPECT_EQ(pg.segment_name(), name);
  EXPECT_EQ(pg.options().slot_bytes, 4096u);
  EXPECT_TRUE(pg.barrier()->wait());
  const at::Tensor t = at::arange(10, at::kFloat);
  std::vector<at::Tensor> v{t};
  EXPECT_TRUE(pg.broadcast(v)->wait());
  EXPECT_TRUE(at::equal(t, at::arange(10, at::kFloat)));
}

// ---------------------------------------------------------------------------------------------
// Collectives against a reference computed in one process
//
// Every rank makes every rank's input from (rank, seed), so each rank computes the expected
// result itself; what each rank got is also noted in Digests, and the parent checks that every
// rank got the same bytes.

using RedOp = c10d::ReduceOp::RedOpType;
constexpr RedOp kAllOps[] = {c10d::ReduceOp::SUM, c10d::ReduceOp::AVG,  c10d::ReduceOp::PRODUCT,
                             c10d::ReduceOp::MIN, c10d::ReduceOp::MAX,  c10d::ReduceOp::BAND,
                             c10d::ReduceOp::BOR, c10d::ReduceOp::BXOR};
const std::vector<at::ScalarType> kAllReduceDtypes = {at::kFloat, at::kDouble, at::kHalf,  at::kBFloat16,
                                                      at::kChar,  at::kByte,   at::kShort, at::kInt,
                                                      at::kLong,  at::kBool,   at::kComplexFloat, at::kComplexDouble};

const char* op_name(RedOp op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    default: return "?";
  }
}

/// What torch has: bitwise ops on integers and bool, MIN/MAX not on complex, AVG not on integers.
bool op_allowed(RedOp op, at::ScalarType dtype) {
  const bool integral = at::isIntegralType(dtype, /*includeBool=*/true);
  switch (op) {
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR: return integral;
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX: return !at::isComplexType(dtype);
    case c10d::ReduceOp::AVG: return !integral;
    default: return true;
  }
}

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

enum class Values {
  kSmall,    // integers in [-4, 4] ([0, 8] unsigned): sums of 5 ranks are exact in every dtype
  kFactors,  // 1, 2, -1 (complex: imaginary parts 0, 1, -1): products of 5 ranks are exact
  kAny,      // full-range integers, non-representable-sum floats in about [-979, 979]
};

/// Rank `rank`'s input for the case `seed`: deterministic, so every rank can make every input.
at::Tensor rank_input(at::ScalarType dtype, int64_t numel, int rank, uint64_t seed, Values values) {
  at::Tensor ints = at::empty({numel}, at::kLong);
  at::Tensor re = at::empty({numel}, at::kDouble);
  at::Tensor im = at::empty({numel}, at::kDouble);
  auto* pi = ints.data_ptr<int64_t>();
  auto* pr = re.data_ptr<double>();
  auto* pm = im.data_ptr<double>();
  const bool is_unsigned = dtype == at::kByte || dtype == at::kBool;
  for (int64_t i = 0; i < numel; ++i) {
    const uint64_t h = mix64(mix64(seed) ^ (static_cast<uint64_t>(rank) << 40) ^ static_cast<uint64_t>(i));
    const uint64_t h2 = mix64(h);
    switch (values) {
      case Values::kSmall:
        pi[i] = is_unsigned ? static_cast<int64_t>(h % 9) : static_cast<int64_t>(h % 9) - 4;
        pr[i] = static_cast<double>(pi[i]);
        pm[i] = static_cast<double>(static_cast<int64_t>(h2 % 9) - 4);
        break;
      case Values::kFactors: {
        static constexpr int64_t kSigned[4] = {1, 2, -1, 1}, kUnsigned[4] = {1, 2, 1, 1}, kImag[4] = {0, 1, -1, 0};
        pi[i] = is_unsigned ? kUnsigned[h % 4] : kSigned[h % 4];
        pr[i] = static_cast<double>(pi[i]);
        pm[i] = static_cast<double>(kImag[h2 % 4]);
        break;
      }
      case Values::kAny:
        pi[i] = static_cast<int64_t>(h);
        pr[i] = static_cast<double>(h % 2000001) / 1021.0 - 979.0;
        pm[i] = static_cast<double>(h2 % 2000001) / 1021.0 - 979.0;
        break;
    }
  }
  if (dtype == at::kBool) return at::bitwise_and(ints, 1).to(at::kBool);
  if (at::isIntegralType(dtype, /*includeBool=*/false)) return ints.to(dtype);
  if (at::isComplexType(dtype)) return at::complex(re, im).to(dtype);
  return re.to(dtype);
}

std::vector<at::Tensor> all_inputs(at::ScalarType dtype, int64_t numel, int world, uint64_t seed, Values values) {
  std::vector<at::Tensor> out;
  for (int r = 0; r < world; ++r) out.push_back(rank_input(dtype, numel, r, seed, values));
  return out;
}

/// a op b as torch computes it (bool: SUM/MAX/BOR are OR, PRODUCT/MIN/BAND are AND, BXOR XOR).
at::Tensor combine(RedOp op, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == at::kBool) {
    switch (op) {
      case c10d::ReduceOp::SUM:
      case c10d::ReduceOp::MAX:
      case c10d::ReduceOp::BOR: return at::logical_or(a, b);
      case c10d::ReduceOp::PRODUCT:
      case c10d::ReduceOp::MIN:
      case c10d::ReduceOp::BAND: return at::logical_and(a, b);
      case c10d::ReduceOp::BXOR: return at::logical_xor(a, b);
      default: break;
    }
    SHM_CHECK(false, "no reference for " << op_name(op) << " on bool");
  }
  switch (op) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG: return at::add(a, b);
    case c10d::ReduceOp::PRODUCT: return at::mul(a, b);
    case c10d::ReduceOp::MIN: return at::minimum(a, b);
    case c10d::ReduceOp::MAX: return at::maximum(a, b);
    case c10d::ReduceOp::BAND: return at::bitwise_and(a, b);
    case c10d::ReduceOp::BOR: return at::bitwise_or(a, b);
    case c10d::ReduceOp::BXOR: return at::bitwise_xor(a, b);
    default: break;
  }
  SHM_CHECK(false, "no reference for op " << static_cast<int>(op));
  return {};
}

/// ins[0] op ins[1] op ... in rank order (AVG: the sum divided by the number of ranks).
at::Tensor reference(RedOp op, const std::vector<at::Tensor>& ins) {
  at::Tensor acc = ins[0].clone();
  for (size_t r = 1; r < ins.size(); ++r) acc = combine(op, acc, ins[r]);
  if (op == c10d::ReduceOp::AVG) {
    const auto world = static_cast<int64_t>(ins.size());
    const at::ScalarType dtype = acc.scalar_type();
    if (dtype == at::kHalf || dtype == at::kBFloat16) {
      acc = (acc.to(at::kFloat) / world).to(dtype);
    } else {
      acc = acc / world;
    }
  }
  return acc;
}

/// Whether the reference is exact: every op in rank order rounds as the backend does, except
/// complex AVG (complex division by the world size may round the last bit either way).
bool exact_reference(RedOp op, at::ScalarType dtype) {
  return !(op == c10d::ReduceOp::AVG && at::isComplexType(dtype));
}

std::string first_difference(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.contiguous().reshape({-1}), w = want.contiguous().reshape({-1});
  if (g.scalar_type() != w.scalar_type() || g.numel() != w.numel()) {
    return "got " + std::string(c10::toString(g.scalar_type())) + "[" + std::to_string(g.numel()) + "], want " +
           c10::toString(w.scalar_type()) + "[" + std::to_string(w.numel()) + "]";
  }
  const int64_t es = static_cast<int64_t>(g.element_size());
  const auto* pg = static_cast<const uint8_t*>(g.data_ptr());
  const auto* pw = static_cast<const uint8_t*>(w.data_ptr());
  for (int64_t i = 0; i < g.numel(); ++i) {
    if (std::memcmp(pg + i * es, pw + i * es, static_cast<size_t>(es)) != 0) {
      std::ostringstream os;
      os << "first difference at element " << i << " of " << g.numel() << ": got " << g[i].item() << ", want "
         << w[i].item();
      return os.str();
    }
  }
  return "no difference";
}

void check_result(const at::Tensor& got, const at::Tensor& want, bool exact, const std::string& what) {
  SHM_CHECK(got.sizes() == want.sizes(), what << ": shape " << got.sizes() << ", want " << want.sizes());
  if (exact) {
    SHM_CHECK(same_bytes(got, want), what << ": " << first_difference(got, want));
  } else {
    const double tol = want.scalar_type() == at::kComplexFloat ? 1e-5 : 1e-12;
    SHM_CHECK(at::allclose(got.to(at::kComplexDouble), want.to(at::kComplexDouble), tol, tol),
              what << ": not close: " << first_difference(got, want));
  }
}

/// Checksums of what each rank got, per collective call, for the parent to compare.
constexpr int kMaxDigestRanks = 5;
constexpr int kMaxDigests = 8192;
struct Digests {
  std::atomic<uint64_t> value[kMaxDigests][kMaxDigestRanks];
  std::atomic<int> count[kMaxDigestRanks];
};

/// Notes what rank `rank` got in its next collective call.
void note_digest(Digests& d, int rank, const at::Tensor& t) {
  const int i = d.count[rank].fetch_add(1);
  SHM_CHECK(i < kMaxDigests, "more than " << kMaxDigests << " digests");
  d.value[i][rank].store(checksum(t) | 1);
}

/// Every rank noted the same number of results, at least `min_count`, with the same bytes.
void expect_same_digests(const Digests& d, int world, int min_count) {
  const int n = d.count[0].load();
  EXPECT_GE(n, min_count) << "too few results were compared";
  for (int r = 1; r < world; ++r) EXPECT_EQ(d.count[r].load(), n) << "rank " << r << " noted another number of results";
  int differing = 0;
  for (int i = 0; i < std::min(n, kMaxDigests); ++i) {
    for (int r = 1; r < world; ++r) {
      if (d.value[i][r].load() != d.value[i][0].load() && ++differing <= 5) {
        ADD_FAILURE() << "result " << i << ": rank " << r << " got other bytes than rank 0";
      }
    }
  }
  EXPECT_EQ(differing, 0);
}

/// Enough elements of `dtype` to take 3 window halves and then some (several steps per rank).
int64_t streaming_numel(const ShmOptions& opts, at::ScalarType dtype) {
  return static_cast<int64_t>(3 * (opts.window_bytes / 2) / c10::elementSize(dtype)) + 5;
}

std::string case_name(const char* collective, at::ScalarType dtype, RedOp op, int64_t numel, int world) {
  std::ostringstream os;
  os << collective << " " << op_name(op) << " of " << numel << " " << c10::toString(dtype) << " over " << world
     << " ranks";
  return os.str();
}

Values values_for(RedOp op, at::ScalarType dtype, int idx) {
  if (op == c10d::ReduceOp::PRODUCT) return Values::kFactors;
  if (op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::AVG) {
    // Floating point: exact sums half of the time, inexact ones (rank order matters) the other.
    return at::isIntegralType(dtype, true) || idx % 2 == 0 ? Values::kSmall : Values::kAny;
  }
  return Values::kAny;
}

struct MatrixSpec {
  int world = 3;
  ShmOptions opts;
  std::vector<at::ScalarType> dtypes;
  std::vector<int64_t> sizes;  // plus streaming_numel per dtype when `streaming`
  bool streaming = true;
  bool coalesced = true;
};

std::vector<int64_t> sizes_of(const MatrixSpec& spec, at::ScalarType dtype) {
  std::vector<int64_t> sizes = spec.sizes;
  if (spec.streaming) sizes.push_back(streaming_numel(spec.opts, dtype));
  return sizes;
}

/// allreduce (contiguous or strided), reduce (to a rotating root; the others' tensors must not
/// change), reduce_scatter and allreduce_coalesced for every dtype × op × size of `spec`.
void reductions_scenario(const std::string& name, int rank, const MatrixSpec& spec, Digests& digests) {
  const int world = spec.world;
  ProcessGroupShm pg(name, rank, world, spec.opts);
  int idx = 0;
  for (at::ScalarType dtype : spec.dtypes) {
    for (RedOp op : kAllOps) {
      if (!op_allowed(op, dtype)) continue;
      for (int64_t numel : sizes_of(spec, dtype)) {
        ++idx;
        const uint64_t seed = static_cast<uint64_t>(idx) * 7919 + static_cast<uint64_t>(numel);
        const Values values = values_for(op, dtype, idx);
        const bool exact = exact_reference(op, dtype);
        const std::vector<at::Tensor> ins = all_inputs(dtype, numel, world, seed, values);
        const at::Tensor want = reference(op, ins);
        const Layout layout = idx % 2 == 1 ? Layout::kStrided : Layout::kContiguous;
        const Layout other = idx % 2 == 1 ? Layout::kContiguous : Layout::kStrided;
        {
          const at::Tensor t = with_layout(ins[static_cast<size_t>(rank)], layout);
          std::vector<at::Tensor> v{t};
          c10d::AllreduceOptions o;
          o.reduceOp = op;
          pg.allreduce(v, o)->wait();
          check_result(t, want, exact, case_name("allreduce", dtype, op, numel, world) + " (" + layout_name(layout) + ")");
          note_digest(digests, rank, t);
        }
        {
          const int root = idx % world;
          const at::Tensor t = with_layout(ins[static_cast<size_t>(rank)], other);
          std::vector<at::Tensor> v{t};
          c10d::ReduceOptions o;
          o.reduceOp = op;
          o.rootRank = root;
          pg.reduce(v, o)->wait();
          const std::string what = case_name("reduce", dtype, op, numel, world) + " to root " + std::to_string(root);
          if (rank == root) {
            check_result(t, want, exact, what);
          } else {
            SHM_CHECK(same_bytes(t, ins[static_cast<size_t>(rank)]), what << ": rank " << rank << "'s tensor changed");
          }
        }
        {
          // Rank r's inputs: one per destination d, from (r, seed ^ d); rank d gets their reduction.
          auto piece_seed = [&](int d) { return seed ^ (static_cast<uint64_t>(d + 1) * 0x5851f42d4c957f2dull); };
          std::vector<at::Tensor> mine;
          for (int d = 0; d < world; ++d) {
            mine.push_back(with_layout(rank_input(dtype, numel, rank, piece_seed(d), values), d % 2 == 1 ? layout : other));
          }
          const at::Tensor want_me = reference(op, all_inputs(dtype, numel, world, piece_seed(rank), values));
          const at::Tensor out = blank_like(want_me, layout);
          std::vector<at::Tensor> outs{out};
          std::vector<std::vector<at::Tensor>> lists{mine};
          c10d::ReduceScatterOptions o;
          o.reduceOp = op;
          pg.reduce_scatter(outs, lists, o)->wait();
          check_result(out, want_me, exact, case_name("reduce_scatter", dtype, op, numel, world));
          for (int d = 0; d < world; ++d) {
            SHM_CHECK(same_bytes(mine[static_cast<size_t>(d)], rank_input(dtype, numel, rank, piece_seed(d), values)),
                      case_name("reduce_scatter", dtype, op, numel, world) << ": input " << d << " changed");
          }
          // The same reduction through _reduce_scatter_base (torch's reduce_scatter_tensor): one
          // input buffer whose block d is the input for rank d; an output of the other layout.
          std::vector<at::Tensor> blocks;
          for (const auto& m : mine) blocks.push_back(m.reshape({-1}));
          at::Tensor whole = at::cat(blocks);
          const at::Tensor whole_before = whole.clone();
          at::Tensor out_base = blank_like(want_me, other);
          pg._reduce_scatter_base(out_base, whole, o)->wait();
          check_result(out_base, want_me, exact, case_name("_reduce_scatter_base", dtype, op, numel, world));
          SHM_CHECK(same_bytes(whole, whole_before),
                    case_name("_reduce_scatter_base", dtype, op, numel, world) << ": the input changed");
        }
        if (spec.coalesced && numel < 1000) {
          // Three tensors of one dtype: the case's, a transposed 3 x 5, a single element.
          const std::vector<at::Tensor> ins2 = all_inputs(dtype, 15, world, seed + 1, values);
          const std::vector<at::Tensor> ins3 = all_inputs(dtype, 1, world, seed + 2, values);
          std::vector<at::Tensor> ts{with_layout(ins[static_cast<size_t>(rank)], layout),
                                     with_layout(ins2[static_cast<size_t>(rank)].reshape({3, 5}), Layout::kTransposed),
                                     ins3[static_cast<size_t>(rank)].clone()};
          c10d::AllreduceCoalescedOptions o;
          o.reduceOp = op;
          pg.allreduce_coalesced(ts, o)->wait();
          const std::string what = case_name("allreduce_coalesced", dtype, op, numel, world);
          check_result(ts[0], want, exact, what + " (tensor 0)");
          check_result(ts[1], reference(op, ins2).reshape({3, 5}), exact, what + " (tensor 1)");
          check_result(ts[2], reference(op, ins3), exact, what + " (tensor 2)");
          note_digest(digests, rank, at::cat({ts[0].reshape({-1}), ts[1].reshape({-1}), ts[2]}));
        }
      }
    }
  }
}

/// allgather, _allgather_base, gather, scatter, broadcast and alltoall_base (equal splits) for
/// every dtype × size of `spec`, roots rotating, inputs and outputs contiguous or strided.
void movement_scenario(const std::string& name, int rank, const MatrixSpec& spec, Digests& digests) {
  const int world = spec.world;
  const auto me = static_cast<size_t>(rank);
  ProcessGroupShm pg(name, rank, world, spec.opts);
  int idx = 0;
  for (at::ScalarType dtype : spec.dtypes) {
    for (int64_t numel : sizes_of(spec, dtype)) {
      ++idx;
      const uint64_t seed = static_cast<uint64_t>(idx) * 104729 + static_cast<uint64_t>(numel);
      const std::vector<at::Tensor> ins = all_inputs(dtype, numel, world, seed, Values::kAny);
      const Layout in_layout = idx % 2 == 1 ? Layout::kStrided : Layout::kContiguous;
      const Layout out_layout = idx % 2 == 1 ? Layout::kContiguous : Layout::kStrided;
      const int root = idx % world;
      auto what = [&](const char* c) {
        std::ostringstream os;
        os << c << " of " << numel << " " << c10::toString(dtype) << " over " << world << " ranks (root " << root
           << ", rank " << rank << ")";
        return os.str();
      };
      {
        std::vector<at::Tensor> outs;
        for (int r = 0; r < world; ++r) outs.push_back(blank_like(ins[0], out_layout));
        std::vector<std::vector<at::Tensor>> lists{outs};
        std::vector<at::Tensor> in{with_layout(ins[me], in_layout)};
        pg.allgather(lists, in)->wait();
        for (int r = 0; r < world; ++r) {
          check_result(outs[static_cast<size_t>(r)], ins[static_cast<size_t>(r)], true,
                       what("allgather") + ", output " + std::to_string(r));
        }
        note_digest(digests, rank, at::cat(outs));
      }
      {
        const at::Tensor want = at::cat(ins);
        at::Tensor out = blank_like(want, out_layout);
        at::Tensor in = with_layout(ins[me], in_layout);
        pg._allgather_base(out, in)->wait();
        check_result(out, want, true, what("_allgather_base"));
      }
      {
        std::vector<at::Tensor> outs;
        if (rank == root) {
          for (int r = 0; r < world; ++r) outs.push_back(blank_like(ins[0], out_layout));
        }
        std::vector<std::vector<at::Tensor>> lists;
        if (rank == root) lists.push_back(outs);
        std::vector<at::Tensor> in{with_layout(ins[me], in_layout)};
        pg.gather(lists, in, c10d::GatherOptions{root})->wait();
        for (size_t r = 0; r < outs.size(); ++r) check_result(outs[r], ins[r], true, what("gather") + ", output " + std::to_string(r));
      }
      {
        const std::vector<at::Tensor> pieces = all_inputs(dtype, numel, world, seed + 77, Values::kAny);
        std::vector<std::vector<at::Tensor>> lists;
        if (rank == root) {
          std::vector<at::Tensor> mine;
          for (int d = 0; d < world; ++d) mine.push_back(with_layout(pieces[static_cast<size_t>(d)], d % 2 == 0 ? in_layout : out_layout));
          lists.push_back(mine);
        }
        const at::Tensor out = blank_like(ins[0], out_layout);
        std::vector<at::Tensor> outs{out};
        c10d::ScatterOptions o;
        o.rootRank = root;
        pg.scatter(outs, lists, o)->wait();
        check_result(out, pieces[me], true, what("scatter"));
      }
      {
        const at::Tensor t = rank == root ? with_layout(ins[static_cast<size_t>(root)], in_layout) : blank_like(ins[0], out_layout);
        std::vector<at::Tensor> v{t};
        c10d::BroadcastOptions o;
        o.rootRank = root;
        pg.broadcast(v, o)->wait();
        check_result(t, ins[static_cast<size_t>(root)], true, what("broadcast"));
        note_digest(digests, rank, t);
      }
      {
        // Rank s sends elements [d * numel, (d + 1) * numel) of its input to rank d.
        const std::vector<at::Tensor> sends = all_inputs(dtype, world * numel, world, seed + 99, Values::kAny);
        std::vector<at::Tensor> want_parts;
        for (int s = 0; s < world; ++s) want_parts.push_back(sends[static_cast<size_t>(s)].narrow(0, rank * numel, numel));
        const at::Tensor want = at::cat(want_parts);
        at::Tensor in = with_layout(sends[me], in_layout);
        at::Tensor out = blank_like(want, out_layout);
        std::vector<int64_t> no_splits;
        pg.alltoall_base(out, in, no_splits, no_splits)->wait();
        check_result(out, want, true, what("alltoall_base"));
      }
    }
  }
}

MatrixSpec small_window_spec(int world, std::vector<at::ScalarType> dtypes, size_t window = 1024) {
  MatrixSpec spec;
  spec.world = world;
  spec.opts = small_options();
  spec.opts.window_bytes = window;
  spec.dtypes = std::move(dtypes);
  spec.sizes = {0, 1, 7, 67};
  return spec;
}

void run_reductions(const std::string& name, Peers peers, const MatrixSpec& spec, int min_digests) {
  Shared<Digests> digests;
  SHM_EXPECT_RANKS_OK(run_ranks(peers, spec.world, [&](int r) { reductions_scenario(name, r, spec, *digests); }, 100s));
  expect_same_digests(*digests, spec.world, min_digests);
}

void run_movement(const std::string& name, Peers peers, const MatrixSpec& spec, int min_digests) {
  Shared<Digests> digests;
  SHM_EXPECT_RANKS_OK(run_ranks(peers, spec.world, [&](int r) { movement_scenario(name, r, spec, *digests); }, 100s));
  expect_same_digests(*digests, spec.world, min_digests);
}

// Valid (op, dtype) pairs: 4 floating × 5 ops + 5 integers × 7 + bool × 7 + 2 complex × 3 = 68;
// each size of each pair notes at least its allreduce.
constexpr int kValidPairs = 68;

TEST_F(ShmCollectiveThreads, ReductionsMatchTheReference_World1) {
  run_reductions(unique_name(), Peers::kThreads, small_window_spec(1, kAllReduceDtypes), kValidPairs * 5);
}

TEST_F(ShmCollectiveThreads, ReductionsMatchTheReference_World2) {
  run_reductions(unique_name(), Peers::kThreads, small_window_spec(2, kAllReduceDtypes), kValidPairs * 5);
}

TEST_F(ShmCollectiveThreads, ReductionsMatchTheReference_World3) {
  // A window whose half (704 bytes) is no power of two: pieces end at odd element counts.
  run_reductions(unique_name(), Peers::kThreads, small_window_spec(3, kAllReduceDtypes, 1280), kValidPairs * 5);
}

TEST_F(ShmCollectiveThreads, ReductionsMatchTheReference_World4) {
  run_reductions(unique_name(), Peers::kThreads, small_window_spec(4, kAllReduceDtypes), kValidPairs * 5);
}

TEST_F(ShmCollectiveThreads, ReductionsMatchTheReference_World5) {
  set_deadline(110s);
  MatrixSpec spec = small_window_spec(5, kAllReduceDtypes);
  spec.sizes = {0, 7, 67};
  run_reductions(unique_name(), Peers::kThreads, spec, kValidPairs * 4);
}

TEST_F(ShmCollectiveProcs, ReductionsMatchTheReference_World3) {
  // Real processes: a few dtypes, every op they have.
  MatrixSpec spec = small_window_spec(3, {at::kFloat, at::kBFloat16, at::kInt, at::kBool, at::kComplexFloat});
  spec.sizes = {0, 7, 67};
  run_reductions(unique_name(), Peers::kProcesses, spec, 10);
}

const std::vector<at::ScalarType> kMovementDtypes = {at::kFloat, at::kByte, at::kBool, at::kHalf, at::kComplexDouble,
                                                     at::kLong};

TEST_F(ShmCollectiveThreads, DataMovementMatchesTheReference_World1) {
  run_movement(unique_name(), Peers::kThreads, small_window_spec(1, kMovementDtypes), 6 * 5 * 2);
}

TEST_F(ShmCollectiveThreads, DataMovementMatchesTheReference_World2) {
  run_movement(unique_name(), Peers::kThreads, small_window_spec(2, kMovementDtypes), 6 * 5 * 2);
}

TEST_F(ShmCollectiveThreads, DataMovementMatchesTheReference_World3) {
  run_movement(unique_name(), Peers::kThreads, small_window_spec(3, kMovementDtypes, 1280), 6 * 5 * 2);
}

TEST_F(ShmCollectiveThreads, DataMovementMatchesTheReference_World4) {
  run_movement(unique_name(), Peers::kThreads, small_window_spec(4, kMovementDtypes), 6 * 5 * 2);
}

TEST_F(ShmCollectiveThreads, DataMovementMatchesTheReference_World5) {
  run_movement(unique_name(), Peers::kThreads, small_window_spec(5, kMovementDtypes), 6 * 5 * 2);
}

TEST_F(ShmCollectiveProcs, DataMovementMatchesTheReference_World4) {
  run_movement(unique_name(), Peers::kProcesses, small_window_spec(4, kMovementDtypes, 4096), 6 * 5 * 2);
}

/// The default window (1 MiB): tensors over 32 KiB per piece take the reduce-scatter +
/// all-gather path for 3 and more ranks, and over 512 KiB they stream in several pieces.
void large_scenario(const std::string& name, int rank, int world, Digests& digests) {
  ShmOptions opts = default_slot_options();
  ProcessGroupShm pg(name, rank, world, opts);
  int idx = 0;
  for (int64_t numel : {int64_t{9000}, int64_t{200003}}) {
    for (auto [dtype, op] : {std::pair{at::kFloat, c10d::ReduceOp::SUM}, std::pair{at::kDouble, c10d::ReduceOp::AVG},
                             std::pair{at::kBFloat16, c10d::ReduceOp::SUM}, std::pair{at::kLong, c10d::ReduceOp::BXOR},
                             std::pair{at::kHalf, c10d::ReduceOp::MAX}}) {
      ++idx;
      const uint64_t seed = 5000 + static_cast<uint64_t>(idx);
      const std::vector<at::Tensor> ins = all_inputs(dtype, numel, world, seed, Values::kAny);
      const at::Tensor want = reference(op, ins);
      const at::Tensor t = with_layout(ins[static_cast<size_t>(rank)], idx % 2 ? Layout::kStrided : Layout::kContiguous);
      std::vector<at::Tensor> v{t};
      c10d::AllreduceOptions o;
      o.reduceOp = op;
      pg.allreduce(v, o)->wait();
      check_result(t, want, true, case_name("allreduce", dtype, op, numel, world));
      note_digest(digests, rank, t);
      const at::Tensor r = ins[static_cast<size_t>(rank)].clone();
      std::vector<at::Tensor> rv{r};
      c10d::ReduceOptions ro;
      ro.reduceOp = op;
      ro.rootRank = world - 1;
      pg.reduce(rv, ro)->wait();
      if (rank == world - 1) check_result(r, want, true, case_name("reduce", dtype, op, numel, world));
      if (rank != world - 1) SHM_CHECK(same_bytes(r, ins[static_cast<size_t>(rank)]), "reduce changed a non-root tensor");
    }
  }
  // 2 MiB + 3 bytes: four and a bit window halves.
  const at::Tensor big = pattern(at::kByte, (int64_t{2} << 20) + 3, 77);
  const at::Tensor t = rank == 1 % world ? big.clone() : at::zeros_like(big);
  std::vector<at::Tensor> v{t};
  pg.broadcast(v, c10d::BroadcastOptions{1 % world})->wait();
  SHM_CHECK(same_bytes(t, big), "broadcast of 2 MiB + 3 differs on rank " << rank);
  const at::Tensor mine = pattern(at::kFloat, 150001, 80 + static_cast<uint64_t>(rank));
  at::Tensor all = at::empty({150001 * world}, at::kFloat);
  at::Tensor in = mine.clone();
  pg._allgather_base(all, in)->wait();
  for (int r = 0; r < world; ++r) {
    SHM_CHECK(same_bytes(all.narrow(0, r * 150001, 150001), pattern(at::kFloat, 150001, 80 + static_cast<uint64_t>(r))),
              "_allgather_base of 600 KB per rank: rank " << r << "'s part differs on rank " << rank);
  }
}

TEST_F(ShmCollectiveThreads, LargeTensorsWithTheDefaultWindow) {
  for (int world : {2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const std::string name = unique_name();
    Shared<Digests> digests;
    SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, world, [&](int r) { large_scenario(name, r, world, *digests); }));
    expect_same_digests(*digests, world, 10);
  }
}

TEST_F(ShmCollectiveProcs, LargeTensorsWithTheDefaultWindow) {
  const std::string name = unique_name();
  Shared<Digests> digests;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 3, [&](int r) { large_scenario(name, r, 3, *digests); }));
  expect_same_digests(*digests, 3, 10);
}

// ---------------------------------------------------------------------------------------------
// alltoall_base with uneven splits

/// Rows rank s sends to rank d (some 0).
int64_t split_rows(int s, int d, int scale) { return static_cast<int64_t>((s * 3 + d * 5 + 1) % 4) * scale; }

void alltoall_uneven_scenario(const std::string& name, int rank, int world, const ShmOptions& opts) {
  ProcessGroupShm pg(name, rank, world, opts);
  int round = 0;
  for (int scale : {1, 7, 60}) {  // 60: 240 rows of 12 bytes at most per pair, several steps
    for (Layout layout : {Layout::kContiguous, Layout::kTransposed}) {
      ++round;
      // Rank s's input: rows of 3 int32, from (s, round); rows [off(s, d), off(s, d) + split) go to d.
      auto input_of = [&](int s) {
        int64_t rows = 0;
        for (int d = 0; d < world; ++d) rows += split_rows(s, d, scale);
        return rank_input(at::kInt, rows * 3, s, 900 + static_cast<uint64_t>(round), Values::kAny).reshape({rows, 3});
      };
      std::vector<int64_t> in_splits, out_splits;
      std::vector<at::Tensor> want_parts;
      for (int d = 0; d < world; ++d) in_splits.push_back(split_rows(rank, d, scale));
      for (int s = 0; s < world; ++s) {
        out_splits.push_back(split_rows(s, rank, scale));
        int64_t off = 0;
        for (int d = 0; d < rank; ++d) off += split_rows(s, d, scale);
        want_parts.push_back(input_of(s).narrow(0, off, split_rows(s, rank, scale)));
      }
      const at::Tensor want = at::cat(want_parts);
      const at::Tensor mine = input_of(rank);
      // kTransposed: a (rows, 3) view of a (3, rows) buffer, for the input and the output.
      at::Tensor in = layout == Layout::kTransposed ? with_layout(mine, Layout::kTransposed) : mine.clone();
      at::Tensor out = blank_like(want, layout);
      pg.alltoall_base(out, in, out_splits, in_splits)->wait();
      check_result(out, want, true,
                   "alltoall_base round " + std::to_string(round) + " over " + std::to_string(world) + " ranks on rank " +
                       std::to_string(rank));
    }
  }
}

TEST_F(ShmCollectiveThreads, AlltoallWithUnevenSplits) {
  for (int world : {1, 2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const std::string name = unique_name();
    ShmOptions opts = small_options();
    opts.window_bytes = 1024;
    SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, world, [&](int r) { alltoall_uneven_scenario(name, r, world, opts); }));
  }
}

TEST_F(ShmCollectiveProcs, AlltoallWithUnevenSplits) {
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.window_bytes = 1024;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 3, [&](int r) { alltoall_uneven_scenario(name, r, 3, opts); }));
}

// A window too small for the group's ranks: every rank gets a TypeError that gives the window's
// size and the option to change; nothing was stepped, so the group's collectives work on.
TEST_F(ShmCollectiveThreads, WindowTooSmallForTheWorldIsATypeErrorNamingTheOption) {
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.window_bytes = 256;  // 4 parts of 64 B: 12 B per rank of 5, less than one complex128
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 5, [&](int r) {
    ProcessGroupShm pg(name, r, 5, opts);
    auto expect_window_error = [](const char* what, const std::function<void()>& call) {
      const Caught c = catch_any(call);
      SHM_CHECK(c.is<TypeError>(), what << " threw " << c.describe() << ", not a tdshm::TypeError");
      SHM_CHECK(contains_nocase(c.what, "a window of 256 bytes") && contains_nocase(c.what, "of 5 ranks") &&
                    contains_nocase(c.what, "ShmOptions::window_bytes"),
                what << ": " << c.what);
    };
    at::Tensor in = at::ones({10}), out = at::empty({10});
    std::vector<int64_t> equal_splits;
    expect_window_error("alltoall_base", [&] { pg.alltoall_base(out, in, equal_splits, equal_splits)->wait(); });
    at::Tensor blocks = at::ones({5}, at::kComplexDouble), share = at::empty({1}, at::kComplexDouble);
    expect_window_error("_reduce_scatter_base of complex128", [&] { pg._reduce_scatter_base(share, blocks)->wait(); });
    std::vector<at::Tensor> v{at::full({3}, static_cast<float>(r))};
    pg.allreduce(v)->wait();
    SHM_CHECK(at::equal(v[0], at::full({3}, 10.0f)), "allreduce after the refused calls is wrong on rank " << r);
  }));
}

TEST_F(ShmCollectiveThreads, AlltoallSplitsThatDisagreeFailEveryRank) {
  // Rank 0 sends 2 rows to rank 1, which expects 1 from it (and 2 from rank 2, which sends 1).
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) {
    ProcessGroupShm pg(name, r, 3, small_options());
    std::vector<int64_t> in_splits = r == 0 ? std::vector<int64_t>{1, 2, 0} : std::vector<int64_t>{1, 1, 1};
    std::vector<int64_t> out_splits = r == 1 ? std::vector<int64_t>{1, 1, 2} : std::vector<int64_t>{1, 1, 1};
    if (r == 0) out_splits = {1, 1, 1};
    at::Tensor in = at::full({3, 2}, static_cast<float>(r));
    at::Tensor out = at::zeros({r == 1 ? 4 : 3, 2});
    auto work = pg.alltoall_base(out, in, out_splits, in_splits);
    SHM_CHECK_THROWS(TransportError, [&] { work->wait(); }, "alltoall");
    // Every rank saw the same sizes and stopped at the same step: the group is still in step.
    std::vector<at::Tensor> v{at::full({2}, static_cast<float>(r + 1))};
    pg.allreduce(v)->wait();
    SHM_CHECK(at::equal(v[0], at::full({2}, 6.0f)), "the allreduce after the failed alltoall got " << v[0]);
  }));
}

// ---------------------------------------------------------------------------------------------
// Bad arguments: typed errors at the call, and the group still works

void expect_call_error(const char* what, const std::function<void()>& call) {
  const Caught c = catch_any(call);
  SHM_CHECK(c.is<c10::Error>(), what << " threw " << c.describe() << ", not a c10::Error");
}

void expect_type_error(const std::string& what, const std::function<void()>& call) {
  const Caught c = catch_any(call);
  SHM_CHECK(c.is<TypeError>(), what << " threw " << c.describe() << ", not a tdshm::TypeError");
}

/// Every rank makes bad calls (all of them on rank 1, a few elsewhere); then every rank runs good
/// collectives, which must give the right values.
void bad_arguments_scenario(const std::string& name, int rank) {
  constexpr int kWorld = 3;
  ProcessGroupShm pg(name, rank, kWorld, small_options());
  const at::Tensor f = at::ones({4});
  std::vector<at::Tensor> none, two{f.clone(), f.clone()}, one{f.clone()};
  if (rank == 1) {
    expect_call_error("allreduce of 0 tensors", [&] { pg.allreduce(none); });
    expect_call_error("allreduce of 2 tensors", [&] { pg.allreduce(two); });
    expect_call_error("allreduce of an undefined tensor", [&] {
      std::vector<at::Tensor> u{at::Tensor()};
      pg.allreduce(u);
    });
    expect_call_error("allreduce of a meta tensor", [&] {
      std::vector<at::Tensor> m{at::empty({4}, at::TensorOptions().device(at::kMeta))};
      pg.allreduce(m);
    });
    expect_call_error("allreduce of a sparse tensor", [&] {
      std::vector<at::Tensor> sp{at::ones({4}).to_sparse()};
      pg.allreduce(sp);
    });
    expect_call_error("allreduce of an expanded tensor", [&] {
      std::vector<at::Tensor> e{at::ones({1}).expand({4})};
      pg.allreduce(e);
    });
    expect_call_error("allreduce_coalesced of 0 tensors", [&] { pg.allreduce_coalesced(none); });
    expect_call_error("allreduce_coalesced of mixed dtypes", [&] {
      std::vector<at::Tensor> mixed{at::ones({2}), at::ones({2}, at::kDouble)};
      pg.allreduce_coalesced(mixed);
    });
    expect_call_error("broadcast from root -1", [&] { pg.broadcast(one, c10d::BroadcastOptions{-1}); });
    expect_call_error("broadcast from root 3", [&] { pg.broadcast(one, c10d::BroadcastOptions{kWorld}); });
    expect_call_error("broadcast with rootTensor 1", [&] { pg.broadcast(one, c10d::BroadcastOptions{0, 1}); });
    expect_call_error("broadcast of 2 tensors", [&] { pg.broadcast(two); });
    expect_call_error("reduce to root 3", [&] {
      c10d::ReduceOptions o;
      o.rootRank = kWorld;
      pg.reduce(one, o);
    });
    expect_call_error("allgather with 2 outputs", [&] {
      std::vector<std::vector<at::Tensor>> outs{{f.clone(), f.clone()}};
      pg.allgather(outs, one);
    });
    expect_call_error("allgather with 2 output lists", [&] {
      std::vector<std::vector<at::Tensor>> outs{{f.clone(), f.clone(), f.clone()}, {f.clone(), f.clone(), f.clone()}};
      pg.allgather(outs, one);
    });
    expect_call_error("allgather into another dtype", [&] {
      std::vector<std::vector<at::Tensor>> outs{{f.clone(), f.to(at::kDouble), f.clone()}};
      pg.allgather(outs, one);
    });
    expect_call_error("allgather into another size", [&] {
      std::vector<std::vector<at::Tensor>> outs{{f.clone(), at::ones({5}), f.clone()}};
      pg.allgather(outs, one);
    });
    expect_call_error("_allgather_base into a tensor of the wrong size", [&] {
      at::Tensor out = at::empty({11});
      at::Tensor in = f.clone();
      pg._allgather_base(out, in);
    });
    expect_call_error("_allgather_base into another dtype", [&] {
      at::Tensor out = at::empty({12}, at::kDouble);
      at::Tensor in = f.clone();
      pg._allgather_base(out, in);
    });
    expect_call_error("gather with outputs on a non-root", [&] {
      std::vector<std::vector<at::Tensor>> outs{{f.clone(), f.clone(), f.clone()}};
      pg.gather(outs, one, c10d::GatherOptions{0});
    });
    expect_call_error("gather with 2 outputs at the root", [&] {
      std::vector<std::vector<at::Tensor>> outs{{f.clone(), f.clone()}};
      pg.gather(outs, one, c10d::GatherOptions{1});
    });
    expect_call_error("gather to root -1", [&] {
      std::vector<std::vector<at::Tensor>> outs;
      pg.gather(outs, one, c10d::GatherOptions{-1});
    });
    expect_call_error("scatter with inputs on a non-root", [&] {
      std::vector<std::vector<at::Tensor>> ins{{f.clone(), f.clone(), f.clone()}};
      c10d::ScatterOptions o;
      o.rootRank = 0;
      pg.scatter(one, ins, o);
    });
    expect_call_error("scatter of other dtypes at the root", [&] {
      std::vector<std::vector<at::Tensor>> ins{{f.clone(), f.to(at::kInt), f.clone()}};
      c10d::ScatterOptions o;
      o.rootRank = 1;
      pg.scatter(one, ins, o);
    });
    expect_call_error("scatter of 4 inputs at the root", [&] {
      std::vector<std::vector<at::Tensor>> ins{{f.clone(), f.clone(), f.clone(), f.clone()}};
      c10d::ScatterOptions o;
      o.rootRank = 1;
      pg.scatter(one, ins, o);
    });
    expect_call_error("reduce_scatter with 2 inputs", [&] {
      std::vector<std::vector<at::Tensor>> ins{{f.clone(), f.clone()}};
      pg.reduce_scatter(one, ins);
    });
    expect_call_error("reduce_scatter with inputs of another size", [&] {
      std::vector<std::vector<at::Tensor>> ins{{f.clone(), at::ones({3}), f.clone()}};
      pg.reduce_scatter(one, ins);
    });
    expect_call_error("_reduce_scatter_base of an input that is not world size blocks", [&] {
      at::Tensor in = at::ones({8}), out = at::ones({3});
      pg._reduce_scatter_base(out, in);
    });
    expect_call_error("_reduce_scatter_base into another dtype", [&] {
      at::Tensor in = at::ones({9}), out = at::ones({3}, at::kDouble);
      pg._reduce_scatter_base(out, in);
    });
    expect_call_error("alltoall_base of 4 rows among 3 ranks without splits", [&] {
      at::Tensor in = at::ones({4, 2}), out = at::ones({4, 2});
      std::vector<int64_t> none_splits;
      pg.alltoall_base(out, in, none_splits, none_splits);
    });
    expect_call_error("alltoall_base with 2 split sizes", [&] {
      at::Tensor in = at::ones({3, 2}), out = at::ones({3, 2});
      std::vector<int64_t> splits{1, 2};
      pg.alltoall_base(out, in, splits, splits);
    });
    expect_call_error("alltoall_base with splits that do not add up", [&] {
      at::Tensor in = at::ones({3, 2}), out = at::ones({3, 2});
      std::vector<int64_t> splits{1, 1, 2};
      pg.alltoall_base(out, in, splits, splits);
    });
    expect_call_error("alltoall_base with a negative split", [&] {
      at::Tensor in = at::ones({3, 2}), out = at::ones({3, 2});
      std::vector<int64_t> splits{2, 2, -1};
      pg.alltoall_base(out, in, splits, splits);
    });
    expect_call_error("alltoall_base between dtypes", [&] {
      at::Tensor in = at::ones({3, 2}), out = at::ones({3, 2}, at::kDouble);
      std::vector<int64_t> none_splits;
      pg.alltoall_base(out, in, none_splits, none_splits);
    });
  }
  // Ops the dtype does not have: TypeError, on every rank, for every reducing collective.
  for (at::ScalarType dtype : kAllReduceDtypes) {
    for (RedOp op : kAllOps) {
      if (op_allowed(op, dtype)) continue;
      const std::string what = std::string(op_name(op)) + " on " + c10::toString(dtype);
      const at::Tensor t = at::zeros({4}, dtype);
      std::vector<at::Tensor> v{t};
      c10d::AllreduceOptions ao;
      ao.reduceOp = op;
      expect_type_error("allreduce " + what, [&] { pg.allreduce(v, ao); });
      c10d::AllreduceCoalescedOptions co;
      co.reduceOp = op;
      expect_type_error("allreduce_coalesced " + what, [&] { pg.allreduce_coalesced(v, co); });
      if (rank == 1) {
        c10d::ReduceOptions ro;
        ro.reduceOp = op;
        expect_type_error("reduce " + what, [&] { pg.reduce(v, ro); });
        std::vector<std::vector<at::Tensor>> ins{{t.clone(), t.clone(), t.clone()}};
        c10d::ReduceScatterOptions rso;
        rso.reduceOp = op;
        expect_type_error("reduce_scatter " + what, [&] { pg.reduce_scatter(v, ins, rso); });
        at::Tensor whole = at::cat({t.reshape({-1}), t.reshape({-1}), t.reshape({-1})});
        at::Tensor share = t.reshape({-1}).clone();
        expect_type_error("_reduce_scatter_base " + what, [&] { pg._reduce_scatter_base(share, whole, rso); });
      }
    }
  }
  {
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::makeNCCLPreMulSum(2.0);
    const Caught c = catch_any([&] { pg.allreduce(one, o); });
    SHM_CHECK(c.is<TypeError>(), "allreduce PREMUL_SUM threw " << c.describe());
    SHM_CHECK(contains_nocase(c.what, "PREMUL_SUM"), "the message does not name the op: " << c.what);
  }
  // The group still works, every collective in step.
  std::vector<at::Tensor> v{at::full({5}, static_cast<int64_t>(rank + 1), at::kLong)};
  pg.allreduce(v)->wait();
  SHM_CHECK(at::equal(v[0], at::full({5}, 6, at::kLong)), "allreduce after the bad calls got " << v[0]);
  std::vector<at::Tensor> b{rank == 2 ? at::arange(6) : at::zeros({6}, at::kLong)};
  pg.broadcast(b, c10d::BroadcastOptions{2})->wait();
  SHM_CHECK(at::equal(b[0], at::arange(6)), "broadcast after the bad calls got " << b[0]);
  std::vector<std::vector<at::Tensor>> outs{{at::zeros({1}), at::zeros({1}), at::zeros({1})}};
  std::vector<at::Tensor> in{at::full({1}, static_cast<float>(rank * 10))};
  pg.allgather(outs, in)->wait();
  for (int r = 0; r < kWorld; ++r) {
    SHM_CHECK(outs[0][static_cast<size_t>(r)].item<float>() == static_cast<float>(r * 10), "allgather after the bad calls");
  }
}

TEST_F(ShmCollectiveThreads, BadArgumentsThrowTypedErrorsAndTheGroupStillWorks) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) { bad_arguments_scenario(name, r); }));
}

TEST_F(ShmCollectiveThreads, OpsTheDtypeHasNotAreTypeErrorsNamingTheOp) {
  const std::string name = unique_name();
  ProcessGroupShm pg(name, 0, 1, small_options());
  const std::vector<std::tuple<RedOp, at::ScalarType, const char*>> cases = {
      {c10d::ReduceOp::BAND, at::kFloat, "BAND"},         {c10d::ReduceOp::BXOR, at::kHalf, "BXOR"},
      {c10d::ReduceOp::MIN, at::kComplexFloat, "MIN"},    {c10d::ReduceOp::MAX, at::kComplexDouble, "MAX"},
      {c10d::ReduceOp::AVG, at::kInt, "AVG"},             {c10d::ReduceOp::AVG, at::kBool, "AVG"},
      {c10d::ReduceOp::BOR, at::kBFloat16, "BOR"},
  };
  for (const auto& [op, dtype, needle] : cases) {
    std::vector<at::Tensor> v{at::ones({3}, dtype)};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    const Caught c = catch_any([&] { pg.allreduce(v, o); });
    EXPECT_TRUE(c.is<TypeError>()) << needle << " on " << c10::toString(dtype) << ": " << c.describe();
    EXPECT_TRUE(contains_nocase(c.what, needle)) << c.describe();
  }
  // A dtype the collectives do not reduce at all (quantized).
  {
    std::vector<at::Tensor> v{at::quantize_per_tensor(at::ones({3}), 0.5, 0, at::kQInt8)};
    const Caught c = catch_any([&] { pg.allreduce(v); });
    EXPECT_TRUE(c.is<TypeError>() || c.is<c10::Error>()) << c.describe();
  }
  std::vector<at::Tensor> v{at::full({3}, 2.0f)};
  EXPECT_TRUE(pg.allreduce(v)->wait());
  EXPECT_TRUE(at::equal(v[0], at::full({3}, 2.0f)));
}

// ---------------------------------------------------------------------------------------------
// Ranks that disagree: TransportError on every rank, no hang

struct MismatchCase {
  const char* what;
  // Runs the collective of rank `rank`; returns its work.
  std::function<c10::intrusive_ptr<c10d::Work>(ProcessGroupShm&, int)> call;
};

std::vector<MismatchCase> mismatch_cases() {
  auto allreduce = [](ProcessGroupShm& pg, at::Tensor t, RedOp op = c10d::ReduceOp::SUM) {
    std::vector<at::Tensor> v{std::move(t)};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    return pg.allreduce(v, o);
  };
  auto broadcast = [](ProcessGroupShm& pg, at::Tensor t, int root) {
    std::vector<at::Tensor> v{std::move(t)};
    return pg.broadcast(v, c10d::BroadcastOptions{root});
  };
  return {
      {"allreduce against broadcast",
       [=](ProcessGroupShm& pg, int r) { return r == 0 ? allreduce(pg, at::ones({4})) : broadcast(pg, at::ones({4}), 0); }},
      {"allreduce of 4 against 5 elements",
       [=](ProcessGroupShm& pg, int r) { return allreduce(pg, at::ones({r == 2 ? 5 : 4})); }},
      {"allreduce SUM against MAX",
       [=](ProcessGroupShm& pg, int r) { return allreduce(pg, at::ones({4}), r == 1 ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM); }},
      {"allreduce float32 against int32 (same bytes)",
       [=](ProcessGroupShm& pg, int r) { return allreduce(pg, at::ones({4}, r == 1 ? at::kInt : at::kFloat)); }},
      {"broadcast from root 0 against root 1",
       [=](ProcessGroupShm& pg, int r) { return broadcast(pg, at::ones({4}), r == 2 ? 1 : 0); }},
      {"barrier against allgather",
       [=](ProcessGroupShm& pg, int r) {
         if (r == 0) return pg.barrier();
         std::vector<std::vector<at::Tensor>> outs{{at::zeros({1}), at::zeros({1}), at::zeros({1})}};
         std::vector<at::Tensor> in{at::ones({1})};
         return pg.allgather(outs, in);
       }},
      {"reduce to root 0 against root 2",
       [=](ProcessGroupShm& pg, int r) {
         std::vector<at::Tensor> v{at::ones({4})};
         c10d::ReduceOptions o;
         o.rootRank = r == 1 ? 2 : 0;
         return pg.reduce(v, o);
       }},
      {"streaming broadcast of 64 KiB against 64 KiB + 1",
       [=](ProcessGroupShm& pg, int r) { return broadcast(pg, at::ones({(64 << 10) + (r == 0 ? 1 : 0)}, at::kByte), 1); }},
  };
}

TEST_F(ShmCollectiveThreads, RanksInDifferentCollectivesGetTransportError) {
  const std::vector<MismatchCase> cases = mismatch_cases();
  for (const MismatchCase& mc : cases) {
    SCOPED_TRACE(mc.what);
    const std::string name = unique_name();
    SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) {
      ProcessGroupShm pg(name, r, 3, small_options());
      // A collective that works first: the mismatch is not in the group's first step.
      pg.barrier()->wait();
      const auto start = Clock::now();
      auto work = mc.call(pg, r);
      SHM_CHECK_THROWS(TransportError, [&] { work->wait(); });
      SHM_CHECK(Clock::now() - start < 3s, mc.what << ": the mismatch took "
                                                   << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count()
                                                   << " ms to notice");
      // The group's collectives are out of step now: the next one fails at once, with an error.
      const auto again = Clock::now();
      const Caught c = catch_any([&] { pg.barrier()->wait(); });
      SHM_CHECK(c.is<tdshm::Error>(), mc.what << ": the barrier after the mismatch threw " << c.describe());
      SHM_CHECK(Clock::now() - again < 1s, mc.what << ": the barrier after the mismatch took too long");
    }));
  }
}

TEST_F(ShmCollectiveProcs, RanksInDifferentCollectivesGetTransportError) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 3, [&](int r) {
    ProcessGroupShm pg(name, r, 3, small_options());
    std::vector<at::Tensor> v{at::ones({r == 1 ? 1000 : 999}, at::kDouble)};
    SHM_CHECK_THROWS(TransportError, [&] { pg.allreduce(v)->wait(); });
  }));
}

// ---------------------------------------------------------------------------------------------
// Timeouts: one rank never calls the collective

struct SitOut {
  std::atomic<int> done{0};
};

/// Rank 2 never calls the collective; ranks 0 and 1 must time out at `expected`, and the next
/// collective of the group fails at once.
void timeout_scenario(const std::string& name, int rank, const ShmOptions& opts, std::chrono::milliseconds call_timeout,
                      std::chrono::milliseconds expected, SitOut& sit_out) {
  ProcessGroupShm pg(name, rank, 3, opts);
  if (rank == 2) {
    const auto give_up = Clock::now() + 20s;
    while (sit_out.done.load() < 2 && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
    return;
  }
  const at::Tensor t = at::ones({100000});  // several window halves
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.timeout = call_timeout;
  const auto start = Clock::now();
  const Caught c = catch_any([&] { pg.allreduce(v, o)->wait(); });
  const auto elapsed = Clock::now() - start;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count();
  SHM_CHECK(c.is<TimeoutError>(), "allreduce threw " << c.describe());
  SHM_CHECK(elapsed >= expected - 20ms, "timed out after " << ms << " ms, expected " << expected.count());
  SHM_CHECK(elapsed < expected + 1500ms, "timed out after " << ms << " ms, expected " << expected.count());
  const auto again = Clock::now();
  const Caught c2 = catch_any([&] { pg.barrier()->wait(); });
  SHM_CHECK(c2.is<tdshm::Error>(), "the barrier after the timeout threw " << c2.describe());
  SHM_CHECK(Clock::now() - again < 1s, "the barrier after the timeout took too long");
  sit_out.done.fetch_add(1);
  // Leave only once the other waiter has timed out too: a rank that left is a lost peer, and the
  // other one would rightly see a PeerLostError instead of its timeout.
  const auto give_up = Clock::now() + 20s;
  while (sit_out.done.load() < 2 && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
}

TEST_F(ShmCollectiveThreads, OneRankAbsentTimesOutAtTheGroupTimeout) {
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 600ms;
  opts.window_bytes = 4096;
  SitOut sit_out;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) {
    timeout_scenario(name, r, opts, c10d::kUnsetTimeout, 600ms, sit_out);
  }));
}

TEST_F(ShmCollectiveThreads, OneRankAbsentTimesOutAtTheCallTimeout) {
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 10s;
  SitOut sit_out;
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kThreads, 3, [&](int r) { timeout_scenario(name, r, opts, 300ms, 300ms, sit_out); }));
}

// ---------------------------------------------------------------------------------------------
// A rank killed mid-collective (real processes)

struct KillCollectiveRecord {
  std::atomic<int> started{0};             // ranks that finished one collective
  std::atomic<int64_t> kill_ns{0};         // when the parent sent SIGKILL
  std::atomic<int64_t> failed_ns[3] = {};  // when each survivor's wait() threw
  std::atomic<int> later_ok[3] = {};       // the survivor's next collective failed fast
};

/// Each rank loops a collective of a 16 MiB tensor through a 4 KiB window (thousands of steps
/// per call) until it fails; the parent kills one rank once all are in the loop.
void looping_rank(const std::string& name, int rank, bool broadcast, KillCollectiveRecord& record) {
  ShmOptions opts = default_slot_options();  // peer_check_interval 100 ms
  opts.window_bytes = 4096;
  opts.timeout = 30s;
  ProcessGroupShm pg(name, rank, 3, opts);
  const at::Tensor t = at::ones({int64_t{4} << 20}, at::kFloat);
  for (int i = 0;; ++i) {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions ao;
    ao.reduceOp = c10d::ReduceOp::MAX;  // stays all ones
    const Caught c = catch_any([&] { (broadcast ? pg.broadcast(v) : pg.allreduce(v, ao))->wait(); });
    if (c.threw) {
      record.failed_ns[rank].store(monotonic_ns());
      SHM_CHECK(record.kill_ns.load() != 0, "call " << i << " failed before any rank was killed: " << c.describe());
      SHM_CHECK(c.is<PeerLostError>(), "wait() threw " << c.describe() << ", not a tdshm::PeerLostError");
      break;
    }
    SHM_CHECK(t[12345].item<float>() == 1.0f && t[-1].item<float>() == 1.0f, "call " << i << " changed the values");
    if (i == 0) record.started.fetch_add(1);
    SHM_CHECK(i < 100000, "the loop never failed");
  }
  // The group is unusable now: a later collective fails fast too.
  const auto start = Clock::now();
  const Caught c = catch_any([&] { pg.barrier()->wait(); });
  SHM_CHECK(c.is<tdshm::Error>(), "the barrier after the loss threw " << c.describe());
  SHM_CHECK(Clock::now() - start < 1s, "the barrier after the loss took "
                                           << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count()
                                           << " ms");
  record.later_ok[rank].store(1);
}

void rank_killed_mid_collective(const std::string& name, bool broadcast, int victim) {
  Shared<KillCollectiveRecord> record;
  std::vector<Child> children;
  for (int r = 0; r < 3; ++r) children.emplace_back([&, r] { looping_rank(name, r, broadcast, *record); });
  const auto give_up = Clock::now() + 30s;
  while (record->started.load() < 3 && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(record->started.load(), 3) << "the ranks never completed a first collective";
  std::this_thread::sleep_for(100ms);  // well inside a call of several thousand steps
  record->kill_ns.store(monotonic_ns());
  children[static_cast<size_t>(victim)].kill();
  wait_all(children, 20s);
  EXPECT_EQ(children[static_cast<size_t>(victim)].signal(), SIGKILL) << children[static_cast<size_t>(victim)].describe();
  for (int r = 0; r < 3; ++r) {
    if (r == victim) continue;
    EXPECT_TRUE(children[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << children[static_cast<size_t>(r)].describe();
    const int64_t failed = record->failed_ns[r].load();
    ASSERT_NE(failed, 0) << "rank " << r << " never failed";
    const double ms = static_cast<double>(failed - record->kill_ns.load()) / 1e6;
    std::fprintf(stderr, "[%s, rank %d killed] rank %d noticed after %.0f ms\n", broadcast ? "broadcast" : "allreduce",
                 victim, r, ms);
    EXPECT_LT(ms, 3000.0) << "rank " << r << " noticed the loss " << ms << " ms after the kill";
    EXPECT_EQ(record->later_ok[r].load(), 1) << "rank " << r;
  }
  // The dead rank's slot keeps the segment; it is stale now that every rank is gone.
  remove_stale_segment(name);
}

TEST_F(ShmCollectiveProcs, RankKilledMidAllreduceFailsTheOthersWithPeerLost) {
  rank_killed_mid_collective(unique_name(), /*broadcast=*/false, /*victim=*/2);
}

TEST_F(ShmCollectiveProcs, RootKilledMidBroadcastFailsTheOthersWithPeerLost) {
  rank_killed_mid_collective(unique_name(), /*broadcast=*/true, /*victim=*/0);
}

// A survivor that noticed the loss first, failed and destroyed its group is gone too when a
// slower survivor checks its peers; the slower one's PeerLostError still names the rank the
// collective lacks (the killed one), not the survivor that published the step and left.
struct WhoIsNamedRecord {
  std::atomic<int> entering{0};     // ranks 0 and 1 about to enter the allreduce
  std::atomic<int> rank1_left{0};   // rank 1 failed and destroyed its group
  char rank0_error[512] = {};       // what rank 0's wait() threw
  std::atomic<int> rank0_done{0};
};

TEST_F(ShmCollectiveProcs, APeerLostErrorNamesTheRankTheStepLacksNotASurvivorThatLeft) {
  const std::string name = unique_name();
  Shared<WhoIsNamedRecord> record;
  auto rank_body = [&](int r) {
    ShmOptions opts = default_slot_options();
    opts.timeout = 30s;
    // Rank 1 notices the loss within ~10 ms; rank 0 first checks its peers 2 s after it joined,
    // long after rank 1 has left.
    opts.peer_check_interval = r == 1 ? 10ms : 2000ms;
    auto pg = std::make_unique<ProcessGroupShm>(name, r, 3, opts);
    if (r == 2) {
      for (;;) std::this_thread::sleep_for(1s);  // never enters the allreduce; killed
    }
    std::vector<at::Tensor> v{at::ones({4}, at::kFloat)};
    record->entering.fetch_add(1);
    const Caught c = catch_any([&] { pg->allreduce(v)->wait(); });
    SHM_CHECK(c.is<PeerLostError>(), "rank " << r << ": the allreduce threw " << c.describe());
    if (r == 1) {
      pg.reset();  // destroy the group: rank 1 leaves the segment
      record->rank1_left.store(1);
      return;
    }
    std::snprintf(record->rank0_error, sizeof record->rank0_error, "%s", c.what.c_str());
    record->rank0_done.store(1);
  };
  std::vector<Child> children;
  for (int r = 0; r < 3; ++r) children.emplace_back([&, r] { rank_body(r); });
  const auto give_up = Clock::now() + 30s;
  while (record->entering.load() < 2 && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(record->entering.load(), 2) << "ranks 0 and 1 never reached the allreduce";
  std::this_thread::sleep_for(50ms);  // both are waiting in its first step
  children[2].kill();
  wait_all(children, 20s);
  EXPECT_TRUE(children[0].ok()) << children[0].describe();
  EXPECT_TRUE(children[1].ok()) << children[1].describe();
  ASSERT_EQ(record->rank1_left.load(), 1) << "rank 1 never left";
  ASSERT_EQ(record->rank0_done.load(), 1) << "rank 0 never failed";
  const std::string what = record->rank0_error;
  EXPECT_NE(what.find("rank 2 "), std::string::npos) << "rank 0's error does not name the killed rank 2: " << what;
  EXPECT_EQ(what.find("rank 1 "), std::string::npos) << "rank 0's error names rank 1, which published and left: " << what;
  remove_stale_segment(name);
}

// A rank that finished the group's last collective and left (destroyed its group, exited) is no
// error for a peer still on its way out of that collective: the peer has everything it needs.
// Blocking waits (spin 0), one rank late, fresh groups of 3 processes, many times.
TEST_F(ShmCollectiveProcs, LeavingRightAfterTheLastCollectiveIsNoErrorForTheOthers) {
  for (int i = 0; i < 12; ++i) {
    const std::string name = unique_name();
    const auto failures = run_ranks(Peers::kProcesses, 3, [&](int r) {
      ProcessGroupShm pg(name, r, 3, small_options(0us));
      // Late by more than a peer check interval (50 ms): the waiters check liveness meanwhile.
      if (r == i % 3) std::this_thread::sleep_for(std::chrono::milliseconds(i % 2 == 0 ? 5 : 120));
      std::vector<at::Tensor> v{at::full({1}, static_cast<int64_t>(r), at::kLong)};
      pg.allreduce(v)->wait();
      SHM_CHECK(v[0].item<int64_t>() == 3, "allreduce got " << v[0].item<int64_t>());
    });
    for (const std::string& f : failures) ADD_FAILURE() << "round " << i << ": " << f;
    if (!failures.empty()) break;
  }
}

// ---------------------------------------------------------------------------------------------
// Collectives with point-to-point, back to back, and on two groups

TEST_F(ShmCollectiveThreads, CollectivesInterleaveWithPointToPoint) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) {
    ShmOptions opts = small_options();
    opts.window_bytes = 1024;
    ProcessGroupShm pg(name, r, 3, opts);
    for (int i = 0; i < 30; ++i) {
      // A ring of messages posted before the collective and received after it.
      const int next = (r + 1) % 3, prev = (r + 2) % 3;
      const int64_t bytes = i % 3 == 0 ? 8 : 3 * 4096 + 5;
      const at::Tensor sent = pattern(at::kByte, bytes, static_cast<uint64_t>(i * 3 + r));
      auto s = post_send(pg, sent, next, i);
      std::vector<at::Tensor> v{at::full({300}, static_cast<int64_t>(r + i), at::kLong)};
      pg.allreduce(v)->wait();
      SHM_CHECK(at::equal(v[0], at::full({300}, static_cast<int64_t>(3 * i + 3), at::kLong)), "allreduce " << i);
      const at::Tensor got = at::zeros({bytes}, at::kByte);
      post_recv(pg, got, prev, i)->wait();
      s->wait();
      SHM_CHECK(same_bytes(got, pattern(at::kByte, bytes, static_cast<uint64_t>(i * 3 + prev))), "message " << i);
      // A broadcast between a send and its receive.
      if (r == 0) s = post_send(pg, sent, 2, 1000 + i);
      std::vector<at::Tensor> b{r == i % 3 ? at::arange(700) : at::zeros({700}, at::kLong)};
      pg.broadcast(b, c10d::BroadcastOptions{i % 3})->wait();
      SHM_CHECK(at::equal(b[0], at::arange(700)), "broadcast " << i);
      if (r == 2) {
        const at::Tensor got2 = at::zeros({bytes}, at::kByte);
        post_recv(pg, got2, 0, 1000 + i)->wait();
        SHM_CHECK(same_bytes(got2, pattern(at::kByte, bytes, static_cast<uint64_t>(i * 3))), "message to 2, " << i);
      }
      if (r == 0) s->wait();
    }
  }));
}

TEST_F(ShmCollectiveThreads, ManySmallAllreducesStayInStep) {
  const std::string name = unique_name();
  constexpr int kRounds = 2000;
  const auto start = Clock::now();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) {
    ProcessGroupShm pg(name, r, 3, small_options());
    const at::Tensor t = at::zeros({1}, at::kLong);  // 8 bytes
    for (int i = 0; i < kRounds; ++i) {
      t.fill_(int64_t{i} * 3 + r);
      std::vector<at::Tensor> v{t};
      pg.allreduce(v)->wait();
      SHM_CHECK(t.item<int64_t>() == int64_t{i} * 9 + 3, "round " << i << " on rank " << r << ": " << t.item<int64_t>());
    }
  }));
  std::fprintf(stderr, "[many small] %d allreduces of 8 B over 3 threads: %.1f us each\n", kRounds,
               std::chrono::duration<double, std::micro>(Clock::now() - start).count() / kRounds);
}

TEST_F(ShmCollectiveProcs, ManySmallAllreducesStayInStep) {
  const std::string name = unique_name();
  constexpr int kRounds = 2000;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 3, [&](int r) {
    ProcessGroupShm pg(name, r, 3, small_options());
    const at::Tensor t = at::zeros({1}, at::kDouble);
    for (int i = 0; i < kRounds; ++i) {
      t.fill_(static_cast<double>(i * 3 + r));
      std::vector<at::Tensor> v{t};
      c10d::AllreduceOptions o;
      o.reduceOp = i % 2 == 0 ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
      pg.allreduce(v, o)->wait();
      const double want = i % 2 == 0 ? i * 9.0 + 3 : i * 3.0 + 2;
      SHM_CHECK(t.item<double>() == want, "round " << i << " on rank " << r << ": " << t.item<double>());
    }
  }));
}

TEST_F(ShmCollectiveThreads, TwoGroupsUsedAlternately) {
  // A "subgroup" is another ProcessGroupShm on its own segment: ranks 0 and 1 of the world group
  // are ranks 1 and 0 of the pair group.
  const std::string world_name = unique_name(), pair_name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) {
    ShmOptions opts = small_options();
    opts.window_bytes = 1024;
    ProcessGroupShm world(world_name, r, 3, opts);
    std::unique_ptr<ProcessGroupShm> pair;
    if (r < 2) pair = std::make_unique<ProcessGroupShm>(pair_name, 1 - r, 2, opts);
    for (int i = 0; i < 40; ++i) {
      std::vector<at::Tensor> v{at::full({257}, static_cast<float>(r + i))};
      world.allreduce(v)->wait();
      SHM_CHECK(at::equal(v[0], at::full({257}, static_cast<float>(3 * i + 3))), "world allreduce " << i);
      if (pair) {
        std::vector<at::Tensor> p{at::full({300}, static_cast<int32_t>(r * 100 + i), at::kInt)};
        c10d::AllreduceOptions o;
        o.reduceOp = c10d::ReduceOp::MAX;
        pair->allreduce(p, o)->wait();
        SHM_CHECK(at::equal(p[0], at::full({300}, 100 + i, at::kInt)), "pair allreduce " << i);
        std::vector<std::vector<at::Tensor>> outs{{at::zeros({2}), at::zeros({2})}};
        std::vector<at::Tensor> in{at::full({2}, static_cast<float>(r))};
        pair->allgather(outs, in)->wait();
        // Pair rank 0 is world rank 1.
        SHM_CHECK(outs[0][0][0].item<float>() == 1.0f && outs[0][1][0].item<float>() == 0.0f, "pair allgather " << i);
      }
      std::vector<at::Tensor> b{r == 2 ? at::full({5}, i) : at::zeros({5}, at::kLong)};
      world.broadcast(b, c10d::BroadcastOptions{2})->wait();
      SHM_CHECK(at::equal(b[0], at::full({5}, i)), "world broadcast " << i);
    }
  }));
}

// ---------------------------------------------------------------------------------------------
// Collectives the backend refuses

// What torch 1.13's ProcessGroup base class refuses and ProcessGroupShm does not override: each
// call throws c10::Error naming the backend ("ProcessGroup shm does not support ...").
TEST_F(ShmCollectiveThreads, UnsupportedCollectivesSayShm) {
  const std::string name = unique_name();
  ProcessGroupShm pg(name, 0, 1, small_options());
  at::Tensor t = at::ones({4});
  at::Tensor out = at::zeros({4});
  std::vector<at::Tensor> ts{t};
  std::vector<at::Tensor> outs{out};
  std::vector<std::vector<at::Tensor>> nested{{out}};
  const std::vector<std::tuple<const char*, const char*, std::function<void()>>> calls = {
      {"allgather_coalesced", "allgather_coalesced", [&] { pg.allgather_coalesced(nested, ts); }},
      {"alltoall", "alltoall", [&] { pg.alltoall(outs, ts); }},
      {"monitoredBarrier", "monitoredBarrier", [&] { pg.monitoredBarrier(c10d::BarrierOptions()); }},
  };
  for (const auto& [what, needle, call] : calls) {
    SCOPED_TRACE(what);
    const Caught c = catch_any(call);
    EXPECT_TRUE(c.is<c10::Error>()) << c.describe();
    EXPECT_TRUE(contains_nocase(c.what, "shm")) << c.describe();
    EXPECT_TRUE(contains_nocase(c.what, needle)) << c.describe();
  }
  // The group still works, collectives included.
  EXPECT_TRUE(pg.barrier()->wait());
  std::vector<at::Tensor> v{at::full({3}, 2.0f)};
  EXPECT_TRUE(pg.allreduce(v)->wait());
  EXPECT_TRUE(at::equal(v[0], at::full({3}, 2.0f)));
}

// ---------------------------------------------------------------------------------------------
// Work

TEST_F(ShmWorkThreads, IsCompletedBecomesTrueWithoutWait) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    const at::Tensor values = pattern(at::kByte, 3 * 4096 + 7, 12);
    const at::Tensor t = r == 0 ? values.clone() : at::zeros_like(values);
    if (r == 1) std::this_thread::sleep_for(50ms);
    auto work = r == 0 ? post_send(pg, t, 1, 3) : post_recv(pg, t, 0, 3);
    const auto give_up = Clock::now() + 5s;
    while (!work->isCompleted()) {
      SHM_CHECK(Clock::now() < give_up, "isCompleted() still false after 5 s on rank " << r);
    }
    SHM_CHECK(work->isSuccess(), "completed without success on rank " << r);
    SHM_CHECK(work->wait(), "wait() after completion returned false");
    SHM_CHECK(same_bytes(t, values), "rank " << r << " ends with wrong bytes");
  }));
}

// A wait that times out withdraws its recv: the work is completed with the TimeoutError, and the
// peer's next message goes to the next recv posted for it, never into the abandoned tensor.
TEST_F(ShmWorkThreads, WaitWithTimeoutThrowsTimeoutErrorAndWithdrawsTheRecv) {
  const std::string name = unique_name();
  std::atomic<bool> timed_out{false}, rank0_done{false};
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    if (r == 1) {
      // Sends nothing until rank 0's wait has timed out, then one message on the same tag.
      ProcessGroupShm pg(name, 1, 2, small_options());
      const auto give_up = Clock::now() + 20s;
      while (!timed_out.load() && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
      post_send(pg, at::full({4}, 7.0f), 0, 9)->wait();
      while (!rank0_done.load() && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
      return;
    }
    const at::Tensor abandoned = at::zeros({4}, at::kFloat);
    ProcessGroupShm pg(name, 0, 2, small_options());
    auto work = post_recv(pg, abandoned, 1, 9);
    const auto start = Clock::now();
    const Caught c = catch_any([&] { work->wait(200ms); });
    const auto elapsed = Clock::now() - start;
    SHM_CHECK(c.is<TimeoutError>(), "wait(200 ms) threw " << c.describe());
    SHM_CHECK(elapsed >= 195ms, "wait(200 ms) gave up after " << elapsed.count() / 1000 << " us");
    SHM_CHECK(elapsed < 1200ms, "wait(200 ms) took " << elapsed.count() / 1000000 << " ms");
    SHM_CHECK(work->isCompleted(), "a withdrawn recv is not completed");
    SHM_CHECK(!work->isSuccess(), "a withdrawn recv reports success");
    const Caught again = catch_any([&] { work->wait(50ms); });
    SHM_CHECK(again.is<TimeoutError>(), "waiting again on the withdrawn recv threw " << again.describe());
    timed_out.store(true);
    const at::Tensor fresh = at::zeros({4}, at::kFloat);
    post_recv(pg, fresh, 1, 9)->wait();
    rank0_done.store(true);
    SHM_CHECK(at::equal(fresh, at::full({4}, 7.0f)), "the next recv got " << fresh);
    SHM_CHECK(at::equal(abandoned, at::zeros({4})), "the withdrawn recv's tensor was written: " << abandoned);
  }));
}

// A recv still pending when its group is destroyed completes with a tdshm error.
TEST_F(ShmWorkThreads, PendingRecvFailsWhenTheGroupIsDestroyed) {
  const std::string name = unique_name();
  std::atomic<bool> rank0_done{false};
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    if (r == 1) {
      ProcessGroupShm pg(name, 1, 2, small_options());
      const auto give_up = Clock::now() + 20s;
      while (!rank0_done.load() && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
      return;
    }
    c10::intrusive_ptr<c10d::Work> work;
    const at::Tensor t = at::zeros({4}, at::kFloat);
    {
      ProcessGroupShm pg(name, 0, 2, small_options());
      work = post_recv(pg, t, 1, 9);
      SHM_CHECK(!work->isCompleted(), "the recv completed with nothing sent");
    }
    rank0_done.store(true);
    SHM_CHECK(work->isCompleted(), "a pending work of a destroyed group is not completed");
    const Caught after = catch_any([&] { work->wait(); });
    SHM_CHECK(after.is<tdshm::Error>(), "wait() on a work of a destroyed group threw " << after.describe());
  }));
}

TEST_F(ShmWorkThreads, WaitEndsAtTheGroupTimeout) {
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 500ms;
  std::atomic<bool> rank0_done{false};
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, opts);
    if (r == 1) {
      const auto give_up = Clock::now() + 20s;
      while (!rank0_done.load() && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
      return;
    }
    const at::Tensor t = at::zeros({4}, at::kFloat);
    auto work = post_recv(pg, t, 1, 9);
    const auto start = Clock::now();
    const Caught c = catch_any([&] { work->wait(); });
    const auto elapsed = Clock::now() - start;
    rank0_done.store(true);
    SHM_CHECK(c.is<TimeoutError>(), "wait() threw " << c.describe());
    SHM_CHECK(elapsed >= 450ms && elapsed < 2s, "wait() gave up after " << elapsed.count() / 1000000 << " ms");
  }));
}

TEST_F(ShmWorkThreads, FuturesCompleteWithoutWait) {
  // Both ends only wait on futures: the helper thread of getFuture() must move the chunks.
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    for (int64_t bytes : {int64_t{8}, int64_t{16 * 4096 + 3}}) {
      const at::Tensor values = pattern(at::kByte, bytes, static_cast<uint64_t>(bytes));
      const at::Tensor t = r == 0 ? values.clone() : at::zeros_like(values);
      if (r == 0) std::this_thread::sleep_for(100ms);  // the receiver's future waits first
      auto work = r == 0 ? post_send(pg, t, 1, 4) : post_recv(pg, t, 0, 4);
      auto future = work->getFuture();
      SHM_CHECK(future, "getFuture() returned null");
      future->wait();
      SHM_CHECK(!future->hasError(), "the future of rank " << r << " failed: " << future->tryRetrieveErrorMessage());
      SHM_CHECK(work->isCompleted(), "the future completed before its work");
      SHM_CHECK(same_bytes(t, values), "rank " << r << " ends with wrong bytes (" << bytes << ")");
    }
  }));
}

// The helper thread of getFuture() survives callbacks that throw and callbacks that destroy the
// group: nothing escapes it, nothing aborts.
TEST_F(ShmWorkThreads, FutureCallbacksMayThrowOrDestroyTheGroup) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    auto pg = std::make_unique<ProcessGroupShm>(name, r, 2, small_options());
    if (r == 1) {
      std::this_thread::sleep_for(100ms);  // rank 0's futures wait first
      post_send(*pg, at::full({2}, 1.0f), 0, 4)->wait();
      post_send(*pg, at::full({2}, 2.0f), 0, 5)->wait();
      return;
    }
    const at::Tensor a = at::zeros({2}), b = at::zeros({2});
    auto first = post_recv(*pg, a, 1, 4)->getFuture();
    first->addCallback([](c10::ivalue::Future&) { throw std::runtime_error("a user callback failed"); });
    std::atomic<bool> destroyed{false};
    auto second = post_recv(*pg, b, 1, 5)->getFuture();
    second->addCallback([&](c10::ivalue::Future&) {
      pg.reset();  // on the helper thread itself
      destroyed.store(true);
    });
    const auto give_up = Clock::now() + 20s;
    while (!destroyed.load() && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
    SHM_CHECK(destroyed.load(), "the second callback never ran");
    SHM_CHECK(first->completed() && !first->hasError(), "the first future: " << first->tryRetrieveErrorMessage());
    SHM_CHECK(at::equal(a, at::full({2}, 1.0f)) && at::equal(b, at::full({2}, 2.0f)), "received " << a << b);
  }));
}

// A recv into a tensor whose elements overlap is refused when posted (TypeError), so the message
// meant for it stays for the next recv: the pair stays in step.
TEST_F(ShmWorkThreads, RecvIntoAnExpandedTensorIsRefusedAndThePairStaysInStep) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    if (r == 1) {
      post_send(pg, at::full({4}, 1.0f), 0, 3)->wait();
      post_send(pg, at::full({4}, 2.0f), 0, 3)->wait();
      return;
    }
    const at::Tensor expanded = at::zeros({1}).expand({4});
    const Caught c = catch_any([&] { post_recv(pg, expanded, 1, 3); });
    SHM_CHECK(c.is<TypeError>(), "recv into an expanded tensor threw " << c.describe());
    SHM_CHECK(contains_nocase(c.what, "overlap"), "the message does not say why: " << c.what);
    for (float want : {1.0f, 2.0f}) {
      const at::Tensor t = at::zeros({4});
      post_recv(pg, t, 1, 3)->wait();
      SHM_CHECK(at::equal(t, at::full({4}, want)), "expected " << want << ", got " << t);
    }
  }));
}

TEST_F(ShmWorkThreads, AnySourceReportsTheSenderAndResultIsTheTensor) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) {
    ProcessGroupShm pg(name, r, 3, small_options());
    if (r == 0) {
      for (int sender : {2, 1}) {
        const at::Tensor t = at::zeros({1}, at::kLong);
        std::vector<at::Tensor> v{t};
        auto work = pg.recvAnysource(v, 8);
        work->wait();
        SHM_CHECK(work->sourceRank() == sender, "sourceRank() " << work->sourceRank() << ", sent by " << sender);
        SHM_CHECK(t.item<int64_t>() == sender * 11, "value " << t.item<int64_t>());
        // c10d: a receive's result() is the tensor it received into (the same storage).
        const auto result = work->result();
        SHM_CHECK(result.size() == 1 && result[0].is_same(t), "recvAnysource result() is not the received tensor");
      }
      const at::Tensor t = at::zeros({1}, at::kLong);
      std::vector<at::Tensor> v{t};
      auto work = pg.recv(v, 1, 9);
      work->wait();
      const auto result = work->result();
      SHM_CHECK(result.size() == 1 && result[0].is_same(t) && t.item<int64_t>() == 99,
                "recv result() is not the received tensor, or the value " << t.item<int64_t>() << " is not 99");
    } else {
      // Rank 2 first, then rank 1 once rank 2's message is surely in.
      if (r == 1) std::this_thread::sleep_for(200ms);
      post_send(pg, at::full({1}, r * 11, at::kLong), 0, 8)->wait();
      if (r == 1) {
        std::vector<at::Tensor> v{at::full({1}, 99, at::kLong)};
        auto work = pg.send(v, 0, 9);
        work->wait();
        SHM_CHECK(work->result().empty(), "a send's result() has " << work->result().size() << " tensors");
      }
    }
  }));
}

// ---------------------------------------------------------------------------------------------
// Messages that do not fit

/// Rank 0 sends `sent`; rank 1 receives into `into`: a TransportError naming `needles`. The bad
/// message is dropped: the next receive on the same tag gets the next message on it, and one on
/// another tag works too.
void expect_mismatch(const std::string& name, const at::Tensor& sent, const at::Tensor& into,
                     const std::vector<std::string>& needles) {
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    if (r == 0) {
      // The outcome of the send itself is not specified (a small send completes on its own).
      const Caught c = catch_any([&] { post_send(pg, sent, 1, 1)->wait(); });
      if (c.threw) std::fprintf(stderr, "[mismatch] the sender got %s\n", c.describe().c_str());
      post_send(pg, at::full({3}, 5, at::kInt), 1, 1)->wait();
      post_send(pg, at::full({2}, 7, at::kLong), 1, 2)->wait();
    } else {
      const Caught c = SHM_CHECK_THROWS(TransportError, [&] { post_recv(pg, into, 0, 1)->wait(); });
      std::fprintf(stderr, "[mismatch] %s\n", c.describe().c_str());
      for (const std::string& n : needles) {
        SHM_CHECK(c.what.find(n) != std::string::npos, "the message does not mention " << n << ": " << c.what);
      }
      const at::Tensor same_tag = at::zeros({3}, at::kInt);
      post_recv(pg, same_tag, 0, 1)->wait();
      SHM_CHECK(same_tag[2].item<int32_t>() == 5, "the message after the dropped one is wrong");
      const at::Tensor next = at::zeros({2}, at::kLong);
      post_recv(pg, next, 0, 2)->wait();
      SHM_CHECK(next[1].item<int64_t>() == 7, "the next message is wrong");
    }
  }));
}

TEST_F(ShmWorkThreads, SizeMismatchIsTransportError) {
  expect_mismatch(unique_name(), at::ones({100}, at::kByte), at::zeros({64}, at::kByte), {"100", "64"});
}

TEST_F(ShmWorkThreads, SmallerMessageThanTensorIsTransportError) {
  expect_mismatch(unique_name(), at::ones({64}, at::kByte), at::zeros({100}, at::kByte), {"100", "64"});
}

TEST_F(ShmWorkThreads, EmptyMessageIntoNonEmptyTensorIsTransportError) {
  expect_mismatch(unique_name(), at::ones({0}, at::kByte), at::zeros({1}, at::kByte), {});
}

TEST_F(ShmWorkThreads, DtypeMismatchWithEqualBytesIsTransportError) {
  expect_mismatch(unique_name(), at::ones({4}, at::kFloat), at::zeros({4}, at::kInt), {});
}

TEST_F(ShmWorkThreads, ShapeMismatchWithEqualBytesIsTransportError) {
  expect_mismatch(unique_name(), at::ones({2, 4}, at::kFloat), at::zeros({4, 2}, at::kFloat), {});
}

}  // namespace
}  // namespace tdshm::test
