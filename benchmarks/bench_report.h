#pragma once
/// \file
/// What `tdshm bench` does with its rows once they are measured: rows are flat JSON objects,
/// one per line (JSON Lines, as `--json` writes them), whether they come from the size sweep
/// (pingpong.h), the TensorDict mode, the workload scenarios (scenarios.h) or a file of an
/// earlier run. `--compare OLD` matches this run's rows with OLD's and flags regressions;
/// `--plot FILE` draws them with gnuplot.
///
/// Row identity (what --compare matches on) and the one metric compared:
///   scenario rows   scenario, pattern, transport and workers / actors / world; the metric is
///                   batches_per_s or steps_per_s (higher is better), or segment_bytes for
///                   scenario "segment" (shown, never a regression); "collectives" rows add
///                   bytes to the identity, and their metric is p50_us (lower is better)
///   size sweep      transport and bytes (workload ""); p50_us (lower is better)
///   --td rows       transport and workload; p50_us (lower is better)
/// Rows of one identity on one side (repeated runs, concatenated) compare by their median.

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tdshm::bench {

/// One field value of a flat JSON object.
struct JsonValue {
  enum class Kind { string, number, boolean, null };
  Kind kind = Kind::null;
  std::string text;   ///< string: the value; number: as written; boolean: "true" / "false"
  double number = 0;  ///< number; boolean: 1 or 0
};

/// One row: a flat JSON object (no nested objects or arrays), fields in insertion order.
class Row {
 public:
  /// Sets (or replaces) a field.
  Row& set(const std::string& key, const std::string& value);
  Row& set(const std::string& key, const char* value) { return set(key, std::string(value)); }
  /// Numbers: %.6g; a non-finite value is written as null.
  Row& set_number(const std::string& key, double value);
  Row& set_int(const std::string& key, int64_t value);
  /// Sets a field to `value` as it is (a parsed number keeps the text it was written with).
  Row& set_value(const std::string& key, JsonValue value);

  const JsonValue* find(std::string_view key) const;
  /// The string field `key`, or "" when it is missing or not a string.
  std::string str(std::string_view key) const;
  /// The number field `key`, or nothing when it is missing or not a number.
  std::optional<double> number(std::string_view key) const;
  const std::vector<std::pair<std::string, JsonValue>>& fields() const noexcept { return fields_; }

  /// The row as one line of JSON (no newline).
  std::string to_json() const;
  /// Parses one JSON object of strings, numbers, booleans and nulls. Throws
  /// std::invalid_argument saying what is wrong and at which column.
  static Row parse(std::string_view line);

 private:
  std::vector<std::pair<std::string, JsonValue>> fields_;
};

/// Every row of a JSON Lines file (blank lines skipped). Throws std::runtime_error naming the
/// file and line of a malformed row, or a file that cannot be read.
std::vector<Row> read_rows(const std::string& path);
/// Writes `rows` to `path`, one per line (replacing the file). Throws std::runtime_error.
void write_rows(const std::string& path, const std::vector<Row>& rows);

/// What compare_rows found.
struct Comparison {
  int matched = 0;
  int regressions = 0;
  int only_old = 0;
  int only_new = 0;
};

/// Matches `new_rows` (this run) with `old_rows` (`old_label`: where they came from) by row
/// identity, prints a table of every matched metric (old, new, % change, REGRESSION when a
/// throughput dropped or a latency rose by more than `threshold_pct` percent) and lists the
/// rows found on one side only, to `out`.
Comparison compare_rows(const std::vector<Row>& old_rows, const std::vector<Row>& new_rows, double threshold_pct,
                        const std::string& old_label, FILE* out);

/// "8 B", "64 KiB", "1 MiB"; a size that is no whole multiple of a unit stays in the smaller one.
std::string size_label(double bytes);
/// A number as Row::set_number writes it (%.6g).
std::string format_number(double v);

/// Rows from one place (this run, or a file), named in the plot's legends when there are several.
struct PlotSource {
  std::string label;
  std::vector<Row> rows;
};

/// Draws with gnuplot into `file` (.png: pngcairo, .svg: svg): p50 latency and GB/s against size
/// of each transport of the size-sweep rows, and bar charts of the loader's batches/s and the
/// actor-learner's steps/s per pattern and N, one bar per transport, min-max as error bars. The
/// gnuplot script and its data files are written to a temporary directory, removed afterwards.
/// Throws std::runtime_error when gnuplot is not in PATH (the message names the Debian package),
/// fails, or when there is nothing to draw. Returns a one-line description of what was drawn.
std::string plot_rows(const std::string& file, const std::vector<PlotSource>& sources);

}  // namespace tdshm::bench
