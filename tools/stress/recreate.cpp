// The re-creation loop of `tdshm stress` (`--scenario recreate`): W ranks run N cycles of
// init_process_group, a checked transfer, a barrier every other cycle and destroy_process_group
// under ONE name, with random 0-2 ms sleeps between the calls so that the ranks' calls
// interleave in every way (the ranks' side is in worker.cpp); then the counts the ranks report,
// their hangs and crashes, and what the name left in /dev/shm.

#include "stress_internal.h"

#include <tdshm/process_group.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace tdshm::tools::stress {

int RecreateResult::failures() const {
  return wrong + timeouts + errors + hangs + crashes + static_cast<int>(!leaked.empty()) +
         (min_cycles_ok != cycles ? 1 : 0);
}

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

}  // namespace tdshm::tools::stress
