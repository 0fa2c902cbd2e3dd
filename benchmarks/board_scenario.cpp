// `tdshm bench --scenario board` (board_scenario.h): the versioned board (include/tdshm/board.h)
// against TorchRL's shared-buffer pattern, in the same run, with real forked processes: one
// writer and --readers readers of 4 MiB of weights.
//
// Per measurement (--steps updates each; the writer waits until every reader has seen an update
// before the next, so each latency is measured alone):
//   board publish   the writer has new weights in its own tree and publish()es them (a copy into a
//                   free buffer); stamped before the copy
//   board commit    the writer writes them in place (begin()) and commit()s; stamped at the commit
//   torchrl update  shared weights updated in place (update_), then a byte down a pipe per reader
//                   (what mp.Queue does) and an ack back; stamped before the update
//   torchrl notify  the same, stamped after the update: the doorbell alone
//   board sleeping  board commit with readers that sleep on the futex at once (spin 0), as
//                   TorchRL's readers sleep on their pipes
// A board reader waits in wait_newer (spinning: BoardOptions::spin of 10 ms, but for board
// sleeping), a TorchRL reader blocks in read() on its pipe; both then copy the newest weights into
// their own. Visible = the reader's clock when it learns of the update, minus the stamp
// (CLOCK_MONOTONIC, one per host). Readers also time their copy of the newest version (read)
// against a plain 4 MiB copy of warm lines and against a TorchRL reader's memcpy of the weights
// just updated, and a view (Board::view and drop). Last, with the writer at full speed (publish in
// a loop, no acks), each reader times its read() against a memcpy of 4 MiB of its own right after.

#include "board_scenario.h"

#include "bench_ranks.h"

#include <tdshm/board.h>
#include <tdshm/tensordict.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <sched.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace tdshm::bench {
namespace {

constexpr int kMaxReaders = 8;
constexpr int kMaxUpdates = 4096;
constexpr int64_t kLeafFloats = 256 * 1024;  // 1 MiB
constexpr int kLeaves = 4;
constexpr size_t kWeightBytes = kLeaves * kLeafFloats * sizeof(float);

const char* const kKinds[] = {"board publish", "board commit", "torchrl update", "torchrl notify", "board sleeping"};
// The rows' transport and pattern (--json), by kind.
const char* const kTransports[] = {"board", "board", "torchrl", "torchrl", "board"};
const char* const kPatterns[] = {"publish-to-visible", "commit-to-visible", "update-to-visible", "notify-to-visible",
                                 "commit-to-visible-sleeping"};
constexpr int kKindCount = 5;
constexpr int kSleeping = 4;  // board commit with readers that sleep at once (BoardOptions::spin 0)

int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Shared by the coordinator and the ranks of one measurement (MAP_SHARED | MAP_ANONYMOUS, zero at
// first), with the TorchRL pattern's weights after it.
struct Shared {
  std::atomic<int> ready;
  std::atomic<int64_t> seen[kMaxReaders];  // the last update each reader saw
  int64_t stamp[kMaxUpdates + 1];          // the writer's stamp of update u
  int notify[kMaxReaders][2];              // torchrl: writer -> reader r
  int ack[2];                              // torchrl: readers -> writer
};

template <class Pred>
void spin_until(Pred&& done, const char* what) {
  const int64_t give_up = now_ns() + int64_t{60} * 1000000000;
  while (!done()) {
    if (now_ns() > give_up) throw std::runtime_error(std::string("board scenario: timed out waiting for ") + what);
    std::this_thread::yield();
  }
}

TensorDict weights(float v) {
  TensorDict td(std::vector<int64_t>{});
  for (int i = 0; i < kLeaves; ++i) td.set("l" + std::to_string(i), at::full({kLeafFloats}, v));
  return td;
}

void fill(const TensorDict& td, float v) {
  for (int i = 0; i < kLeaves; ++i) td.get("l" + std::to_string(i)).fill_(v);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

// One rank of one measurement of `kind`; rank 0 writes, the others read. Readers report
// "L <latency ns>..." lines of up to 40 values, "P <their median>", "C <copy ns>" "M <memcpy ns>"
// "V <view ns>".
int board_rank(int kind, int readers, int updates, const std::string& name, Shared& sh, uint8_t* shared_weights,
               int rank, const Reporter& report) {
  at::set_num_threads(1);
  const bool board = kind < 2 || kind == kSleeping;
  try {
    if (rank == 0) {
      std::optional<tdshm::Board> b;
      TensorDict mine = weights(0);
      if (board) b.emplace(tdshm::Board::create(name, weights(0), {.readers = static_cast<uint32_t>(readers)}));
      spin_until([&] { return sh.ready.load() == readers; }, "the readers");
      for (int u = 1; u <= updates; ++u) {
        if (kind == 0) {
          fill(mine, static_cast<float>(u));  // new weights in the writer's own tree
          sh.stamp[u] = now_ns();
          b->publish(mine);
        } else if (kind == 1 || kind == kSleeping) {
          TensorDict slot = b->begin();
          fill(slot, static_cast<float>(u));
          sh.stamp[u] = now_ns();
          b->commit();
        } else {
          fill(mine, static_cast<float>(u));
          if (kind == 2) sh.stamp[u] = now_ns();
          for (int i = 0; i < kLeaves; ++i) {
            std::memcpy(shared_weights + static_cast<size_t>(i) * kLeafFloats * sizeof(float),
                        mine.get("l" + std::to_string(i)).data_ptr(), kLeafFloats * sizeof(float));
          }
          if (kind == 3) sh.stamp[u] = now_ns();
          for (int r = 0; r < readers; ++r) {
            const char one = 1;
            if (::write(sh.notify[r][1], &one, 1) != 1)
              throw std::system_error(errno, std::generic_category(), "notify");
          }
        }
        // Every reader acks once it has its copy: TorchRL's pattern does, and the board's writer
        // waits the same way here (blocked, not spinning: a spinning writer would take a CPU from
        // the readers it waits for), only so that each update's latency is measured alone.
        for (int r = 0; r < readers; ++r) {
          char got = 0;
          if (::read(sh.ack[0], &got, 1) != 1) throw std::system_error(errno, std::generic_category(), "ack");
        }
        spin_until(
            [&] {
              for (int r = 0; r < readers; ++r) {
                if (sh.seen[r].load() < u) return false;
              }
              return true;
            },
            "every reader to see an update");
      }
      spin_until([&] { return sh.ready.load() == 2 * readers; }, "the readers' last measurements");
      return 0;
    }
    const int r = rank - 1;
    std::optional<tdshm::Board> b;
    if (board) {
      const std::chrono::microseconds spin =
          kind == kSleeping ? std::chrono::microseconds(0) : std::chrono::milliseconds(10);
      b.emplace(tdshm::Board::open(name, {.timeout = kGroupTimeout, .spin = spin}));
    }
    TensorDict mine = weights(0);
    sh.ready.fetch_add(1);
    std::vector<int64_t> lat;
    std::vector<double> copies;
    uint64_t last = 0;
    for (int u = 1; u <= updates; ++u) {
      int64_t visible = 0;
      if (board) {
        last = b->wait_newer(last, kGroupTimeout);
        visible = now_ns();
        const int64_t t0 = now_ns();
        last = b->read(mine);
        copies.push_back(static_cast<double>(now_ns() - t0));
      } else {
        char got = 0;
        if (::read(sh.notify[r][0], &got, 1) != 1) throw std::system_error(errno, std::generic_category(), "notify");
        visible = now_ns();
        const int64_t t0 = now_ns();
        for (int i = 0; i < kLeaves; ++i) {
          std::memcpy(mine.get("l" + std::to_string(i)).data_ptr(),
                      shared_weights + static_cast<size_t>(i) * kLeafFloats * sizeof(float),
                      kLeafFloats * sizeof(float));
        }
        copies.push_back(static_cast<double>(now_ns() - t0));
        last = static_cast<uint64_t>(u);
      }
      const float first = mine.get("l0").data_ptr<float>()[0];
      const float end = mine.get("l3").data_ptr<float>()[kLeafFloats - 1];
      if (first != static_cast<float>(u) || end != static_cast<float>(u)) {
        throw std::runtime_error("board scenario: reader " + std::to_string(r) + " holds " + std::to_string(first) +
                                 " / " + std::to_string(end) + " at update " + std::to_string(u));
      }
      lat.push_back(visible - sh.stamp[u]);
      const char one = 1;
      if (::write(sh.ack[1], &one, 1) != 1) throw std::system_error(errno, std::generic_category(), "ack");
      sh.seen[r].store(u);
    }
    for (size_t i = 0; i < lat.size(); i += 40) {
      std::string line = "L";
      for (size_t j = i; j < std::min(lat.size(), i + 40); ++j) line += " " + std::to_string(lat[j]);
      report.line(line);
    }
    report.line("P " + std::to_string(r) + " " + std::to_string(median(std::vector<double>(lat.begin(), lat.end()))));
    if (board) {
      // A plain copy of the same bytes, and views, in this process after the updates.
      const TensorDict other = weights(1);
      std::vector<double> plain, views;
      for (int i = 0; i < 30; ++i) {
        const int64_t t0 = now_ns();
        for (int k = 0; k < kLeaves; ++k) mine.get("l" + std::to_string(k)).copy_(other.get("l" + std::to_string(k)));
        plain.push_back(static_cast<double>(now_ns() - t0));
      }
      for (int i = 0; i < 200; ++i) {
        const int64_t t0 = now_ns();
        { const TensorDict v = b->view(); }
        views.push_back(static_cast<double>(now_ns() - t0));
      }
      report.line("C " + std::to_string(median(copies)));
      report.line("M " + std::to_string(median(plain)));
      report.line("V " + std::to_string(median(views)));
    } else {
      report.line("C " + std::to_string(median(copies)));  // a memcpy of the lines the writer just wrote
    }
    sh.ready.fetch_add(1);
    return 0;
  } catch (const std::exception& e) {
    report.line("E " + std::to_string(rank) + " " + e.what());
    return 1;
  }
}

// The writer at full speed: it publish()es new weights of its own as fast as it can while each
// reader, kFullSpeedReads times, copies the newest version (read) and then makes a plain copy of
// its own 4 MiB (memcpy between two trees of its own), timing both: the two copies meet the same
// CPUs, the same writer and the same other reader. Readers report "F <read ns> <memcpy ns>"
// (medians) and check that each version read holds one value throughout its first and last
// floats.
constexpr int kFullSpeedReads = 300;

int full_speed_rank(int readers, const std::string& name, Shared& sh, int rank, const Reporter& report) {
  at::set_num_threads(1);
  try {
    if (rank == 0) {
      tdshm::Board b = tdshm::Board::create(name, weights(0), {.readers = static_cast<uint32_t>(readers)});
      TensorDict mine = weights(0);
      spin_until([&] { return sh.ready.load() == readers; }, "the readers");
      for (int64_t u = 1; sh.ready.load() < 2 * readers; ++u) {
        fill(mine, static_cast<float>(u));
        b.publish(mine);
      }
      return 0;
    }
    tdshm::Board b = tdshm::Board::open(name, {.timeout = kGroupTimeout});
    TensorDict mine = weights(0), own = weights(1), other = weights(2);
    sh.ready.fetch_add(1);
    (void)b.wait_newer(0, kGroupTimeout);
    std::vector<double> reads, copies;
    for (int i = 0; i < kFullSpeedReads; ++i) {
      const int64_t t0 = now_ns();
      (void)b.read(mine);
      const int64_t t1 = now_ns();
      for (int k = 0; k < kLeaves; ++k) {
        const std::string key = "l" + std::to_string(k);
        std::memcpy(other.get(key).data_ptr(), own.get(key).data_ptr(), kLeafFloats * sizeof(float));
      }
      const int64_t t2 = now_ns();
      reads.push_back(static_cast<double>(t1 - t0));
      copies.push_back(static_cast<double>(t2 - t1));
      const float first = mine.get("l0").data_ptr<float>()[0];
      if (mine.get("l3").data_ptr<float>()[kLeafFloats - 1] != first) {
        throw std::runtime_error("board scenario: a version read at full speed holds two values");
      }
    }
    report.line("F " + std::to_string(median(reads)) + " " + std::to_string(median(copies)));
    sh.ready.fetch_add(1);
    return 0;
  } catch (const std::exception& e) {
    report.line("E " + std::to_string(rank) + " " + e.what());
    return 1;
  }
}

// One context switch between two processes on one CPU, with the pipe write and read that cause
// it (medians of 5 runs of 2,000 round trips): with more processes than CPUs, a reader that
// shares the writer's CPU sees a commit no sooner than this after the writer gives the CPU up.
// 0 when it cannot be measured.
double switch_floor_us() {
  cpu_set_t before;
  if (::sched_getaffinity(0, sizeof before, &before) != 0) return 0;
  int cpu = 0;
  while (cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &before)) ++cpu;
  if (cpu == CPU_SETSIZE) return 0;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  int there[2], back[2];
  if (::pipe(there) != 0) return 0;
  if (::pipe(back) != 0) {
    ::close(there[0]);
    ::close(there[1]);
    return 0;
  }
  constexpr int kTrips = 2000, kRuns = 5;
  std::vector<double> runs;
  if (::sched_setaffinity(0, sizeof one, &one) == 0) {
    const pid_t child = ::fork();
    if (child == 0) {
      char c = 0;
      for (int i = 0; i < kTrips * kRuns; ++i) {
        if (::read(there[0], &c, 1) != 1 || ::write(back[1], &c, 1) != 1) ::_exit(1);
      }
      ::_exit(0);
    }
    if (child > 0) {
      char c = 0;
      for (int run = 0; run < kRuns; ++run) {
        const int64_t t0 = now_ns();
        for (int i = 0; i < kTrips; ++i) {
          if (::write(there[1], &c, 1) != 1 || ::read(back[0], &c, 1) != 1) break;
        }
        runs.push_back(static_cast<double>(now_ns() - t0) / (2.0 * kTrips) / 1e3);
      }
      int status = 0;
      ::waitpid(child, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) runs.clear();
    }
    ::sched_setaffinity(0, sizeof before, &before);
  }
  for (int fd : {there[0], there[1], back[0], back[1]}) ::close(fd);
  return runs.empty() ? 0.0 : median(runs);
}

std::string rank_name(int rank) {
  return rank == 0 ? std::string("writer (rank 0)") : "reader " + std::to_string(rank);
}

std::string format_us(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

struct KindResult {
  std::vector<double> lat_us;  // every update's, every reader's, every repeat's
  std::vector<double> p50s;    // per repeat
  std::vector<double> copy_us, memcpy_us, view_us;
  std::vector<double> reader_p50_us[kMaxReaders];  // each reader's own p50, per repeat
};

// Each reader's p50 (the median over repeats), lowest first: with more processes than CPUs a
// reader that shares the writer's CPU sees a commit only once the writer leaves it.
std::vector<double> reader_p50s(const KindResult& k) {
  std::vector<double> out;
  for (const auto& per_repeat : k.reader_p50_us) {
    if (!per_repeat.empty()) out.push_back(median(per_repeat));
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

ScenarioRun run_board(const BenchOptions& o) {
  ScenarioRun run;
  const int readers = std::clamp(o.actors, 1, kMaxReaders);
  const int updates = std::clamp(o.steps, 10, kMaxUpdates);
  std::printf(
      "\nscenario board: 1 writer, %d reader process(es), 4 MiB of weights (4 float32 leaves of 1 MiB),\n"
      "  %d updates per measurement, each seen by every reader before the next\n"
      "  board publish   the writer publish()es weights of its own (a copy into a free buffer), stamped\n"
      "                  before that copy\n"
      "  board commit    the writer writes in place (begin()) and commit()s, stamped at the commit\n"
      "  torchrl update  TorchRL's pattern: shared weights updated in place, a byte down a pipe per\n"
      "                  reader (mp.Queue's way) and an ack back; stamped before the update\n"
      "  torchrl notify  the same, stamped after the update: the doorbell alone\n"
      "  board sleeping  board commit, readers sleeping on the futex at once (spin 0)\n"
      "  readers: board ones spin in wait_newer (10 ms before sleeping), TorchRL ones block on their\n"
      "  pipe; both copy the newest weights into their own and check them. p50 / p90 of every\n"
      "  update of every reader, median of %d measurement(s) for the p50, min-max beside it\n",
      readers, updates, o.repeat);
  if (readers + 1 > allowed_cpu_count()) {
    std::printf(
        "\nnote: %d processes on %d CPU(s): oversubscribed, so the latencies measure time sharing of the\n"
        "      CPUs as much as the doorbells\n",
        readers + 1, allowed_cpu_count());
  }
  std::fflush(stdout);
  KindResult results[kKindCount];
  const size_t bytes = sizeof(Shared) + kWeightBytes;
  for (int rep = 0; rep < o.repeat; ++rep) {
    for (int kind = 0; kind < kKindCount; ++kind) {
      void* mem = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
      if (mem == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap of the board scenario");
      auto* sh = new (mem) Shared();
      std::vector<int> fds;
      for (int r = 0; r < readers; ++r) {
        if (::pipe(sh->notify[r]) != 0) throw std::system_error(errno, std::generic_category(), "pipe");
        fds.insert(fds.end(), {sh->notify[r][0], sh->notify[r][1]});
      }
      if (::pipe(sh->ack) != 0) throw std::system_error(errno, std::generic_category(), "pipe");
      fds.insert(fds.end(), {sh->ack[0], sh->ack[1]});
      const std::string name = "tdshm-bench-" + std::to_string(::getpid()) + "-board-" + std::to_string(kind);
      RankJob job;
      job.world = readers + 1;
      job.segment = name;
      uint8_t* weights_mem = static_cast<uint8_t*>(mem) + sizeof(Shared);
      job.run_rank = [&, kind](int rank, Control&, const Reporter& report) {
        return board_rank(kind, readers, updates, name, *sh, weights_mem, rank, report);
      };
      job.rank_name = rank_name;
      RanksResult ranks = run_ranks(job, std::chrono::seconds(120));
      for (int fd : fds) ::close(fd);
      ::munmap(mem, bytes);
      for (auto& f : ranks.failures) run.failures.push_back(std::string("board ") + kKinds[kind] + ": " + f);
      KindResult& k = results[kind];
      std::vector<double> lat;
      for (const std::string& line : ranks.reports) {
        if (line.empty()) continue;
        std::vector<double> values;
        size_t pos = 1;
        while (pos < line.size()) {
          char* end = nullptr;
          const double v = std::strtod(line.c_str() + pos, &end);
          if (end == line.c_str() + pos) break;
          values.push_back(v / 1e3);
          pos = static_cast<size_t>(end - line.c_str());
        }
        if (line[0] == 'L') lat.insert(lat.end(), values.begin(), values.end());
        int reader = -1;
        double p50_ns = 0;
        if (std::sscanf(line.c_str(), "P %d %lf", &reader, &p50_ns) == 2 && reader >= 0 && reader < kMaxReaders) {
          k.reader_p50_us[reader].push_back(p50_ns / 1e3);
        }
        if (line[0] == 'C' && !values.empty()) k.copy_us.push_back(values[0]);
        if (line[0] == 'M' && !values.empty()) k.memcpy_us.push_back(values[0]);
        if (line[0] == 'V' && !values.empty()) k.view_us.push_back(values[0]);
      }
      if (!lat.empty()) k.p50s.push_back(percentile(lat, 0.5));
      k.lat_us.insert(k.lat_us.end(), lat.begin(), lat.end());
    }
  }
  std::vector<double> full_reads, full_copies;  // every reader's medians, every repeat's
  for (int rep = 0; rep < o.repeat; ++rep) {
    void* mem = ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap of the board scenario");
    auto* sh = new (mem) Shared();
    const std::string name = "tdshm-bench-" + std::to_string(::getpid()) + "-board-full";
    RankJob job;
    job.world = readers + 1;
    job.segment = name;
    job.run_rank = [&](int rank, Control&, const Reporter& report) {
      return full_speed_rank(readers, name, *sh, rank, report);
    };
    job.rank_name = rank_name;
    RanksResult ranks = run_ranks(job, std::chrono::seconds(120));
    ::munmap(mem, sizeof(Shared));
    for (auto& f : ranks.failures) run.failures.push_back("board at full speed: " + f);
    for (const std::string& line : ranks.reports) {
      double read_ns = 0, copy_ns = 0;
      if (std::sscanf(line.c_str(), "F %lf %lf", &read_ns, &copy_ns) == 2) {
        full_reads.push_back(read_ns / 1e3);
        full_copies.push_back(copy_ns / 1e3);
      }
    }
  }
  std::printf("\n  %-16s %12s %20s %10s   %s\n", "pattern", "p50 us", "min - max", "p90 us", "each reader's p50 us");
  for (int kind = 0; kind < kKindCount; ++kind) {
    const KindResult& k = results[kind];
    if (k.p50s.empty()) continue;
    const double p50 = median(k.p50s);
    std::string each;
    for (double v : reader_p50s(k)) each += (each.empty() ? "" : " / ") + format_us(v);
    std::printf("  %-16s %12.1f %9.1f - %-8.1f %10.1f   %s\n", kKinds[kind], p50,
                *std::min_element(k.p50s.begin(), k.p50s.end()), *std::max_element(k.p50s.begin(), k.p50s.end()),
                percentile(k.lat_us, 0.9), each.c_str());
    Row row;
    row.set("scenario", "board")
        .set("pattern", kPatterns[kind])
        .set("transport", kTransports[kind])
        .set_int("world", readers + 1)
        .set_int("bytes", static_cast<int64_t>(kWeightBytes))
        .set_number("p50_us", p50)
        .set_number("p90_us", percentile(k.lat_us, 0.9))
        .set_int("repeats", static_cast<int64_t>(k.p50s.size()));
    run.rows.push_back(row);
  }
  std::vector<double> spinning, plain, view, fresh;
  for (int kind : {0, 1, kSleeping}) {
    if (kind != kSleeping) spinning.insert(spinning.end(), results[kind].copy_us.begin(), results[kind].copy_us.end());
    plain.insert(plain.end(), results[kind].memcpy_us.begin(), results[kind].memcpy_us.end());
    view.insert(view.end(), results[kind].view_us.begin(), results[kind].view_us.end());
  }
  for (int kind : {2, 3}) fresh.insert(fresh.end(), results[kind].copy_us.begin(), results[kind].copy_us.end());
  const std::vector<double>& sleeping = results[kSleeping].copy_us;
  auto ratio = [&](int a, int b) {
    return results[a].p50s.empty() || results[b].p50s.empty() ? 0.0 : median(results[a].p50s) / median(results[b].p50s);
  };
  auto goal = [](const char* what, double v, const char* op, double limit, bool pass) {
    std::printf("  goal: %-48s %8.2f  %s %.2f  %s\n", what, v, op, limit, pass ? "PASS" : "MISS");
  };
  if (!sleeping.empty() && !plain.empty() && !fresh.empty()) {
    // The goals take the copies of readers that wait as TorchRL's do (asleep until told). With more
    // processes than CPUs, readers that spin before they copy copy slower, whatever they spin on:
    // TorchRL's readers made to spin on the stamp did too, and a view's memcpy as much as read().
    const double copy = median(sleeping);
    std::printf(
        "  a reader's copy of the newest version (read), readers asleep between versions as TorchRL's:\n"
        "  %.1f us (spinning in wait_newer: %.1f); a TorchRL reader's memcpy of the weights its writer\n"
        "  just updated: %.1f us; a plain 4 MiB copy of warm lines in the reader: %.1f us; a view (view()\n"
        "  and drop): %.2f us (medians over readers and repeats)\n",
        copy, spinning.empty() ? 0.0 : median(spinning), median(fresh), median(plain), median(view));
    goal("reader copy / memcpy of just-written weights", median(fresh) / copy, ">=", 0.8, median(fresh) / copy >= 0.8);
    goal("reader copy / plain copy (speed)", median(plain) / copy, ">=", 0.8, median(plain) / copy >= 0.8);
    goal("view (us)", median(view), "<=", 2.0, median(view) <= 2.0);
  }
  if (!full_reads.empty()) {
    std::vector<double> ratios;
    for (size_t i = 0; i < full_reads.size(); ++i) ratios.push_back(full_copies[i] / full_reads[i]);
    std::printf(
        "  writer at full speed (publish in a loop), each reader %d x: read %.1f us, a memcpy of its own\n"
        "  4 MiB right after %.1f us (medians); read / memcpy by reader and repeat: %.2f - %.2f\n",
        kFullSpeedReads, median(full_reads), median(full_copies), *std::min_element(ratios.begin(), ratios.end()),
        *std::max_element(ratios.begin(), ratios.end()));
    goal("full speed: reader copy / memcpy (speed, median)", median(ratios), ">=", 0.8, median(ratios) >= 0.8);
  }
  if (!results[1].p50s.empty()) {
    goal("board commit-to-visible p50 (us)", median(results[1].p50s), "<=", 5.0, median(results[1].p50s) <= 5.0);
  }
  if (ratio(2, 0) > 0)
    goal("torchrl update / board publish (p50, lower by)", ratio(2, 0), ">=", 10.0, ratio(2, 0) >= 10.0);
  if (ratio(3, 1) > 0)
    goal("torchrl notify / board commit (p50, lower by)", ratio(3, 1), ">=", 10.0, ratio(3, 1) >= 10.0);
  const std::vector<double> board_each = reader_p50s(results[1]), torchrl_each = reader_p50s(results[3]);
  if (!board_each.empty() && board_each.size() == torchrl_each.size()) {
    // Reader by reader, soonest with soonest: with more processes than CPUs the reader that shares
    // the writer's CPU sees a commit only after the writer leaves it (a context switch).
    std::string each;
    for (size_t i = 0; i < board_each.size(); ++i) {
      each += (i == 0 ? "" : " / ") + format_us(torchrl_each[i] / std::max(board_each[i], 0.01)) + "x";
    }
    std::printf("  torchrl notify / board commit, each reader's p50: %s\n", each.c_str());
    if (readers + 1 > allowed_cpu_count()) {
      if (const double floor = switch_floor_us(); floor > 0) {
        std::printf(
            "  a context switch on one CPU (pipe ping-pong, its write and read included): %.1f us. A reader\n"
            "  that shares the writer's CPU sees a commit no sooner: against torchrl notify's p50 of its\n"
            "  reader, the most such a reader can show is %.1fx\n",
            floor, torchrl_each.back() / floor);
      }
    }
  }
  std::fflush(stdout);
  return run;
}

}  // namespace tdshm::bench
