// One trial of the kill loop of `tdshm stress`: start a scenario's ranks, SIGKILL one at a
// uniformly random instant of the scenario's window (a calibration run kills none and measures
// the window), classify what the survivors ended in, then start a fresh group of all ranks under
// the same name (no cleanup before) and clean the name with tdshm::remove_stale_segment,
// recording whatever /dev/shm still holds.

#include "stress_internal.h"

#include <tdshm/process_group.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>

namespace tdshm::tools::stress {
namespace {

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

}  // namespace

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

}  // namespace tdshm::tools::stress
