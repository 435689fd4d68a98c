#include "tools/reports.h"

#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace moe::tools {

namespace {

std::string fixed(double v, int digits) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

}  // namespace

void print_table_header(std::ostream& out) {
  out << std::left << std::setw(34) << "op" << std::right << std::setw(6) << "cases" << std::setw(7)
      << "passed" << std::setw(7) << "failed" << std::setw(7) << "n/s" << std::setw(11)
      << "worst %tol" << std::setw(9) << "time s"
      << "  disposition" << std::endl;
}

void print_table_row(std::ostream& out, const OpResult& o, const std::string& disposition) {
  out << std::left << std::setw(34) << o.op << std::right << std::setw(6) << o.cases.size()
      << std::setw(7) << o.passed << std::setw(7) << o.failed << std::setw(7) << o.not_supported
      << std::setw(11) << fixed(o.worst_pct, 1) << std::setw(9) << fixed(o.seconds, 2) << "  "
      << disposition << std::endl;
}

void print_case(std::ostream& out, const CaseResult& r, bool details) {
  if (r.verdict == Verdict::passed) {
    out << "PASS " << r.c.line() << " (worst " << fixed(r.worst_pct, 1) << "% of tolerance)\n";
  } else if (r.verdict == Verdict::not_supported) {
    out << "NOT SUPPORTED " << r.c.line() << ": " << r.report << "\n";
  } else {
    out << "FAIL " << r.c.line() << "\n";
    if (details) {
      if (!r.original.empty()) out << "  shrunk from: " << r.original << "\n";
      out << r.report;
    }
  }
  if (details || r.verdict == Verdict::failed) {
    for (auto& n : r.notes) out << "  note: " << n << "\n";
  }
  if (r.verdict == Verdict::failed) out << "  replay: " << r.replay << "\n";
  out << std::flush;
}

void print_summary(std::ostream& out, const Run& run) {
  int cases = 0, passed = 0, failed = 0, ns = 0;
  std::vector<std::string> edges;
  for (auto& o : run.ops) {
    cases += static_cast<int>(o.cases.size());
    passed += o.passed;
    failed += o.failed;
    ns += o.not_supported;
  }
  out << "\n"
      << run.impl << ": " << cases << " cases, " << passed << " passed, " << failed << " failed, "
      << ns << " not supported\n";
  for (auto& o : run.ops) {
    if (o.edge_classes.empty()) continue;
    out << "edges covered, " << o.op << ":";
    for (auto& e : o.edge_classes) out << " " << e << ";";
    out << "\n";
  }
  out << std::flush;
}

std::string json_report(const Run& run) {
  nlohmann::json j;
  j["tool"] = "moe-harness check";
  j["version"] = MOE_VERSION;
  j["git"] = MOE_GIT_REV;
  j["impl"] = run.impl;
  j["ties"] = run.ties;
  j["seed"] = run.seed;
  j["random_cases_per_op"] = run.cases_per_op;
  j["runs_per_case"] = run.runs;
  j["case_timeout_s"] = run.case_timeout_s;
  if (!run.stopped.empty()) j["stopped"] = run.stopped;
  if (!run.interrupted_op.empty())
    j["interrupted"] = {{"op", run.interrupted_op}, {"message", run.interrupted}};
  j["ops"] = nlohmann::json::array();
  for (auto& o : run.ops) {
    nlohmann::json oj{{"op", o.op},
                      {"impl", o.impl},
                      {"passed", o.passed},
                      {"failed", o.failed},
                      {"not_supported", o.not_supported},
                      {"worst_pct_of_tolerance", o.worst_pct},
                      {"seconds", o.seconds},
                      {"disposition", o.disposition()},
                      {"aborted", o.aborted},
                      {"not_run", o.not_run},
                      {"edge_classes", o.edge_classes},
                      {"cases", nlohmann::json::array()}};
    for (auto& r : o.cases) {
      nlohmann::json cj{{"case", r.c.line()},
                        {"verdict", std::string(verdict_name(r.verdict))},
                        {"named", r.named},
                        {"worst_pct_of_tolerance", r.worst_pct},
                        {"seconds", r.seconds}};
      if (!r.notes.empty()) cj["notes"] = r.notes;
      if (r.verdict != Verdict::passed) cj["report"] = r.report;
      if (r.verdict == Verdict::failed) {
        cj["replay"] = r.replay;
        if (!r.original.empty()) cj["shrunk_from"] = r.original;
        if (r.context_lost) cj["context_lost"] = true;
      }
      oj["cases"].push_back(std::move(cj));
    }
    j["ops"].push_back(std::move(oj));
  }
  return j.dump(2) + "\n";
}

std::string junit_report(const Run& run) {
  std::ostringstream x;
  int tests = 0, failures = 0, skipped = 0;
  double seconds = 0;
  for (auto& o : run.ops) {
    tests += static_cast<int>(o.cases.size());
    failures += o.failed;
    skipped += o.not_supported;
    seconds += o.seconds;
  }
  if (!run.interrupted_op.empty()) {
    ++tests;
    ++failures;
  }
  x << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  x << "<testsuites name=\"moe-harness check --impl " << xml_escape(run.impl) << "\" tests=\""
    << tests << "\" failures=\"" << failures << "\" skipped=\"" << skipped << "\" time=\""
    << fixed(seconds, 3) << "\">\n";
  for (auto& o : run.ops) {
    x << "  <testsuite name=\"" << xml_escape(o.op + " (" + o.impl + ")") << "\" tests=\""
      << o.cases.size() << "\" failures=\"" << o.failed << "\" skipped=\"" << o.not_supported
      << "\" time=\"" << fixed(o.seconds, 3) << "\">\n";
    for (auto& r : o.cases) {
      x << "    <testcase classname=\"" << xml_escape(o.op) << "\" name=\""
        << xml_escape(r.c.line()) << "\" time=\"" << fixed(r.seconds, 3) << "\"";
      if (r.verdict == Verdict::passed) {
        x << "/>\n";
        continue;
      }
      x << ">\n";
      if (r.verdict == Verdict::not_supported) {
        x << "      <skipped message=\"" << xml_escape(r.report) << "\"/>\n";
      } else {
        std::string body = r.report;
        if (!r.original.empty()) body = "shrunk from: " + r.original + "\n" + body;
        for (auto& n : r.notes) body += "note: " + n + "\n";
        body += "replay: " + r.replay + "\n";
        const std::string first = r.report.substr(0, r.report.find('\n'));
        x << "      <failure message=\"" << xml_escape(first) << "\">" << xml_escape(body)
          << "</failure>\n";
      }
      x << "    </testcase>\n";
    }
    x << "  </testsuite>\n";
  }
  if (!run.interrupted_op.empty()) {
    x << "  <testsuite name=\"" << xml_escape(run.interrupted_op + " (" + run.impl + ")")
      << "\" tests=\"1\" failures=\"1\" skipped=\"0\" time=\"0.000\">\n";
    x << "    <testcase classname=\"" << xml_escape(run.interrupted_op)
      << "\" name=\"(the process ended during this op)\" time=\"0.000\">\n";
    x << "      <failure message=\"" << xml_escape(run.interrupted) << "\">"
      << xml_escape(run.interrupted) << "</failure>\n";
    x << "    </testcase>\n  </testsuite>\n";
  }
  x << "</testsuites>\n";
  return x.str();
}

bool write_reports(const Run& run, const std::string& json_path, const std::string& junit_path) {
  auto write = [](const std::string& path, const std::string& text, const char* what) {
    std::ofstream f(path);
    f << text;
    f.close();
    if (!f) {
      std::fprintf(stderr, "--%s: cannot write '%s'\n", what, path.c_str());
      return false;
    }
    return true;
  };
  bool ok = true;
  if (!json_path.empty()) ok &= write(json_path, json_report(run), "json");
  if (!junit_path.empty()) ok &= write(junit_path, junit_report(run), "junit");
  return ok;
}

}  // namespace moe::tools
