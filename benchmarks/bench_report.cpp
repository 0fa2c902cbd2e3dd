// Rows of `tdshm bench` as JSON Lines: parsing and writing them, --compare and --plot
// (bench_report.h).

#include "bench_report.h"

#include "common/json.h"

#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
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

// ---- JSON ----

using detail::json_quote;


class Parser {
 public:
  explicit Parser(std::string_view text) : s_(text) {}

  Row row() {
    Row r;
    skip_ws();
    expect('{');
    skip_ws();
    if (peek() == '}') {
      ++i_;
    } else {
      for (;;) {
        skip_ws();
        const std::string key = string();
        skip_ws();
        expect(':');
        skip_ws();
        r.set_value(key, value());
        skip_ws();
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect('}');
        break;
      }
    }
    skip_ws();
    if (i_ != s_.size()) fail("text after the object");
    return r;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument(what + " at column " + std::to_string(i_ + 1));
  }
  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\r' || s_[i_] == '\n')) ++i_;
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }

  static void put_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    expect('"');
    std::string out;
    for (;;) {
      if (i_ >= s_.size()) fail("unterminated string");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      const char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (i_ + 4 > s_.size()) fail("short \\u escape");
          unsigned cp = 0;
          for (int k = 0; k < 4; ++k) {
            const char h = s_[i_++];
            cp <<= 4;
            if (h >= '0' && h <= '9') cp |= static_cast<unsigned>(h - '0');
            else if (h >= 'a' && h <= 'f') cp |= static_cast<unsigned>(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F') cp |= static_cast<unsigned>(h - 'A' + 10);
            else fail("bad \\u escape");
          }
          put_utf8(out, cp);
          break;
        }
        default: fail(std::string("bad escape \\") + e);
      }
    }
  }

  JsonValue value() {
    JsonValue v;
    const char c = peek();
    if (c == '"') {
      v.kind = JsonValue::Kind::string;
      v.text = string();
    } else if (c == '{' || c == '[') {
      fail("nested objects and arrays are not bench rows");
    } else if (s_.substr(i_, 4) == "true" || s_.substr(i_, 5) == "false") {
      v.kind = JsonValue::Kind::boolean;
      v.text = s_[i_] == 't' ? "true" : "false";
      v.number = s_[i_] == 't' ? 1 : 0;
      i_ += v.text.size();
    } else if (s_.substr(i_, 4) == "null") {
      v.kind = JsonValue::Kind::null;
      i_ += 4;
    } else {
      const size_t start = i_;
      while (i_ < s_.size() && std::strchr("+-0123456789.eE", s_[i_]) != nullptr) ++i_;
      const std::string text(s_.substr(start, i_ - start));
      char* end = nullptr;
      v.number = std::strtod(text.c_str(), &end);
      if (text.empty() || end != text.c_str() + text.size()) {
        i_ = start;
        fail("expected a value");
      }
      v.kind = JsonValue::Kind::number;
      v.text = text;
    }
    return v;
  }

  std::string_view s_;
  size_t i_ = 0;
};

std::string format_number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

// For gnuplot's data and tics: every digit a double holds.
std::string exact_number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// ---- --compare ----

// A row's identity and the one metric --compare looks at.
struct Metric {
  std::string key;     // identity, also the table's first column
  std::string name;    // e.g. "batches/s"
  double value = 0;
  bool higher_is_better = true;
  bool informational = false;  // shown, never a regression
};

std::string count_field(const Row& r) {
  for (const char* f : {"workers", "actors", "world"}) {
    if (const auto v = r.number(f)) return std::string(" ") + f + "=" + format_number(*v);
  }
  return "";
}

std::optional<Metric> metric_of(const Row& r) {
  Metric m;
  const std::string scenario = r.str("scenario");
  if (!scenario.empty()) {
    m.key = scenario;
    for (const char* f : {"pattern", "transport"}) {
      if (const std::string v = r.str(f); !v.empty()) m.key += " " + v;
    }
    m.key += count_field(r);
    const struct {
      const char* field;
      const char* name;
      bool higher;
      bool info;
    } metrics[] = {{"batches_per_s", "batches/s", true, false},
                   {"steps_per_s", "steps/s", true, false},
                   {"segment_bytes", "bytes", false, true}};
    for (const auto& c : metrics) {
      if (const auto v = r.number(c.field)) {
        m.name = c.name;
        m.value = *v;
        m.higher_is_better = c.higher;
        m.informational = c.info;
        return m;
      }
    }
    // --collectives rows: a per-op time at a size.
    if (const auto p50 = r.number("p50_us"); p50 && r.number("bytes")) {
      m.key += " " + size_label(*r.number("bytes"));
      m.name = "p50 us";
      m.value = *p50;
      m.higher_is_better = false;
      return m;
    }
    return std::nullopt;
  }
  const std::string transport = r.str("transport");
  const auto p50 = r.number("p50_us");
  if (transport.empty() || !p50) return std::nullopt;
  const std::string workload = r.str("workload");
  if (workload.empty()) {
    const auto bytes = r.number("bytes");
    if (!bytes) return std::nullopt;
    m.key = "size " + size_label(*bytes) + " " + transport;
  } else {
    m.key = "td " + workload + " " + transport;
  }
  m.name = "p50 us";
  m.value = *p50;
  m.higher_is_better = false;
  return m;
}

// Rows by identity, first one wins; `duplicates` counts the others.
std::vector<Metric> metrics_of(const std::vector<Row>& rows, int& duplicates) {
  std::vector<Metric> out;
  duplicates = 0;
  for (const auto& r : rows) {
    auto m = metric_of(r);
    if (!m) continue;
    if (std::any_of(out.begin(), out.end(), [&](const Metric& o) { return o.key == m->key; })) {
      ++duplicates;
      continue;
    }
    out.push_back(*m);
  }
  return out;
}

std::string format_value(double v) {
  char buf[64];
  if (std::fabs(v) >= 100) {
    std::snprintf(buf, sizeof buf, "%.1f", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.4g", v);
  }
  return buf;
}

// ---- --plot ----

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

}  // namespace

// "8 B", "64 KiB", "1 MiB"; a size that is no whole multiple stays in bytes.
std::string size_label(double bytes) {
  const auto b = static_cast<uint64_t>(bytes);
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  uint64_t v = b;
  int u = 0;
  while (u < 4 && v >= 1024 && v % 1024 == 0) {
    v /= 1024;
    ++u;
  }
  return std::to_string(v) + " " + units[u];
}

namespace {

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

// ---- Row ----

Row& Row::set_value(const std::string& key, JsonValue value) {
  for (auto& [k, old] : fields_) {
    if (k == key) {
      old = std::move(value);
      return *this;
    }
  }
  fields_.emplace_back(key, std::move(value));
  return *this;
}

Row& Row::set(const std::string& key, const std::string& value) {
  JsonValue v;
  v.kind = JsonValue::Kind::string;
  v.text = value;
  return set_value(key, std::move(v));
}

Row& Row::set_number(const std::string& key, double value) {
  JsonValue v;
  if (std::isfinite(value)) {
    v.kind = JsonValue::Kind::number;
    v.number = value;
    v.text = format_number(value);
  }
  return set_value(key, std::move(v));
}

Row& Row::set_int(const std::string& key, int64_t value) {
  JsonValue v;
  v.kind = JsonValue::Kind::number;
  v.number = static_cast<double>(value);
  v.text = std::to_string(value);
  return set_value(key, std::move(v));
}

const JsonValue* Row::find(std::string_view key) const {
  for (const auto& [k, v] : fields_) {
    if (k == key) return &v;
  }
  return nullptr;
}

std::string Row::str(std::string_view key) const {
  const JsonValue* v = find(key);
  return v != nullptr && v->kind == JsonValue::Kind::string ? v->text : std::string();
}

std::optional<double> Row::number(std::string_view key) const {
  const JsonValue* v = find(key);
  if (v == nullptr || v->kind != JsonValue::Kind::number) return std::nullopt;
  return v->number;
}

std::string Row::to_json() const {
  std::string out = "{";
  for (const auto& [k, v] : fields_) {
    if (out.size() > 1) out += ",";
    out += json_quote(k) + ":";
    switch (v.kind) {
      case JsonValue::Kind::string: out += json_quote(v.text); break;
      case JsonValue::Kind::number: out += v.text; break;
      case JsonValue::Kind::boolean: out += v.text; break;
      case JsonValue::Kind::null: out += "null"; break;
    }
  }
  return out + "}";
}

Row Row::parse(std::string_view line) { return Parser(line).row(); }

std::vector<Row> read_rows(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read '" + path + "': " + std::strerror(errno));
  std::vector<Row> rows;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      rows.push_back(Row::parse(line));
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(path + ":" + std::to_string(n) + ": not a bench row: " + e.what());
    }
  }
  if (in.bad()) throw std::runtime_error("error reading '" + path + "'");
  return rows;
}

void write_rows(const std::string& path, const std::vector<Row>& rows) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw std::runtime_error("cannot open '" + path + "' for writing the JSON results");
  for (const auto& r : rows) out << r.to_json() << "\n";
  if (!out.flush()) throw std::runtime_error("cannot write the JSON results to '" + path + "'");
}

// ---- --compare ----

Comparison compare_rows(const std::vector<Row>& old_rows, const std::vector<Row>& new_rows, double threshold_pct,
                        const std::string& old_label, FILE* out) {
  int old_dups = 0, new_dups = 0;
  const auto olds = metrics_of(old_rows, old_dups);
  const auto news = metrics_of(new_rows, new_dups);
  Comparison c;
  std::vector<std::string> only_new;
  size_t key_width = 24;
  for (const auto& m : news) key_width = std::max(key_width, m.key.size());
  for (const auto& m : olds) key_width = std::max(key_width, m.key.size());
  const int kw = static_cast<int>(key_width);

  std::fprintf(out, "\ncompare with %s (regression: throughput down or latency up by more than %g %%):\n",
               old_label.c_str(), threshold_pct);
  std::fprintf(out, "  %-*s %-10s %12s %12s %9s\n", kw, "row", "metric", "old", "new", "change");
  for (const auto& n : news) {
    const auto o = std::find_if(olds.begin(), olds.end(), [&](const Metric& m) { return m.key == n.key; });
    if (o == olds.end()) {
      only_new.push_back(n.key);
      continue;
    }
    ++c.matched;
    const double change = o->value != 0 ? (n.value - o->value) / o->value * 100.0 : 0.0;
    const bool worse = n.higher_is_better ? change < -threshold_pct : change > threshold_pct;
    const bool regression = worse && !n.informational && o->value > 0;
    if (regression) ++c.regressions;
    std::fprintf(out, "  %-*s %-10s %12s %12s %+8.1f%%%s\n", kw, n.key.c_str(), n.name.c_str(),
                 format_value(o->value).c_str(), format_value(n.value).c_str(), change,
                 regression ? "  REGRESSION" : "");
  }
  std::vector<std::string> only_old;
  for (const auto& o : olds) {
    if (std::none_of(news.begin(), news.end(), [&](const Metric& m) { return m.key == o.key; })) {
      only_old.push_back(o.key);
    }
  }
  c.only_old = static_cast<int>(only_old.size());
  c.only_new = static_cast<int>(only_new.size());
  if (!only_old.empty()) {
    std::fprintf(out, "only in %s (not compared):\n", old_label.c_str());
    for (const auto& k : only_old) std::fprintf(out, "  %s\n", k.c_str());
  }
  if (!only_new.empty()) {
    std::fprintf(out, "only in this run (not compared):\n");
    for (const auto& k : only_new) std::fprintf(out, "  %s\n", k.c_str());
  }
  if (old_dups + new_dups > 0) {
    std::fprintf(out, "duplicate rows ignored (the first of each counts): %d old, %d new\n", old_dups, new_dups);
  }
  std::fprintf(out, "%d matched, %d regression(s), %d only in %s, %d only in this run\n", c.matched, c.regressions,
               c.only_old, old_label.c_str(), c.only_new);
  return c;
}

// ---- --plot ----

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
