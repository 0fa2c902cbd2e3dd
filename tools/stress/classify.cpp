// What a worker's run ended in (`tdshm stress`): completed, PeerLostError and how soon after the
// kill, TimeoutError, another exception, a signal, a hang, wrong data or no report; and which
// outcomes make a trial fail.

#include "stress_internal.h"

#include <sys/wait.h>

#include <cstdio>

namespace tdshm::tools::stress {

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
    // (RendezvousAbandonedError is a PeerLostError: a peer that gave the rendezvous up.)
    const bool lost = err->type == "tdshm::PeerLostError" || err->type == "tdshm::RendezvousAbandonedError";
    s.outcome = lost                                 ? Outcome::kPeerLost
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

bool Trial::survivor_failed(const Survivor& s) const {
  switch (s.outcome) {
    case Outcome::kCompleted:
    case Outcome::kPeerLost: return false;
    case Outcome::kTimeout: return calibration || !scenario->rendezvous;
    default: return true;
  }
}

bool Trial::failed() const {
  if (!setup_error.empty()) return true;
  for (const Survivor& s : survivors) {
    if (calibration ? s.outcome != Outcome::kCompleted : survivor_failed(s)) return true;
  }
  if (calibration) return false;
  return !recovery_ok || !leaked_after_recovery.empty() || !leaked_final.empty() || !cleanup_error.empty();
}

}  // namespace tdshm::tools::stress
