// `tdshm bench`: the two-rank driver of the ping-pong benchmark. It forks rank 1, brings every
// transport up in both ranks, measures each row (a size, or a TensorDict workload) in rounds that
// interleave the transports, and hands rank 0's times to the measurement, table and goals. The
// method is described in pingpong.h. It sits on top of the benchmark's files, which never call
// back into it:
//   pingpong_link.h         control block, Link, waits on a word (the lowest layer)
//   pingpong_transport.h    the table of transports, PingPong, Workload, the payload pattern
//   pingpong_floors.h       spin and futex floors, memcpy ceiling, ping-pong over any c10d group
//   pingpong_ring.h         the ring floor (cache-line elements, sequence word inline)
//   pingpong_ucx.h          UCX's own ucx_perftest, run pinned like the ranks (optional)
//   pingpong_gloo.h         c10d::ProcessGroupGloo on 127.0.0.1
//   pingpong_shm.h          tdshm::ProcessGroupShm
//   pingpong_td.h           TensorDict workloads (--td): their trees, their ping-pong, the
//                           memmap workloads' files
//   pingpong_processes.h    the shared mapping, CPU pinning, reaping rank 1, stop signals
//   pingpong_measurement.h  a row's statistics and its JSON line
//   pingpong_table.h        the header, the table rows and the goals
// Beside it, above none of them: pingpong_options.cpp (parse_bench_options) and
// pingpong_usage.cpp (print_bench_usage).

#include "pingpong.h"

#include "pingpong_floors.h"
#include "pingpong_gloo.h"
#include "pingpong_link.h"
#include "pingpong_measurement.h"
#include "pingpong_processes.h"
#include "pingpong_ring.h"
#include "pingpong_shm.h"
#include "pingpong_table.h"
#include "pingpong_td.h"
#include "pingpong_transport.h"
#include "pingpong_ucx.h"
#include "wire_lines.h"

#include <tdshm/process_group.h>

#include <ATen/Parallel.h>

#include <sys/prctl.h>
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <new>
#include <stdexcept>
#include <system_error>

namespace tdshm::bench {

namespace {

using namespace detail;
using Clock = std::chrono::steady_clock;

// Deadline of every setup and every wait of the c10d transports: far above the slowest round
// trip (64 MiB through gloo takes well under a second), short enough that a peer that failed
// on its own is noticed before a CI job times out.
constexpr std::chrono::milliseconds kTransportTimeout{std::chrono::seconds(30)};
// ShmOptions::spin of the spinning mode (the default, what users get); the blocking-only mode
// uses 0.
const std::chrono::microseconds kShmSpin = default_shm_spin();

// The directory of the memmap workloads' files.
constexpr const char* kMemmapDir = "/dev/shm";
// Round trips of a gloo transport at most: max(kGlooMinIters, kGlooBudget / bytes), so that a
// 1 GiB workload over TCP takes seconds, not minutes.
constexpr uint64_t kGlooBudget = uint64_t{4} << 30;
constexpr uint64_t kGlooMinIters = 5;

bool is_gloo(const std::string& transport) { return transport == "gloo" || transport == "td-gloo"; }

struct Session {
  const BenchOptions& options;
  std::vector<std::string> transports;  // in table order
  std::vector<Workload> rows;           // in table order
  Link& link;
  uint8_t* payload0;
  uint8_t* payload1;
  size_t payload_bytes;  // capacity of each payload buffer
  RingDirection* rings;  // the ring floor's: [0] rank 0 -> 1, [1] rank 1 -> 0
  std::vector<int> cpus;  // the CPUs of rank 0 and rank 1 when pinned, else empty
  std::string run_id;  // unique per run: names the shm segments and the memmap files
  // Rank 0 only.
  std::vector<Measurement> results;
  std::vector<std::string> failures;
  std::vector<std::string> skipped;  // rows left out on purpose (no room), not failures

  std::string segment(const char* which) const { return run_id + "-" + which; }
  std::string memmap_file(const Workload& w) const { return std::string(kMemmapDir) + "/" + run_id + "-" + w.name; }
};

std::unique_ptr<PingPong> make_transport(const std::string& name, Session& s) {
  if (name == "spin") return make_floor_pingpong(s.link, WaitMode::spin, s.payload0, s.payload1);
  if (name == "futex") return make_floor_pingpong(s.link, WaitMode::futex, s.payload0, s.payload1);
  if (name == "memcpy") return make_memcpy_pingpong();
  if (name == "ring") return make_ring_pingpong(s.link, s.rings);
  if (name == "ucx-posix") return make_ucx_pingpong(s.cpus);
  if (name == "c10d-spin") {
    return make_c10d_pingpong(make_spin_floor_group(s.link, s.payload0, s.payload1, s.payload_bytes));
  }
  if (name == "gloo") return make_c10d_pingpong(make_gloo_group(s.link, kTransportTimeout));
  if (name == "shm") {
    return make_c10d_pingpong(make_shm_group(s.segment("spin"), s.link.rank(), kShmSpin, kTransportTimeout));
  }
  if (name == "shm-blocking") {
    return make_c10d_pingpong(
        make_shm_group(s.segment("blocking"), s.link.rank(), std::chrono::microseconds(0), kTransportTimeout));
  }
  if (name == "shm-loan") return make_loan_pingpong(s.segment("loan"), s.link.rank(), s.payload_bytes, kTransportTimeout);
  if (name == "td-shm") {
    return make_td_pingpong(make_shm_group(s.segment("td"), s.link.rank(), kShmSpin, kTransportTimeout), s.link.rank());
  }
  if (name == "td-gloo") return make_td_pingpong(make_gloo_group(s.link, kTransportTimeout), s.link.rank());
  throw std::invalid_argument("unknown transport '" + name + "'");
}

// Brings every requested transport up in both ranks. A transport that fails on either rank is
// left out on both, with its error recorded by rank 0.
std::vector<std::pair<std::string, std::unique_ptr<PingPong>>> set_up(Session& s) {
  std::vector<std::pair<std::string, std::unique_ptr<PingPong>>> live;
  const int rank = s.link.rank();
  for (const auto& name : s.transports) {
    if (name == "memcpy" || name == "ucx-posix") {  // rank 0 alone
      if (rank != 0) continue;
      try {
        live.emplace_back(name, make_transport(name, s));
      } catch (const std::exception& e) {
        s.failures.push_back(name + ": not measured: could not be set up (" + e.what() + ")");
        std::fprintf(stderr, "tdshm bench: %s\n", s.failures.back().c_str());
      }
      continue;
    }
    std::unique_ptr<PingPong> transport;
    std::string error;
    try {
      transport = make_transport(name, s);
    } catch (const std::exception& e) {
      error = e.what();
      s.link.set_error(error);
    }
    if (s.link.sync(transport != nullptr)) {
      live.emplace_back(name, std::move(transport));
      continue;
    }
    if (rank == 0) {
      std::string why = error.empty() ? "" : "rank 0: " + error;
      const std::string peer = s.link.peer_error();
      if (!peer.empty() && peer != error) why += (why.empty() ? "rank 1: " : "; rank 1: ") + peer;
      s.failures.push_back(name + ": not measured: could not be set up (" + why + ")");
      std::fprintf(stderr, "tdshm bench: %s\n", s.failures.back().c_str());
    }
    // Rank 1 keeps its message in place until rank 0 has read it.
    s.link.sync(true);
    s.link.set_error("");
  }
  return live;
}

// Where unpinned ranks ran while a transport was timed: rank 0 samples, after every 16th timed
// round trip (outside the timed part), whether it runs on the CPU rank 1 last published.
struct Placement {
  int samples = 0;
  int shared = 0;  // samples that found both ranks on one CPU
};

// One round of one transport at one size: `warmup` round trips, then `iters` timed ones whose
// times are appended to `elapsed_ns` (rank 0; rank 1 only answers). Unpinned runs also count
// where the ranks ran (`placement`, rank 0); a figure then depends on it: on one CPU, every
// message waits for the scheduler.
void run_round(Session& s, PingPong& transport, int warmup, int iters, std::vector<int64_t>& elapsed_ns,
               Placement& placement) {
  const bool unpinned = s.cpus.empty() && !transport.single_process();
  if (!transport.single_process()) {
    s.link.sync(true);  // both ranks ready: the first warm-up ping meets a waiting pong
    if (s.link.rank() == 1) {
      for (int i = 0; i < warmup + iters; ++i) {
        transport.pong();
        if (unpinned) s.link.publish_cpu();
      }
      return;
    }
  }
  for (int i = 0; i < warmup; ++i) transport.ping();
  for (int i = 0; i < iters; ++i) {
    const auto start = Clock::now();
    transport.ping();
    elapsed_ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
    if (unpinned && i % 16 == 0) {
      ++placement.samples;
      placement.shared += s.link.on_peer_cpu() ? 1 : 0;
    }
  }
}

using Live = std::vector<std::pair<std::string, std::unique_ptr<PingPong>>>;

// Memory a memmap row needs at `bytes`: its file, plus the buffers of the live floors (spin:
// two page buffers per rank and the two shared payload buffers; memcpy: two page buffers).
uint64_t memory_for_memmap_row(const Live& live, size_t bytes) {
  uint64_t buffers = 1;
  for (const auto& [name, transport] : live) {
    if (name == "spin" || name == "futex") buffers += 6;
    if (name == "memcpy") buffers += 2;
  }
  return buffers * bytes;
}

// A memmap row's file: rank 0 checks for room and creates it, both ranks agree. Returns false
// (on both ranks) if the row is skipped; rank 0 has then recorded why.
bool make_workload_file(Session& s, const Live& live, Workload& w, WorkloadFile& file) {
  w.file = s.memmap_file(w);
  std::string why;
  if (s.link.rank() == 0) {
    why = no_room_for(kMemmapDir, w.bytes, memory_for_memmap_row(live, w.bytes));
    if (why.empty()) {
      try {
        file = WorkloadFile(w.file, w.bytes);
      } catch (const std::exception& e) {
        why = std::string("could not create ") + w.file + ": " + e.what();
      }
    }
  }
  if (s.link.sync(why.empty())) return true;
  if (s.link.rank() == 0) {
    s.skipped.push_back(w.name + ": skipped: " + why);
    std::printf("%-18s skipped: %s\n\n", w.name.c_str(), why.c_str());
    std::fflush(stdout);
  }
  return false;
}

// Measures every live transport on one row (a size, or a TD workload). The iterations are cut
// into rounds and the rounds interleave the transports (round 1 of each, then round 2 of each,
// ...), so that a change in the machine's load during the row's measurement hits every
// transport alike and the ratios between them stay fair; each round starts with its share of
// the warm-up. A gloo transport may get fewer iterations than the others (iterations_for): it
// then sits out the rounds its share leaves empty.
void measure_row(Session& s, Live& live, Workload w) {
  const int rank = s.link.rank();
  WorkloadFile file;  // rank 0, memmap rows: removed when the row is done, whatever happens
  if (w.tree == Workload::Tree::memmap && !make_workload_file(s, live, w, file)) return;
  std::vector<int> iters(live.size()), warmups(live.size());
  int most = 1;
  for (size_t t = 0; t < live.size(); ++t) {
    iters[t] = iterations_for(s.options, w.bytes, live[t].first);
    warmups[t] = warmup_for(s.options, w.bytes, live[t].first);
    most = std::max(most, iters[t]);
  }
  const int rounds = std::min(s.options.rounds, most);
  std::vector<std::vector<int64_t>> elapsed(live.size());
  std::vector<Placement> placement(live.size());
  std::vector<std::vector<ExternalRound>> external(live.size());
  std::vector<char> external_failed(live.size(), 0);
  for (auto& [name, transport] : live) {
    if (rank == 0 || !transport->single_process()) transport->prepare(w);
  }
  for (int r = 0; r < rounds; ++r) {
    for (size_t t = 0; t < live.size(); ++t) {
      PingPong& transport = *live[t].second;
      if (transport.single_process() && rank != 0) continue;
      // Rounds split a transport's iterations as evenly as integers allow.
      const int n = iters[t] * (r + 1) / rounds - iters[t] * r / rounds;
      if (n == 0) continue;
      if (transport.external()) {
        if (external_failed[t]) continue;
        try {
          external[t].push_back(transport.external_round((warmups[t] + rounds - 1) / rounds, n));
        } catch (const std::exception& e) {
          external_failed[t] = true;
          s.failures.push_back(live[t].first + " at " + size_label(w.bytes) + ": " + e.what());
          std::fprintf(stderr, "tdshm bench: %s\n", s.failures.back().c_str());
        }
        continue;
      }
      run_round(s, transport, (warmups[t] + rounds - 1) / rounds, n, elapsed[t], placement[t]);
    }
  }
  if (rank != 0) return;
  for (size_t t = 0; t < live.size(); ++t) {
    const auto& [name, transport] = live[t];
    const std::string where = w.name.empty() ? size_label(w.bytes) : w.name;
    if (external_failed[t]) continue;
    if (!transport->verify()) {
      s.failures.push_back(name + " at " + where + ": the echoed message differs from the one sent");
      std::fprintf(stderr, "tdshm bench: %s\n", s.failures.back().c_str());
    }
    const int warmup_rounds = std::min(rounds, iters[t]);  // the rounds it took part in
    const int warmup = (warmups[t] + rounds - 1) / rounds * warmup_rounds;
    s.results.push_back(transport->external()
                            ? summarize_external(name, w, warmup, iters[t], external[t])
                            : summarize(name, w, warmup, rounds, elapsed[t], !transport->single_process()));
    if (placement[t].samples > 0) {
      s.results.back().one_cpu = static_cast<double>(placement[t].shared) / placement[t].samples;
    }
    print_row(s.results.back(), t == 0);
  }
  std::printf("\n");
}

// Both ranks run this; rank 1 only answers. Throws on a failure the run cannot go on from.
void run_rank(Session& s) {
  auto live = set_up(s);
  if (live.empty()) return;
  for (const Workload& w : s.rows) measure_row(s, live, w);
}

}  // namespace

const std::vector<std::string>& all_transports() {
  static const std::vector<std::string> names = transport_names(false);
  return names;
}

const std::vector<std::string>& all_td_transports() {
  static const std::vector<std::string> names = transport_names(true);
  return names;
}

const std::vector<std::string>& all_workloads() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& w : td_workloads()) v.push_back(w.name);
    return v;
  }();
  return names;
}

int iterations_for(const BenchOptions& options, size_t bytes, const std::string& transport) {
  // A byte budget per row keeps big rows short; a floor keeps p50 meaningful.
  const uint64_t budget = options.quick ? uint64_t{16} << 20 : uint64_t{512} << 20;
  const uint64_t floor = options.quick ? 5 : 20;
  const uint64_t size = std::max<size_t>(bytes, 1);
  uint64_t by_budget = std::max<uint64_t>(floor, budget / size);
  // TCP moves about a GB/s here: 20 round trips of 1 GiB would take a minute.
  if (is_gloo(transport)) by_budget = std::min(by_budget, std::max(kGlooMinIters, kGlooBudget / size));
  return static_cast<int>(std::min<uint64_t>(static_cast<uint64_t>(options.iters), by_budget));
}

int warmup_for(const BenchOptions& options, size_t bytes, const std::string& transport) {
  const int iters = iterations_for(options, bytes, transport);
  return std::min(options.warmup, std::max(2, iters / 4));
}

int run_pingpong_bench(const BenchOptions& options, std::vector<std::string>* json_lines) {
  std::vector<std::string> transports;
  std::string left_out;  // why an optional transport of the default run is not measured
  for (const auto& name : options.td ? all_td_transports() : all_transports()) {
    if (options.transports.empty() && name == "ucx-posix" && find_ucx_perftest().empty()) {
      left_out = "ucx-posix: not measured (ucx_perftest not found: apt-get install ucx-utils)";
      continue;
    }
    // The loan path is measured when named: its loan heap is as large as the largest row, which
    // the default sweep's 1 GiB row would add to /dev/shm twice.
    if (options.transports.empty() && name == "shm-loan") continue;
    if (options.transports.empty() ||
        std::find(options.transports.begin(), options.transports.end(), name) != options.transports.end()) {
      transports.push_back(name);
    }
  }
  std::vector<Workload> rows;
  if (options.td) {
    for (const auto& w : td_workloads()) {
      if (options.workloads.empty() ||
          std::find(options.workloads.begin(), options.workloads.end(), w.name) != options.workloads.end()) {
        rows.push_back(w);
      }
    }
  } else {
    for (const size_t bytes : options.sizes) rows.push_back(message_workload(bytes));
  }
  if (rows.empty()) throw std::invalid_argument(options.td ? "no workloads given" : "no message sizes given");

  // Control block, then the two payload buffers of the floors, page aligned.
  constexpr size_t kPage = 4096;
  const size_t max_bytes =
      std::max_element(rows.begin(), rows.end(), [](const Workload& a, const Workload& b) { return a.bytes < b.bytes; })
          ->bytes;
  const size_t control_bytes = (sizeof(ControlBlock) + kPage - 1) / kPage * kPage;
  const size_t payload_bytes = (max_bytes + kPage - 1) / kPage * kPage;
  const size_t ring_bytes = (2 * sizeof(RingDirection) + kPage - 1) / kPage * kPage;
  SharedMapping mapping(control_bytes + 2 * payload_bytes + ring_bytes);
  auto* block = new (mapping.data()) ControlBlock{};

  const std::vector<int> cpus = allowed_cpus();
  const bool pin = options.pin && cpus.size() >= 2;
  const std::string run_id = "tdshm-bench-" + std::to_string(::getpid());

  ChildReaper reaper;
  // Fork now, before LibTorch has started any thread in this process.
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child < 0) throw std::system_error(errno, std::generic_category(), "fork of the benchmark's peer");
  const int rank = child == 0 ? 1 : 0;
  if (rank == 1) {
    // Rank 1 dies with rank 0, whatever happens to rank 0.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    reaper.restore();
  } else {
    reaper.watch(child);
  }
  Link link(block, rank, rank == 0 ? child : parent, pin, rank == 0 ? ChildReaper::child_status() : nullptr);
  Session s{options,
            transports,
            rows,
            link,
            mapping.data() + control_bytes,
            mapping.data() + control_bytes + payload_bytes,
            payload_bytes,
            // Zero as mapped; an implicit-lifetime type, like the control block.
            reinterpret_cast<RingDirection*>(mapping.data() + control_bytes + 2 * payload_bytes),
            pin ? std::vector<int>{cpus[0], cpus[1]} : std::vector<int>{},
            run_id,
            {},
            {},
            {}};

  at::set_num_threads(1);
  std::string pinning = "ranks not pinned";
  if (pin) {
    const bool ok = pin_to(cpus[static_cast<size_t>(rank)]);
    pinning = "rank 0 on CPU " + std::to_string(cpus[0]) + ", rank 1 on CPU " + std::to_string(cpus[1]);
    if (!ok) pinning = "pinning failed: ranks not pinned";
  } else if (options.pin) {
    pinning = "ranks not pinned (fewer than 2 CPUs allowed)";
  }

  if (rank == 1) {
    int rc = 0;
    try {
      run_rank(s);
    } catch (const std::exception& e) {
      link.abort(e.what());
      rc = 1;
    }
    std::fflush(nullptr);
    // No atexit handlers or static destructors in the forked copy; the transports are gone.
    ::_exit(rc);
  }

  const SegmentsRemovedOnSignal on_signal({s.segment("spin"), s.segment("blocking"), s.segment("td")});
  print_header(s.transports, options.td, pinning);
  if (!left_out.empty()) std::printf("  %s\n\n", left_out.c_str());
  bool aborted = false;
  try {
    run_rank(s);
  } catch (const std::exception& e) {
    link.abort(e.what());
    s.failures.push_back(std::string("run stopped: ") + e.what());
    std::fprintf(stderr, "tdshm bench: %s\n", s.failures.back().c_str());
    aborted = true;
  }
  const int status =
      reaper.reap(child, aborted ? std::chrono::milliseconds(200) : std::chrono::milliseconds(kTransportTimeout));
  if (!aborted && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    s.failures.push_back("rank 1 ended badly (wait status " + std::to_string(status) + ")" +
                         (link.peer_error().empty() ? "" : ": " + link.peer_error()));
  }
  for (const char* which : {"spin", "blocking", "td", "loan"}) remove_shm_segment(s.segment(which));

  print_goals(s.results, options.td);
  if (!options.td) print_wire_lines(options.sizes, tdshm::ShmOptions{}.ring_entries);
  if (json_lines != nullptr) {
    for (const auto& m : s.results) json_lines->push_back(json_line(m));
  }
  if (!options.json_path.empty()) {
    write_json(options.json_path, s.results);
    std::printf("\nwrote %zu measurements to %s (JSON Lines)\n", s.results.size(), options.json_path.c_str());
  }
  if (!s.skipped.empty()) {
    std::printf("\n%zu workload(s) skipped:\n", s.skipped.size());
    for (const auto& why : s.skipped) std::printf("  %s\n", why.c_str());
  }
  if (!s.failures.empty()) {
    std::printf("\n%zu problem(s):\n", s.failures.size());
    for (const auto& f : s.failures) std::printf("  %s\n", f.c_str());
  }
  return s.failures.empty() ? 0 : 1;
}

}  // namespace tdshm::bench
