// The tdshm command-line tool.
//
//   tdshm demo     the two seed scenarios (isend/irecv, init_remote/from_remote_init) as two
//                  processes over shm or, with --backend gloo, gloo (tools/demo.cpp)
//   tdshm tour     build, consolidate and inspect a TensorDict in one process; rebuild it from
//                  its schema and from a consolidated file; exit non-zero if any check fails
//   tdshm bench    two-process ping-pong of the transports, their floors and baselines
//                  (benchmarks/pingpong.h), workload scenarios (--scenario, benchmarks/scenarios.h),
//                  --compare and --plot (benchmarks/bench_report.h); `tdshm bench --help` lists
//                  its options
//   tdshm stress   SIGKILL at random instants of real lifecycles, and destroy/init loops under one
//                  name (tools/stress/); `tdshm stress --help` lists its options
//   tdshm ls, tdshm inspect NAME, tdshm gc [--dry-run]
//   tdshm world tcp://HOST:PORT  a world across hosts, from its store
//                  the segments in /dev/shm, read-only; gc removes the stale ones (tools/segments.cpp)
//   tdshm help     this text

#include <tdshm/memmap.h>
#include <tdshm/tensorclass.h>
#include <tdshm/tensordict.h>

#include "bench_report.h"
#include "demo.h"
#include "pingpong.h"
#include "scenarios.h"
#include "segment_sizes.h"
#include "segments.h"
#include "stress.h"
#include "world.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>

#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

TDSHM_TENSORCLASS(DemoTransition, "tdshm.demo.Transition", obs, action, reward);

int failures = 0;

void check(bool ok, const char* what) {
  std::printf("  [%s] %s\n", ok ? " ok " : "FAIL", what);
  if (!ok) ++failures;
}

std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

void print_layout(const tdshm::SchemaNode& node, const std::string& prefix) {
  for (const auto& e : node.entries) {
    const std::string key = prefix.empty() ? e.key : prefix + "." + e.key;
    if (const auto* t = std::get_if<tdshm::SchemaTensor>(&e.value)) {
      std::printf("    %-10s %-8s %-12s bytes [%3" PRIu64 ", %3" PRIu64 ")  pad %u\n", key.c_str(),
                  c10::toString(t->dtype), shape_str(t->shape).c_str(), t->start, t->stop, t->pad);
    } else if (const auto* c = std::get_if<std::shared_ptr<tdshm::SchemaNode>>(&e.value)) {
      print_layout(**c, key);
    } else {
      std::printf("    %-10s non-tensor value (travels in the metadata)\n", key.c_str());
    }
  }
}

std::string scratch_file() {
  const std::filesystem::path dir =
      std::filesystem::is_directory("/dev/shm") ? std::filesystem::path("/dev/shm") : std::filesystem::temp_directory_path();
  return (dir / ("tdshm-demo-" + std::to_string(::getpid()) + ".td")).string();
}

int tour() {
  std::printf("tdshm tour: the seed tensordict of TensorDictBase.isend\n\n");
  tdshm::TensorDict td({{{"a", "b"}, at::randn({2})}, {"c", at::randn({2, 3})}, {"_", at::ones({2, 1, 5})},
                        {"step", int64_t{42}}},
                       {2});
  std::printf("%s\n", td.repr().c_str());

  std::printf("per-leaf transfer order (keys sorted at each level, depth first):");
  for (const auto& k : td.sorted_leaf_keys()) std::printf(" %s", k.str().c_str());
  std::printf("\n\n");

  const auto t0 = std::chrono::steady_clock::now();
  tdshm::TensorDict c = td.consolidate();
  const auto t1 = std::chrono::steady_clock::now();
  std::printf("consolidate(): %" PRIu64 " bytes in one uint8 storage, %.1f us; layout:\n", c.schema().total_bytes,
              std::chrono::duration<double, std::micro>(t1 - t0).count());
  print_layout(c.schema().root, "");
  const auto encoded = tdshm::encode_schema(c.schema());
  std::printf("schema: %zu bytes encoded, fingerprint %016" PRIx64 "\n\n", encoded.size(), c.schema_fingerprint());

  std::printf("checks:\n");
  check(c.is_locked(), "the consolidated tensordict is locked");
  check((c == td).all(), "its leaves equal the original's");
  check(c.get("c").is_alias_of(c.consolidated_storage()), "its leaves are views of the storage");
  c.update_(tdshm::TensorDict({{"c", at::ones({2, 3})}}, {2}));
  check(c.get("c").eq(1).all().item<bool>(), "update_ writes through into the storage");

  tdshm::TensorDict rebuilt =
      tdshm::TensorDict::from_consolidated(c.consolidated_storage().clone(), tdshm::decode_schema(encoded));
  check(rebuilt.same_structure(c) && (rebuilt == c).all(), "storage + decoded schema rebuild the same tensordict");

  const std::string file = scratch_file();
  tdshm::TensorDict in_file = td.consolidate({.filename = file});
  tdshm::TensorDict from_file = tdshm::TensorDict::from_consolidated_file(file);
  check((from_file == td).all() && std::get<int64_t>(from_file.get_non_tensor("step")) == 42,
        "a consolidated file alone rebuilds the tensordict");
  in_file.set_("_", at::zeros({2, 1, 5}));
  check(!from_file.get("_").ne(0).any().item<bool>(), "two mappings of the file see each other's writes");
  std::filesystem::remove(file);

  DemoTransition tr({{"obs", at::randn({4, 3})}, {"action", at::ones({4})}, {"reward", at::randn({4})}}, {4});
  tdshm::TensorDict body = tr.consolidate().tensordict();
  auto any = tdshm::make_tensorclass(tdshm::TensorDict::from_consolidated(body.consolidated_storage(), body.schema()));
  check(any->type_name() == "tdshm.demo.Transition" && dynamic_cast<DemoTransition*>(any.get()) != nullptr,
        "a tensorclass is rebuilt from its schema by registered name");

  std::printf("\n%s\n", failures == 0 ? "tour passed" : "tour FAILED");
  return failures == 0 ? 0 : 1;
}

void usage(FILE* out) {
  std::fprintf(out,
               "usage: tdshm <command>\n"
               "  demo   the seed scenarios as two processes over shm or gloo (--help)\n"
               "  tour   build, consolidate and inspect a TensorDict in one process (checks included)\n"
               "  bench  two-process ping-pong: ProcessGroupShm, gloo, raw floors, memcpy (--help)\n"
               "  stress kill ranks at random instants; destroy/init loops under one name (--help)\n"
               "  ls     the segments in /dev/shm: size, world, attached/alive ranks, age, status (--json)\n"
               "  inspect NAME: one segment's header, ranks, lock file and ring depths (--json)\n"
               "  gc     remove segments whose ranks are all dead or left (--dry-run only says)\n"
               "  world tcp://HOST:PORT: a running \"shm\" world's hosts, routes and heartbeats, from its store\n"
               "  help   this text\n");
}

// The label of a --from file in the plot's legends: its name without folder and extension.
std::string file_label(const std::string& path) { return std::filesystem::path(path).stem().string(); }

}  // namespace

int bench(int argc, char** argv) {
  namespace b = tdshm::bench;
  bool help = false;
  b::BenchOptions options;
  try {
    options = b::parse_bench_options(argc, argv, help);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "tdshm bench: %s\n", e.what());
    b::print_bench_usage(stderr);
    return 2;
  }
  if (help) {
    b::print_bench_usage(stdout);
    return 0;
  }
  int rc = 0;
  std::vector<b::Row> rows;  // measured in this run
  // A table only: shm_segment_bytes starts no thread.
  if (!options.worlds.empty()) {
    const auto sizes = b::print_segment_sizes(options.worlds);
    rows.insert(rows.end(), sizes.begin(), sizes.end());
  }
  // The first things that touch LibTorch's threads: both fork their ranks before any start.
  if (!options.scenarios.empty()) {
    const b::ScenarioRun run = b::run_scenarios(options);
    rows.insert(rows.end(), run.rows.begin(), run.rows.end());
    if (!run.failures.empty()) {
      std::printf("\n%zu problem(s):\n", run.failures.size());
      for (const auto& f : run.failures) std::printf("  %s\n", f.c_str());
      rc = 1;
    }
  }
  if (options.sweep()) {
    std::vector<std::string> lines;
    rc = b::run_pingpong_bench(options, &lines);  // writes --json itself
    for (const auto& line : lines) rows.push_back(b::Row::parse(line));
  } else if (!options.json_path.empty()) {
    b::write_rows(options.json_path, rows);
    std::printf("\nwrote %zu rows to %s (JSON Lines)\n", rows.size(), options.json_path.c_str());
  }

  std::vector<b::PlotSource> sources;
  if (!rows.empty()) sources.push_back({"this run", rows});
  std::vector<b::Row> all = rows;
  for (const auto& path : options.from_paths) {
    auto file_rows = b::read_rows(path);
    all.insert(all.end(), file_rows.begin(), file_rows.end());
    sources.push_back({file_label(path), std::move(file_rows)});
  }
  if (!options.compare_path.empty()) {
    const auto old_rows = b::read_rows(options.compare_path);
    const b::Comparison c = b::compare_rows(old_rows, all, options.threshold, options.compare_path, stdout);
    if (c.regressions > 0 && rc == 0) rc = 3;
  }
  if (!options.plot_path.empty()) {
    try {
      const std::string what = b::plot_rows(options.plot_path, sources);
      std::printf("\nplotted %s into %s\n", what.c_str(), options.plot_path.c_str());
    } catch (const std::exception& e) {
      std::fflush(stdout);
      std::fprintf(stderr, "tdshm bench: --plot: %s\n", e.what());
      if (rc == 0) rc = 1;
    }
  }
  std::fflush(stdout);
  return rc;
}

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  try {
    if (cmd == "demo") return tdshm::tools::run_demo(argc - 2, argv + 2);
    if (cmd == "tour") return tour();
    if (cmd == "bench") return bench(argc - 2, argv + 2);
    if (cmd == "stress") return tdshm::tools::run_stress(argc - 2, argv + 2);
    if (cmd == "ls") return tdshm::tools::run_ls(argc - 2, argv + 2);
    if (cmd == "inspect") return tdshm::tools::run_inspect(argc - 2, argv + 2);
    if (cmd == "gc") return tdshm::tools::run_gc(argc - 2, argv + 2);
    if (cmd == "world") return tdshm::tools::run_world(argc - 2, argv + 2);
    if (cmd == "help" || cmd == "--help" || cmd == "-h") {
      usage(stdout);
      return 0;
    }
    std::fprintf(stderr, cmd.empty() ? "tdshm: no command given\n" : "tdshm: unknown command '%s'\n", cmd.c_str());
    usage(stderr);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdshm %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
}
