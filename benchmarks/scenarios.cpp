// The workload scenarios of `tdshm bench --scenario` (scenarios.h): the ranks' schedule, the
// loader and actor-learner ranks, and the tables; forking and reaping the ranks of each process
// layout is bench_ranks.h's.

#include "scenarios.h"

#include "bench_ranks.h"
#include "board_scenario.h"
#include "collectives.h"
#include "copy_channel.h"
#include "loader_batch.h"
#include "scenario_results.h"

#include <tdshm/distributed.h>
#include <tdshm/feed.h>
#include <tdshm/process_group.h>
#include <tdshm/tensordict.h>

#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <new>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <thread>

namespace tdshm::bench {

namespace {

using Clock = std::chrono::steady_clock;

const char* const kTransports[] = {"shm", "gloo", "memcpy", "inplace"};

// The memcpy reference (copy_channel.h) streams through ProcessGroupShm's default arena: 64
// slots of 64 KiB per sender.
constexpr size_t kCopySlotBytes = size_t{64} << 10;
constexpr uint32_t kCopySlots = 64;
const size_t kCopyChannelBytes = (CopyChannel::bytes_needed(kCopySlotBytes, kCopySlots) + 63) / 64 * 64;

// ---- the loader's batch (loader_batch.h) ----

// The in-place reference's buffer holds a batch as image, label, idx, worker, one after the other.
const size_t kInplaceChannelBytes = InplaceChannel::bytes_needed(kBatchBytes);

// ---- the actor-learner's tensordicts ----

constexpr int64_t kWeightLeaves = 4;
constexpr int64_t kWeightFloats = (int64_t{1} << 20) / static_cast<int64_t>(sizeof(float));
constexpr int64_t kSteps = 64;  // trajectory length
constexpr size_t kWeightBytes = static_cast<size_t>(kWeightLeaves * kWeightFloats) * sizeof(float);
constexpr size_t kTrajectoryBytes = static_cast<size_t>(kSteps) * (16 * sizeof(float) + sizeof(int64_t) + sizeof(float));

TensorDict make_weights() {
  TensorDict td;
  for (int64_t i = 0; i < kWeightLeaves; ++i) td.set("w" + std::to_string(i), at::zeros({kWeightFloats}));
  return td.consolidate();
}

TensorDict make_trajectory() {
  return TensorDict({{"obs", at::zeros({kSteps, 16})}, {"action", at::zeros({kSteps}, at::kLong)},
                     {"reward", at::zeros({kSteps})}},
                    {kSteps});
}

// ---- schedule ----

struct Step {
  std::string pattern;
  std::string transport;
  int repeat;  // -1: warm-up
  int count;   // batches per worker, or steps
};

struct Layout {
  std::string scenario;  // "loader" or "actor-learner"
  int peers = 1;         // workers or actors
  int world() const { return peers + 1; }
  std::string segment;
  std::vector<Step> schedule;
  int repeat = 1;
  // Progress line (rank 0): measurements before this layout's, and in the whole scenario.
  bool progress = false;
  bool tty = false;
  // TDSHM_BENCH_FAULT (tests only): "loader-data": worker 1 sends a wrong meta.worker in batch 5;
  // "worker-exit": worker 1 (actor 1) exits with 7 before its batch (step) 3.
  std::string fault;
  int progress_done = 0;
  int progress_total = 0;
  // The memcpy reference's channels (made before fork, shared by the ranks): loader: one per
  // worker (worker -> main); actor-learner: two per actor (weights out, trajectory back).
  uint8_t* copy_memory = nullptr;
  // The in-place reference's buffers (loader: one per worker), after the memcpy channels.
  uint8_t* inplace_memory = nullptr;
  size_t channels() const { return scenario == "loader" ? static_cast<size_t>(peers) : 2 * static_cast<size_t>(peers); }
  size_t inplace_channels() const { return scenario == "loader" ? static_cast<size_t>(peers) : 0; }
  InplaceChannel inplace_channel(int w) const {
    return {inplace_memory + static_cast<size_t>(w - 1) * kInplaceChannelBytes, kBatchBytes};
  }
  CopyChannel worker_channel(int w) const { return channel(static_cast<size_t>(w - 1)); }
  CopyChannel weights_channel(int a) const { return channel(2 * static_cast<size_t>(a - 1)); }
  CopyChannel trajectory_channel(int a) const { return channel(2 * static_cast<size_t>(a - 1) + 1); }

 private:
  CopyChannel channel(size_t i) const { return {copy_memory + i * kCopyChannelBytes, kCopySlotBytes, kCopySlots}; }
};

std::vector<std::string> patterns_of(const std::string& scenario) {
  if (scenario == "loader") {
    return {"blocking", "irecv-ahead", "consolidated", "loan-copy", "loan-view", "loan-view-c", "feed"};
  }
  return {"weights-trajectory", "loan-view"};
}

// Loans (docs/loans.md): the sender fills loans (double-buffered) and sends references; main
// copies once (loan-copy) or takes views (loan-view). Over gloo a loan is an ordinary tensor.
bool is_loan_pattern(const std::string& pattern) { return pattern.rfind("loan-", 0) == 0; }

// Which transports a pattern runs over: shm and gloo every one; the memcpy reference the copying
// patterns (a loan is the shm transport's); the in-place reference the loader's loan-view, whose
// hand-written counterpart it is (worker writes in place, main reads in place). The feed
// (include/tdshm/feed.h) is the shm transport's ready-made loader core.
bool runs(const std::string& scenario, const std::string& pattern, const std::string& transport) {
  if (pattern == "feed") return transport == "shm";
  if (transport == "memcpy") return !is_loan_pattern(pattern);
  if (transport == "inplace") return scenario == "loader" && pattern == "loan-view";
  return true;
}

std::vector<Step> make_schedule(const std::string& scenario, int repeat, int count) {
  std::vector<Step> s;
  const int warm = std::max(2, count / 10);
  constexpr size_t kCount = std::size(kTransports);
  for (const auto& p : patterns_of(scenario)) {
    for (const char* t : kTransports) {
      if (runs(scenario, p, t)) s.push_back({p, t, -1, warm});
    }
  }
  for (int r = 0; r < repeat; ++r) {
    for (const auto& p : patterns_of(scenario)) {
      // The order rotates, so that no transport always runs right after the same other one.
      for (size_t i = 0; i < kCount; ++i) {
        const char* t = kTransports[(i + static_cast<size_t>(r)) % kCount];
        if (runs(scenario, p, t)) s.push_back({p, t, r, count});
      }
    }
  }
  return s;
}

int measured_steps(const std::vector<Step>& schedule) {
  return static_cast<int>(std::count_if(schedule.begin(), schedule.end(), [](const Step& s) { return s.repeat >= 0; }));
}

// ---- a rank ----

std::string step_label(const Layout& layout, const Step& s) {
  std::string label = s.pattern + " " + s.transport + (layout.scenario == "loader" ? " N=" : " actors=") +
                      std::to_string(layout.peers);
  if (s.repeat < 0) return "warm-up " + label;
  if (layout.repeat > 1) label += " repeat " + std::to_string(s.repeat + 1) + "/" + std::to_string(layout.repeat);
  return label;
}

void show_progress(const Layout& layout, int done, const Step& s) {
  if (!layout.progress) return;
  const int index = std::min(layout.progress_total, done + 1);
  std::fprintf(stderr, "%s[scenario %s %d/%d] %s ...%s", layout.tty ? "\r\033[K" : "", layout.scenario.c_str(),
               index, layout.progress_total, step_label(layout, s).c_str(), layout.tty ? "" : "\n");
  std::fflush(stderr);
}

// ---- the memcpy reference (copy_channel.h) ----

// What the reference moves of a tensordict, in a fixed order: its consolidated storage, or its
// leaves in sorted key order. Resolved before a timed loop: the reference has no bookkeeping.
std::vector<at::Tensor> copied_tensors(const TensorDict& td) {
  if (td.is_consolidated()) return {td.consolidated_storage()};
  std::vector<at::Tensor> out;
  for (const auto& key : td.sorted_leaf_keys()) out.push_back(td.get(key));
  return out;
}

size_t byte_size(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

void copy_send(CopyChannel ch, const std::vector<at::Tensor>& tensors) {
  const auto deadline = Clock::now() + kGroupTimeout;
  for (const auto& t : tensors) ch.send(t.data_ptr(), byte_size(t), deadline);
}

void copy_recv(CopyChannel ch, const std::vector<at::Tensor>& tensors) {
  const auto deadline = Clock::now() + kGroupTimeout;
  for (const auto& t : tensors) ch.recv(t.data_ptr(), byte_size(t), deadline);
}

// The group a step synchronizes on (the references use the shm group's barrier).
const Group& step_group(const Groups& groups, const Step& s) { return s.transport == "gloo" ? groups.gloo : groups.shm; }

// What main's loop took: all of it, and what reading and checking its batches costs (the
// consumption every transport pays alike; the rest is what the transport costs main). Reading
// is the median batch's read time times the batches: a read that another process preempted
// (N > CPUs) does not count its wait as reading.
struct MainTime {
  double seconds = 0;
  double read_seconds = 0;
};

// The feed pattern's ends: made at its first step and kept for the layout's run (as the groups
// of the other patterns are), so that every step runs on a warm heap.
struct FeedEnds {
  std::optional<FeedConsumer> consumer;
  std::optional<FeedProducer> producer;
};

std::string feed_name(const Layout& layout) { return layout.segment + "-feed"; }

// Rank 0 of the feed pattern: a FeedConsumer takes each worker's batches in turn, as views. Each
// worker's first item (a batch of zeros) is taken before the clock of the first step starts: the
// groups are joined and grown to the batches' size then (a heap is sized from the first item).
template <class Check>
double feed_main(const Layout& layout, const Step& s, int64_t seq0, const std::string& where, FeedEnds& ends,
                 Check&& check) {
  if (!ends.consumer) {
    ends.consumer.emplace(feed_name(layout), layout.peers, FeedOptions{.timeout = kGroupTimeout});
    for (int w = 1; w <= layout.peers; ++w) {
      if (!ends.consumer->next_td_from(w - 1)) throw std::runtime_error(where + ": worker " + std::to_string(w) + " closed");
    }
  }
  FeedConsumer& feed = *ends.consumer;
  const auto start = Clock::now();
  for (int b = 0; b < s.count; ++b) {
    for (int w = 1; w <= layout.peers; ++w) {
      const std::optional<TensorDict> batch = feed.next_td_from(w - 1);
      if (!batch) throw std::runtime_error(where + ": worker " + std::to_string(w) + " closed early");
      check(view(*batch), w, seq0 + b, where);
    }  // each view is dropped here: its worker may fill that loan again
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Rank 0 of the loader: receives `s.count` batches of every worker.
// Over the memcpy reference, irecv-ahead is blocking (the reference has no asynchronous receive).
MainTime loader_main(const Layout& layout, const Groups& groups, const Step& s, int64_t seq0,
                     std::vector<TensorDict>& plain, std::vector<TensorDict>& consolidated, FeedEnds& ends) {
  const Group& g = step_group(groups, s);
  const std::string where = "loader " + s.pattern + " " + s.transport + " N=" + std::to_string(layout.peers);
  std::vector<Transfer> pending(static_cast<size_t>(layout.peers) + 1);
  const bool by_copy = s.transport == "memcpy";
  const std::vector<TensorDict>& copy_into = s.pattern == "consolidated" ? consolidated : plain;
  std::vector<std::vector<at::Tensor>> copied(static_cast<size_t>(layout.peers) + 1);
  for (int w = 1; by_copy && w <= layout.peers; ++w) copied[w] = copied_tensors(copy_into[w]);
  const auto deadline = Clock::now() + kGroupTimeout;
  std::vector<Clock::duration> reads;
  reads.reserve(static_cast<size_t>(s.count) * static_cast<size_t>(layout.peers));
  // Two clock reads per batch (~0.1 % of a batch's time here), in every transport alike.
  auto check_batch = [&reads](const BatchView& v, int w, int64_t seq, const std::string& at) {
    const auto t0 = Clock::now();
    bench::check_batch(v, w, seq, at);
    reads.push_back(Clock::now() - t0);
  };
  auto median_reads = [&reads] {
    if (reads.empty()) return 0.0;
    std::nth_element(reads.begin(), reads.begin() + static_cast<std::ptrdiff_t>(reads.size() / 2), reads.end());
    return std::chrono::duration<double>(reads[reads.size() / 2]).count() * static_cast<double>(reads.size());
  };
  if (s.pattern == "feed") {
    const double seconds = feed_main(layout, s, seq0, where, ends, check_batch);
    return {seconds, median_reads()};
  }
  const auto start = Clock::now();
  for (int b = 0; b < s.count; ++b) {
    const int64_t seq = seq0 + b;
    if (by_copy) {
      for (int w = 1; w <= layout.peers; ++w) {
        copy_recv(layout.worker_channel(w), copied[w]);
        check_batch(view(copy_into[w]), w, seq, where);
      }
    } else if (s.transport == "inplace") {
      for (int w = 1; w <= layout.peers; ++w) {
        InplaceChannel ch = layout.inplace_channel(w);
        ch.wait_full(deadline);
        check_batch(view(ch), w, seq, where);
        ch.consume();
      }
    } else if (s.pattern == "blocking") {
      for (int w = 1; w <= layout.peers; ++w) {
        plain[w].recv({.group = g, .group_src = w});
        check_batch(view(plain[w]), w, seq, where);
      }
    } else if (s.pattern == "irecv-ahead" || s.pattern == "loan-copy") {
      for (int w = 1; w <= layout.peers; ++w) {
        pending[w] = plain[w].irecv({.group = g, .group_src = w, .return_premature = true});
      }
      for (int w = 1; w <= layout.peers; ++w) {
        pending[w].wait();
        check_batch(view(plain[w]), w, seq, where);
      }
    } else if (s.pattern == "loan-view") {
      for (int w = 1; w <= layout.peers; ++w) {
        const TensorDict batch = plain[w].recv_view({.group = g, .group_src = w});
        check_batch(view(batch), w, seq, where);
      }  // each view is dropped here: its worker may fill that loan again
    } else if (s.pattern == "loan-view-c") {
      for (int w = 1; w <= layout.peers; ++w) {
        const TensorDict batch = consolidated[w].recv_view({.group = g, .group_src = w, .consolidated = true});
        check_batch(view(batch), w, seq, where);
      }
    } else {
      for (int w = 1; w <= layout.peers; ++w) {
        consolidated[w].recv({.group = g, .group_src = w, .consolidated = true});
        check_batch(view(consolidated[w]), w, seq, where);
      }
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return {seconds, median_reads()};
}

// The test hook of TDSHM_BENCH_FAULT (see Layout::fault), called before batch or step `seq`.
void inject_fault(const std::string& fault, int rank, int64_t seq, const BatchView* batch) {
  if (rank != 1 || fault.empty()) return;
  if (fault == "worker-exit" && seq == 3) ::_exit(7);
  if (fault == "loader-data" && seq == 5 && batch != nullptr) batch->worker[0] = 99;
}

constexpr int kLoanBuffers = 4;

// A worker's production of its batches: fill_batch, timed (two clock reads per batch, in every
// transport alike). median_seconds() is what writing one batch costs a worker: with main's read,
// the work no transport can take away (scenario_results.cpp's ceiling).
class Producer {
 public:
  Producer(const Layout& layout, int w, int64_t seq0, int count) : layout_(layout), w_(w), seq0_(seq0) {
    fills_.reserve(static_cast<size_t>(count));
  }
  void produce(const BatchView& v, int b) {
    const auto t0 = Clock::now();
    fill_batch(v, w_, seq0_ + b);
    fills_.push_back(Clock::now() - t0);
    inject_fault(layout_.fault, w_, seq0_ + b, &v);
  }
  double median_seconds() {
    if (fills_.empty()) return 0;
    std::nth_element(fills_.begin(), fills_.begin() + static_cast<std::ptrdiff_t>(fills_.size() / 2), fills_.end());
    return std::chrono::duration<double>(fills_[fills_.size() / 2]).count();
  }

 private:
  const Layout& layout_;
  int w_;
  int64_t seq0_;
  std::vector<Clock::duration> fills_;
};

// A worker of the loan patterns: kLoanBuffers loans filled in turn, each sent by
// reference; a loan is filled again once its previous send completed (main dropped its view,
// or copied it out).
void loan_worker(const Group& g, const Step& s, Producer& producer) {
  const LoanOptions o{.group = g, .dst = 0, .consolidated = s.pattern == "loan-view-c"};
  std::vector<TensorDict> loans;
  for (int i = 0; i < kLoanBuffers; ++i) loans.push_back(loan(make_batch(), o));
  std::vector<Transfer> sent(kLoanBuffers);
  for (int b = 0; b < s.count; ++b) {
    const TensorDict& batch = loans[static_cast<size_t>(b % kLoanBuffers)];
    Transfer& previous = sent[static_cast<size_t>(b % kLoanBuffers)];
    previous.wait();
    producer.produce(view(batch), b);
    previous = batch.isend({.group = g, .group_dst = 0, .return_early = true, .consolidated = o.consolidated});
  }
  for (const Transfer& t : sent) t.wait();
}

// A worker of the feed pattern: fills a loan of its feed when there is one (zero copy), else a
// batch of its own (copied into the heap by put), and puts it; the feed does the rest.
void feed_worker(const Layout& layout, const Step& s, int w, FeedEnds& ends, Producer& producer) {
  if (!ends.producer) {
    ends.producer.emplace(feed_name(layout), w - 1, FeedOptions{.timeout = kGroupTimeout});
    ends.producer->put(make_batch());  // joins and sizes the heap: main takes it before any clock
  }
  FeedProducer& feed = *ends.producer;
  const TensorDict like = make_batch().consolidate();
  for (int b = 0; b < s.count; ++b) {
    std::optional<TensorDict> slot = feed.try_loan(like);
    const TensorDict batch = slot ? *slot : make_batch();
    producer.produce(view(batch), b);
    feed.put(batch);
  }
}

// A worker of the loader; returns the median time it took to write a batch.
double loader_worker(const Layout& layout, const Groups& groups, const Step& s, int64_t seq0, int w,
                     const TensorDict& batch, FeedEnds& ends) {
  const Group& g = step_group(groups, s);
  Producer producer(layout, w, seq0, s.count);
  if (s.transport == "inplace") {
    const auto deadline = Clock::now() + kGroupTimeout;
    InplaceChannel ch = layout.inplace_channel(w);
    for (int b = 0; b < s.count; ++b) {
      ch.wait_empty(deadline);
      producer.produce(view(ch), b);
      ch.publish();
    }
    return producer.median_seconds();
  }
  if (is_loan_pattern(s.pattern)) {
    loan_worker(g, s, producer);
    return producer.median_seconds();
  }
  if (s.pattern == "feed") {
    feed_worker(layout, s, w, ends, producer);
    return producer.median_seconds();
  }
  const bool by_copy = s.transport == "memcpy";
  const std::vector<at::Tensor> leaves = copied_tensors(batch);
  for (int b = 0; b < s.count; ++b) {
    producer.produce(view(batch), b);
    if (by_copy) {
      // The consolidated pattern pays its consolidate() per batch here too.
      copy_send(layout.worker_channel(w),
                s.pattern == "consolidated" ? copied_tensors(batch.consolidate()) : leaves);
    } else if (s.pattern == "consolidated") {
      batch.consolidate().send({.group = g, .group_dst = 0, .consolidated = true});
    } else {
      batch.send({.group = g, .group_dst = 0});
    }
  }
  return producer.median_seconds();
}

double learner(const Layout& layout, const Groups& groups, const Step& s, int64_t seq0, const TensorDict& weights,
               std::vector<TensorDict>& trajectories) {
  const Group& g = step_group(groups, s);
  const std::string where = "actor-learner " + s.transport + " actors=" + std::to_string(layout.peers);
  float* first = weights.get("w0").data_ptr<float>();
  float* last = weights.get("w" + std::to_string(kWeightLeaves - 1)).data_ptr<float>() + (kWeightFloats - 1);
  std::vector<Transfer> sends, recvs;
  // The memcpy reference: actor a's weights go through channel 2(a-1), its trajectory comes
  // back through 2(a-1)+1.
  const bool by_copy = s.transport == "memcpy";
  // loan-view: the weights live in a loan, sent by reference to every actor (one ticket each),
  // which takes a view; the learner writes into them again once every actor dropped its view.
  const TensorDict sent_weights =
      is_loan_pattern(s.pattern) ? loan(weights, {.group = g, .consolidated = true}).update_(weights) : weights;
  first = sent_weights.get("w0").data_ptr<float>();
  last = sent_weights.get("w" + std::to_string(kWeightLeaves - 1)).data_ptr<float>() + (kWeightFloats - 1);
  const std::vector<at::Tensor> weight_bytes = copied_tensors(weights);
  std::vector<std::vector<at::Tensor>> trajectory_leaves;
  for (const auto& tr : trajectories) trajectory_leaves.push_back(copied_tensors(tr));
  const auto start = Clock::now();
  for (int i = 0; i < s.count; ++i) {
    const int64_t seq = seq0 + i;
    *first = static_cast<float>(seq);
    *last = static_cast<float>(2 * seq);
    sends.clear();
    recvs.clear();
    for (int a = 1; by_copy && a <= layout.peers; ++a) copy_send(layout.weights_channel(a), weight_bytes);
    for (int a = 1; !by_copy && a <= layout.peers; ++a) {
      sends.push_back(sent_weights.isend({.group = g, .group_dst = a, .return_early = true, .consolidated = true}));
    }
    for (int a = 1; !by_copy && a <= layout.peers; ++a) {
      recvs.push_back(trajectories[a].irecv({.group = g, .group_src = a, .return_premature = true}));
    }
    for (const auto& t : sends) t.wait();
    for (int a = 1; a <= layout.peers; ++a) {
      if (by_copy) {
        copy_recv(layout.trajectory_channel(a), trajectory_leaves[static_cast<size_t>(a)]);
      } else {
        recvs[static_cast<size_t>(a - 1)].wait();
      }
      const TensorDict& tr = trajectories[a];
      const float obs = tr.get("obs").data_ptr<float>()[0];
      const float reward = tr.get("reward").data_ptr<float>()[kSteps - 1];
      const int64_t* action = tr.get("action").data_ptr<int64_t>();
      if (obs != static_cast<float>(seq) || reward != static_cast<float>(seq + a) || action[0] != a ||
          action[kSteps - 1] != a) {
        throw std::runtime_error(where + ": step " + std::to_string(seq) + ": actor " + std::to_string(a) +
                                 "'s trajectory holds obs[0] " + std::to_string(obs) + ", reward[-1] " +
                                 std::to_string(reward) + ", action[0] " + std::to_string(action[0]));
      }
    }
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void actor(const Layout& layout, const Groups& groups, const Step& s, int64_t seq0, int a, TensorDict& weights,
           const TensorDict& traj) {
  const Group& g = step_group(groups, s);
  const bool by_copy = s.transport == "memcpy";
  const std::vector<at::Tensor> weight_bytes = copied_tensors(weights), trajectory_leaves = copied_tensors(traj);
  for (int i = 0; i < s.count; ++i) {
    const int64_t seq = seq0 + i;
    inject_fault(layout.fault, a, seq, nullptr);
    TensorDict got = weights;  // loan-view: a view of the learner's loan, dropped before the reply
    if (by_copy) {
      copy_recv(layout.weights_channel(a), weight_bytes);
    } else if (is_loan_pattern(s.pattern)) {
      got = weights.recv_view({.group = g, .group_src = 0, .consolidated = true});
    } else {
      weights.recv({.group = g, .group_src = 0, .consolidated = true});
    }
    const float first = got.get("w0").data_ptr<float>()[0];
    const float last = got.get("w" + std::to_string(kWeightLeaves - 1)).data_ptr<float>()[kWeightFloats - 1];
    got = weights;
    if (first != static_cast<float>(seq) || last != static_cast<float>(2 * seq)) {
      throw std::runtime_error("actor " + std::to_string(a) + " " + s.transport + ": step " + std::to_string(seq) +
                               ": the weights hold " + std::to_string(first) + " and " + std::to_string(last));
    }
    traj.get("obs").data_ptr<float>()[0] = static_cast<float>(seq);
    traj.get("reward").data_ptr<float>()[kSteps - 1] = static_cast<float>(seq + a);
    int64_t* action = traj.get("action").data_ptr<int64_t>();
    for (int64_t k = 0; k < kSteps; ++k) action[k] = a;
    if (by_copy) {
      copy_send(layout.trajectory_channel(a), trajectory_leaves);
    } else {
      traj.send({.group = g, .group_dst = 0});
    }
  }
}

// Everything a rank does after fork; returns its exit code.
int scenario_rank(const Layout& layout, int rank, Control& control, const Reporter& report) {
  at::set_num_threads(1);
  try {
    const Groups groups = make_groups(layout.segment, rank, layout.world(), control);
    const bool loader = layout.scenario == "loader";
    // Rank 0's receive buffers; a worker's batch (its image filled once); the actor-learner's.
    std::vector<TensorDict> plain, consolidated, trajectories;
    TensorDict batch, weights, traj;
    if (loader && rank == 0) {
      for (int w = 0; w <= layout.peers; ++w) {
        plain.push_back(make_batch());
        consolidated.push_back(make_batch().consolidate());
      }
    } else if (loader) {
      batch = make_batch();
    } else {
      weights = make_weights();
      if (rank == 0) {
        for (int a = 0; a <= layout.peers; ++a) trajectories.push_back(make_trajectory());
      } else {
        traj = make_trajectory();
      }
    }

    FeedEnds feed_ends;  // left after the last barrier below, with the groups
    int64_t seq = 0;
    int done = layout.progress_done;
    for (const Step& s : layout.schedule) {
      if (rank == 0) show_progress(layout, done, s);
      barrier(step_group(groups, s));
      MainTime seconds;
      if (loader) {
        if (rank == 0) {
          seconds = loader_main(layout, groups, s, seq, plain, consolidated, feed_ends);
        } else {
          const double write = loader_worker(layout, groups, s, seq, rank, batch, feed_ends);
          if (s.repeat >= 0) {
            char line[256];
            std::snprintf(line, sizeof line, "W %s %s %d %.9g", s.pattern.c_str(), s.transport.c_str(), s.repeat, write);
            report.line(line);
          }
        }
      } else if (rank == 0) {
        seconds.seconds = learner(layout, groups, s, seq, weights, trajectories);
      } else {
        actor(layout, groups, s, seq, rank, weights, traj);
      }
      seq += s.count;
      if (rank == 0 && s.repeat >= 0) {
        ++done;
        char line[256];
        std::snprintf(line, sizeof line, "M %s %s %d %d %.9g %.9g", s.pattern.c_str(), s.transport.c_str(), s.repeat,
                      s.count, seconds.seconds, seconds.read_seconds);
        report.line(line);
      }
    }
    // Nobody tears a group down while a peer still waits in it.
    barrier(groups.gloo);
    barrier(groups.shm);
    if (rank == 0 && layout.progress && layout.tty) std::fprintf(stderr, "\r\033[K");
    return 0;
  } catch (const std::exception& e) {
    report.line("E " + std::to_string(rank) + " " + e.what());
    return 1;
  }
}

// ---- the coordinator ----

std::string name_of_rank(const Layout& layout, int rank) {
  if (rank == 0) return layout.scenario == "loader" ? "main (rank 0)" : "learner (rank 0)";
  return std::string(layout.scenario == "loader" ? "worker " : "actor ") + std::to_string(rank);
}

// The measurements in rank 0's report lines ("M pattern transport repeat count seconds
// read_seconds") and the loader workers' ("W pattern transport repeat write_seconds": the median
// time a batch took to write).
void read_report(const std::string& line, LayoutResult& result) {
  if (line.rfind("W ", 0) == 0) {
    char pattern[64], transport[16];
    Written w;
    if (std::sscanf(line.c_str(), "W %63s %15s %d %lf", pattern, transport, &w.repeat, &w.batch_seconds) == 4) {
      w.pattern = pattern;
      w.transport = transport;
      result.written.push_back(w);
      return;
    }
  }
  if (line.rfind("M ", 0) == 0) {
    char pattern[64], transport[16];
    Measured m;
    if (std::sscanf(line.c_str(), "M %63s %15s %d %d %lf %lf", pattern, transport, &m.repeat, &m.count, &m.seconds,
                    &m.read_seconds) == 6) {
      m.pattern = pattern;
      m.transport = transport;
      result.measured.push_back(m);
      return;
    }
  }
  result.failures.push_back("unreadable report from a rank: " + line);
}

// Forks every rank of `layout`, collects rank 0's measurements, reaps every rank (bench_ranks.h).
LayoutResult run_layout(Layout layout, std::chrono::seconds deadline_after) {
  // The references' channels and buffers, shared by the ranks forked below (zero-filled).
  const size_t copy_bytes = layout.channels() * kCopyChannelBytes + layout.inplace_channels() * kInplaceChannelBytes;
  void* copy_memory = ::mmap(nullptr, copy_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (copy_memory == MAP_FAILED) {
    throw std::system_error(errno, std::generic_category(), "mmap of the memcpy reference's channels");
  }
  struct Unmap {
    void* p;
    size_t n;
    ~Unmap() { ::munmap(p, n); }
  } unmap{copy_memory, copy_bytes};
  layout.copy_memory = static_cast<uint8_t*>(copy_memory);
  layout.inplace_memory = layout.copy_memory + layout.channels() * kCopyChannelBytes;
  RankJob job;
  job.world = layout.world();
  job.segment = layout.segment;
  job.run_rank = [&layout](int rank, Control& control, const Reporter& report) {
    return scenario_rank(layout, rank, control, report);
  };
  job.rank_name = [&layout](int rank) { return name_of_rank(layout, rank); };
  RanksResult ranks = run_ranks(job, deadline_after);
  LayoutResult result;
  result.failures = std::move(ranks.failures);
  for (const auto& line : ranks.reports) read_report(line, result);
  return result;
}

}  // namespace

const std::vector<std::string>& all_scenarios() {
  static const std::vector<std::string> names{"loader", "actor-learner", "board"};
  return names;
}

ScenarioRun run_scenarios(const BenchOptions& options) {
  ScenarioRun run;
  const bool tty = ::isatty(STDERR_FILENO) == 1;
  const bool progress = options.progress || tty;
  const int cpus = allowed_cpu_count();
  for (const auto& scenario : options.scenarios) {
    if (scenario == "collectives" || scenario == "board") {
      ScenarioRun c = scenario == "board" ? run_board(options) : run_collectives(options);
      run.rows.insert(run.rows.end(), c.rows.begin(), c.rows.end());
      run.failures.insert(run.failures.end(), c.failures.begin(), c.failures.end());
      continue;
    }
    const bool loader = scenario == "loader";
    std::vector<int> counts = loader ? options.workers : std::vector<int>{options.actors};
    const int count = loader ? options.batches : options.steps;
    const auto schedule = make_schedule(scenario, options.repeat, count);
    const int total = measured_steps(schedule) * static_cast<int>(counts.size());
    print_scenario_header(options, scenario, kTrajectoryBytes);
    // The oversubscribed layouts, said once above the table.
    std::string crowded, processes;
    for (const int peers : counts) {
      if (peers + 1 <= cpus) continue;
      crowded += (crowded.empty() ? "" : ", ") + std::to_string(peers);
      processes += (processes.empty() ? "" : ", ") + std::to_string(peers + 1);
    }
    if (!crowded.empty()) {
      std::printf("\nnote: %s %s run%s %s processes on %d CPU(s): oversubscribed, so those rows measure time\n"
                  "      sharing of the CPUs as much as the transports\n",
                  loader ? "N =" : "actors =", crowded.c_str(), crowded.find(',') == std::string::npos ? "s" : "",
                  processes.c_str(), cpus);
    }
    print_columns(scenario);
    int done = 0;
    for (const int peers : counts) {
      Layout layout;
      layout.scenario = scenario;
      layout.peers = peers;
      layout.segment = "tdshm-bench-" + std::to_string(::getpid()) + "-" + scenario + "-" + std::to_string(peers);
      layout.schedule = schedule;
      layout.repeat = options.repeat;
      layout.progress = progress;
      layout.tty = tty;
      layout.progress_done = done;
      layout.progress_total = total;
      if (const char* fault = std::getenv("TDSHM_BENCH_FAULT")) layout.fault = fault;
      done += measured_steps(schedule);
      // A safety net only: every wait of the ranks has its own 60 s deadline.
      const auto deadline = std::chrono::seconds(120 + 30 * static_cast<int64_t>(schedule.size()));
      LayoutResult result;
      try {
        result = run_layout(layout, deadline);
      } catch (const std::exception& e) {
        result.failures.push_back(e.what());
      }
      if (progress && tty) std::fprintf(stderr, "\r\033[K");
      const std::string where = scenario + (loader ? " N=" : " actors=") + std::to_string(peers) + ": ";
      for (const auto& f : result.failures) {
        run.failures.push_back(where + f);
        std::fprintf(stderr, "tdshm bench: %s\n", run.failures.back().c_str());
      }

      const int items = loader ? peers : 1;  // per count: main gets one batch of every worker
      const size_t item_bytes = loader ? kBatchBytes : static_cast<size_t>(peers) * (kWeightBytes + kTrajectoryBytes);
      bool first = true;
      for (const auto& pattern : patterns_of(scenario)) {
        const Stats shm = stats_of(result, pattern, "shm", items);
        const Stats gloo = stats_of(result, pattern, "gloo", items);
        const Stats copy = stats_of(result, pattern, "memcpy", items);
        const Stats inplace = stats_of(result, pattern, "inplace", items);
        const Stats& ref = runs(scenario, pattern, "inplace") ? inplace : copy;
        for (const char* transport : kTransports) {
          const std::string t = transport;
          if (!runs(scenario, pattern, t)) continue;
          const Stats& st = t == "shm" ? shm : t == "gloo" ? gloo : t == "memcpy" ? copy : inplace;
          const std::string peers_text = first ? std::to_string(peers) : "";
          first = false;
          if (st.n < options.repeat) {
            if (result.failures.empty()) {
              run.failures.push_back(where + pattern + " " + transport + ": " + std::to_string(st.n) + " of " +
                                     std::to_string(options.repeat) + " measurements came back");
            }
            std::printf("%7s  %-*s %-9s %11s\n", peers_text.c_str(), loader ? 13 : 19, pattern.c_str(), transport,
                        "not measured");
            continue;
          }
          const double gbps = st.median * static_cast<double>(item_bytes) / 1e9;
          char spread[64], ratio[32] = "", of_copy[32] = "";
          std::snprintf(spread, sizeof spread, "%9.1f - %-9.1f", st.min, st.max);
          if (t == "shm" && gloo.n > 0 && gloo.median > 0) {
            std::snprintf(ratio, sizeof ratio, "%8.2fx", shm.median / gloo.median);
          }
          if (t == "shm" && ref.n > 0 && ref.median > 0) {
            std::snprintf(of_copy, sizeof of_copy, "%10.2fx", shm.median / ref.median);
          }
          char reads[16] = "";
          if (loader) std::snprintf(reads, sizeof reads, "%9.0f%%", 100 * st.read_share);
          std::printf("%7s  %-*s %-9s %11.1f  %-23s %8.3f %9s %11s %10s\n", peers_text.c_str(), loader ? 13 : 19,
                      pattern.c_str(), transport, st.median, spread, gbps, ratio, of_copy, reads);
          Row r;
          r.set("scenario", scenario).set("pattern", pattern).set("transport", transport);
          const std::string rate = loader ? "batches_per_s" : "steps_per_s";
          if (loader) {
            r.set_int("workers", peers).set_int("batches", static_cast<int64_t>(count) * peers);
            r.set_int("batch_bytes", static_cast<int64_t>(kBatchBytes));
            r.set_number("main_read_share", st.read_share).set_number("read_bound_batches_per_s", st.read_bound);
            r.set_number("worker_write_s", st.write_batch_seconds).set_number("main_read_s", st.read_batch_seconds);
          } else {
            r.set_int("actors", peers).set_int("steps", count);
            r.set_int("step_bytes", static_cast<int64_t>(item_bytes));
          }
          r.set_int("repeats", st.n);
          r.set_number(rate, st.median).set_number(rate + "_min", st.min).set_number(rate + "_max", st.max);
          r.set_number("gbps", gbps).set_number("seconds", st.median_seconds);
          run.rows.push_back(std::move(r));
        }
      }
      print_loan_goals(result, scenario, items);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  return run;
}

}  // namespace tdshm::bench
