// The command line of `tdshm stress`: its options, the hidden arguments of a worker process,
// scenario names and letters, and the usage text.

#include "stress.h"

#include "stress_internal.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>

namespace tdshm::tools {
namespace stress {
namespace {

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

}  // namespace

const Scenario* find_scenario(const std::string& name) {
  for (const Scenario& s : kScenarios) {
    if (name == s.name || (name.size() == 1 && name[0] == s.letter)) return &s;
  }
  return nullptr;
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

}  // namespace stress

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
               "Scenarios (LIST: comma-separated names or letters, \"all\" for a-h, which is the default):\n");
  for (const stress::Scenario& s : stress::kScenarios) std::fprintf(out, "  %c %-13s %s\n", s.letter, s.name, s.what);
  std::fprintf(out,
               "  recreate        --ranks (default 2,4) ranks run --cycles (default 500) cycles of\n"
               "                  init_process_group / checked transfer / barrier every other cycle /\n"
               "                  destroy_process_group under one name, sleeping 0-2 ms between the calls\n"
               "--json FILE writes one JSON object per trial, per scenario summary and per recreate run.\n"
               "Workers are this tool re-executed (--spawn fork: forked only); their stdout and stderr go to\n"
               "a log folder that keeps the logs of failed runs (TDSHM_LOG_LEVEL=debug makes them talk).\n"
               "Exits 1 on any hang, crash, wrong data, failed recovery, leak or recreate problem.\n");
}

}  // namespace tdshm::tools
