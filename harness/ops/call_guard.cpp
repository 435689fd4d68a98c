#include "harness/ops/call_guard.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>

namespace moe::ops {

namespace {

using Clock = std::chrono::steady_clock;

thread_local const CaseScope* t_case = nullptr;
// The message a fatal signal prints: set only while a call runs. Read in the signal handler, so
// it is a plain pointer to a string that lives as long as the CaseScope.
thread_local const std::string* t_crash = nullptr;
thread_local bool t_alt_stack = false;
std::atomic<int> g_fd{STDERR_FILENO};  // lock-free: read in the signal handler

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
struct sigaction g_previous[std::size(kSignals)];

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV:
      return "SIGSEGV";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGILL:
      return "SIGILL";
    case SIGABRT:
      return "SIGABRT";
    default:
      return "a fatal signal";
  }
}

// Async-signal-safe: write(2) only.
void write_all(const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(g_fd.load(std::memory_order_relaxed), p, n);
    if (w <= 0) return;
    p += w;
    n -= static_cast<size_t>(w);
  }
}
void write_str(const char* s) {
  size_t n = 0;
  while (s[n]) ++n;
  write_all(s, n);
}

extern "C" void on_fatal_signal(int sig) {
  if (const std::string* msg = t_crash) {
    write_str("\nmoe-harness: ");
    write_str(signal_name(sig));
    write_all(msg->data(), msg->size());
  }
  // The previous action (the default: the process dies of the signal), raised again: it is
  // delivered once this handler returns, before a faulting instruction runs again.
  for (size_t i = 0; i < std::size(kSignals); ++i)
    if (kSignals[i] == sig) sigaction(sig, &g_previous[i], nullptr);
  raise(sig);
}

void install_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_handler = on_fatal_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_ONSTACK;  // a stack overflow still gets its message out
    for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &sa, &g_previous[i]);
  });
  // An alternate signal stack for this thread, unless it has one (Python's faulthandler sets
  // its own); kept for the thread's life.
  if (!t_alt_stack) {
    t_alt_stack = true;
    stack_t old{};
    if (sigaltstack(nullptr, &old) == 0 && (old.ss_flags & SS_DISABLE)) {
      constexpr size_t kBytes = 64 * 1024;
      stack_t ss{};
      ss.ss_sp = new char[kBytes];  // never freed: the thread may die with it installed
      ss.ss_size = kBytes;
      sigaltstack(&ss, nullptr);
    }
  }
}

std::mutex g_hook_mu;
std::function<void(const TimedOutCall&)>* g_hook = nullptr;  // never freed: read at exit

}  // namespace

// One thread that ends the process when a watched call outlives its deadline. Never destroyed:
// it may still wait while static destructors run at exit.
struct Watchdog {
  std::mutex mu;
  std::condition_variable cv;
  struct Call {
    Clock::time_point deadline;
    const CaseScope* scope;  // alive while the call is in `calls` (~CallGuard erases it first)
  };
  std::map<unsigned long long, Call> calls;
  unsigned long long next_id = 1;

  void loop() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      if (calls.empty()) {
        cv.wait(lock);
        continue;
      }
      auto first = calls.begin();
      for (auto it = calls.begin(); it != calls.end(); ++it)
        if (it->second.deadline < first->second.deadline) first = it;
      const Call due = first->second;
      if (Clock::now() < due.deadline) {
        cv.wait_until(lock, due.deadline);
        continue;  // the call may have ended meanwhile: look again
      }
      // What the run printed so far, unless the hung thread holds the stream (it may hang in
      // stdio): then it is lost, but the message is not.
      for (FILE* f : {stdout, stderr}) {
        if (ftrylockfile(f) == 0) {
          fflush_unlocked(f);
          funlockfile(f);
        }
      }
      write_all(due.scope->timeout_.data(), due.scope->timeout_.size());
      // `mu` stays held: the scope cannot go away, and no other call's guard starts or ends.
      std::function<void(const TimedOutCall&)> hook;
      {
        std::lock_guard<std::mutex> h(g_hook_mu);
        if (g_hook) hook = *g_hook;
      }
      if (hook) {
        hook(TimedOutCall{due.scope->impl_, due.scope->case_line_, due.scope->replay_,
                          due.scope->timeout_s_});
      }
      std::_Exit(1);
    }
  }
};

namespace {

Watchdog& watchdog() {
  static Watchdog* w = [] {
    auto* d = new Watchdog;
    std::thread([d] { d->loop(); }).detach();
    return d;
  }();
  return *w;
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

}  // namespace

void set_message_fd(int fd) {
  g_fd.store(fd < 0 ? STDERR_FILENO : fd);
}

void set_timeout_hook(std::function<void(const TimedOutCall&)> hook) {
  std::lock_guard<std::mutex> lock(g_hook_mu);
  if (!g_hook) g_hook = new std::function<void(const TimedOutCall&)>;
  *g_hook = std::move(hook);
}

CaseScope::CaseScope(const std::string& impl, const std::string& case_line,
                     const std::string& replay, double timeout_s)
    : impl_(impl),
      case_line_(case_line),
      replay_(replay),
      crash_(" in a call of implementation '" + impl +
             "' for this case; the process dies of it.\n  case: " + case_line + "\nReplay:\n  " +
             replay + "\n"),
      timeout_("\nmoe-harness: a call of implementation '" + impl +
               "' ran past the case timeout (" + seconds(timeout_s) +
               " s) for this case; the run stops here (a call cannot be abandoned), exit status "
               "1.\n  case: " +
               case_line + "\nReplay:\n  " + replay + "\n"),
      timeout_s_(timeout_s),
      outer_(t_case) {
  t_case = this;
}

CaseScope::~CaseScope() {
  t_case = outer_;
}

CallGuard::CallGuard() : outer_crash_(t_crash) {
  const CaseScope* c = t_case;
  if (!c) return;
  install_handlers();
  t_crash = &c->crash_;
  if (c->timeout_s_ > 0) {
    Watchdog& w = watchdog();
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(c->timeout_s_));
    std::lock_guard<std::mutex> lock(w.mu);
    watch_id_ = w.next_id++;
    w.calls.emplace(watch_id_, Watchdog::Call{deadline, c});
    w.cv.notify_one();
  }
}

CallGuard::~CallGuard() {
  if (watch_id_) {
    Watchdog& w = watchdog();
    std::lock_guard<std::mutex> lock(w.mu);
    w.calls.erase(watch_id_);
  }
  t_crash = outer_crash_;
}

}  // namespace moe::ops
