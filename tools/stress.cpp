// `tdshm stress`: the shm transport under real lifecycles, through the public API only.
//
// Kill loop (scenarios a-g). Every trial starts one process per rank (fork + exec of this tool in
// a hidden worker mode, `tdshm stress --worker ...`; `--spawn fork` skips the exec), with a
// segment name of its own, waits until all are ready, starts the scenario and SIGKILLs one rank
// at a uniformly random instant of the scenario's active window (measured beforehand by one run
// without a kill). The survivors report what their waits ended in and when. Then a fresh group of
// all ranks under the same name must rendezvous and do one checked transfer, with no cleanup in
// between; only after that is the name cleaned with tdshm::remove_stale_segment, and whatever
// was left in /dev/shm is reported as a leak.
//
// Re-creation loop (`--scenario recreate`): W ranks run N cycles of init_process_group, a
// checked transfer, a barrier every other cycle and destroy_process_group under ONE name, with
// random 0-2 ms sleeps between the calls so that the ranks' calls interleave in every way.
//
// Workers write one line per event to fd 3, a pipe to the driver: "TAG NS TYPE TEXT". NS is
// CLOCK_MONOTONIC in nanoseconds (comparable between the processes of one host), TYPE is "-" or
// the demangled dynamic type of an exception. Tags: READY (set up; waits for a byte on fd 0),
// ENTER (got it), PHASE (a coarse step, in TEXT), INIT (init_process_group returned), DONE
// (every received value checked), EXIT (the group is destroyed; leaving), ERR (an exception),
// WRONG (received values differ from what was sent), DESTROY_ERR (destroy_process_group threw
// after an error), END (recreate: the counts).

#include "stress.h"

#include "common/json.h"

#include <tdshm/distributed.h>
#include <tdshm/errors.h>
#include <tdshm/process_group.h>
#include <tdshm/tensordict.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <cxxabi.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <typeinfo>
#include <utility>
#include <variant>
#include <vector>

namespace tdshm::tools {
namespace {

using namespace std::chrono_literals;
using detail::json_quote;

int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

std::string demangle(const char* name) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> out(abi::__cxa_demangle(name, nullptr, nullptr, &status), std::free);
  return status == 0 && out ? std::string(out.get()) : std::string(name);
}

// ---------------------------------------------------------------------------------------------
// Scenarios

struct Scenario {
  const char* name;
  char letter;
  int world;
  /// The kill lands inside init_process_group: the window ends when it returns, and a survivor's
  /// TimeoutError is acceptable (a victim killed before it registered cannot be told from a slow
  /// one).
  bool rendezvous;
  const char* what;
};

constexpr Scenario kScenarios[] = {
    {"rendezvous", 'a', 3, true, "3 ranks in init_process_group(\"shm\", shm://NAME)"},
    {"p2p", 'b', 2, false, "per-leaf isend/irecv ping-pong of a 4-leaf TensorDict (405 KiB), 150 round trips"},
    {"consolidated", 'c', 2, false, "64 MiB consolidated send/recv, 5 transfers"},
    {"remote", 'd', 2, false, "init_remote / from_remote_init of a 1 MiB tree with a non-tensor value, 30 times"},
    {"broadcast", 'e', 3, false, "3 ranks: TensorDict::broadcast and ProcessGroupShm::broadcast, rotating root, 60 rounds"},
    {"fullring", 'f', 2, false, "1 MiB per-leaf sends into a 4 x 4 KiB ring while the receiver sleeps 150 ms, twice"},
    {"create", 'g', 2, true, "rank 0 creating a 256 MiB segment while rank 1 waits to attach"},
};

constexpr int kP2PRounds = 150;
constexpr int kBigTransfers = 5;
constexpr int64_t kBigFloats = int64_t{16} << 20;  // 64 MiB of float32
constexpr int kRemoteRounds = 30;
constexpr int kBroadcastRounds = 60;
constexpr int kFullRingRounds = 2;
constexpr auto kFullRingSleep = 150ms;
constexpr int kRecreateMaxProblems = 10;  // a recreate rank stops after this many failed cycles

const Scenario* find_scenario(const std::string& name) {
  for (const Scenario& s : kScenarios) {
    if (name == s.name || (name.size() == 1 && name[0] == s.letter)) return &s;
  }
  return nullptr;
}

ShmOptions shm_options_for(const Scenario& s) {
  ShmOptions o;
  if (s.letter == 'f') {  // a sender soon finds the ring full
    o.slot_bytes = 4096;
    o.ring_entries = 4;
  } else if (s.letter == 'g') {  // 2 ranks: 4 rings x 64 x 1 MiB = 256 MiB, reserved at creation
    o.slot_bytes = size_t{1} << 20;
    o.ring_entries = 64;
  }
  return o;
}

ShmOptions recreate_options() {
  ShmOptions o;
  o.slot_bytes = size_t{64} << 10;
  o.ring_entries = 8;
  return o;
}

// ---------------------------------------------------------------------------------------------
// Worker side

struct WorkerSpec {
  std::string mode;      // a scenario's name, "recover" or "recreate"
  std::string scenario;  // whose options the group uses (recover)
  int rank = 0;
  int world = 2;
  std::string name;
  uint64_t seed = 0;
  int cycles = 0;
};

constexpr int kReportFd = 3;

void emit(const char* tag, const std::string& type = "-", const std::string& text = "") {
  std::string line = tag;
  line += ' ';
  line += std::to_string(now_ns());
  line += ' ';
  line += type.empty() ? "-" : type;
  line += ' ';
  std::string body = text.substr(0, 1500);  // one write below PIPE_BUF: never interleaved
  for (char& c : body) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  line += body;
  line += '\n';
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    const ssize_t n = ::write(kReportFd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
}

class WrongData : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void expect(bool ok, const std::string& what) {
  if (!ok) throw WrongData(what);
}

struct Caught {
  std::string type;
  std::string what;
};

/// The exception being handled: its dynamic type and message (call inside a catch block).
Caught caught_now() {
  Caught c;
  const std::type_info* ti = abi::__cxa_current_exception_type();
  c.type = ti != nullptr ? demangle(ti->name()) : "unknown";
  try {
    throw;
  } catch (const std::exception& e) {
    c.what = e.what();
  } catch (...) {
    c.what = "(not a std::exception)";
  }
  return c;
}

bool wait_go() {
  char c = 0;
  for (;;) {
    const ssize_t n = ::read(0, &c, 1);
    if (n == 1) return true;
    if (n < 0 && errno == EINTR) continue;
    return false;  // the driver is gone
  }
}

InitOptions init_options(const WorkerSpec& w, const ShmOptions& shm, std::chrono::milliseconds timeout) {
  InitOptions o;
  o.rank = w.rank;
  o.world_size = w.world;
  o.init_method = "shm://" + w.name;
  o.timeout = timeout;
  o.shm = shm;
  return o;
}

void destroy_after_error() {
  try {
    if (is_initialized()) destroy_process_group();
  } catch (...) {
    const Caught c = caught_now();
    emit("DESTROY_ERR", c.type, c.what);
  }
}

at::Tensor i64(std::initializer_list<int64_t> values) {
  at::Tensor t = at::zeros({static_cast<int64_t>(values.size())}, at::kLong);
  int64_t* p = t.data_ptr<int64_t>();
  for (const int64_t v : values) *p++ = v;
  return t;
}

std::string i64_str(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  std::string out = "[";
  for (int64_t i = 0; i < c.numel(); ++i) out += (i ? ", " : "") + std::to_string(c.data_ptr<int64_t>()[i]);
  return out + "]";
}

bool i64_eq(const at::Tensor& t, std::initializer_list<int64_t> values) {
  if (t.scalar_type() != at::kLong || t.numel() != static_cast<int64_t>(values.size())) return false;
  const at::Tensor c = t.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  for (const int64_t v : values) {
    if (*p++ != v) return false;
  }
  return true;
}

/// Rank 0 sends (value, r, 1) to every other rank r as a one-leaf TensorDict; r checks it and
/// answers (value, r, 2), which rank 0 checks.
void checked_exchange(const WorkerSpec& w, int64_t value, std::string& phase) {
  if (w.rank == 0) {
    for (int r = 1; r < w.world; ++r) {
      phase = "exchange: send to rank " + std::to_string(r);
      TensorDict({{"x", i64({value, r, 1})}}).send({.dst = r});
    }
    for (int r = 1; r < w.world; ++r) {
      phase = "exchange: recv from rank " + std::to_string(r);
      TensorDict got({{"x", at::zeros({3}, at::kLong)}});
      got.recv({.src = r});
      expect(i64_eq(got.get("x"), {value, r, 2}), "rank 0 received " + i64_str(got.get("x")) + " from rank " +
                                                       std::to_string(r) + ", expected " +
                                                       i64_str(i64({value, r, 2})));
    }
  } else {
    phase = "exchange: recv from rank 0";
    TensorDict got({{"x", at::zeros({3}, at::kLong)}});
    got.recv({.src = 0});
    expect(i64_eq(got.get("x"), {value, w.rank, 1}),
           "received " + i64_str(got.get("x")) + ", expected " + i64_str(i64({value, w.rank, 1})));
    phase = "exchange: reply to rank 0";
    TensorDict({{"x", i64({value, w.rank, 2})}}).send({.dst = 0});
  }
}

void fill_all(const TensorDict& td, int64_t v) {
  for (const Key& k : td.sorted_leaf_keys()) td.get(k).fill_(v);
}

std::string round_phase(int i, const char* what) { return "round " + std::to_string(i) + ": " + what; }

TensorDict p2p_tree() {
  return TensorDict({{"a", at::zeros({1000}, at::kFloat)},
                     {"b", at::zeros({64}, at::kLong)},
                     {{"n", "c"}, at::zeros({100000}, at::kFloat)},
                     {{"n", "d"}, at::zeros({3}, at::kByte)}});
}

// (b) rank 1 isends, rank 0 irecvs (return_premature, then waits) and answers the same way.
void body_p2p(const WorkerSpec& w, std::string& phase) {
  const TensorDict out = p2p_tree();
  TensorDict in = p2p_tree();
  for (int i = 0; i < kP2PRounds; ++i) {
    const int64_t to0 = (2 * i) % 251, to1 = (2 * i + 1) % 251;  // values fit uint8 and differ per message
    if (w.rank == 1) {
      phase = round_phase(i, "isend to 0");
      fill_all(out, to0);
      out.isend({.dst = 0});
      phase = round_phase(i, "irecv from 0");
      in.irecv({.src = 0, .return_premature = true}).wait();
      expect(in.eq(to1).all(), phase + ": a leaf differs from " + std::to_string(to1));
    } else {
      phase = round_phase(i, "irecv from 1");
      in.irecv({.src = 1, .return_premature = true}).wait();
      expect(in.eq(to0).all(), phase + ": a leaf differs from " + std::to_string(to0));
      phase = round_phase(i, "isend to 1");
      fill_all(out, to1);
      out.isend({.dst = 1});
    }
  }
}

TensorDict big_tree() {
  return TensorDict({{"x", at::zeros({kBigFloats}, at::kFloat)}, {"i", at::zeros({1}, at::kLong)}}).consolidate();
}

// (c) rank 1 sends 64 MiB consolidated, rank 0 receives it consolidated and checks every element.
void body_consolidated(const WorkerSpec& w, std::string& phase) {
  TensorDict td = big_tree();
  for (int i = 0; i < kBigTransfers; ++i) {
    const int64_t v = i + 1;
    if (w.rank == 1) {
      phase = round_phase(i, "consolidated send");
      td.get("x").fill_(v);
      td.get("i").fill_(v);
      td.send({.dst = 0, .consolidated = true});
    } else {
      phase = round_phase(i, "consolidated recv");
      td.recv({.src = 1, .consolidated = true});
      const int64_t got = td.get("i").item<int64_t>();
      expect(got == v, phase + ": index leaf " + std::to_string(got) + ", expected " + std::to_string(v));
      expect(td.get("x").eq(v).all().item<bool>(), phase + ": the 64 MiB leaf is not all " + std::to_string(v));
    }
  }
}

// (d) rank 0 init_remote's a fresh tree each round; rank 1 rebuilds it with from_remote_init.
void body_remote(const WorkerSpec& w, std::string& phase) {
  for (int i = 0; i < kRemoteRounds; ++i) {
    const int64_t v = i + 1;
    if (w.rank == 0) {
      phase = round_phase(i, "init_remote");
      TensorDict td({{{"a", "b"}, at::full({2}, v, at::kFloat)},
                     {"c", at::full({2, 3}, v, at::kLong)},
                     {"big", at::full({2, 131072}, v, at::kFloat)},
                     {"step", v}},
                    {2});
      td.init_remote({.dst = 1});
    } else {
      phase = round_phase(i, "from_remote_init");
      const TensorDict r = TensorDict::from_remote_init({.src = 0});
      expect(r.contains("big") && r.contains({"a", "b"}) && r.contains("c"), phase + ": keys missing");
      const auto step = r.get_non_tensor("step");
      expect(std::holds_alternative<int64_t>(step) && std::get<int64_t>(step) == v,
             phase + ": non-tensor \"step\" is not " + std::to_string(v));
      expect(r.eq(v).all(), phase + ": a leaf is not all " + std::to_string(v));
    }
  }
}

// (e) 3 ranks; root i % 3; even rounds TensorDict::broadcast, odd rounds ProcessGroupShm::broadcast.
void body_broadcast(const WorkerSpec& w, std::string& phase) {
  for (int i = 0; i < kBroadcastRounds; ++i) {
    const int root = i % w.world;
    const int64_t v = i + 1;
    if (i % 2 == 0) {
      phase = round_phase(i, "TensorDict::broadcast");
      const TensorDict src = w.rank == root ? TensorDict({{"v", at::full({65536}, v, at::kFloat)},
                                                          {"w", at::full({3}, v, at::kLong)}})
                                            : TensorDict();
      const TensorDict got = src.broadcast({.src = root});
      expect(got.contains("v") && got.contains("w") && got.eq(v).all(),
             phase + ": the result is not {v, w} all " + std::to_string(v));
    } else {
      phase = round_phase(i, "ProcessGroupShm::broadcast");
      std::vector<at::Tensor> t{w.rank == root ? at::full({100000}, v, at::kFloat) : at::zeros({100000}, at::kFloat)};
      c10d::BroadcastOptions o;
      o.rootRank = root;
      default_group().backend().broadcast(t, o)->wait();
      expect(t[0].eq(v).all().item<bool>(), phase + ": the tensor is not all " + std::to_string(v));
    }
  }
}

// (f) rank 1 sends 1 MiB per-leaf through a 16 KiB ring while rank 0 sleeps outside tdshm.
void body_fullring(const WorkerSpec& w, std::string& phase) {
  TensorDict td({{"x", at::zeros({262144}, at::kFloat)}, {"y", at::zeros({16}, at::kLong)}});
  for (int i = 0; i < kFullRingRounds; ++i) {
    const int64_t v = i + 1;
    if (w.rank == 1) {
      phase = round_phase(i, "send into the full ring");
      fill_all(td, v);
      td.send({.dst = 0});
    } else {
      phase = round_phase(i, "sleeping, not receiving");
      std::this_thread::sleep_for(kFullRingSleep);
      phase = round_phase(i, "recv");
      td.recv({.src = 1});
      expect(td.eq(v).all(), phase + ": a leaf is not all " + std::to_string(v));
    }
  }
}

int run_kill_worker(const WorkerSpec& w, const Scenario& s) {
  std::string phase = "start";
  auto step = [&](const char* p) {
    phase = p;
    emit("PHASE", "-", p);
  };
  try {
    const std::chrono::milliseconds timeout = s.rendezvous ? 5s : 60s;
    if (!s.rendezvous) {
      step("init");
      init_process_group("shm", init_options(w, shm_options_for(s), timeout));
    }
    emit("READY");
    if (!wait_go()) return 3;
    emit("ENTER");
    if (s.rendezvous) {
      step("init");
      init_process_group("shm", init_options(w, shm_options_for(s), timeout));
      emit("INIT");
    }
    step("body");
    switch (s.letter) {
      case 'b': body_p2p(w, phase); break;
      case 'c': body_consolidated(w, phase); break;
      case 'd': body_remote(w, phase); break;
      case 'e': body_broadcast(w, phase); break;
      case 'f': body_fullring(w, phase); break;
      default: checked_exchange(w, static_cast<int64_t>(w.seed), phase); break;
    }
    emit("DONE");
    step("barrier");
    default_group().backend().barrier()->wait();
    step("destroy");
    destroy_process_group();
    emit("EXIT");
    return 0;
  } catch (const WrongData& e) {
    emit("WRONG", "-", phase + ": " + e.what());
    destroy_after_error();
    return 2;
  } catch (...) {
    const Caught c = caught_now();
    emit("ERR", c.type, phase + ": " + c.what);
    destroy_after_error();
    return 1;
  }
}

/// A fresh group under a name a killed trial used: rendezvous, checked exchange, barrier, destroy.
int run_recover_worker(const WorkerSpec& w, const Scenario& s) {
  std::string phase = "init";
  try {
    init_process_group("shm", init_options(w, shm_options_for(s), 10s));
    emit("INIT");
    checked_exchange(w, static_cast<int64_t>(w.seed), phase);
    emit("DONE");
    phase = "barrier";
    default_group().backend().barrier()->wait();
    phase = "destroy";
    destroy_process_group();
    emit("EXIT");
    return 0;
  } catch (const WrongData& e) {
    emit("WRONG", "-", phase + ": " + e.what());
    destroy_after_error();
    return 2;
  } catch (...) {
    const Caught c = caught_now();
    emit("ERR", c.type, phase + ": " + c.what);
    destroy_after_error();
    return 1;
  }
}

/// One cycle's transfer over the c10d group: rank 0 sends (cycle, r, 1) to every rank r, r checks
/// it and answers (cycle, r, 2). A message left over from another cycle shows as a wrong value.
void recreate_exchange(const WorkerSpec& w, int64_t cycle, std::string& phase) {
  c10d::ProcessGroup& pg = default_group().backend();
  constexpr int kTagDown = 11, kTagUp = 12;
  if (w.rank == 0) {
    for (int r = 1; r < w.world; ++r) {
      phase = "send to rank " + std::to_string(r);
      std::vector<at::Tensor> t{i64({cycle, r, 1})};
      pg.send(t, r, kTagDown)->wait();
    }
    for (int r = 1; r < w.world; ++r) {
      phase = "recv from rank " + std::to_string(r);
      std::vector<at::Tensor> t{at::zeros({3}, at::kLong)};
      pg.recv(t, r, kTagUp)->wait();
      expect(i64_eq(t[0], {cycle, r, 2}), phase + ": received " + i64_str(t[0]) + ", expected " + i64_str(i64({cycle, r, 2})));
    }
  } else {
    phase = "recv from rank 0";
    std::vector<at::Tensor> t{at::zeros({3}, at::kLong)};
    pg.recv(t, 0, kTagDown)->wait();
    expect(i64_eq(t[0], {cycle, w.rank, 1}),
           phase + ": received " + i64_str(t[0]) + ", expected " + i64_str(i64({cycle, w.rank, 1})));
    phase = "reply to rank 0";
    std::vector<at::Tensor> back{i64({cycle, w.rank, 2})};
    pg.send(back, 0, kTagUp)->wait();
  }
}

int run_recreate_worker(const WorkerSpec& w) {
  std::mt19937_64 rng(w.seed);
  auto jitter = [&] { std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2001)); };
  emit("READY");
  if (!wait_go()) return 3;
  int ok = 0, wrong = 0, timeouts = 0, errors = 0, cycle = 0;
  for (; cycle < w.cycles; ++cycle) {
    std::string phase = "init";
    try {
      jitter();
      init_process_group("shm", init_options(w, recreate_options(), 5s));
      jitter();
      recreate_exchange(w, cycle, phase);
      if (cycle % 2 == 0) {
        phase = "barrier";
        default_group().backend().barrier()->wait();
      }
      jitter();
      phase = "destroy";
      destroy_process_group();
      ++ok;
    } catch (const WrongData& e) {
      ++wrong;
      emit("WRONG", "-", "cycle " + std::to_string(cycle) + ", " + e.what());
      destroy_after_error();
    } catch (...) {
      const Caught c = caught_now();
      if (c.type == "tdshm::TimeoutError") {
        ++timeouts;
      } else {
        ++errors;
      }
      emit("ERR", c.type, "cycle " + std::to_string(cycle) + ", " + phase + ": " + c.what);
      destroy_after_error();
    }
    if (wrong + timeouts + errors >= kRecreateMaxProblems) {
      ++cycle;
      break;
    }
  }
  emit("END", "-",
       "cycles=" + std::to_string(cycle) + " ok=" + std::to_string(ok) + " wrong=" + std::to_string(wrong) +
           " timeouts=" + std::to_string(timeouts) + " errors=" + std::to_string(errors));
  return wrong + timeouts + errors == 0 ? 0 : 1;
}

int run_worker(const WorkerSpec& w) {
  at::set_num_threads(1);
  if (w.mode == "recreate") return run_recreate_worker(w);
  if (w.mode == "recover") {
    const Scenario* s = find_scenario(w.scenario);
    if (s == nullptr) return 64;
    return run_recover_worker(w, *s);
  }
  const Scenario* s = find_scenario(w.mode);
  if (s == nullptr) return 64;
  return run_kill_worker(w, *s);
}

// ---------------------------------------------------------------------------------------------
// Driver side: the processes

struct Event {
  std::string tag;
  int64_t ns = 0;
  std::string type;
  std::string text;
};

Event parse_event(const std::string& line) {
  Event e;
  std::istringstream is(line);
  is >> e.tag >> e.ns >> e.type;
  std::getline(is, e.text);
  if (!e.text.empty() && e.text[0] == ' ') e.text.erase(0, 1);
  return e;
}

/// One worker process: its report pipe (read end), its GO pipe (write end), what it reported.
/// The destructor SIGKILLs and reaps it if it is still there.
struct Proc {
  int rank = 0;
  pid_t pid = -1;
  int report_fd = -1;
  int ctl_fd = -1;
  std::string log;
  std::string partial;
  std::vector<Event> events;
  bool eof = false;
  bool reaped = false;
  int status = 0;
  bool may_reap = true;  // false for a victim until it is killed (its pid must not be reused)
  bool hang = false;

  Proc() = default;
  Proc(const Proc&) = delete;
  Proc& operator=(const Proc&) = delete;
  Proc(Proc&& o) noexcept { *this = std::move(o); }
  Proc& operator=(Proc&& o) noexcept {
    if (this != &o) {
      release();
      rank = o.rank;
      pid = std::exchange(o.pid, -1);
      report_fd = std::exchange(o.report_fd, -1);
      ctl_fd = std::exchange(o.ctl_fd, -1);
      log = std::move(o.log);
      partial = std::move(o.partial);
      events = std::move(o.events);
      eof = o.eof;
      reaped = o.reaped;
      status = o.status;
      may_reap = o.may_reap;
      hang = o.hang;
    }
    return *this;
  }
  ~Proc() { release(); }

  void release() noexcept {
    if (pid > 0 && !reaped) {
      ::kill(pid, SIGKILL);
      int st = 0;
      while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
      }
      reaped = true;
    }
    if (report_fd >= 0) ::close(report_fd);
    if (ctl_fd >= 0) ::close(ctl_fd);
    report_fd = ctl_fd = -1;
    pid = -1;
  }

  void read_some() {
    if (eof || report_fd < 0) return;
    char buf[4096];
    for (;;) {
      const ssize_t n = ::read(report_fd, buf, sizeof buf);
      if (n > 0) {
        partial.append(buf, static_cast<size_t>(n));
        size_t pos = 0;
        while ((pos = partial.find('\n')) != std::string::npos) {
          events.push_back(parse_event(partial.substr(0, pos)));
          partial.erase(0, pos + 1);
        }
        continue;
      }
      if (n == 0) {
        eof = true;
        return;
      }
      if (errno == EINTR) continue;
      return;  // EAGAIN: nothing more for now
    }
  }

  bool try_reap() {
    if (reaped) return true;
    int st = 0;
    if (::waitpid(pid, &st, WNOHANG) == pid) {
      reaped = true;
      status = st;
    }
    return reaped;
  }

  void reap_blocking() {
    if (reaped) return;
    int st = 0;
    while (::waitpid(pid, &st, 0) < 0) {
      if (errno != EINTR) return;
    }
    reaped = true;
    status = st;
  }

  /// Exited, but not reaped (waitid with WNOWAIT keeps the zombie, so the pid stays ours).
  bool exited_unreaped() const {
    siginfo_t si{};
    if (::waitid(P_PID, static_cast<id_t>(pid), &si, WEXITED | WNOHANG | WNOWAIT) != 0) return false;
    return si.si_pid == pid;
  }

  void go() {
    const char c = 'g';
    while (::write(ctl_fd, &c, 1) < 0 && errno == EINTR) {
    }
  }

  const Event* find(const std::string& tag) const {
    for (const Event& e : events) {
      if (e.tag == tag) return &e;
    }
    return nullptr;
  }

  std::string last_phase() const {
    std::string p = "(none reported)";
    for (const Event& e : events) {
      if (e.tag == "PHASE") p = e.text;
    }
    return p;
  }

  std::string describe_exit() const {
    if (!reaped) return "not reaped";
    if (WIFSIGNALED(status)) {
      return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
    }
    return "exited with " + std::to_string(WEXITSTATUS(status));
  }
};

class Driver {
 public:
  std::string exe;
  bool fork_only = false;
  std::filesystem::path log_dir;
  double hang_s = 10;
  bool verbose = false;

  Proc spawn(const WorkerSpec& w, const std::string& log_name) const {
    Proc p;
    p.rank = w.rank;
    p.log = (log_dir / log_name).string();
    int rep[2] = {-1, -1}, ctl[2] = {-1, -1};
    if (::pipe2(rep, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));
    if (::pipe2(ctl, O_CLOEXEC) != 0) {
      ::close(rep[0]);
      ::close(rep[1]);
      throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));
    }
    const int log_fd = ::open(p.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    std::vector<std::string> args = {exe,          "stress",       "--worker",
                                     w.mode,       "--scenario",   w.scenario.empty() ? "-" : w.scenario,
                                     "--rank",     std::to_string(w.rank),
                                     "--world",    std::to_string(w.world),
                                     "--name",     w.name,
                                     "--seed",     std::to_string(w.seed),
                                     "--cycles",   std::to_string(w.cycles)};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int err = errno;
      for (const int fd : {rep[0], rep[1], ctl[0], ctl[1], log_fd}) {
        if (fd >= 0) ::close(fd);
      }
      throw std::runtime_error(std::string("fork: ") + std::strerror(err));
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // no orphan if the driver dies
      if (::getppid() != parent) ::_exit(120);
      // fds 0-2 are open in the driver, so every pipe end is >= 3; fd 3 is set last.
      if (::dup2(ctl[0], 0) < 0) ::_exit(121);
      if (log_fd >= 0 && (::dup2(log_fd, 1) < 0 || ::dup2(log_fd, 2) < 0)) ::_exit(121);
      if (rep[1] == kReportFd) {
        ::fcntl(kReportFd, F_SETFD, 0);
      } else if (::dup2(rep[1], kReportFd) < 0) {
        ::_exit(121);
      }
      if (fork_only) {
        if (::close_range(kReportFd + 1, ~0U, 0) != 0) {
          for (int fd = kReportFd + 1; fd < 1024; ++fd) ::close(fd);
        }
        ::_exit(run_worker(w));
      }
      // The driver's own binary, even if a rebuild has replaced the file since it started.
      ::execv("/proc/self/exe", argv.data());
      ::_exit(127);
    }
    ::close(rep[1]);
    ::close(ctl[0]);
    if (log_fd >= 0) ::close(log_fd);
    p.pid = pid;
    p.report_fd = rep[0];
    p.ctl_fd = ctl[1];
    ::fcntl(p.report_fd, F_SETFL, O_NONBLOCK);
    return p;
  }
};

/// Reads reports and reaps (where may_reap) until `until()` holds or `deadline` passes; returns
/// whether `until()` held.
template <typename Pred>
bool pump(std::vector<Proc>& ps, int64_t deadline, Pred until) {
  for (;;) {
    for (Proc& p : ps) {
      p.read_some();
      if (p.may_reap && !p.reaped && p.try_reap()) p.read_some();
    }
    if (until()) return true;
    const int64_t left = deadline - now_ns();
    if (left <= 0) return false;
    std::vector<pollfd> fds;
    for (const Proc& p : ps) {
      if (!p.eof && p.report_fd >= 0) fds.push_back({p.report_fd, POLLIN, 0});
    }
    const int64_t wait = std::min<int64_t>(left, 2'000'000);  // reaping has no fd to poll on
    const timespec ts{static_cast<time_t>(wait / 1'000'000'000), static_cast<long>(wait % 1'000'000'000)};
    if (fds.empty()) {
      ::nanosleep(&ts, nullptr);
    } else {
      ::ppoll(fds.data(), fds.size(), &ts, nullptr);
    }
  }
}

bool all_reaped(const std::vector<Proc>& ps) {
  return std::all_of(ps.begin(), ps.end(), [](const Proc& p) { return p.reaped; });
}

/// Waits for every process until `deadline`; the ones still running then are SIGKILLed and
/// marked as hangs. Then reads what is left in their pipes.
void finish_all(std::vector<Proc>& ps, int64_t deadline) {
  for (Proc& p : ps) p.may_reap = true;
  pump(ps, deadline, [&] { return all_reaped(ps); });
  for (Proc& p : ps) {
    if (!p.reaped) {
      p.hang = true;
      ::kill(p.pid, SIGKILL);
      p.reap_blocking();
    }
  }
  pump(ps, now_ns() + 2'000'000'000, [&] {
    return std::all_of(ps.begin(), ps.end(), [](const Proc& p) { return p.eof; });
  });
}

// ---------------------------------------------------------------------------------------------
// /dev/shm

std::vector<std::string> shm_entries(const std::string& prefix_or_name, bool prefix) {
  std::vector<std::string> out;
  std::error_code ec;
  const std::string base = "tdshm." + prefix_or_name;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string n = e.path().filename().string();
    if (prefix ? n.rfind(base, 0) == 0 : (n == base || n.rfind(base + ".", 0) == 0)) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void unlink_entries(const std::vector<std::string>& names) {
  for (const std::string& n : names) {
    std::error_code ec;
    std::filesystem::remove(std::filesystem::path("/dev/shm") / n, ec);
  }
}

std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

void remove_logs(const Driver& d, const std::string& name) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(d.log_dir, ec)) {
    if (e.path().filename().string().rfind(name + ".", 0) == 0) std::filesystem::remove(e.path(), ec);
  }
}

// ---------------------------------------------------------------------------------------------
// JSON (one object per line)


std::string json_num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", v);
  return buf;
}

// ---------------------------------------------------------------------------------------------
// Kill trials

enum class Outcome { kCompleted, kPeerLost, kTimeout, kUnexpected, kSignal, kHang, kWrong, kNoReport };

const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::kCompleted: return "completed";
    case Outcome::kPeerLost: return "peer_lost";
    case Outcome::kTimeout: return "timeout";
    case Outcome::kUnexpected: return "unexpected_exception";
    case Outcome::kSignal: return "signal";
    case Outcome::kHang: return "hang";
    case Outcome::kWrong: return "wrong_data";
    case Outcome::kNoReport: return "no_report";
  }
  return "?";
}

struct Survivor {
  int rank = 0;
  Outcome outcome = Outcome::kNoReport;
  double latency_ms = -1;  // PeerLostError / TimeoutError: when it was seen, after the kill
  std::string type;
  std::string text;
};

Survivor classify(const Proc& p, int64_t kill_ns, double hang_s) {
  Survivor s;
  s.rank = p.rank;
  const Event* err = p.find("ERR");
  const Event* wrong = p.find("WRONG");
  const Event* destroy_err = p.find("DESTROY_ERR");
  if (p.hang) {
    s.outcome = Outcome::kHang;
    char buf[64];
    std::snprintf(buf, sizeof buf, "still running %.0f s after the kill", hang_s);
    s.text = std::string(buf) + "; last phase: " + p.last_phase();
  } else if (WIFSIGNALED(p.status)) {
    s.outcome = Outcome::kSignal;
    s.text = p.describe_exit() + "; last phase: " + p.last_phase();
  } else if (wrong != nullptr) {
    s.outcome = Outcome::kWrong;
    s.text = wrong->text;
  } else if (err != nullptr) {
    s.type = err->type;
    s.text = err->text;
    s.latency_ms = static_cast<double>(err->ns - kill_ns) / 1e6;
    s.outcome = err->type == "tdshm::PeerLostError" ? Outcome::kPeerLost
                : err->type == "tdshm::TimeoutError" ? Outcome::kTimeout
                                                     : Outcome::kUnexpected;
    if (destroy_err != nullptr && s.outcome != Outcome::kUnexpected) {
      s.outcome = Outcome::kUnexpected;
      s.type = destroy_err->type;
      s.text = "destroy_process_group after " + err->type + " threw: " + destroy_err->text;
    }
  } else if (destroy_err != nullptr) {
    s.outcome = Outcome::kUnexpected;
    s.type = destroy_err->type;
    s.text = "destroy_process_group threw: " + destroy_err->text;
  } else if (p.find("EXIT") != nullptr && WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0) {
    s.outcome = Outcome::kCompleted;
  } else {
    s.outcome = Outcome::kNoReport;
    s.text = p.describe_exit() + " without a report; last phase: " + p.last_phase();
  }
  return s;
}

struct Trial {
  const Scenario* scenario = nullptr;
  int index = 0;
  bool calibration = false;
  std::string name;
  uint64_t seed = 0;
  int victim = -1;
  double window_ms = 0;
  double delay_ms = 0;
  double measured_ms = -1;       // calibration: the window it measured
  bool victim_gone_first = false;  // the victim had exited before its kill
  std::string setup_error;
  std::vector<Survivor> survivors;  // calibration: every rank
  bool recovery_ok = false;
  std::string recovery_error;
  std::vector<std::string> leaked_after_recovery;  // left by a recovery group that ended cleanly
  std::vector<std::string> leaked_final;           // left after remove_stale_segment
  std::string cleanup_error;

  bool survivor_failed(const Survivor& s) const {
    switch (s.outcome) {
      case Outcome::kCompleted:
      case Outcome::kPeerLost: return false;
      case Outcome::kTimeout: return calibration || !scenario->rendezvous;
      default: return true;
    }
  }
  bool failed() const {
    if (!setup_error.empty()) return true;
    for (const Survivor& s : survivors) {
      if (calibration ? s.outcome != Outcome::kCompleted : survivor_failed(s)) return true;
    }
    if (calibration) return false;
    return !recovery_ok || !leaked_after_recovery.empty() || !leaked_final.empty() || !cleanup_error.empty();
  }
};

std::string trial_label(const Trial& t) {
  return std::string("[") + t.scenario->letter + " " + t.scenario->name + " " +
         (t.calibration ? "calibration " + std::to_string(t.index) : "#" + std::to_string(t.index)) + "]";
}

/// Starts the scenario's ranks, waits until all are ready and starts them; returns t0, the start
/// of the kill window (rank 0's ENTER for "create", when GO was sent otherwise), or -1 when the
/// setup failed (t.setup_error says how).
int64_t start_ranks(const Driver& d, Trial& t, std::vector<Proc>& ps) {
  const Scenario& s = *t.scenario;
  for (int r = 0; r < s.world; ++r) {
    WorkerSpec w{s.name, s.name, r, s.world, t.name, t.seed, 0};
    ps.push_back(d.spawn(w, t.name + ".r" + std::to_string(r) + ".log"));
  }
  const bool ready = pump(ps, now_ns() + 120'000'000'000, [&] {
    bool all = true;
    for (const Proc& p : ps) {
      if (p.find("READY") == nullptr) {
        if (p.eof) return true;  // died before it was ready
        all = false;
      }
    }
    return all;
  });
  std::vector<std::string> problems;
  for (const Proc& p : ps) {
    if (p.find("READY") != nullptr) continue;
    const Event* err = p.find("ERR");
    problems.push_back("rank " + std::to_string(p.rank) + " not ready: " +
                       (err != nullptr ? err->type + ": " + err->text : ready ? "it exited" : "timed out"));
  }
  if (!problems.empty()) {
    t.setup_error = join(problems, "; ");
    for (Proc& p : ps) {  // a worker waiting for GO sees EOF and leaves
      ::close(p.ctl_fd);
      p.ctl_fd = -1;
    }
    return -1;
  }
  if (s.letter == 'g') {
    ps[0].go();
    pump(ps, now_ns() + 10'000'000'000, [&] { return ps[0].find("ENTER") != nullptr || ps[0].eof; });
    const Event* enter = ps[0].find("ENTER");
    const int64_t t0 = enter != nullptr ? enter->ns : now_ns();
    for (size_t r = 1; r < ps.size(); ++r) ps[r].go();
    return t0;
  }
  const int64_t t0 = now_ns();
  for (Proc& p : ps) p.go();
  return t0;
}

void recover_and_clean(const Driver& d, Trial& t) {
  const Scenario& s = *t.scenario;
  {
    std::vector<Proc> ps;
    for (int r = 0; r < s.world; ++r) {
      WorkerSpec w{"recover", s.name, r, s.world, t.name, t.seed + 1, 0};
      ps.push_back(d.spawn(w, t.name + ".recover.r" + std::to_string(r) + ".log"));
    }
    finish_all(ps, now_ns() + 120'000'000'000);
    std::vector<std::string> problems;
    for (const Proc& p : ps) {
      const Survivor o = classify(p, 0, 120);
      if (o.outcome == Outcome::kCompleted) continue;
      problems.push_back("rank " + std::to_string(p.rank) + " " + outcome_name(o.outcome) +
                         (o.type.empty() ? "" : " " + o.type) + (o.text.empty() ? "" : ": " + o.text));
    }
    t.recovery_ok = problems.empty();
    t.recovery_error = join(problems, "; ");
  }
  const std::vector<std::string> left = shm_entries(t.name, false);
  if (t.recovery_ok) t.leaked_after_recovery = left;
  try {
    remove_stale_segment(t.name);
  } catch (const std::exception& e) {
    t.cleanup_error = std::string("remove_stale_segment: ") + e.what();
  }
  t.leaked_final = shm_entries(t.name, false);
  unlink_entries(t.leaked_final);
}

Trial run_trial(const Driver& d, const Scenario& s, int index, bool calibration, double window_ms,
                std::mt19937_64& rng) {
  Trial t;
  t.scenario = &s;
  t.index = index;
  t.calibration = calibration;
  t.name = "stress." + std::to_string(::getpid()) + "." + s.letter + "." + (calibration ? "cal" + std::to_string(index) : std::to_string(index));
  t.seed = rng() >> 24;  // < 2^40: exact in the checks
  if (!calibration) {
    t.victim = s.letter == 'g' ? 0 : static_cast<int>(rng() % static_cast<uint64_t>(s.world));
    t.window_ms = window_ms;
    t.delay_ms = std::uniform_real_distribution<double>(0.0, window_ms)(rng);
  }
  std::vector<Proc> ps;
  const int64_t t0 = start_ranks(d, t, ps);
  const auto hang_ns = static_cast<int64_t>(d.hang_s * 1e9);
  if (t0 < 0) {
    finish_all(ps, now_ns() + hang_ns);
  } else if (calibration) {
    finish_all(ps, t0 + 120'000'000'000);
    int64_t end = -1;
    for (const Proc& p : ps) {
      const Event* e = p.find(s.rendezvous ? "INIT" : "DONE");
      if (e != nullptr && (s.letter != 'g' || p.rank == 0)) end = std::max(end, e->ns);
    }
    if (end >= t0) t.measured_ms = static_cast<double>(end - t0) / 1e6;
    for (const Proc& p : ps) t.survivors.push_back(classify(p, t0, d.hang_s));
  } else {
    Proc& victim = ps[static_cast<size_t>(t.victim)];
    victim.may_reap = false;
    pump(ps, t0 + static_cast<int64_t>(t.delay_ms * 1e6), [] { return false; });
    if (victim.exited_unreaped()) {
      t.victim_gone_first = true;
    } else {
      ::kill(victim.pid, SIGKILL);
    }
    const int64_t kill_ns = now_ns();
    finish_all(ps, kill_ns + hang_ns);
    for (const Proc& p : ps) {
      if (p.rank != t.victim) t.survivors.push_back(classify(p, kill_ns, d.hang_s));
    }
  }
  ps.clear();
  if (!calibration) {
    recover_and_clean(d, t);
  } else {
    try {
      remove_stale_segment(t.name);
    } catch (const std::exception& e) {
      t.cleanup_error = std::string("remove_stale_segment: ") + e.what();
    }
    unlink_entries(shm_entries(t.name, false));
  }
  return t;
}

std::string trial_json(const Trial& t) {
  std::string j = "{\"kind\":\"trial\",\"scenario\":" + json_quote(t.scenario->name) +
                  ",\"trial\":" + std::to_string(t.index) + ",\"calibration\":" + (t.calibration ? "true" : "false") +
                  ",\"name\":" + json_quote(t.name) + ",\"victim\":" + std::to_string(t.victim) +
                  ",\"window_ms\":" + json_num(t.window_ms) + ",\"delay_ms\":" + json_num(t.delay_ms) +
                  ",\"victim_exited_first\":" + (t.victim_gone_first ? "true" : "false") +
                  ",\"setup_error\":" + json_quote(t.setup_error) + ",\"survivors\":[";
  for (size_t i = 0; i < t.survivors.size(); ++i) {
    const Survivor& s = t.survivors[i];
    j += std::string(i ? "," : "") + "{\"rank\":" + std::to_string(s.rank) + ",\"outcome\":" +
         json_quote(outcome_name(s.outcome)) + ",\"latency_ms\":" + json_num(s.latency_ms) +
         ",\"type\":" + json_quote(s.type) + ",\"text\":" + json_quote(s.text) + "}";
  }
  j += "],\"recovery_ok\":" + std::string(t.recovery_ok ? "true" : "false") +
       ",\"recovery_error\":" + json_quote(t.recovery_error) +
       ",\"leaked_after_recovery\":" + json_quote(join(t.leaked_after_recovery)) +
       ",\"leaked_final\":" + json_quote(join(t.leaked_final)) + ",\"cleanup_error\":" + json_quote(t.cleanup_error) +
       ",\"failed\":" + (t.failed() ? "true" : "false") + "}";
  return j;
}

void print_trial(const Trial& t, bool always) {
  const bool failed = t.failed();
  if (!failed && !always) return;
  std::printf("  %s%s", failed ? "FAIL " : "", trial_label(t).c_str());
  if (t.calibration) {
    std::printf(" window %.2f ms\n", t.measured_ms);
  } else {
    std::printf(" victim rank %d at %.2f of %.2f ms%s\n", t.victim, t.delay_ms, t.window_ms,
                t.victim_gone_first ? " (it had already exited)" : "");
  }
  if (!t.setup_error.empty()) std::printf("      setup: %s\n", t.setup_error.c_str());
  for (const Survivor& s : t.survivors) {
    if (!always && !(t.calibration ? s.outcome != Outcome::kCompleted : t.survivor_failed(s))) continue;
    std::printf("      rank %d: %s", s.rank, outcome_name(s.outcome));
    if (s.latency_ms >= 0 && !t.calibration) std::printf(" after %.1f ms", s.latency_ms);
    if (!s.type.empty()) std::printf(" %s", s.type.c_str());
    if (!s.text.empty()) std::printf(": %s", s.text.substr(0, 400).c_str());
    std::printf("\n");
  }
  if (!t.calibration) {
    if (!t.recovery_ok) std::printf("      same-name recovery FAILED: %s\n", t.recovery_error.substr(0, 600).c_str());
    if (!t.leaked_after_recovery.empty()) {
      std::printf("      leak: the recovery group ended cleanly but left %s\n", join(t.leaked_after_recovery).c_str());
    }
    if (!t.leaked_final.empty()) {
      std::printf("      leak: left after remove_stale_segment: %s\n", join(t.leaked_final).c_str());
    }
    if (!t.cleanup_error.empty()) std::printf("      cleanup: %s\n", t.cleanup_error.c_str());
  }
  std::fflush(stdout);
}

struct Stats {
  int trials = 0;
  int kills_after_end = 0;  // the victim had already finished
  int survivors = 0;
  int completed = 0;
  int peer_lost = 0;
  int peer_lost_1s = 0;
  int timeouts = 0;
  int bad_timeouts = 0;  // TimeoutError where the group had formed
  int hangs = 0;
  int crashes = 0;  // signal, unexpected exception, exit without a report, setup failure
  int wrong = 0;
  int recovery_ok = 0;
  int recovery_total = 0;
  int leaks = 0;
  int calibration_failures = 0;
  std::vector<double> latencies;

  void add(const Trial& t) {
    if (t.calibration) {
      if (t.failed()) ++calibration_failures;
      return;
    }
    ++trials;
    if (t.victim_gone_first) ++kills_after_end;
    if (!t.setup_error.empty()) ++crashes;
    for (const Survivor& s : t.survivors) {
      ++survivors;
      switch (s.outcome) {
        case Outcome::kCompleted: ++completed; break;
        case Outcome::kPeerLost:
          ++peer_lost;
          latencies.push_back(s.latency_ms);
          if (s.latency_ms <= 1000.0) ++peer_lost_1s;
          break;
        case Outcome::kTimeout:
          ++timeouts;
          if (!t.scenario->rendezvous) ++bad_timeouts;
          break;
        case Outcome::kHang: ++hangs; break;
        case Outcome::kWrong: ++wrong; break;
        default: ++crashes; break;
      }
    }
    ++recovery_total;
    if (t.recovery_ok) ++recovery_ok;
    if (!t.leaked_after_recovery.empty() || !t.leaked_final.empty() || !t.cleanup_error.empty()) ++leaks;
  }
  void merge(const Stats& o) {
    trials += o.trials;
    kills_after_end += o.kills_after_end;
    survivors += o.survivors;
    completed += o.completed;
    peer_lost += o.peer_lost;
    peer_lost_1s += o.peer_lost_1s;
    timeouts += o.timeouts;
    bad_timeouts += o.bad_timeouts;
    hangs += o.hangs;
    crashes += o.crashes;
    wrong += o.wrong;
    recovery_ok += o.recovery_ok;
    recovery_total += o.recovery_total;
    leaks += o.leaks;
    calibration_failures += o.calibration_failures;
    latencies.insert(latencies.end(), o.latencies.begin(), o.latencies.end());
  }
  int failures() const {
    return hangs + crashes + wrong + bad_timeouts + (recovery_total - recovery_ok) + leaks + calibration_failures;
  }
  /// Survivor waits that did not complete: those that had to end in PeerLostError.
  int interrupted() const { return survivors - completed; }
  double percentile(double q) const {
    if (latencies.empty()) return -1;
    std::vector<double> v = latencies;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
  }
};

void print_stats_row(const char* label, const Stats& st) {
  char frac[48] = "-";
  if (st.interrupted() > 0) {
    std::snprintf(frac, sizeof frac, "%d/%d %.0f%%", st.peer_lost_1s, st.interrupted(),
                  100.0 * st.peer_lost_1s / st.interrupted());
  }
  char lat[48] = "-";
  if (!st.latencies.empty()) std::snprintf(lat, sizeof lat, "%.0f/%.0f", st.percentile(0.5), st.percentile(1.0));
  char rec[24];
  std::snprintf(rec, sizeof rec, "%d/%d", st.recovery_ok, st.recovery_total);
  std::printf("%-16s %6d %5d %9d %8d %-15s %-11s %7d %5d %7d %5d %-9s %5d\n", label, st.trials, st.survivors,
              st.completed, st.peer_lost, frac, lat, st.timeouts, st.hangs, st.crashes, st.wrong, rec, st.leaks);
}

void print_stats_header() {
  std::printf("%-16s %6s %5s %9s %8s %-15s %-11s %7s %5s %7s %5s %-9s %5s\n", "scenario", "trials", "surv",
              "completed", "PeerLost", "PeerLost<=1s", "p50/max ms", "timeout", "hangs", "crashes", "wrong",
              "recovery", "leaks");
}

std::string stats_json(const char* scenario, const Stats& st) {
  return std::string("{\"kind\":\"summary\",\"scenario\":") + json_quote(scenario) +
         ",\"trials\":" + std::to_string(st.trials) + ",\"kills_after_end\":" + std::to_string(st.kills_after_end) +
         ",\"survivors\":" + std::to_string(st.survivors) + ",\"completed\":" + std::to_string(st.completed) +
         ",\"peer_lost\":" + std::to_string(st.peer_lost) + ",\"peer_lost_within_1s\":" +
         std::to_string(st.peer_lost_1s) + ",\"interrupted\":" + std::to_string(st.interrupted()) +
         ",\"peer_lost_p50_ms\":" + json_num(st.percentile(0.5)) + ",\"peer_lost_max_ms\":" +
         json_num(st.percentile(1.0)) + ",\"timeouts\":" + std::to_string(st.timeouts) +
         ",\"timeouts_counted_as_failures\":" + std::to_string(st.bad_timeouts) + ",\"hangs\":" +
         std::to_string(st.hangs) + ",\"crashes\":" + std::to_string(st.crashes) + ",\"wrong\":" +
         std::to_string(st.wrong) + ",\"recovery_ok\":" + std::to_string(st.recovery_ok) +
         ",\"recovery_total\":" + std::to_string(st.recovery_total) + ",\"leaks\":" + std::to_string(st.leaks) +
         ",\"calibration_failures\":" + std::to_string(st.calibration_failures) +
         ",\"failures\":" + std::to_string(st.failures()) + "}";
}

// ---------------------------------------------------------------------------------------------
// Re-creation loop

struct RecreateResult {
  int world = 0;
  int cycles = 0;
  int min_cycles_ok = 0;  // over the ranks
  int wrong = 0, timeouts = 0, errors = 0;  // summed over the ranks
  int hangs = 0, crashes = 0;
  std::vector<std::string> leaked;
  std::vector<std::string> samples;  // the first problems reported
  double seconds = 0;
  int failures() const {
    return wrong + timeouts + errors + hangs + crashes + static_cast<int>(!leaked.empty()) +
           (min_cycles_ok != cycles ? 1 : 0);
  }
};

RecreateResult run_recreate(const Driver& d, int world, int cycles, uint64_t seed) {
  RecreateResult res;
  res.world = world;
  res.cycles = cycles;
  const std::string name = "stress." + std::to_string(::getpid()) + ".recreate" + std::to_string(world);
  std::vector<Proc> ps;
  for (int r = 0; r < world; ++r) {
    WorkerSpec w{"recreate", "-", r, world, name, seed + static_cast<uint64_t>(r) * 7919, cycles};
    ps.push_back(d.spawn(w, name + ".r" + std::to_string(r) + ".log"));
  }
  pump(ps, now_ns() + 120'000'000'000, [&] {
    return std::all_of(ps.begin(), ps.end(), [](const Proc& p) { return p.find("READY") != nullptr || p.eof; });
  });
  const int64_t t0 = now_ns();
  for (Proc& p : ps) p.go();
  finish_all(ps, t0 + 60'000'000'000 + int64_t{cycles} * 100'000'000);
  res.seconds = static_cast<double>(now_ns() - t0) / 1e9;
  res.min_cycles_ok = cycles;
  for (const Proc& p : ps) {
    for (const Event& e : p.events) {
      if ((e.tag == "ERR" || e.tag == "WRONG" || e.tag == "DESTROY_ERR") && res.samples.size() < 8) {
        res.samples.push_back("rank " + std::to_string(p.rank) + " " + e.tag + (e.type == "-" ? "" : " " + e.type) +
                              ": " + e.text.substr(0, 300));
      }
    }
    const Event* end = p.find("END");
    int c = 0, ok = 0, wrong = 0, timeouts = 0, errors = 0;
    if (end != nullptr &&
        std::sscanf(end->text.c_str(), "cycles=%d ok=%d wrong=%d timeouts=%d errors=%d", &c, &ok, &wrong, &timeouts,
                    &errors) == 5) {
      res.wrong += wrong;
      res.timeouts += timeouts;
      res.errors += errors;
      res.min_cycles_ok = std::min(res.min_cycles_ok, ok);
    } else {
      res.min_cycles_ok = 0;
    }
    if (p.hang) {
      ++res.hangs;
      if (res.samples.size() < 8) {
        res.samples.push_back("rank " + std::to_string(p.rank) + " hang (killed at the deadline)");
      }
    } else if (WIFSIGNALED(p.status) || end == nullptr) {
      ++res.crashes;
      if (res.samples.size() < 8) res.samples.push_back("rank " + std::to_string(p.rank) + " " + p.describe_exit());
    }
  }
  const bool clean = res.hangs == 0 && res.crashes == 0;
  ps.clear();
  const std::vector<std::string> left = shm_entries(name, false);
  if (clean) res.leaked = left;
  try {
    remove_stale_segment(name);
  } catch (const std::exception& e) {
    res.samples.push_back(std::string("remove_stale_segment: ") + e.what());
  }
  const std::vector<std::string> still = shm_entries(name, false);
  if (!still.empty()) {
    res.leaked.insert(res.leaked.end(), still.begin(), still.end());
    unlink_entries(still);
  }
  if (res.failures() == 0) remove_logs(d, name);
  return res;
}

// ---------------------------------------------------------------------------------------------
// Options

struct Options {
  int trials = 210;
  int calibrations = 3;
  std::optional<uint64_t> seed;
  std::vector<std::string> scenarios;  // names of kScenarios and/or "recreate"
  std::string json;
  std::vector<int> ranks{2, 4};
  int cycles = 500;
  double hang_s = 10;
  bool fork_only = false;
  bool verbose = false;
  bool help = false;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (const char c : s + ",") {
    if (c == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  return out;
}

long long parse_int(const std::string& flag, const std::string& v, long long lo, long long hi) {
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || x < lo || x > hi) {
    throw std::invalid_argument(flag + " takes an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                "], not '" + v + "'");
  }
  return x;
}

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--trials") {
      o.trials = static_cast<int>(parse_int(a, value(), 0, 1'000'000));
    } else if (a == "--calibrations") {
      o.calibrations = static_cast<int>(parse_int(a, value(), 1, 100));
    } else if (a == "--seed") {
      const std::string v = value();
      char* end = nullptr;
      errno = 0;
      const unsigned long long s = std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || errno != 0) throw std::invalid_argument("--seed takes an unsigned integer");
      o.seed = s;
    } else if (a == "--scenario") {
      for (const std::string& n : split(value())) {
        if (n == "all") {
          for (const Scenario& s : kScenarios) o.scenarios.emplace_back(s.name);
        } else if (n == "recreate") {
          o.scenarios.push_back(n);
        } else if (const Scenario* s = find_scenario(n)) {
          o.scenarios.emplace_back(s->name);
        } else {
          throw std::invalid_argument("unknown scenario '" + n + "'");
        }
      }
    } else if (a == "--json") {
      o.json = value();
    } else if (a == "--ranks") {
      o.ranks.clear();
      for (const std::string& r : split(value())) o.ranks.push_back(static_cast<int>(parse_int(a, r, 2, 64)));
    } else if (a == "--cycles") {
      o.cycles = static_cast<int>(parse_int(a, value(), 1, 10'000'000));
    } else if (a == "--hang-s") {
      o.hang_s = static_cast<double>(parse_int(a, value(), 1, 3600));
    } else if (a == "--spawn") {
      const std::string v = value();
      if (v != "exec" && v != "fork") throw std::invalid_argument("--spawn takes exec or fork");
      o.fork_only = v == "fork";
    } else if (a == "-v" || a == "--verbose") {
      o.verbose = true;
    } else if (a == "-h" || a == "--help") {
      o.help = true;
    } else {
      throw std::invalid_argument("unknown argument '" + a + "'");
    }
  }
  if (o.scenarios.empty()) {
    for (const Scenario& s : kScenarios) o.scenarios.emplace_back(s.name);
  }
  std::vector<std::string> unique;
  for (const std::string& n : o.scenarios) {
    if (std::find(unique.begin(), unique.end(), n) == unique.end()) unique.push_back(n);
  }
  o.scenarios = unique;
  return o;
}

WorkerSpec parse_worker(int argc, char** argv) {
  WorkerSpec w;
  if (argc < 2) throw std::invalid_argument("--worker needs a mode");
  w.mode = argv[1];
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--scenario") {
      w.scenario = v;
    } else if (a == "--rank") {
      w.rank = static_cast<int>(parse_int(a, v, 0, 1 << 20));
    } else if (a == "--world") {
      w.world = static_cast<int>(parse_int(a, v, 1, 1 << 20));
    } else if (a == "--name") {
      w.name = v;
    } else if (a == "--seed") {
      w.seed = std::strtoull(v.c_str(), nullptr, 10);
    } else if (a == "--cycles") {
      w.cycles = static_cast<int>(parse_int(a, v, 0, 1 << 30));
    } else {
      throw std::invalid_argument("unknown worker argument '" + a + "'");
    }
  }
  return w;
}

/// Opens /dev/null on any of fds 0-2 that is closed, so that pipes never land there.
void ensure_std_fds() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF) {
      const int n = ::open("/dev/null", O_RDWR);
      if (n >= 0 && n != fd) {
        ::dup2(n, fd);
        ::close(n);
      }
    }
  }
}

int run_driver(const Options& o) {
  ensure_std_fds();
  ::signal(SIGPIPE, SIG_IGN);  // a GO written to a worker that died
  Driver d;
  std::error_code ec;
  d.exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (ec) {
    std::fprintf(stderr, "tdshm stress: cannot read /proc/self/exe: %s\n", ec.message().c_str());
    return 1;
  }
  d.fork_only = o.fork_only;
  if (d.fork_only) {
    // A fork without exec is only as safe as the driver is single-threaded (it never runs ATen ops,
    // so LibTorch's pools are not started; check rather than trust).
    size_t threads = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task", ec)) ++threads;
    if (threads != 1) {
      std::printf("tdshm stress: the driver runs %zu threads: workers are exec'd after all\n", threads);
      d.fork_only = false;
    }
  }
  d.hang_s = o.hang_s;
  d.verbose = o.verbose;
  std::string dir_template = (std::filesystem::temp_directory_path() / "tdshm-stress-XXXXXX").string();
  if (::mkdtemp(dir_template.data()) == nullptr) {
    std::fprintf(stderr, "tdshm stress: mkdtemp: %s\n", std::strerror(errno));
    return 1;
  }
  d.log_dir = dir_template;
  const uint64_t seed = o.seed ? *o.seed : std::random_device{}();
  std::mt19937_64 rng(seed);
  std::ofstream json;
  if (!o.json.empty()) {
    json.open(o.json, std::ios::out | std::ios::trunc);
    if (!json) {
      std::fprintf(stderr, "tdshm stress: cannot write %s\n", o.json.c_str());
      return 1;
    }
  }

  std::vector<const Scenario*> kills;
  bool recreate = false;
  for (const std::string& n : o.scenarios) {
    if (n == "recreate") {
      recreate = true;
    } else {
      kills.push_back(find_scenario(n));
    }
  }
  std::printf("tdshm stress: seed %" PRIu64 ", pid %d, %s, hang deadline %.0f s after a kill, logs in %s\n", seed,
              static_cast<int>(::getpid()), o.fork_only ? "workers forked" : "workers forked and exec'd", o.hang_s,
              d.log_dir.string().c_str());
  int failures = 0;

  if (!kills.empty()) {
    std::printf("kill loop: %d trials over %zu scenarios\n", o.trials, kills.size());
    std::vector<Stats> per(kills.size());
    for (size_t k = 0; k < kills.size(); ++k) {
      const Scenario& s = *kills[k];
      const int n = o.trials / static_cast<int>(kills.size()) + (static_cast<int>(k) < o.trials % static_cast<int>(kills.size()) ? 1 : 0);
      if (n == 0) continue;
      std::printf("%c %-13s %s\n", s.letter, s.name, s.what);
      std::fflush(stdout);
      // The window: the median of the calibration runs (one run alone is at the mercy of a busy CPU).
      std::vector<double> measured;
      for (int c = 0; c < o.calibrations; ++c) {
        const Trial cal = run_trial(d, s, c, true, 0, rng);
        per[k].add(cal);
        print_trial(cal, o.verbose || cal.failed());
        if (json.is_open()) json << trial_json(cal) << "\n";
        if (!cal.failed()) remove_logs(d, cal.name);
        if (cal.measured_ms > 0) measured.push_back(cal.measured_ms);
      }
      std::sort(measured.begin(), measured.end());
      const double window = measured.empty() ? 100.0 : measured[measured.size() / 2];
      std::printf("  window %.2f ms (median of %zu calibration runs without a kill), %d trials\n", window,
                  measured.size(), n);
      std::fflush(stdout);
      for (int i = 0; i < n; ++i) {
        const Trial t = run_trial(d, s, i, false, window, rng);
        per[k].add(t);
        print_trial(t, o.verbose);
        if (json.is_open()) json << trial_json(t) << "\n";
        if (!t.failed()) remove_logs(d, t.name);
      }
    }
    std::printf("\n");
    print_stats_header();
    Stats total;
    for (size_t k = 0; k < kills.size(); ++k) {
      const std::string label = std::string(1, kills[k]->letter) + " " + kills[k]->name;
      print_stats_row(label.c_str(), per[k]);
      if (json.is_open()) json << stats_json(kills[k]->name, per[k]) << "\n";
      total.merge(per[k]);
    }
    print_stats_row("total", total);
    if (json.is_open()) json << stats_json("total", total) << "\n";
    std::printf(
        "(surv: surviving ranks; PeerLost<=1s: PeerLostError within 1 s of the kill among the survivors whose\n"
        " waits did not complete; timeout: TimeoutError, a failure except in rendezvous and create where the victim\n"
        " may die before it registers; crashes: killed by a signal, another exception type, no report, or a rank\n"
        " that failed before the kill; recovery: a fresh group of all ranks under the same name, no cleanup before;\n"
        " leaks: trials that left /dev/shm entries; kills after the victim had finished: %d; calibration failures: %d)\n",
        total.kills_after_end, total.calibration_failures);
    failures += total.failures();
  }

  if (recreate) {
    std::printf("\nre-creation loop: init_process_group / checked transfer / barrier every other cycle / "
                "destroy_process_group under one name, 0-2 ms random sleeps between the calls\n");
    std::printf("%-6s %7s %9s %6s %8s %7s %6s %8s %6s %8s\n", "ranks", "cycles", "ok(min)", "wrong", "timeouts",
                "errors", "hangs", "crashes", "leaks", "seconds");
    for (const int world : o.ranks) {
      const RecreateResult r = run_recreate(d, world, o.cycles, rng());
      std::printf("%-6d %7d %9d %6d %8d %7d %6d %8d %6zu %8.1f\n", r.world, r.cycles, r.min_cycles_ok, r.wrong,
                  r.timeouts, r.errors, r.hangs, r.crashes, r.leaked.size(), r.seconds);
      for (const std::string& s : r.samples) std::printf("    %s\n", s.c_str());
      if (!r.leaked.empty()) std::printf("    leaked: %s\n", join(r.leaked).c_str());
      std::fflush(stdout);
      if (json.is_open()) {
        json << "{\"kind\":\"recreate\",\"ranks\":" << r.world << ",\"cycles\":" << r.cycles
             << ",\"min_cycles_ok\":" << r.min_cycles_ok << ",\"wrong\":" << r.wrong << ",\"timeouts\":" << r.timeouts
             << ",\"errors\":" << r.errors << ",\"hangs\":" << r.hangs << ",\"crashes\":" << r.crashes
             << ",\"leaked\":" << json_quote(join(r.leaked)) << ",\"seconds\":" << json_num(r.seconds)
             << ",\"failures\":" << r.failures() << "}\n";
      }
      failures += r.failures();
    }
  }

  const std::vector<std::string> left = shm_entries("stress." + std::to_string(::getpid()) + ".", true);
  if (!left.empty()) {
    std::printf("leak: /dev/shm still holds %s\n", join(left).c_str());
    unlink_entries(left);
    ++failures;
  }
  std::filesystem::remove(d.log_dir, ec);  // only if empty: the logs of failed trials stay
  if (std::filesystem::exists(d.log_dir)) std::printf("logs of the failed runs: %s\n", d.log_dir.string().c_str());
  std::printf("%s\n", failures == 0 ? "stress passed" : "stress FAILED");
  return failures == 0 ? 0 : 1;
}

}  // namespace

void print_stress_usage(FILE* out) {
  std::fprintf(out,
               "usage: tdshm stress [--trials N] [--seed S] [--scenario LIST] [--json FILE] [--calibrations N]\n"
               "                    [--ranks LIST] [--cycles N] [--hang-s S] [--spawn exec|fork] [-v]\n"
               "Kill loop: N trials (default 210) split over the scenarios; each starts the ranks as processes\n"
               "with a segment name of their own, SIGKILLs one rank at a uniformly random instant of the\n"
               "scenario's active window (the median of --calibrations runs without a kill, default 3), and\n"
               "records what the survivors' waits ended in (PeerLostError, and how soon; completion; anything\n"
               "else), hangs (still running --hang-s seconds after the kill, default 10), crashes and wrong\n"
               "data; then a fresh group of all ranks under the same name must rendezvous and do a checked\n"
               "transfer (no cleanup before), and /dev/shm must be clean after tdshm::remove_stale_segment.\n"
               "Scenarios (LIST: comma-separated names or letters, \"all\" for a-g, which is the default):\n");
  for (const Scenario& s : kScenarios) std::fprintf(out, "  %c %-13s %s\n", s.letter, s.name, s.what);
  std::fprintf(out,
               "  recreate        --ranks (default 2,4) ranks run --cycles (default 500) cycles of\n"
               "                  init_process_group / checked transfer / barrier every other cycle /\n"
               "                  destroy_process_group under one name, sleeping 0-2 ms between the calls\n"
               "--json FILE writes one JSON object per trial, per scenario summary and per recreate run.\n"
               "Workers are this tool re-executed (--spawn fork: forked only); their stdout and stderr go to\n"
               "a log folder that keeps the logs of failed runs (TDSHM_LOG_LEVEL=debug makes them talk).\n"
               "Exits 1 on any hang, crash, wrong data, failed recovery, leak or recreate problem.\n");
}

int run_stress(int argc, char** argv) {
  if (argc >= 1 && std::string(argv[0]) == "--worker") {
    int code = 64;
    try {
      code = run_worker(parse_worker(argc, argv));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tdshm stress worker: %s\n", e.what());
    }
    std::fflush(nullptr);
    ::_exit(code);
  }
  Options o;
  try {
    o = parse_options(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "tdshm stress: %s\n", e.what());
    print_stress_usage(stderr);
    return 2;
  }
  if (o.help) {
    print_stress_usage(stdout);
    return 0;
  }
  return run_driver(o);
}

}  // namespace tdshm::tools
