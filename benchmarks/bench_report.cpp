// Rows of `tdshm bench` as JSON Lines: parsing and writing them, and --compare (bench_report.h;
// --plot draws them in bench_plot.cpp).

#include "bench_report.h"

#include "common/json.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <stdexcept>

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

// ---- --compare ----

// A row's identity and the one metric --compare looks at.
struct Metric {
  std::string key;     // identity, also the table's first column
  std::string name;    // e.g. "batches/s"
  double value = 0;    // of several rows with this identity: their median
  bool higher_is_better = true;
  bool informational = false;  // shown, never a regression
  size_t runs = 1;             // rows with this identity
  double lo = 0, hi = 0;       // their smallest and largest value
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

// Rows by identity, in first-seen order. Several rows with one identity (the runs of alternating
// measurements, concatenated) count as one: the median of their values, with their range, so
// that a comparison of repeated runs is not decided by whichever run came first.
std::vector<Metric> metrics_of(const std::vector<Row>& rows) {
  std::vector<Metric> out;
  std::vector<std::vector<double>> values;
  for (const auto& r : rows) {
    auto m = metric_of(r);
    if (!m) continue;
    const auto it = std::find_if(out.begin(), out.end(), [&](const Metric& o) { return o.key == m->key; });
    if (it == out.end()) {
      out.push_back(*m);
      values.push_back({m->value});
    } else {
      values[static_cast<size_t>(it - out.begin())].push_back(m->value);
    }
  }
  for (size_t i = 0; i < out.size(); ++i) {
    auto& v = values[i];
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    out[i].value = n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
    out[i].runs = n;
    out[i].lo = v.front();
    out[i].hi = v.back();
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

std::string format_number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

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
  const auto olds = metrics_of(old_rows);
  const auto news = metrics_of(new_rows);
  Comparison c;
  std::vector<std::string> only_new;
  size_t key_width = 24;
  for (const auto& m : news) key_width = std::max(key_width, m.key.size());
  for (const auto& m : olds) key_width = std::max(key_width, m.key.size());
  const int kw = static_cast<int>(key_width);

  const bool repeated = std::any_of(olds.begin(), olds.end(), [](const Metric& m) { return m.runs > 1; }) ||
                        std::any_of(news.begin(), news.end(), [](const Metric& m) { return m.runs > 1; });
  std::fprintf(out, "\ncompare with %s (regression: throughput down or latency up by more than %g %%):\n",
               old_label.c_str(), threshold_pct);
  if (repeated) {
    std::fprintf(out, "  (a row measured several times: the median of its runs, then [runs: min-max])\n");
  }
  std::fprintf(out, "  %-*s %-10s %12s %12s %9s\n", kw, "row", "metric", "old", "new", "change");
  auto spread = [](const Metric& m) {
    return m.runs > 1 ? " [" + std::to_string(m.runs) + ": " + format_value(m.lo) + "-" + format_value(m.hi) + "]"
                      : std::string();
  };
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
    std::fprintf(out, "  %-*s %-10s %12s %12s %+8.1f%%%s%s\n", kw, n.key.c_str(), n.name.c_str(),
                 format_value(o->value).c_str(), format_value(n.value).c_str(), change,
                 regression ? "  REGRESSION" : "",
                 repeated ? ("  old" + spread(*o) + " new" + spread(n)).c_str() : "");
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
  std::fprintf(out, "%d matched, %d regression(s), %d only in %s, %d only in this run\n", c.matched, c.regressions,
               c.only_old, old_label.c_str(), c.only_new);
  return c;
}

}  // namespace tdshm::bench
