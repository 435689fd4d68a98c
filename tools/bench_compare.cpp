// The speed gate between two bench reports; see bench_compare.h.
#include "tools/bench_compare.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>

namespace moe::tools {

namespace {

// One report row, read and checked.
struct Row {
  std::string op, name, dir, impl, kind, line;
  bool verified = false;
  double median_us = 0, min_us = 0, bytes = 0, flops = 0;
  double pct_copy = 0;      // memory-bound rows
  double pct_roof = 0;      // 0: null or absent (a row without a dense rate)
  double tokens_per_s = 0;  // the block's rows; 0: absent
};

using Key = std::tuple<std::string, std::string, std::string, std::string>;
Key key_of(const Row& r) {
  return {r.op, r.name, r.dir, r.impl};
}

struct Report {
  std::string device, build;
  double sustain_ms = 0;
  bool complete = true;
  std::vector<Row> rows;
};

[[noreturn]] void bad(const std::string& file, const std::string& where, const std::string& what) {
  throw BenchFileError(file + ": " + where + ": " + what +
                       " (not a `moe-harness bench --json` report?)");
}

std::string shown(const nlohmann::json& v) {
  std::string s = v.dump();
  return s.size() > 40 ? s.substr(0, 37) + "..." : s;
}

std::string str_field(const nlohmann::json& row, const std::string& file, const std::string& at,
                      const char* f) {
  const auto it = row.find(f);
  if (it == row.end()) bad(file, at + "." + f, "missing");
  if (!it->is_string()) bad(file, at + "." + f, "expected a string, got " + shown(*it));
  return it->get<std::string>();
}

// A finite number, > 0 when `positive`, else >= 0; absent or null is an error unless `optional`
// (then 0).
double num_field(const nlohmann::json& row, const std::string& file, const std::string& at,
                 const char* f, bool positive, bool optional = false) {
  const auto it = row.find(f);
  if (it == row.end() || it->is_null()) {
    if (optional) return 0;
    bad(file, at + "." + f, it == row.end() ? "missing" : "null");
  }
  if (!it->is_number()) bad(file, at + "." + f, "expected a number, got " + shown(*it));
  const double v = it->get<double>();
  if (!std::isfinite(v) || v < 0 || (positive && v == 0)) {
    bad(file, at + "." + f,
        std::string("expected a ") + (positive ? "positive" : "non-negative") + " number, got " +
            shown(*it));
  }
  return v;
}

Report read_report(const nlohmann::json& j, const std::string& file) {
  if (!j.is_object()) bad(file, "top level", "expected an object, got " + shown(j));
  Report r;
  if (const auto d = j.find("device"); d != j.end() && d->is_string()) r.device = *d;
  if (const auto v = j.find("version"); v != j.end() && v->is_string()) {
    r.build = v->get<std::string>();
    if (const auto g = j.find("git"); g != j.end() && g->is_string()) {
      r.build += " (git " + g->get<std::string>() + ")";
    }
  }
  if (j.contains("sustain_ms")) r.sustain_ms = num_field(j, file, "top level", "sustain_ms", false);
  if (const auto c = j.find("complete"); c != j.end()) {
    if (!c->is_boolean()) bad(file, "complete", "expected true or false, got " + shown(*c));
    r.complete = c->get<bool>();
  }
  const auto res = j.find("results");
  if (res == j.end()) bad(file, "results", "missing");
  if (!res->is_array()) bad(file, "results", "expected an array, got " + shown(*res));
  std::map<Key, size_t> seen;
  for (size_t i = 0; i < res->size(); ++i) {
    const nlohmann::json& e = (*res)[i];
    const std::string at = "results[" + std::to_string(i) + "]";
    if (!e.is_object()) bad(file, at, "expected an object, got " + shown(e));
    Row row;
    row.op = str_field(e, file, at, "op");
    row.name = str_field(e, file, at, "name");
    row.dir = str_field(e, file, at, "dir");
    row.impl = str_field(e, file, at, "impl");
    row.kind = str_field(e, file, at, "kind");
    row.line = str_field(e, file, at, "case");
    if (row.kind != "memory" && row.kind != "gemm" && row.kind != "tokens") {
      bad(file, at + ".kind", "expected memory, gemm or tokens, got " + shown(e["kind"]));
    }
    const auto v = e.find("verified");
    if (v == e.end() || !v->is_boolean()) {
      bad(file, at + ".verified",
          v == e.end() ? "missing" : "expected true or false, got " + shown(*v));
    }
    row.verified = v->get<bool>();
    row.median_us = num_field(e, file, at, "median_us", true);
    row.min_us = num_field(e, file, at, "min_us", true);
    if (row.min_us > row.median_us) {
      bad(file, at + ".min_us", "above median_us (" + shown(e["median_us"]) + ")");
    }
    row.bytes = num_field(e, file, at, "bytes", false);
    row.flops = num_field(e, file, at, "flops", false);
    if (row.kind == "memory") {
      row.pct_copy = num_field(e, file, at, "pct_copy", true);
    } else {
      row.pct_roof = num_field(e, file, at, "pct_roof", true, true);
    }
    row.tokens_per_s = num_field(e, file, at, "tokens_per_s", true, true);  // the block's rows
    const auto [it, fresh] = seen.emplace(key_of(row), i);
    if (!fresh) {
      bad(file, at,
          "repeats results[" + std::to_string(it->second) + "] (" + row.op + " " + row.name + " " +
              row.dir + " " + row.impl + ")");
    }
    r.rows.push_back(std::move(row));
  }
  return r;
}

bool same_count(double a, double b) {
  return std::fabs(a - b) <= 1e-9 * std::max(std::fabs(a), std::fabs(b));
}

// The row's speed by a metric, higher faster: its % of copy or of roofline, or 1 / its time
// (median, or fastest sample for "min").
double speed(const Row& r, const std::string& metric) {
  return metric == "pct_copy"   ? r.pct_copy
         : metric == "pct_roof" ? r.pct_roof
         : metric == "min"      ? 1.0 / r.min_us
                                : 1.0 / r.median_us;
}
double shown_value(const Row& r, const std::string& metric) {
  return metric == "time" ? r.median_us : metric == "min" ? r.min_us : speed(r, metric);
}

// A comparison of row r, its verdict and why (the rest to fill).
RowComparison listed(const Row& r, RowVerdict v = RowVerdict::same, const std::string& why = "") {
  RowComparison m;
  m.op = r.op;
  m.name = r.name;
  m.dir = r.dir;
  m.impl = r.impl;
  m.kind = r.kind;
  m.verdict = v;
  m.why = why;
  return m;
}

// NEW's row against the same row of each baseline that has it (at least one).
RowComparison compare_row(const std::vector<const Row*>& olds, const Row& n,
                          const BenchCompareOptions& opt) {
  RowComparison c = listed(n);
  c.baselines = static_cast<int>(olds.size());
  if (!n.verified) {
    c.verdict = RowVerdict::unverified;
    c.why = "NEW's row failed verification: its time says nothing";
    return c;
  }
  for (const Row* o : olds) {
    if (o->line != n.line || o->kind != n.kind || !same_count(o->bytes, n.bytes) ||
        !same_count(o->flops, n.flops)) {
      c.verdict = RowVerdict::incomparable;
      c.why = o->line != n.line   ? "the case line changed"
              : o->kind != n.kind ? "the row's kind changed (" + o->kind + " -> " + n.kind + ")"
                                  : "its bytes or FLOPs changed";
      return c;
    }
  }
  // The metric: the run's yardstick where every report has it, else the time.
  bool roof = n.pct_roof > 0;
  for (const Row* o : olds) roof = roof && o->pct_roof > 0;
  c.metric = opt.by == CompareBy::min    ? "min"
             : opt.by == CompareBy::time ? "time"
             : n.kind == "memory"        ? "pct_copy"
             : roof                      ? "pct_roof"
                                         : "time";
  // Against the slowest baseline (and the fastest for FASTER): with several runs of OLD, a row
  // fails only where NEW is slower than all of them.
  const Row* slow = olds.front();
  const Row* fast = olds.front();
  for (const Row* o : olds) {
    if (speed(*o, c.metric) < speed(*slow, c.metric)) slow = o;
    if (speed(*o, c.metric) > speed(*fast, c.metric)) fast = o;
  }
  c.old_value = shown_value(*slow, c.metric);
  c.new_value = shown_value(n, c.metric);
  c.ratio = speed(*slow, c.metric) / speed(n, c.metric);  // NEW's normalised time / OLD's
  // By the fastest samples the ratio is already the best one: the noise guard adds nothing.
  c.best_ratio = c.metric == "min" ? c.ratio : c.ratio * n.min_us / n.median_us;
  c.old_spread = speed(*fast, c.metric) / speed(*slow, c.metric) - 1;
  if (c.ratio > 1 + opt.max_slowdown && c.best_ratio > 1) {
    c.verdict = RowVerdict::slower;
  } else if (speed(*fast, c.metric) / speed(n, c.metric) < 1 - opt.max_slowdown) {
    c.verdict = RowVerdict::faster;
  }
  return c;
}

// A metric's value as the table shows it.
std::string value(const std::string& metric, double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf,
                metric == "time" || metric == "min" ? "%.1fus"
                : metric == "ratio"                 ? "%.3f"
                : metric == "ms"                    ? "%.0f"
                : metric == "spread"                ? "%7.1f%%"
                                                    : "%.1f%%",
                v);
  return buf;
}

// What rows are compared by, as --by names it.
const char* by_name(const BenchCompareOptions& o) {
  return o.by == CompareBy::min ? "min" : o.by == CompareBy::time ? "time" : "yardstick";
}

}  // namespace

const char* verdict_name(RowVerdict v) {
  switch (v) {
    case RowVerdict::same:
      return "same";
    case RowVerdict::slower:
      return "SLOWER";
    case RowVerdict::faster:
      return "faster";
    case RowVerdict::missing:
      return "MISSING";
    case RowVerdict::added:
      return "added";
    case RowVerdict::unverified:
      return "UNVERIFIED";
    case RowVerdict::incomparable:
      return "INCOMPARABLE";
  }
  return "?";
}

bool BenchComparison::failed(const BenchCompareOptions& o) const {
  for (const RowComparison& r : rows) {
    switch (r.verdict) {
      case RowVerdict::slower:
      case RowVerdict::unverified:
      case RowVerdict::incomparable:
        return true;
      case RowVerdict::missing:
        if (!o.allow_missing) return true;
        break;
      default:
        break;
    }
  }
  return false;
}

BenchComparison compare_bench(const std::vector<NamedReport>& olds, const NamedReport& neu,
                              const BenchCompareOptions& o) {
  if (!(o.max_slowdown >= 0) || !(o.max_slowdown < 10)) {
    throw std::invalid_argument("--max-slowdown: " + std::to_string(100 * o.max_slowdown) +
                                "% outside [0, 1000)");
  }
  if (olds.empty()) throw std::invalid_argument("bench-compare: no baseline report");
  std::vector<Report> as;
  for (const NamedReport& r : olds) as.push_back(read_report(r.json, r.name));
  const Report b = read_report(neu.json, neu.name);
  BenchComparison c;
  c.baselines = static_cast<int>(as.size());
  c.old_device = as.front().device;
  c.new_device = b.device;
  c.old_build = as.front().build;
  c.new_build = b.build;
  c.old_complete = true;
  for (const Report& a : as) c.old_complete = c.old_complete && a.complete;
  c.new_complete = b.complete;
  std::map<Key, const Row*> in_new;
  const auto kept = [&o](const Row& r) {
    const auto in = [](const std::vector<std::string>& v, const std::string& x) {
      return v.empty() || std::find(v.begin(), v.end(), x) != v.end();
    };
    return in(o.ops, r.op) && in(o.impls, r.impl);
  };
  for (const Row& r : b.rows) {
    if (kept(r)) in_new[key_of(r)] = &r;
  }
  // Every key of the baselines in the order of first appearance, with its rows.
  std::vector<Key> order;
  std::map<Key, std::vector<const Row*>> in_old;
  for (const Report& a : as) {
    for (const Row& r : a.rows) {
      if (!kept(r)) continue;
      auto& v = in_old[key_of(r)];
      if (v.empty()) order.push_back(key_of(r));
      v.push_back(&r);
    }
  }
  for (const Key& k : order) {
    const std::vector<const Row*>& rows = in_old[k];
    const auto it = in_new.find(k);
    if (it == in_new.end()) {
      c.rows.push_back(listed(*rows.front(), RowVerdict::missing,
                              b.complete ? "not in NEW" : "not in NEW, a run cut short"));
    } else {
      c.rows.push_back(compare_row(rows, *it->second, o));
    }
  }
  for (const Row& r : b.rows) {
    if (!kept(r) || in_old.count(key_of(r))) continue;
    c.rows.push_back(
        r.verified ? listed(r, RowVerdict::added, "only in NEW")
                   : listed(r, RowVerdict::unverified, "only in NEW, and it failed verification"));
  }
  for (size_t i = 0; i < as.size(); ++i) {
    if (!as[i].complete)
      c.notes.push_back(olds[i].name + " is from a run cut short (complete: false)");
  }
  if (!b.complete) c.notes.push_back(neu.name + " is from a run cut short (complete: false)");
  for (size_t i = 0; i < as.size(); ++i) {
    const Report& a = as[i];
    if (a.sustain_ms != b.sustain_ms) {
      c.notes.push_back(olds[i].name + " and " + neu.name +
                        " warmed up differently (--sustain-ms " + value("ms", a.sustain_ms) +
                        " and " + value("ms", b.sustain_ms) +
                        "): burst and sustained clocks differ (the DeepSeek-like grouped forward "
                        "read 80-83% of its roofline burst, 71-75% sustained, on an H100)");
    }
    if (a.device != b.device) {
      c.notes.push_back(
          olds[i].name + " and " + neu.name + " are from different devices ('" + a.device + "', '" +
          b.device + "')" +
          (o.by != CompareBy::yardstick
               ? ": --by " + std::string(by_name(o)) + " compares their times as they are"
               : std::string(": each row is compared against its own run's yardstick")));
    }
  }
  // A filter that names nothing in the reports, or a comparison of no rows, would pass while
  // gating nothing: both are usage errors.
  const auto named = [&](const std::vector<std::string>& want, const char* flag, bool by_op) {
    for (const std::string& w : want) {
      const auto has = [&](const Report& rep) {
        for (const Row& r : rep.rows) {
          if ((by_op ? r.op : r.impl) == w) return true;
        }
        return false;
      };
      bool found = has(b);
      for (const Report& a : as) found = found || has(a);
      if (!found) {
        throw std::invalid_argument(std::string(flag) + " " + w + ": no row of the reports has it");
      }
    }
  };
  named(o.ops, "--op", true);
  named(o.impls, "--impl", false);
  if (c.rows.empty()) {
    throw std::invalid_argument(
        "no rows to compare" +
        std::string(o.ops.empty() && o.impls.empty() ? "" : " under the --op / --impl filters"));
  }
  return c;
}

BenchComparison compare_bench(const nlohmann::json& old_report, const std::string& old_name,
                              const nlohmann::json& new_report, const std::string& new_name,
                              const BenchCompareOptions& o) {
  return compare_bench({NamedReport{old_report, old_name}}, NamedReport{new_report, new_name}, o);
}

nlohmann::json read_bench_report(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw BenchFileError(path + ": cannot be read");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    throw BenchFileError(path + ": not JSON: " + e.what());
  }
}

std::string format_comparison(const BenchComparison& c, const BenchCompareOptions& o) {
  std::ostringstream out;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "max slowdown %.1f%%, %s; ratio = NEW's time / %s%s (> 1: slower)%s\n",
                100 * o.max_slowdown,
                o.by == CompareBy::min    ? "by the fastest samples"
                : o.by == CompareBy::time ? "by time"
                                          : "against each run's yardstick",
                c.baselines > 1 ? "the slowest OLD run's" : "OLD's",
                o.by != CompareBy::yardstick ? "" : ", each over its run's yardstick",
                c.baselines > 1 ? "; spread: the OLD runs' fastest over their slowest" : "");
  out << buf;
  const bool spread = c.baselines > 1;  // a column for the baselines' spread
  std::snprintf(buf, sizeof buf, "%-18s %-18s %-7s %-10s %-8s %9s %9s %7s%s  %s\n", "op", "case",
                "dir", "impl", "metric", spread ? "slowest" : "old", "new", "ratio",
                spread ? "   spread" : "", "verdict");
  out << buf;
  int count[7] = {};
  for (const RowComparison& r : c.rows) {
    ++count[static_cast<int>(r.verdict)];
    const bool cmp = r.ratio > 0;
    const std::string sp = !spread ? ""
                           : cmp   ? " " + value("spread", 100 * r.old_spread)
                                   : std::string(8, ' ');
    std::snprintf(buf, sizeof buf, "%-18s %-18s %-7s %-10s %-8s %9s %9s %7s%s  %s\n", r.op.c_str(),
                  r.name.c_str(), r.dir.c_str(), r.impl.c_str(), cmp ? r.metric.c_str() : "-",
                  cmp ? value(r.metric, r.old_value).c_str() : "-",
                  cmp ? value(r.metric, r.new_value).c_str() : "-",
                  cmp ? value("ratio", r.ratio).c_str() : "-", sp.c_str(), verdict_name(r.verdict));
    out << buf;
  }
  for (const RowComparison& r : c.rows) {
    if (r.verdict == RowVerdict::slower) {
      const std::string against =
          r.baselines > 1 ? "the slowest of " + std::to_string(r.baselines) + " OLD runs" : "OLD";
      const std::string how = r.metric == "time" ? ""
                              : r.metric == "min"
                                  ? " at the fastest samples"
                                  : " against its run's yardstick (" + r.metric + ")";
      char best[96] = "";  // the noise guard's figure; by the fastest samples there is none
      if (r.metric != "min") {
        std::snprintf(best, sizeof best, "; NEW's fastest sample %.1f%% more than its median",
                      100 * (r.best_ratio - 1));
      }
      std::snprintf(buf, sizeof buf, "  SLOWER %s %s %s (%s): %.1f%% more time than %s%s%s\n",
                    r.op.c_str(), r.name.c_str(), r.dir.c_str(), r.impl.c_str(),
                    100 * (r.ratio - 1), against.c_str(), how.c_str(), best);
      out << buf;
    } else if (!r.why.empty() && r.verdict != RowVerdict::added) {
      out << "  " << verdict_name(r.verdict) << " " << r.op << " " << r.name << " " << r.dir << " ("
          << r.impl << "): " << r.why << "\n";
    }
  }
  for (const std::string& n : c.notes) out << "  note: " << n << "\n";
  std::snprintf(buf, sizeof buf,
                "bench-compare: %zu rows: %d slower, %d faster, %d same; %d missing%s, %d added, "
                "%d unverified, %d incomparable: %s\n",
                c.rows.size(), count[1], count[2], count[0], count[3],
                o.allow_missing ? " (allowed)" : "", count[4], count[5], count[6],
                c.failed(o) ? "FAIL" : "ok");
  out << buf;
  return out.str();
}

nlohmann::json comparison_json(const BenchComparison& c, const BenchCompareOptions& o) {
  nlohmann::json j;
  j["old_device"] = c.old_device;
  j["new_device"] = c.new_device;
  j["old_build"] = c.old_build;
  j["new_build"] = c.new_build;
  j["old_complete"] = c.old_complete;
  j["new_complete"] = c.new_complete;
  j["baselines"] = c.baselines;
  j["max_slowdown"] = o.max_slowdown;
  j["by_time"] = o.by == CompareBy::time;
  j["by"] = by_name(o);
  j["allow_missing"] = o.allow_missing;
  j["failed"] = c.failed(o);
  j["notes"] = c.notes;
  j["rows"] = nlohmann::json::array();
  for (const RowComparison& r : c.rows) {
    nlohmann::json e = {{"op", r.op},     {"name", r.name}, {"dir", r.dir},
                        {"impl", r.impl}, {"kind", r.kind}, {"verdict", verdict_name(r.verdict)}};
    if (r.ratio > 0) {
      e["metric"] = r.metric;
      e["old"] = r.old_value;
      e["new"] = r.new_value;
      e["ratio"] = r.ratio;
      e["best_ratio"] = r.best_ratio;
      e["baselines"] = r.baselines;
      e["old_spread"] = r.old_spread;
    }
    if (!r.why.empty()) e["why"] = r.why;
    j["rows"].push_back(e);
  }
  return j;
}

// ---- bench-targets -------------------------------------------------------------------------

namespace {

[[noreturn]] void bad_target(const std::string& file, const std::string& where,
                             const std::string& what) {
  throw BenchFileError(file + ": " + where + ": " + what + " (see `moe-harness bench-targets -h`)");
}

std::string target_str(const nlohmann::json& e, const std::string& file, const std::string& at,
                       const char* f, bool optional) {
  const auto it = e.find(f);
  if (it == e.end()) {
    if (optional) return "";
    bad_target(file, at + "." + f, "missing");
  }
  if (!it->is_string() || it->get<std::string>().empty()) {
    bad_target(file, at + "." + f, "expected a non-empty string, got " + shown(*it));
  }
  return it->get<std::string>();
}

}  // namespace

const char* target_verdict_name(TargetVerdict v) {
  switch (v) {
    case TargetVerdict::met:
      return "MET";
    case TargetVerdict::missed:
      return "MISSED";
    case TargetVerdict::missing:
      return "MISSING";
    case TargetVerdict::unverified:
      return "UNVERIFIED";
    case TargetVerdict::no_value:
      return "NO VALUE";
  }
  return "?";
}

BenchTargets read_bench_targets(const nlohmann::json& j, const std::string& file) {
  if (!j.is_object()) bad_target(file, "top level", "expected an object, got " + shown(j));
  BenchTargets t;
  t.title = target_str(j, file, "top level", "title", true);
  t.device = target_str(j, file, "top level", "device", true);
  const auto list = j.find("targets");
  if (list == j.end()) bad_target(file, "targets", "missing");
  if (!list->is_array() || list->empty()) {
    bad_target(file, "targets", "expected a non-empty array, got " + shown(*list));
  }
  std::map<std::tuple<std::string, std::string, std::string, std::string, std::string>, size_t>
      seen;
  for (size_t i = 0; i < list->size(); ++i) {
    const nlohmann::json& e = (*list)[i];
    const std::string at = "targets[" + std::to_string(i) + "]";
    if (!e.is_object()) bad_target(file, at, "expected an object, got " + shown(e));
    BenchTarget g;
    g.op = target_str(e, file, at, "op", false);
    g.name = target_str(e, file, at, "name", false);
    g.dir = target_str(e, file, at, "dir", false);
    if (const std::string impl = target_str(e, file, at, "impl", true); !impl.empty()) {
      g.impl = impl;
    }
    g.metric = target_str(e, file, at, "metric", false);
    if (g.metric != "pct_copy" && g.metric != "pct_roof" && g.metric != "tokens_per_s") {
      bad_target(file, at + ".metric",
                 "expected pct_copy, pct_roof or tokens_per_s, got " + shown(e["metric"]));
    }
    const auto m = e.find("min");
    if (m == e.end()) bad_target(file, at + ".min", "missing");
    if (!m->is_number() || !std::isfinite(m->get<double>()) || m->get<double>() <= 0) {
      bad_target(file, at + ".min", "expected a positive number, got " + shown(*m));
    }
    g.min = m->get<double>();
    g.note = target_str(e, file, at, "note", true);
    const auto [it, fresh] = seen.emplace(std::tuple(g.op, g.name, g.dir, g.impl, g.metric), i);
    if (!fresh) {
      bad_target(file, at,
                 "repeats targets[" + std::to_string(it->second) + "] (" + g.op + " " + g.name +
                     " " + g.dir + " " + g.impl + " " + g.metric + ")");
    }
    t.targets.push_back(std::move(g));
  }
  return t;
}

bool TargetsCheck::failed() const {
  return std::any_of(results.begin(), results.end(),
                     [](const TargetResult& r) { return r.verdict != TargetVerdict::met; });
}

TargetsCheck check_targets(const BenchTargets& t, const nlohmann::json& report,
                           const std::string& report_name) {
  const Report r = read_report(report, report_name);
  TargetsCheck c;
  c.device = r.device;
  c.build = r.build;
  c.device_matches = t.device.empty() || r.device.find(t.device) != std::string::npos;
  std::map<Key, const Row*> rows;
  for (const Row& row : r.rows) rows[key_of(row)] = &row;
  for (const BenchTarget& g : t.targets) {
    TargetResult res;
    res.target = g;
    const auto it = rows.find(Key{g.op, g.name, g.dir, g.impl});
    if (it == rows.end()) {
      res.verdict = TargetVerdict::missing;
    } else if (!it->second->verified) {
      res.verdict = TargetVerdict::unverified;
    } else {
      const Row& row = *it->second;
      res.value = g.metric == "pct_copy"   ? row.pct_copy
                  : g.metric == "pct_roof" ? row.pct_roof
                                           : row.tokens_per_s;
      res.verdict = res.value <= 0       ? TargetVerdict::no_value
                    : res.value >= g.min ? TargetVerdict::met
                                         : TargetVerdict::missed;
    }
    c.results.push_back(std::move(res));
  }
  return c;
}

namespace {

std::string metric_value(const std::string& metric, double v) {
  char buf[64];
  if (metric == "tokens_per_s") {
    std::snprintf(buf, sizeof buf, "%.0f tokens/s", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f%% of %s", v, metric == "pct_copy" ? "copy" : "roofline");
  }
  return buf;
}

}  // namespace

std::string format_targets(const BenchTargets& t, const TargetsCheck& c) {
  std::ostringstream out;
  if (!t.title.empty()) out << t.title << "\n";
  int count[5] = {0, 0, 0, 0, 0};
  for (const TargetResult& r : c.results) {
    const BenchTarget& g = r.target;
    ++count[static_cast<int>(r.verdict)];
    out << "  " << target_verdict_name(r.verdict) << " " << g.op << " " << g.name << " " << g.dir
        << " (" << g.impl << "): ";
    switch (r.verdict) {
      case TargetVerdict::met:
      case TargetVerdict::missed: {
        char buf[96];
        std::snprintf(buf, sizeof buf, " (%.1f%% of the target)", 100 * r.value / g.min);
        out << metric_value(g.metric, r.value) << (r.verdict == TargetVerdict::met ? " >= " : " < ")
            << metric_value(g.metric, g.min) << buf;
        break;
      }
      case TargetVerdict::missing:
        out << "no such row in the report";
        break;
      case TargetVerdict::unverified:
        out << "the row failed verification";
        break;
      case TargetVerdict::no_value:
        out << "the row has no " << g.metric;
        break;
    }
    if (!g.note.empty()) out << " [" << g.note << "]";
    out << "\n";
  }
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "bench-targets: %zu targets: %d met, %d missed, %d missing, %d unverified, %d "
                "without a value: %s\n",
                c.results.size(), count[0], count[1], count[2], count[3], count[4],
                c.failed() ? "FAIL" : "ok");
  out << buf;
  return out.str();
}

nlohmann::json targets_json(const BenchTargets& t, const TargetsCheck& c) {
  nlohmann::json j = {{"title", t.title},     {"device", c.device},
                      {"build", c.build},     {"targets_device", t.device},
                      {"failed", c.failed()}, {"targets", nlohmann::json::array()}};
  for (const TargetResult& r : c.results) {
    const BenchTarget& g = r.target;
    nlohmann::json e = {{"op", g.op},
                        {"name", g.name},
                        {"dir", g.dir},
                        {"impl", g.impl},
                        {"metric", g.metric},
                        {"min", g.min},
                        {"verdict", target_verdict_name(r.verdict)}};
    e["value"] = r.value > 0 ? nlohmann::json(r.value) : nlohmann::json(nullptr);
    if (!g.note.empty()) e["note"] = g.note;
    j["targets"].push_back(e);
  }
  return j;
}

}  // namespace moe::tools
