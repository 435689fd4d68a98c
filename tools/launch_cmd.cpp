// moe-harness launch: runs one command as N local ranks, one per GPU, the way torchrun or mpirun
// would, with the environment gpu/nccl_comm.cuh bootstraps from:
//
//   moe-harness launch -n N [--timeout S] [--grace S] -- <command...>
//
// Each rank r gets MOE_RANK = rank_offset + r, MOE_LOCAL_RANK = r (its GPU), MOE_WORLD_SIZE,
// MOE_LOCAL_WORLD_SIZE, MOE_NCCL_ID_FILE (a fresh file in a private temporary directory, unless
// --id-file names a shared one for multi-node jobs), and NCCL_NVLS_ENABLE=0,
// TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 (multicast objects are never
// created on these machines). Every output line of a rank is prefixed "[rank r] ".
//
// Failure is clean, never a hang: the first rank that exits non-zero or dies from a signal, the
// --timeout, or a SIGINT/SIGTERM to the launcher makes it send SIGTERM to every other rank's
// process group, then SIGKILL after --grace seconds. It then exits 1 naming the rank and its
// status (or the timeout). 0 only when every rank exited 0; 2 for bad usage.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tools/commands.h"

extern char** environ;

namespace moe::tools {

namespace {

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) {
  g_signal = sig;
}

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = strsignal(sig);
    return "signal " + std::to_string(sig) + " (" + (name ? name : "?") + ")";
  }
  return "status " + std::to_string(status);
}

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // our own output is gone; the ranks still run to completion
    off += static_cast<size_t>(n);
  }
}

// One output stream of one rank: complete lines go out prefixed, each with one write(2) so the
// lines of different ranks never interleave mid-line.
struct Stream {
  int fd = -1;     // read end of the pipe, -1 once closed
  int out_fd = 1;  // where the prefixed lines go
  std::string prefix, partial;

  void emit(const std::string& line) { write_all(out_fd, prefix + line + "\n"); }
  // Reads what is available; false at end of file.
  bool pump() {
    char buf[65536];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n > 0) {
        partial.append(buf, static_cast<size_t>(n));
        size_t start = 0;
        for (size_t nl; (nl = partial.find('\n', start)) != std::string::npos; start = nl + 1) {
          emit(partial.substr(start, nl - start));
        }
        partial.erase(0, start);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      return false;  // EOF or error
    }
  }
  void close_stream() {
    if (!partial.empty()) emit(partial);
    partial.clear();
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

struct Rank {
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Stream out, err;
};

struct Options {
  int nranks = 1;
  double timeout_s = 0;
  double grace_s = 5;
  int rank_offset = 0;
  int world_size = 0;  // 0: nranks
  std::string id_file;
  std::vector<std::string> command;
};

std::vector<std::string> child_env(const Options& o, int r, const std::string& id_file) {
  const int world = o.world_size > 0 ? o.world_size : o.nranks;
  const std::vector<std::pair<std::string, std::string>> set = {
      {"MOE_RANK", std::to_string(o.rank_offset + r)},
      {"MOE_LOCAL_RANK", std::to_string(r)},
      {"MOE_WORLD_SIZE", std::to_string(world)},
      {"MOE_LOCAL_WORLD_SIZE", std::to_string(o.nranks)},
      {"MOE_NCCL_ID_FILE", id_file},
      {"NCCL_NVLS_ENABLE", "0"},
      {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"},
      {"NVSHMEM_DISABLE_NVLS", "1"},
  };
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    bool replaced = key == "MOE_NCCL_ID";  // a stale id from an outer job would never connect
    for (const auto& [k, v] : set) replaced = replaced || key == k;
    if (!replaced) env.push_back(kv);
  }
  for (const auto& [k, v] : set) env.push_back(k + "=" + v);
  return env;
}

[[noreturn]] void exec_child(const Options& o, const std::vector<std::string>& env, int out_w,
                             int err_w) {
  // Its own process group, so teardown reaches everything the rank started.
  setpgid(0, 0);
  dup2(out_w, 1);
  dup2(err_w, 2);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) signal(sig, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  std::vector<char*> argv, envp;
  for (const auto& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  execvpe(argv[0], argv.data(), envp.data());
  const std::string msg =
      "launch: cannot execute '" + o.command[0] + "': " + std::strerror(errno) + "\n";
  write_all(2, msg);
  _exit(127);
}

void signal_groups(std::vector<Rank>& ranks, int sig) {
  for (Rank& r : ranks) {
    if (r.running) kill(-r.pid, sig);
  }
}

int run_launch(const Options& o) {
  std::string dir, id_file = o.id_file;
  if (id_file.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/moe-launch-XXXXXX";
    if (!mkdtemp(templ.data())) {
      std::fprintf(stderr, "launch: cannot create a temporary directory %s: %s\n", templ.c_str(),
                   std::strerror(errno));
      return 2;
    }
    dir = templ;
    id_file = dir + "/nccl_id";
  }

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {
  }, old_term{}, old_hup{}, old_pipe{};
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  sigaction(SIGHUP, &sa, &old_hup);
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ign, &old_pipe);
  g_signal = 0;

  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<Rank> ranks(static_cast<size_t>(o.nranks));
  std::string spawn_error;
  for (int r = 0; r < o.nranks && spawn_error.empty(); ++r) {
    int out_p[2], err_p[2];
    if (pipe2(out_p, O_CLOEXEC) != 0 || pipe2(err_p, O_CLOEXEC) != 0) {
      spawn_error = std::string("pipe: ") + std::strerror(errno);
      break;
    }
    const std::vector<std::string> env = child_env(o, r, id_file);
    const pid_t pid = fork();
    if (pid < 0) {
      spawn_error = std::string("fork: ") + std::strerror(errno);
      break;
    }
    if (pid == 0) exec_child(o, env, out_p[1], err_p[1]);
    setpgid(pid, pid);  // also here: no window in which a kill(-pid) would miss the child
    ::close(out_p[1]);
    ::close(err_p[1]);
    Rank& k = ranks[r];
    k.pid = pid;
    k.running = true;
    const std::string prefix = "[rank " + std::to_string(o.rank_offset + r) + "] ";
    k.out = Stream{out_p[0], 1, prefix, {}};
    k.err = Stream{err_p[0], 2, prefix, {}};
    fcntl(out_p[0], F_SETFL, O_NONBLOCK);
    fcntl(err_p[0], F_SETFL, O_NONBLOCK);
  }

  const auto t0 = Clock::now();
  std::string cause;  // why the job failed, empty while all is well
  bool tearing_down = false;
  Clock::time_point kill_at{};
  auto teardown = [&](const std::string& why) {
    if (tearing_down) return;
    tearing_down = true;
    cause = why;
    std::fprintf(stderr, "launch: %s; terminating the other ranks\n", why.c_str());
    signal_groups(ranks, SIGTERM);
    kill_at = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.grace_s * 1000));
  };
  if (!spawn_error.empty()) teardown("cannot start all ranks (" + spawn_error + ")");

  for (;;) {
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    for (Rank& k : ranks) {
      for (Stream* s : {&k.out, &k.err}) {
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
        }
      }
    }
    int running = 0;
    for (const Rank& k : ranks) running += k.running;
    if (running == 0 && fds.empty()) break;
    if (!fds.empty()) {
      ::poll(fds.data(), fds.size(), 100);
    } else {
      ::usleep(20000);
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
        if (!streams[i]->pump()) streams[i]->close_stream();
      }
    }
    for (size_t r = 0; r < ranks.size(); ++r) {
      Rank& k = ranks[r];
      if (!k.running) continue;
      int st = 0;
      const pid_t got = waitpid(k.pid, &st, WNOHANG);
      if (got != k.pid) continue;
      k.running = false;
      k.status = st;
      // Whatever the rank left behind in its group goes with it.
      kill(-k.pid, SIGKILL);
      const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
      if (!ok && !tearing_down) {
        teardown("rank " + std::to_string(o.rank_offset + static_cast<int>(r)) + " (pid " +
                 std::to_string(k.pid) + ") failed with " + describe_status(st));
      }
    }
    if (!tearing_down && o.timeout_s > 0 && since(t0) > o.timeout_s) {
      std::string alive;
      for (size_t r = 0; r < ranks.size(); ++r) {
        if (ranks[r].running) alive += " " + std::to_string(o.rank_offset + static_cast<int>(r));
      }
      teardown("timeout after " + std::to_string(static_cast<int64_t>(o.timeout_s)) +
               " s with ranks" + alive + " still running");
    }
    if (!tearing_down && g_signal != 0) {
      teardown(std::string("interrupted by ") + strsignal(g_signal));
    }
    if (tearing_down && Clock::now() >= kill_at) {
      signal_groups(ranks, SIGKILL);
      kill_at = Clock::now() + std::chrono::hours(1);
    }
    // Every rank is gone: drain what is buffered, but do not wait for descendants that inherited
    // the pipes (their group was killed above).
    if (running > 0) continue;
    bool left = false;
    for (const Rank& k : ranks) left = left || k.running;
    if (!left) {
      for (Rank& k : ranks) {
        for (Stream* s : {&k.out, &k.err}) {
          if (s->fd >= 0) {
            s->pump();
            s->close_stream();
          }
        }
      }
      break;
    }
  }

  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  sigaction(SIGHUP, &old_hup, nullptr);
  sigaction(SIGPIPE, &old_pipe, nullptr);
  if (!dir.empty()) {
    ::unlink(id_file.c_str());
    ::rmdir(dir.c_str());
  }
  if (!cause.empty()) {
    for (size_t r = 0; r < ranks.size(); ++r) {
      const Rank& k = ranks[r];
      if (k.pid < 0) continue;
      std::fprintf(stderr, "launch: rank %d: %s\n", o.rank_offset + static_cast<int>(r),
                   describe_status(k.status).c_str());
    }
    std::fprintf(stderr, "launch: FAILED: %s\n", cause.c_str());
    return spawn_error.empty() ? 1 : 2;
  }
  return 0;
}

}  // namespace

void add_launch_command(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand(
      "launch", "Run a command as N local ranks, one per GPU (NCCL bootstrap environment)");
  static Options o;
  cmd->add_option("-n,--nranks", o.nranks, "Ranks to start on this node, one per GPU")
      ->required()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--timeout", o.timeout_s,
                  "Seconds after which every rank is killed and the launch fails (0: none)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--grace", o.grace_s, "Seconds between SIGTERM and SIGKILL in a teardown")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--rank-offset", o.rank_offset,
                  "Global rank of this node's first rank (multi-node jobs)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--world-size", o.world_size, "Ranks over all nodes (default: -n)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--id-file", o.id_file,
                  "MOE_NCCL_ID_FILE on a filesystem shared by all nodes (default: a fresh "
                  "private file)");
  cmd->add_option("command", o.command, "The command every rank runs, after --")->required();
  cmd->callback([&status] {
    const int world = o.world_size > 0 ? o.world_size : o.nranks;
    if (o.rank_offset + o.nranks > world) {
      std::fprintf(stderr, "launch: --rank-offset %d with -n %d exceeds --world-size %d\n",
                   o.rank_offset, o.nranks, world);
      status = 2;
      return;
    }
    if (world > o.nranks && o.id_file.empty()) {
      std::fprintf(stderr,
                   "launch: --world-size %d spans nodes: --id-file must name a file "
                   "on a filesystem every node sees\n",
                   world);
      status = 2;
      return;
    }
    status = run_launch(o);
  });
}

}  // namespace moe::tools
