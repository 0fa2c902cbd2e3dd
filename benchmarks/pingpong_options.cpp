// The command line of `tdshm bench` (parse_bench_options, pingpong.h): sizes, counts and lists
// as the options spell them, the options of each mode, and which of them go together.

#include "pingpong.h"

#include "collectives.h"
#include "scenarios.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <system_error>

namespace tdshm::bench {

namespace {

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t comma = list.find(',', start);
    std::string item = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) out.push_back(std::move(item));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ",") + item;
  return out;
}

// "4096", "4K", "4KiB", "64M", "1G": binary multiples.
size_t parse_size(const std::string& text) {
  uint64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr == text.data()) throw std::invalid_argument("bad size '" + text + "'");
  std::string unit(ptr, end);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  unsigned shift = 0;
  if (unit.empty() || unit == "b") {
    shift = 0;
  } else if (unit == "k" || unit == "kib" || unit == "kb") {
    shift = 10;
  } else if (unit == "m" || unit == "mib" || unit == "mb") {
    shift = 20;
  } else if (unit == "g" || unit == "gib" || unit == "gb") {
    shift = 30;
  } else {
    throw std::invalid_argument("bad size unit in '" + text + "' (use B, K/KiB, M/MiB or G/GiB)");
  }
  if (value == 0 || value > (uint64_t{1} << (40 - shift))) {
    throw std::invalid_argument("size '" + text + "' out of range (1 B to 1 TiB)");
  }
  return static_cast<size_t>(value << shift);
}

int parse_count(const std::string& flag, const std::string& text, int min) {
  int value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || value < min) {
    throw std::invalid_argument(flag + " needs an integer >= " + std::to_string(min) + ", got '" + text + "'");
  }
  return value;
}

// "1,2,4,8": positive integers in [min, max], in the given order, no duplicates.
std::vector<int> parse_int_list(const std::string& flag, const std::string& text, int min, int max) {
  std::vector<int> out;
  for (const auto& item : split(text)) {
    const int v = parse_count(flag, item, min);
    if (v > max) throw std::invalid_argument(flag + " values must be at most " + std::to_string(max) + ", got " + item);
    if (std::find(out.begin(), out.end(), v) != out.end()) throw std::invalid_argument(flag + " lists " + item + " twice");
    out.push_back(v);
  }
  if (out.empty()) throw std::invalid_argument(flag + " needs at least one number");
  return out;
}

}  // namespace

BenchOptions parse_bench_options(int argc, char** argv, bool& help) {
  BenchOptions o;
  help = false;
  std::optional<int> iters, warmup, rounds, batches, steps, repeat;
  bool sizes_given = false;
  // Options of the size sweep, which does not run with a scenario, --world or --from.
  std::vector<std::string> sweep_flags;
  bool workers_given = false, actors_given = false, threshold_given = false, world_sizes_given = false;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    std::optional<std::string> inline_value;
    if (const size_t eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = arg.substr(eq + 1);
      arg.resize(eq);
    }
    auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      help = true;
    } else if (arg == "--sizes") {
      sweep_flags.push_back(arg);
      o.sizes.clear();
      for (const auto& item : split(value())) o.sizes.push_back(parse_size(item));
      if (o.sizes.empty()) throw std::invalid_argument("--sizes needs at least one size");
      sizes_given = true;
    } else if (arg == "--td") {
      sweep_flags.push_back(arg);
      o.td = true;
    } else if (arg == "--workloads") {
      sweep_flags.push_back(arg);
      const auto wanted = split(value());
      if (wanted.empty()) throw std::invalid_argument("--workloads needs at least one workload");
      for (const auto& name : wanted) {
        if (std::find(all_workloads().begin(), all_workloads().end(), name) == all_workloads().end()) {
          throw std::invalid_argument("unknown workload '" + name + "'");
        }
      }
      o.workloads = wanted;
      o.td = true;
    } else if (arg == "--iters") {
      sweep_flags.push_back(arg);
      iters = parse_count(arg, value(), 1);
    } else if (arg == "--warmup") {
      sweep_flags.push_back(arg);
      warmup = parse_count(arg, value(), 0);
    } else if (arg == "--rounds") {
      sweep_flags.push_back(arg);
      rounds = parse_count(arg, value(), 1);
    } else if (arg == "--transports") {
      sweep_flags.push_back(arg);
      const auto wanted = split(value());
      if (wanted.empty()) throw std::invalid_argument("--transports needs at least one transport");
      o.transports = wanted;
    } else if (arg == "--json") {
      o.json_path = value();
    } else if (arg == "--quick") {
      o.quick = true;
    } else if (arg == "--no-pin") {
      sweep_flags.push_back(arg);
      o.pin = false;
    } else if (arg == "--scenario") {
      const auto wanted = split(value());
      if (wanted.empty()) throw std::invalid_argument("--scenario needs at least one scenario");
      for (const auto& name : wanted) {
        const auto& known = all_scenarios();
        if (name == "all") {
          for (const auto& k : known) {
            if (std::find(o.scenarios.begin(), o.scenarios.end(), k) == o.scenarios.end()) o.scenarios.push_back(k);
          }
        } else if (std::find(known.begin(), known.end(), name) == known.end()) {
          throw std::invalid_argument("unknown scenario '" + name + "' (use " + join(known) + " or all)");
        } else if (std::find(o.scenarios.begin(), o.scenarios.end(), name) == o.scenarios.end()) {
          o.scenarios.push_back(name);
        }
      }
    } else if (arg == "--collectives") {
      if (std::find(o.scenarios.begin(), o.scenarios.end(), "collectives") == o.scenarios.end()) {
        o.scenarios.push_back("collectives");
      }
    } else if (arg == "--world-sizes") {
      o.world_sizes = parse_int_list(arg, value(), 1, 64);
      world_sizes_given = true;
    } else if (arg == "--workers") {
      o.workers = parse_int_list(arg, value(), 1, 64);
      workers_given = true;
    } else if (arg == "--actors") {
      o.actors = parse_count(arg, value(), 1);
      if (o.actors > 64) throw std::invalid_argument("--actors must be at most 64");
      actors_given = true;
    } else if (arg == "--batches") {
      batches = parse_count(arg, value(), 1);
    } else if (arg == "--steps") {
      steps = parse_count(arg, value(), 1);
    } else if (arg == "--repeat") {
      repeat = parse_count(arg, value(), 1);
    } else if (arg == "--progress") {
      o.progress = true;
    } else if (arg == "--world") {
      o.worlds = parse_int_list(arg, value(), 1, 4096);
    } else if (arg == "--plot") {
      o.plot_path = value();
      const auto dot = o.plot_path.rfind('.');
      std::string ext = dot == std::string::npos ? "" : o.plot_path.substr(dot);
      std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      if (ext != ".png" && ext != ".svg") {
        throw std::invalid_argument("--plot needs a file name ending in .png or .svg, got '" + o.plot_path + "'");
      }
    } else if (arg == "--from" || arg == "--plot-from") {
      const auto files = split(value());
      if (files.empty()) throw std::invalid_argument(arg + " needs at least one file");
      o.from_paths.insert(o.from_paths.end(), files.begin(), files.end());
    } else if (arg == "--compare") {
      o.compare_path = value();
      if (o.compare_path.empty()) throw std::invalid_argument("--compare needs a file");
    } else if (arg == "--threshold") {
      const std::string text = value();
      char* end = nullptr;
      const double pct = std::strtod(text.c_str(), &end);
      if (text.empty() || end != text.c_str() + text.size() || !(pct > 0) || pct >= 1000) {
        throw std::invalid_argument("--threshold needs a percentage above 0 and below 1000, got '" + text + "'");
      }
      o.threshold = pct;
      threshold_given = true;
    } else {
      throw std::invalid_argument("unknown option '" + arg + "'");
    }
  }
  if (o.td && sizes_given) throw std::invalid_argument("--sizes is for the size sweep; --td measures workloads");
  const auto& known = o.td ? all_td_transports() : all_transports();
  for (const auto& name : o.transports) {
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      throw std::invalid_argument("unknown transport '" + name + "'" + (o.td ? " with --td" : "") + " (use one of " +
                                  join(known) + ")");
    }
  }
  const bool scenario = !o.scenarios.empty();
  const auto wants = [&](const char* name) {
    return std::find(o.scenarios.begin(), o.scenarios.end(), name) != o.scenarios.end();
  };
  // --sizes also chooses the sizes of --collectives.
  if (wants("collectives")) {
    sweep_flags.erase(std::remove(sweep_flags.begin(), sweep_flags.end(), std::string("--sizes")), sweep_flags.end());
    if (!sizes_given) o.sizes = default_collective_sizes();
  }
  if (world_sizes_given && !wants("collectives")) throw std::invalid_argument("--world-sizes is an option of --collectives");
  if (!o.sweep() && !sweep_flags.empty()) {
    throw std::invalid_argument(sweep_flags.front() +
                                " is an option of the size sweep, which does not run with --scenario, "
                                "--collectives, --world or --from");
  }
  if ((workers_given || batches) && !wants("loader")) {
    throw std::invalid_argument(std::string(workers_given ? "--workers" : "--batches") +
                                " is an option of --scenario loader");
  }
  if ((actors_given || steps) && !wants("actor-learner") && !wants("board")) {
    throw std::invalid_argument(std::string(actors_given ? "--actors" : "--steps") +
                                " is an option of --scenario actor-learner and board");
  }
  if ((repeat || o.progress) && !scenario) {
    throw std::invalid_argument(std::string(repeat ? "--repeat" : "--progress") +
                                " is an option of --scenario and --collectives");
  }
  if (threshold_given && o.compare_path.empty()) throw std::invalid_argument("--threshold is an option of --compare");
  o.batches = batches.value_or(o.quick ? 30 : o.batches);
  o.steps = steps.value_or(o.quick ? 20 : o.steps);
  o.repeat = repeat.value_or(o.quick ? 1 : o.repeat);
  o.iters = iters.value_or(o.quick ? 200 : o.iters);
  o.warmup = warmup.value_or(o.quick ? 20 : o.warmup);
  o.rounds = rounds.value_or(o.quick ? 2 : o.rounds);
  return o;
}

}  // namespace tdshm::bench
