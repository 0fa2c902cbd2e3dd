// The report of `tdshm stress`: the lines printed per trial, the per-scenario statistics and
// their table, the recreate table, and the JSON objects (one per line) of --json.

#include "stress_internal.h"

#include "common/json.h"

#include <algorithm>
#include <cstdio>

namespace tdshm::tools::stress {
namespace {

using detail::json_quote;

std::string json_num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", v);
  return buf;
}

std::string trial_label(const Trial& t) {
  return std::string("[") + t.scenario->letter + " " + t.scenario->name + " " +
         (t.calibration ? "calibration " + std::to_string(t.index) : "#" + std::to_string(t.index)) + "]";
}

}  // namespace

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
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

void Stats::add(const Trial& t) {
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

void Stats::merge(const Stats& o) {
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

int Stats::failures() const {
  return hangs + crashes + wrong + bad_timeouts + (recovery_total - recovery_ok) + leaks + calibration_failures;
}

double Stats::percentile(double q) const {
  if (latencies.empty()) return -1;
  std::vector<double> v = latencies;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

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

void print_recreate_header() {
  std::printf("%-6s %7s %9s %6s %8s %7s %6s %8s %6s %8s\n", "ranks", "cycles", "ok(min)", "wrong", "timeouts",
              "errors", "hangs", "crashes", "leaks", "seconds");
}

void print_recreate(const RecreateResult& r) {
  std::printf("%-6d %7d %9d %6d %8d %7d %6d %8d %6zu %8.1f\n", r.world, r.cycles, r.min_cycles_ok, r.wrong,
              r.timeouts, r.errors, r.hangs, r.crashes, r.leaked.size(), r.seconds);
  for (const std::string& s : r.samples) std::printf("    %s\n", s.c_str());
  if (!r.leaked.empty()) std::printf("    leaked: %s\n", join(r.leaked).c_str());
  std::fflush(stdout);
}

std::string recreate_json(const RecreateResult& r) {
  return "{\"kind\":\"recreate\",\"ranks\":" + std::to_string(r.world) + ",\"cycles\":" + std::to_string(r.cycles) +
         ",\"min_cycles_ok\":" + std::to_string(r.min_cycles_ok) + ",\"wrong\":" + std::to_string(r.wrong) +
         ",\"timeouts\":" + std::to_string(r.timeouts) + ",\"errors\":" + std::to_string(r.errors) +
         ",\"hangs\":" + std::to_string(r.hangs) + ",\"crashes\":" + std::to_string(r.crashes) +
         ",\"leaked\":" + json_quote(join(r.leaked)) + ",\"seconds\":" + json_num(r.seconds) +
         ",\"failures\":" + std::to_string(r.failures()) + "}";
}

}  // namespace tdshm::tools::stress
