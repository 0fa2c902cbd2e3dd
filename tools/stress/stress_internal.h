#pragma once
// The types and calls the parts of `tdshm stress` share (tools/stress/; run.cpp describes the
// method): the scenario table, a worker's spec, the event lines workers write to fd 3, the
// driver's view of a worker process, a trial and what its survivors ended in, the counts the
// report prints and a recreate run's result. Each group of declarations names its file.

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace tdshm::tools::stress {

// ---------------------------------------------------------------------------------------------
// Scenarios (the table; find_scenario is in options.cpp)

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

inline constexpr Scenario kScenarios[] = {
    {"rendezvous", 'a', 3, true, "3 ranks in init_process_group(\"shm\", shm://NAME)"},
    {"p2p", 'b', 2, false, "per-leaf isend/irecv ping-pong of a 4-leaf TensorDict (405 KiB), 150 round trips"},
    {"consolidated", 'c', 2, false, "64 MiB consolidated send/recv, 5 transfers"},
    {"remote", 'd', 2, false, "init_remote / from_remote_init of a 1 MiB tree with a non-tensor value, 30 times"},
    {"broadcast", 'e', 3, false, "3 ranks: TensorDict::broadcast and ProcessGroupShm::broadcast, rotating root, 60 rounds"},
    {"fullring", 'f', 2, false, "1 MiB per-leaf sends into a 4 x 4 KiB ring while the receiver sleeps 150 ms, twice"},
    {"create", 'g', 2, true, "rank 0 creating a 256 MiB segment while rank 1 waits to attach"},
    {"loans", 'h', 2, false, "96 KiB loans, per-leaf and consolidated, sent by reference; 2 views held; 300 rounds"},
};

/// The scenario named `name` or lettered so; nullptr if none.
const Scenario* find_scenario(const std::string& name);

// ---------------------------------------------------------------------------------------------
// Workers (worker.cpp; the transfers they check are in transfers.cpp)

struct WorkerSpec {
  std::string mode;      // a scenario's name, "recover" or "recreate"
  std::string scenario;  // whose options the group uses (recover)
  int rank = 0;
  int world = 2;
  std::string name;
  uint64_t seed = 0;
  int cycles = 0;
};

/// Received values differ from what was sent.
class WrongData : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Runs a worker process's part; returns its exit code.
int run_worker(const WorkerSpec& w);

// transfers.cpp: what the ranks send and check; `phase` says where they are (for the report).
void checked_exchange(const WorkerSpec& w, int64_t value, std::string& phase);
void body_p2p(const WorkerSpec& w, std::string& phase);
void body_consolidated(const WorkerSpec& w, std::string& phase);
void body_remote(const WorkerSpec& w, std::string& phase);
void body_broadcast(const WorkerSpec& w, std::string& phase);
void body_fullring(const WorkerSpec& w, std::string& phase);
void body_loans(const WorkerSpec& w, std::string& phase);
void recreate_exchange(const WorkerSpec& w, int64_t cycle, std::string& phase);

// ---------------------------------------------------------------------------------------------
// Events (events.cpp): one line per event on fd 3, "TAG NS TYPE TEXT"

constexpr int kReportFd = 3;

/// CLOCK_MONOTONIC in nanoseconds (comparable between the processes of one host).
int64_t now_ns();

/// Worker side: writes one event line to kReportFd.
void emit(const char* tag, const std::string& type = "-", const std::string& text = "");

struct Event {
  std::string tag;
  int64_t ns = 0;
  std::string type;
  std::string text;
};

/// Driver side: one line as emit wrote it (without the newline).
Event parse_event(const std::string& line);

// ---------------------------------------------------------------------------------------------
// The driver's processes (driver.cpp)

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
  Proc& operator=(Proc&& o) noexcept;
  ~Proc() { release(); }

  void release() noexcept;
  void read_some();
  bool try_reap();
  void reap_blocking();
  /// Exited, but not reaped (waitid with WNOWAIT keeps the zombie, so the pid stays ours).
  bool exited_unreaped() const;
  void go();
  const Event* find(const std::string& tag) const;
  std::string last_phase() const;
  std::string describe_exit() const;
};

class Driver {
 public:
  std::string exe;
  bool fork_only = false;
  std::filesystem::path log_dir;
  double hang_s = 10;
  bool verbose = false;

  Proc spawn(const WorkerSpec& w, const std::string& log_name) const;
};

/// Reads reports and reaps (where may_reap) until `until()` holds or `deadline` passes; returns
/// whether `until()` held.
bool pump(std::vector<Proc>& ps, int64_t deadline, const std::function<bool()>& until);

/// Waits for every process until `deadline`; the ones still running then are SIGKILLed and
/// marked as hangs. Then reads what is left in their pipes.
void finish_all(std::vector<Proc>& ps, int64_t deadline);

// ---------------------------------------------------------------------------------------------
// What runs leave behind (leftovers.cpp)

/// The /dev/shm entries of segment `prefix_or_name` (its files), or of every name that starts
/// with it (`prefix`), sorted.
std::vector<std::string> shm_entries(const std::string& prefix_or_name, bool prefix);
void unlink_entries(const std::vector<std::string>& names);
/// Removes the logs of the run `name` from the driver's log folder.
void remove_logs(const Driver& d, const std::string& name);

// ---------------------------------------------------------------------------------------------
// Outcomes (classify.cpp)

enum class Outcome { kCompleted, kPeerLost, kTimeout, kUnexpected, kSignal, kHang, kWrong, kNoReport };

const char* outcome_name(Outcome o);

struct Survivor {
  int rank = 0;
  Outcome outcome = Outcome::kNoReport;
  double latency_ms = -1;  // PeerLostError / TimeoutError: when it was seen, after the kill
  std::string type;
  std::string text;
};

/// What a finished worker's run ended in; latencies count from `kill_ns`.
Survivor classify(const Proc& p, int64_t kill_ns, double hang_s);

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

  bool survivor_failed(const Survivor& s) const;
  bool failed() const;
};

// ---------------------------------------------------------------------------------------------
// Trials (trial.cpp)

/// One trial of scenario `s` (or a calibration run, without a kill): the ranks, the kill at a
/// random instant of `window_ms`, the survivors' outcomes, then the same-name recovery and the
/// cleanup of the name.
Trial run_trial(const Driver& d, const Scenario& s, int index, bool calibration, double window_ms,
                std::mt19937_64& rng);

// ---------------------------------------------------------------------------------------------
// Re-creation loop (recreate.cpp)

struct RecreateResult {
  int world = 0;
  int cycles = 0;
  int min_cycles_ok = 0;  // over the ranks
  int wrong = 0, timeouts = 0, errors = 0;  // summed over the ranks
  int hangs = 0, crashes = 0;
  std::vector<std::string> leaked;
  std::vector<std::string> samples;  // the first problems reported
  double seconds = 0;
  int failures() const;
};

RecreateResult run_recreate(const Driver& d, int world, int cycles, uint64_t seed);

// ---------------------------------------------------------------------------------------------
// The report: statistics, tables, JSON (report.cpp)

std::string join(const std::vector<std::string>& v, const char* sep = ", ");

std::string trial_json(const Trial& t);
void print_trial(const Trial& t, bool always);

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

  void add(const Trial& t);
  void merge(const Stats& o);
  int failures() const;
  /// Survivor waits that did not complete: those that had to end in PeerLostError.
  int interrupted() const { return survivors - completed; }
  double percentile(double q) const;
};

void print_stats_header();
void print_stats_row(const char* label, const Stats& st);
std::string stats_json(const char* scenario, const Stats& st);

void print_recreate_header();
void print_recreate(const RecreateResult& r);
std::string recreate_json(const RecreateResult& r);

// ---------------------------------------------------------------------------------------------
// Options (options.cpp)

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

/// The arguments after "stress". Throws std::invalid_argument.
Options parse_options(int argc, char** argv);
/// The arguments of a worker: "--worker MODE --scenario S --rank R ...".
WorkerSpec parse_worker(int argc, char** argv);

}  // namespace tdshm::tools::stress
