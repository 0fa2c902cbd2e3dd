// A worker process of `tdshm stress` (`tdshm stress --worker MODE ...`, or forked with
// --spawn fork): runs one rank of a scenario's lifecycle (init_process_group, the scenario's
// transfers, barrier, destroy_process_group), one rank of a same-name recovery group, or one rank
// of the recreate loop, and reports each step and what every wait ended in as event lines on
// fd 3 (events.cpp). It waits for the driver's byte on fd 0 before the part the kill aims at.

#include "stress_internal.h"

#include <tdshm/distributed.h>
#include <tdshm/process_group.h>

#include <ATen/Parallel.h>

#include <cxxabi.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <random>
#include <thread>
#include <typeinfo>

namespace tdshm::tools::stress {
namespace {

using namespace std::chrono_literals;

constexpr int kRecreateMaxProblems = 10;  // a recreate rank stops after this many failed cycles

std::string demangle(const char* name) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> out(abi::__cxa_demangle(name, nullptr, nullptr, &status), std::free);
  return status == 0 && out ? std::string(out.get()) : std::string(name);
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

/// Call inside a catch block: reports the exception being handled as WRONG (WrongData) or ERR
/// with the phase it ended, destroys the group, and returns the worker's exit code (2: wrong
/// data, 1: any other exception).
int report_failure(const std::string& phase) {
  try {
    throw;
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
      case 'h': body_loans(w, phase); break;
      default: checked_exchange(w, static_cast<int64_t>(w.seed), phase); break;
    }
    emit("DONE");
    step("barrier");
    default_group().backend().barrier()->wait();
    step("destroy");
    destroy_process_group();
    emit("EXIT");
    return 0;
  } catch (...) {
    return report_failure(phase);
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
  } catch (...) {
    return report_failure(phase);
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

}  // namespace

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

}  // namespace tdshm::tools::stress
