// What `moe-harness check` prints and writes: the per-op table, the per-case failure report with
// its replay line, and the JSON and JUnit XML reports of a whole run.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

#include "moe_harness/impl.h"

namespace moe::tools {

struct Run {
  std::string impl, ties;
  uint64_t seed = 0;
  int cases_per_op = 0;
  int runs = 2;               // calls of the implementation per case (--runs)
  double case_timeout_s = 0;  // --case-timeout (0: none)
  std::string stopped;        // why the run ended early (a case timeout); empty: it ran to the end
  // Set in the reports written as an op starts (tools/check_cmd.cpp, LiveReports): the op, and
  // what it means if the report is still there (the process ended during the op).
  std::string interrupted_op, interrupted;
  std::vector<OpResult> ops;
};

void print_table_header(std::ostream& out);
void print_table_row(std::ostream& out, const OpResult& o, const std::string& disposition);
// A case: one PASS/NOT SUPPORTED line, or for a failure its report, notes and replay line.
void print_case(std::ostream& out, const CaseResult& r, bool details);
void print_summary(std::ostream& out, const Run& run);

std::string json_report(const Run& run);
std::string junit_report(const Run& run);
// Writes the reports whose path is non-empty; false (and a message on stderr) if one cannot be
// written.
bool write_reports(const Run& run, const std::string& json_path, const std::string& junit_path);

}  // namespace moe::tools
