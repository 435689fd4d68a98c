#include "tools/timeline.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

namespace moe::tools {

namespace {

double us_between(uint64_t from_ns, uint64_t to_ns) {
  return to_ns > from_ns ? static_cast<double>(to_ns - from_ns) * 1e-3 : 0.0;
}

bool is_kernel(const gpu::TimelineEvent& e) {
  return e.kind == "kernel";
}

}  // namespace

std::string short_kernel_name(const std::string& demangled) {
  std::string s = demangled;
  for (const std::string anon : {"(anonymous namespace)", "{anonymous}"}) {
    for (size_t p; (p = s.find(anon)) != std::string::npos;) s.replace(p, anon.size(), "anon");
  }
  // Cut at the first '(' or '<' outside template arguments: the parameters, or the template
  // arguments of the function itself (scopes before it are namespaces here).
  int depth = 0;
  size_t end = s.size();
  for (size_t i = 0; i < s.size() && end == s.size(); ++i) {
    if (s[i] == '<') {
      if (depth == 0) end = i;
      ++depth;
    } else if (s[i] == '>') {
      --depth;
    } else if (s[i] == '(' && depth == 0) {
      end = i;
    }
  }
  s.resize(end);
  if (const size_t sp = s.rfind(' '); sp != std::string::npos) s.erase(0, sp + 1);
  if (const size_t sc = s.rfind("::"); sc != std::string::npos) s.erase(0, sc + 2);
  return s.empty() ? demangled : s;
}

namespace {

std::string where(const gpu::TimelineEvent& e) {
  return (is_kernel(e) ? short_kernel_name(e.name) : e.name) + " [" +
         (e.stage.empty() ? "no stage" : e.stage) + "]";
}

// Length of the union of intervals given in start order, in us; each hole between them counted
// in *gaps, the largest kept in *largest and the 3 longest in *longest (any may be null).
double union_us(const std::vector<const gpu::TimelineEvent*>& ev, int* gaps, double* largest,
                std::vector<TimelineGap>* longest) {
  if (ev.empty()) return 0;
  uint64_t cover_end = ev.front()->start_ns, busy_ns = 0;
  const gpu::TimelineEvent* last = ev.front();  // the event that ends at cover_end
  for (const auto* e : ev) {
    const uint64_t b = std::max(e->start_ns, cover_end), f = std::max(e->end_ns, e->start_ns);
    if (e->start_ns > cover_end) {
      const double us = us_between(cover_end, e->start_ns);
      if (gaps) ++*gaps;
      if (largest) *largest = std::max(*largest, us);
      if (longest) {
        longest->push_back({us, where(*last), where(*e)});
        std::stable_sort(longest->begin(), longest->end(),
                         [](const TimelineGap& x, const TimelineGap& y) { return x.us > y.us; });
        if (longest->size() > 3) longest->pop_back();
      }
    }
    if (f > b) busy_ns += f - b;
    if (f > cover_end) {
      cover_end = f;
      last = e;
    }
  }
  return static_cast<double>(busy_ns) * 1e-3;
}

}  // namespace

TimelineSummary summarize_timeline(const std::vector<gpu::TimelineEvent>& events) {
  TimelineSummary s;
  if (events.empty()) return s;
  std::vector<const gpu::TimelineEvent*> ev;
  for (const auto& e : events) ev.push_back(&e);
  std::stable_sort(ev.begin(), ev.end(),
                   [](const auto* a, const auto* b) { return a->start_ns < b->start_ns; });
  const uint64_t t0 = ev.front()->start_ns;
  uint64_t t_end = t0;
  for (const auto* e : ev) t_end = std::max(t_end, e->end_ns);
  s.events = static_cast<int>(ev.size());
  s.span_us = us_between(t0, t_end);

  // Busy time: the union of the intervals, swept in start order; each hole is an idle gap.
  s.busy_us = union_us(ev, &s.gaps, &s.largest_gap_us, &s.largest_gaps);
  s.idle_us = std::max(0.0, s.span_us - s.busy_us);

  std::map<std::string, size_t> index;  // stage -> position in s.stages
  std::vector<std::map<std::string, double>> per_kernel;
  std::vector<std::vector<const gpu::TimelineEvent*>> of_stage;  // each stage's, in start order
  for (const auto* e : ev) {
    auto [it, added] = index.emplace(e->stage, s.stages.size());
    if (added) {
      StageTime st;
      st.stage = e->stage;
      st.first_us = us_between(t0, e->start_ns);
      s.stages.push_back(st);
      per_kernel.emplace_back();
      of_stage.emplace_back();
    }
    of_stage[it->second].push_back(e);
    StageTime& st = s.stages[it->second];
    const double d = us_between(e->start_ns, e->end_ns);
    st.busy_us += d;
    st.last_us = std::max(st.last_us, us_between(t0, e->end_ns));
    if (is_kernel(*e)) {
      ++st.kernels;
      ++s.kernels;
      per_kernel[it->second][short_kernel_name(e->name)] += d;
    } else {
      ++st.copies;
      ++s.copies;
      per_kernel[it->second][e->name] += d;
    }
  }
  for (size_t i = 0; i < s.stages.size(); ++i) {
    s.stages[i].active_us = union_us(of_stage[i], nullptr, nullptr, nullptr);
    std::vector<std::pair<std::string, double>> v(per_kernel[i].begin(), per_kernel[i].end());
    std::stable_sort(v.begin(), v.end(),
                     [](const auto& a, const auto& b) { return a.second > b.second; });
    if (v.size() > 3) v.resize(3);
    s.stages[i].top = std::move(v);
  }
  return s;
}

nlohmann::json timeline_json(const TimelineSummary& s) {
  nlohmann::json j = {{"events", s.events},   {"kernels", s.kernels},
                      {"copies", s.copies},   {"span_us", s.span_us},
                      {"busy_us", s.busy_us}, {"idle_us", s.idle_us},
                      {"gaps", s.gaps},       {"largest_gap_us", s.largest_gap_us}};
  j["largest_gaps"] = nlohmann::json::array();
  for (const TimelineGap& g : s.largest_gaps) {
    j["largest_gaps"].push_back({{"us", g.us}, {"after", g.after}, {"before", g.before}});
  }
  j["stages"] = nlohmann::json::array();
  for (const StageTime& st : s.stages) {
    nlohmann::json top = nlohmann::json::array();
    for (const auto& [name, us] : st.top) top.push_back({{"name", name}, {"us", us}});
    j["stages"].push_back({{"stage", st.stage},
                           {"kernels", st.kernels},
                           {"copies", st.copies},
                           {"busy_us", st.busy_us},
                           {"active_us", st.active_us},
                           {"first_us", st.first_us},
                           {"last_us", st.last_us},
                           {"top", top}});
  }
  return j;
}

std::string timeline_text(const std::string& label, const TimelineSummary& s, double median_us) {
  std::string out;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "  timeline %s: one recorded call, %.1f us from its first GPU event to its last "
                "(row median %.1f), busy %.1f, idle %.1f in %d gaps (largest %.1f); %d kernels, "
                "%d copies or memsets\n",
                label.c_str(), s.span_us, median_us, s.busy_us, s.idle_us, s.gaps, s.largest_gap_us,
                s.kernels, s.copies);
  out += buf;
  for (const StageTime& st : s.stages) {
    std::string top;
    for (const auto& [name, us] : st.top) {
      std::snprintf(buf, sizeof buf, "%s%s %.1f", top.empty() ? "" : ", ", name.c_str(), us);
      top += buf;
    }
    std::snprintf(buf, sizeof buf,
                  "    stage %-24s active %9.1f us %5.1f%% of the span, kernels and copies %9.1f "
                  "us: %4d kernels %3d copies (%s)\n",
                  st.stage.empty() ? "(none)" : st.stage.c_str(), st.active_us,
                  s.span_us > 0 ? 100.0 * st.active_us / s.span_us : 0.0, st.busy_us, st.kernels,
                  st.copies, top.c_str());
    out += buf;
  }
  if (!s.largest_gaps.empty()) {
    out += "    longest idle gaps:";
    for (const TimelineGap& g : s.largest_gaps) {
      std::snprintf(buf, sizeof buf, " %.1f us after %s before %s;", g.us, g.after.c_str(),
                    g.before.c_str());
      out += buf;
    }
    out += "\n";
  }
  return out;
}

void append_chrome_trace(nlohmann::json& trace_events, int pid, const std::string& label,
                         const std::vector<gpu::TimelineEvent>& events) {
  trace_events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", label}}}});
  if (events.empty()) return;
  uint64_t t0 = events.front().start_ns;
  std::set<uint32_t> streams;
  for (const auto& e : events) {
    t0 = std::min(t0, e.start_ns);
    streams.insert(e.stream);
  }
  for (uint32_t st : streams) {
    trace_events.push_back({{"name", "thread_name"},
                            {"ph", "M"},
                            {"pid", pid},
                            {"tid", st},
                            {"args", {{"name", "stream " + std::to_string(st)}}}});
  }
  for (const auto& e : events) {
    nlohmann::json args = {{"stage", e.stage}, {"device", e.device}};
    if (is_kernel(e)) {
      args["kernel"] = e.name;
      args["grid"] = {e.grid[0], e.grid[1], e.grid[2]};
      args["block"] = {e.block[0], e.block[1], e.block[2]};
      args["registers"] = e.registers;
      args["shared_bytes"] = e.shared_bytes;
    } else {
      args["bytes"] = e.bytes;
    }
    trace_events.push_back({{"name", is_kernel(e) ? short_kernel_name(e.name) : e.name},
                            {"cat", e.stage.empty() ? e.kind : e.stage},
                            {"ph", "X"},
                            {"pid", pid},
                            {"tid", e.stream},
                            {"ts", us_between(t0, e.start_ns)},
                            {"dur", us_between(e.start_ns, e.end_ns)},
                            {"args", args}});
  }
}

}  // namespace moe::tools
