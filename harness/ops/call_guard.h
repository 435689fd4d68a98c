// What `check` says when a call into an implementation never comes back. An implementation is
// untrusted code (a plugin, a user's kernel): it may crash the process or hang in a call, and a
// CI log must still name the case that did it and how to replay it.
//   - A fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) raised on the calling thread during
//     a call prints the case's message to stderr; the signal then takes its previous action (the
//     process dies of it, or Python's faulthandler runs).
//   - A call that runs past the case timeout (CheckOptions::case_timeout_s, `--case-timeout`)
//     prints its message and ends the process with status 1: a thread stuck in foreign code
//     cannot be abandoned safely.
// Only calls into the implementation are guarded: the reference and the comparison are ours.
#pragma once

#include <functional>
#include <string>

namespace moe::ops {

// The case running on this thread while it lives (check_case): the implementation's name, the
// case line and the replay line go into the messages. timeout_s 0: no timeout.
class CaseScope {
 public:
  CaseScope(const std::string& impl, const std::string& case_line, const std::string& replay,
            double timeout_s);
  ~CaseScope();
  CaseScope(const CaseScope&) = delete;
  CaseScope& operator=(const CaseScope&) = delete;

 private:
  std::string impl_, case_line_, replay_;
  std::string crash_, timeout_;
  double timeout_s_;
  const CaseScope* outer_;
  friend class CallGuard;
  friend struct Watchdog;
};

// Around one call into an implementation (ops::invoke). Without a CaseScope on this thread
// (golden verify, bench) it guards nothing.
class CallGuard {
 public:
  CallGuard();
  ~CallGuard();
  CallGuard(const CallGuard&) = delete;
  CallGuard& operator=(const CallGuard&) = delete;

 private:
  const std::string* outer_crash_;
  unsigned long long watch_id_ = 0;  // 0: not watched
};

// Where the messages go: a file descriptor (default 2). The pytest plugin passes a copy of the
// terminal's stderr taken before pytest's capture replaces descriptor 2, as pytest's own
// faulthandler does, so the message is not lost with the captured output when the process ends.
void set_message_fd(int fd);

// A call past its case timeout, as the timeout hook sees it.
struct TimedOutCall {
  std::string impl, case_line, replay;
  double timeout_s = 0;
};

// Runs on the watchdog's thread once a call is past its timeout, after the message and before the
// process ends with status 1: `check` writes its --json / --junit reports there
// (tools/check_cmd.cpp). The hung call's thread still runs, and other calls may too: the hook
// must not wait for them without a bound. One hook a process; an empty function removes it.
void set_timeout_hook(std::function<void(const TimedOutCall&)> hook);

// The seconds CheckOptions::case_timeout_s may hold: 0 (none) or up to a day.
constexpr double kMaxCaseTimeout = 86400;

}  // namespace moe::ops
