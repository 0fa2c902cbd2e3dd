// `tdshm bench --plot FILE` (plot_rows, bench_report.h): the rows drawn with gnuplot, the size
// sweep's latency and bandwidth, the scenarios' throughput as bar charts and the collectives' GB/s
// per world size, through a script and data files in a temporary directory.

#include "bench_report.h"

#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <thread>

extern char** environ;

namespace tdshm::bench {

namespace {

// For gnuplot's data and tics: every digit a double holds.
std::string exact_number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string gp_quote(const std::string& s) {
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

std::string data_label(std::string s) {
  std::replace(s.begin(), s.end(), '"', '\'');
  return "\"" + s + "\"";
}

// The path of `name` in PATH, or "".
std::string find_in_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  std::string_view rest(path);
  while (true) {
    const size_t colon = rest.find(':');
    std::string dir(rest.substr(0, colon));
    if (dir.empty()) dir = ".";
    const std::string candidate = dir + "/" + name;
    struct stat st {};
    if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
    if (colon == std::string_view::npos) return "";
    rest.remove_prefix(colon + 1);
  }
}

// Runs `argv`, waits at most `limit`; returns its wait status (killed on overrun: throws).
int run_program(const std::vector<std::string>& args, std::chrono::seconds limit) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (const int rc = ::posix_spawn(&pid, args[0].c_str(), nullptr, nullptr, argv.data(), environ); rc != 0) {
    throw std::system_error(rc, std::generic_category(), "cannot start " + args[0]);
  }
  const auto end = std::chrono::steady_clock::now() + limit;
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0 && errno != EINTR) throw std::system_error(errno, std::generic_category(), "waitpid " + args[0]);
    if (std::chrono::steady_clock::now() > end) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      throw std::runtime_error(args[0] + " ran longer than " + std::to_string(limit.count()) + " s and was killed");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// A temporary directory, removed with what it holds when this goes away.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "tdshm-plot-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) {
      throw std::system_error(errno, std::generic_category(), "mkdtemp for the plot's files");
    }
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  if (!out.flush()) throw std::runtime_error("cannot write " + path);
}

// One bar chart: categories (x) by series (bars), each value with its min and max.
struct Bars {
  std::string title, ylabel;
  std::vector<std::string> categories;
  std::vector<std::string> series;
  // (category, series) -> {median, min, max}
  std::map<std::pair<size_t, size_t>, std::array<double, 3>> values;

  size_t index(std::vector<std::string>& v, const std::string& s) {
    const auto it = std::find(v.begin(), v.end(), s);
    if (it != v.end()) return static_cast<size_t>(it - v.begin());
    v.push_back(s);
    return v.size() - 1;
  }
  bool empty() const { return values.empty(); }
};

// A gnuplot x tic at every size, labelled as the tables label sizes.
std::string size_tics(std::vector<double> sizes) {
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  std::string tics = "set xtics (";
  for (size_t i = 0; i < sizes.size(); ++i) {
    tics += (i ? ", " : "") + gp_quote(size_label(sizes[i])) + " " + exact_number(sizes[i]);
  }
  return tics + ")\n";
}

}  // namespace

std::string plot_rows(const std::string& file, const std::vector<PlotSource>& sources) {
  // Which chart each source has rows for: a legend names the source only where several meet.
  enum Chart { kSizes, kLoader, kActor, kCharts };
  auto chart_of = [](const Row& r) -> int {
    const std::string scenario = r.str("scenario");
    if (scenario.empty()) return r.str("workload").empty() && r.number("bytes") ? kSizes : -1;
    if (scenario == "loader") return kLoader;
    if (scenario == "actor-learner") return kActor;
    return -1;
  };
  int sources_of[kCharts] = {0, 0, 0};
  for (const auto& src : sources) {
    bool has[kCharts] = {false, false, false};
    for (const auto& r : src.rows) {
      if (const int c = chart_of(r); c >= 0) has[c] = true;
    }
    for (int c = 0; c < kCharts; ++c) sources_of[c] += has[c] ? 1 : 0;
  }
  auto series_name = [&](const std::string& transport, const PlotSource& src, int chart) {
    return sources_of[chart] > 1 ? transport + " (" + src.label + ")" : transport;
  };

  // Size sweep: (series) -> sorted (bytes, p50_us, gbps).
  std::vector<std::pair<std::string, std::vector<std::array<double, 3>>>> lines;
  Bars loader{"loader: batches/s received by main (median; bars: min-max)", "batches/s", {}, {}, {}};
  Bars actor{"actor-learner: steps/s (median; bars: min-max)", "steps/s", {}, {}, {}};
  for (const auto& src : sources) {
    for (const auto& r : src.rows) {
      const std::string scenario = r.str("scenario");
      const std::string transport = r.str("transport");
      if (scenario.empty()) {
        const auto bytes = r.number("bytes");
        const auto p50 = r.number("p50_us");
        const auto gbps = r.number("gbps");
        if (transport.empty() || !r.str("workload").empty() || !bytes || !p50 || !gbps) continue;
        const std::string name = series_name(transport, src, kSizes);
        auto it = std::find_if(lines.begin(), lines.end(), [&](const auto& l) { return l.first == name; });
        if (it == lines.end()) it = lines.insert(lines.end(), {name, {}});
        it->second.push_back({*bytes, *p50, *gbps});
        continue;
      }
      Bars* bars = nullptr;
      std::string category;
      const char* metric = nullptr;
      if (scenario == "loader") {
        bars = &loader;
        metric = "batches_per_s";
        category = r.str("pattern") + " N=" + format_number(r.number("workers").value_or(0));
      } else if (scenario == "actor-learner") {
        bars = &actor;
        metric = "steps_per_s";
        category = "actors=" + format_number(r.number("actors").value_or(0));
      } else {
        continue;
      }
      const auto v = r.number(metric);
      if (!v || transport.empty()) continue;
      const size_t ci = bars->index(bars->categories, category);
      const size_t si = bars->index(bars->series, series_name(transport, src, bars == &loader ? kLoader : kActor));
      const std::string m = metric;
      bars->values[{ci, si}] = {*v, r.number(m + "_min").value_or(*v), r.number(m + "_max").value_or(*v)};
    }
  }
  for (auto& [name, points] : lines) std::sort(points.begin(), points.end());

  // --collectives: a panel per world size, GB/s against size, a line per (op, transport) and
  // the memcpy reference (workers 1) in every panel.
  using Series = std::vector<std::pair<std::string, std::vector<std::pair<double, double>>>>;
  std::map<int, Series> collective_panels;
  Series memcpy_lines;
  // A plottable collectives row: its bytes, GB/s and world size.
  struct CollectivePoint {
    double bytes, gbps, world;
  };
  auto collective_point = [](const auto& r) -> std::optional<CollectivePoint> {
    if (r.str("scenario") != "collectives") return std::nullopt;
    const auto bytes = r.number("bytes");
    const auto gbps = r.number("gbps");
    const auto world = r.number("workers");
    if (!bytes || !gbps || !world) return std::nullopt;
    return CollectivePoint{*bytes, *gbps, *world};
  };
  // Line names carry their source's label only when several sources have collectives rows.
  const auto collective_sources = std::count_if(sources.begin(), sources.end(), [&](const auto& src) {
    return std::any_of(src.rows.begin(), src.rows.end(), [&](const auto& r) { return collective_point(r).has_value(); });
  });
  for (const auto& src : sources) {
    for (const auto& r : src.rows) {
      const auto point = collective_point(r);
      if (!point) continue;
      const std::string transport = r.str("transport");
      std::string name = transport == "memcpy" ? std::string("memcpy") : r.str("pattern") + " " + transport;
      if (collective_sources > 1) name += " (" + src.label + ")";
      Series& series = transport == "memcpy" ? memcpy_lines : collective_panels[static_cast<int>(point->world)];
      auto it = std::find_if(series.begin(), series.end(), [&](const auto& l) { return l.first == name; });
      if (it == series.end()) it = series.insert(series.end(), {name, {}});
      it->second.push_back({point->bytes, point->gbps});
    }
  }
  for (auto& [world, series] : collective_panels) {
    series.insert(series.end(), memcpy_lines.begin(), memcpy_lines.end());
    for (auto& [name, points] : series) std::sort(points.begin(), points.end());
  }

  const int panels = (lines.empty() ? 0 : 2) + (loader.empty() ? 0 : 1) + (actor.empty() ? 0 : 1) +
                     static_cast<int>(collective_panels.size());
  if (panels == 0) {
    throw std::runtime_error(
        "nothing to plot: no size-sweep rows (workload \"\"), no loader or actor-learner rows and no collectives rows");
  }
  const std::string gnuplot = find_in_path("gnuplot");
  if (gnuplot.empty()) {
    throw std::runtime_error("gnuplot is not in PATH; install it (Debian: apt-get install gnuplot-nox)");
  }

  TempDir dir;
  const int cols = panels > 1 ? 2 : 1;
  const int rows = (panels + cols - 1) / cols;
  const bool svg = file.size() >= 4 && (file.substr(file.size() - 4) == ".svg" || file.substr(file.size() - 4) == ".SVG");
  std::string gp;
  gp += svg ? "set terminal svg size " + std::to_string(cols * 640) + "," + std::to_string(rows * 460) +
                  " dynamic noenhanced font 'sans,11' background rgb 'white'\n"
            : "set terminal pngcairo size " + std::to_string(cols * 640) + "," + std::to_string(rows * 460) +
                  " noenhanced font 'sans,10' background rgb 'white'\n";
  gp += "set output " + gp_quote(file) + "\n";
  gp += "set datafile missing '?'\n";
  gp += "set grid ytics\n";
  gp += "set multiplot layout " + std::to_string(rows) + "," + std::to_string(cols) + " title 'tdshm bench'\n";

  if (!lines.empty()) {
    std::string plot_lat = "plot ", plot_bw = "plot ";
    for (size_t i = 0; i < lines.size(); ++i) {
      const std::string data = dir.file("size_" + std::to_string(i) + ".dat");
      std::string text = "# bytes p50_us gbps\n";
      for (const auto& p : lines[i].second) {
        text += exact_number(p[0]) + " " + exact_number(p[1]) + " " + exact_number(p[2]) + "\n";
      }
      write_file(data, text);
      const std::string sep = i ? ", " : "";
      plot_lat += sep + gp_quote(data) + " using 1:2 with linespoints pt 7 ps 0.6 title " + gp_quote(lines[i].first);
      plot_bw += sep + gp_quote(data) + " using 1:3 with linespoints pt 7 ps 0.6 title " + gp_quote(lines[i].first);
    }
    // A tic at every size measured, labelled as the tables label sizes.
    std::vector<double> sizes;
    for (const auto& [name, points] : lines) {
      for (const auto& p : points) sizes.push_back(p[0]);
    }
    gp += size_tics(std::move(sizes));
    gp += "set title 'p50 one-way latency against message size'\n"
          "set logscale xy\nset xlabel 'message size'\n"
          "set ylabel 'p50 one-way latency (us)'\nset key top left Left reverse\n" +
          plot_lat + "\n";
    gp += "set title 'bandwidth against message size'\n"
          "unset logscale y\nset ylabel 'GB/s (10^9 bytes/s, from p50)'\nset yrange [0:*]\n" +
          plot_bw + "\n";
    gp += "unset logscale\nset xtics autofreq\nset autoscale y\nunset xlabel\n";
  }

  int chart = 0;
  for (const Bars* bars : {&loader, &actor}) {
    if (bars->empty()) continue;
    const std::string data = dir.file("bars_" + std::to_string(chart++) + ".dat");
    std::string text = "# category then (median min max) per series:";
    for (const auto& s : bars->series) text += " [" + s + "]";
    text += "\n";
    for (size_t c = 0; c < bars->categories.size(); ++c) {
      text += data_label(bars->categories[c]);
      for (size_t s = 0; s < bars->series.size(); ++s) {
        const auto it = bars->values.find({c, s});
        if (it == bars->values.end()) {
          text += " ? ? ?";
        } else {
          for (const double v : it->second) text += " " + exact_number(v);
        }
      }
      text += "\n";
    }
    write_file(data, text);
    gp += "set title " + gp_quote(bars->title) + "\n";
    gp += "set ylabel " + gp_quote(bars->ylabel) + "\nset yrange [0:*]\nset key top right\n";
    gp += "set style data histograms\nset style histogram errorbars gap 1 lw 1\n"
          "set style fill solid 0.75 border -1\nset boxwidth 0.9\nset xtics rotate by -30 nomirror\n";
    std::string plot = "plot ";
    for (size_t s = 0; s < bars->series.size(); ++s) {
      const size_t col = 2 + 3 * s;
      plot += (s ? ", " : "") + gp_quote(data) + " using " + std::to_string(col) + ":" + std::to_string(col + 1) + ":" +
              std::to_string(col + 2) + (s == 0 ? ":xtic(1)" : "") + " title " + gp_quote(bars->series[s]);
    }
    gp += plot + "\n";
    gp += "set xtics norotate\nset style data lines\n";
  }
  int panel = 0;
  std::vector<std::string> ops;  // colour order of the collectives' ops
  for (const auto& [world, series] : collective_panels) {
    std::string plot = "plot ";
    std::vector<double> sizes;
    for (size_t i = 0; i < series.size(); ++i) {
      const std::string data = dir.file("coll_" + std::to_string(panel) + "_" + std::to_string(i) + ".dat");
      std::string text = "# bytes gbps\n";
      for (const auto& p : series[i].second) {
        text += exact_number(p.first) + " " + exact_number(p.second) + "\n";
        // Tics at the sizes of the plain ops (a TD tree's total would crowd them).
        if (series[i].first.rfind("td.", 0) != 0) sizes.push_back(p.first);
      }
      write_file(data, text);
      // A colour per op, shm solid, gloo dashed with open points, memcpy black.
      const std::string& name = series[i].first;
      const std::string op = name.substr(0, name.find(' '));
      static const char* const colours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
                                            "#e377c2", "#17becf"};
      const auto known = std::find(ops.begin(), ops.end(), op);
      const size_t colour = static_cast<size_t>(known - ops.begin()) % std::size(colours);
      if (known == ops.end()) ops.push_back(op);
      std::string style = "lc rgb '" + std::string(colours[colour]) + "' pt 7";
      if (name.rfind("memcpy", 0) == 0) {
        style = "dt 2 lc rgb 'black' pt 6";
      } else if (name.find(" gloo") != std::string::npos) {
        style = "dt 3 lc rgb '" + std::string(colours[colour]) + "' pt 6";
      }
      plot += (i ? ", " : "") + gp_quote(data) + " using 1:2 with linespoints " + style + " ps 0.6 title " +
              gp_quote(name);
    }
    ++panel;
    gp += size_tics(std::move(sizes));
    gp += "set title " + gp_quote("collectives, world " + std::to_string(world) + ": GB/s (bytes per rank / p50)") +
          "\nset logscale xy\nset xlabel 'bytes per rank'\nset ylabel 'GB/s (10^9 bytes/s)'\n"
          "set autoscale y\nset format y '%g'\nset key top left Left reverse font ',8'\n" +
          plot + "\n";
    gp += "unset logscale\nset xtics autofreq\nunset xlabel\nset key font ''\nset format y '% h'\n";
  }
  gp += "unset multiplot\n";
  const std::string script = dir.file("plot.gp");
  write_file(script, gp);

  std::error_code ec;
  std::filesystem::remove(file, ec);
  const int status = run_program({gnuplot, script}, std::chrono::seconds(120));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw std::runtime_error("gnuplot failed (wait status " + std::to_string(status) + ") on its script:\n" + gp);
  }
  const auto size = std::filesystem::file_size(file, ec);
  if (ec || size == 0) throw std::runtime_error("gnuplot wrote nothing to " + file);
  std::string what;
  if (!lines.empty()) what += std::to_string(lines.size()) + " size-sweep series (latency, bandwidth)";
  if (!loader.empty()) what += std::string(what.empty() ? "" : ", ") + "loader throughput";
  if (!actor.empty()) what += std::string(what.empty() ? "" : ", ") + "actor-learner throughput";
  if (!collective_panels.empty()) {
    what += std::string(what.empty() ? "" : ", ") + "collectives GB/s (" + std::to_string(collective_panels.size()) +
            " world size(s))";
  }
  return what;
}

}  // namespace tdshm::bench
