#include "core/log.h"

#include <execinfo.h>
#include <fcntl.h>
#include <ucontext.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include <spdlog/sinks/stdout_color_sinks.h>

namespace odyssey {

void init_logging(const std::string& role, const std::string& level) {
  const std::string name = role.empty() ? "odyssey" : role;
  spdlog::drop(name);
  auto logger = spdlog::stderr_color_mt(name);
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %v");
  std::string lvl = level;
  if (lvl.empty()) {
    const char* env = std::getenv("ODYSSEY_LOG");
    lvl = env ? env : "info";
  }
  logger->set_level(spdlog::level::from_str(lvl));
  spdlog::set_default_logger(logger);
}

namespace {

void write_str(const char* s) { (void)!write(STDERR_FILENO, s, std::strlen(s)); }

void write_hex(uintptr_t v) {
  char buf[19] = "0x";
  for (int i = 0; i < 16; ++i) buf[2 + i] = "0123456789abcdef"[(v >> (60 - 4 * i)) & 0xf];
  buf[18] = 0;
  write_str(buf);
}

// Writes the /proc/self/maps line holding `addr`, so a raw address names its library.
void write_mapping(uintptr_t addr) {
  int fd = open("/proc/self/maps", O_RDONLY);
  if (fd < 0) return;
  char buf[8192];
  char line[512];
  size_t len = 0;
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) {
    for (ssize_t i = 0; i < n; ++i) {
      if (buf[i] != '\n') {
        if (len + 1 < sizeof(line)) line[len++] = buf[i];
        continue;
      }
      line[len] = 0;
      uintptr_t lo = 0, hi = 0;
      const char* p = line;
      while (*p && *p != '-') lo = lo * 16 + static_cast<uintptr_t>(*p >= 'a' ? *p - 'a' + 10 : *p - '0'), ++p;
      if (*p == '-') ++p;
      while (*p && *p != ' ') hi = hi * 16 + static_cast<uintptr_t>(*p >= 'a' ? *p - 'a' + 10 : *p - '0'), ++p;
      if (addr >= lo && addr < hi) {
        write_str("  in ");
        write_str(line);
        write_str("\n");
        close(fd);
        return;
      }
      len = 0;
    }
  }
  close(fd);
}

void on_fatal_signal(int sig, siginfo_t* info, void* context) {
  // Async-signal-safe calls only (write, open, read, backtrace after a first warm-up call).
  write_str("\n*** odyssey: fatal signal: ");
  write_str(strsignal(sig));
  write_str(" at address ");
  write_hex(reinterpret_cast<uintptr_t>(info->si_addr));
#if defined(__x86_64__)
  const uintptr_t pc = static_cast<uintptr_t>(static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_RIP]);
  write_str(", pc ");
  write_hex(pc);
  write_str(" ***\n");
  write_mapping(pc);
  // A call through a bad pointer leaves the caller's return address on top of the stack.
  const uintptr_t sp = static_cast<uintptr_t>(static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_RSP]);
  if (sp) {
    const uintptr_t ret = *reinterpret_cast<const uintptr_t*>(sp);
    write_str("  return address on the stack ");
    write_hex(ret);
    write_str("\n");
    write_mapping(ret);
  }
#else
  (void)context;
  write_str(" ***\n");
#endif
  void* frames[64];
  int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

void install_crash_handler() {
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc's unwinder now, not inside the handler
  static char alt_stack[64 * 1024];
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof(alt_stack);
  sigaltstack(&ss, nullptr);  // so a stack overflow can still be reported
  struct sigaction sa {};
  sa.sa_sigaction = on_fatal_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) sigaction(sig, &sa, nullptr);
}

}  // namespace odyssey
