// Native frames of a crash, for machines without a debugger (the GPU machine
// has no gdb). Preloaded into a process (LD_PRELOAD), it installs a handler
// for the fatal signals that writes the crashing thread's native stack to
// stderr as it was when the library loaded (a copy of that descriptor: test
// runners redirect descriptor 2 into files that die with the process), one
// frame a line:
//
//   #3   0x7f..  /path/to/_C.cpython-311-x86_64-linux-gnu.so +0x1a2b3 _ZN7prefire...
//
// (the object, the frame's offset in it, the nearest dynamic symbol), between
// "== native frames" and "== end of native frames" lines; resolve.py turns
// the offsets into functions and source lines with addr2line. Then the
// process dies of the signal as it would have.
//
// Under `python -X faulthandler` both report: faulthandler's handler is
// installed after this one (at interpreter start), dumps every thread's
// Python frames, puts this handler back and raises the signal again.
//
// Note [Formatting in a signal handler]
// snprintf and dladdr are not async-signal-safe. The process is about to die
// of a fault and what matters is the report, so the handler takes that risk;
// backtrace() is called once at load so that its unwinder (libgcc_s) is
// loaded before any fault.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static const int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
static int report_fd = STDERR_FILENO;  // a copy of stderr as it was at load

static void write_all(const char* text, int length) {
  while (length > 0) {
    ssize_t written = write(report_fd, text, (size_t)length);
    if (written <= 0) return;
    text += written;
    length -= (int)written;
  }
}

static void on_fatal_signal(int sig, siginfo_t* info, void* context) {
  (void)context;
  void* frames[128];
  int count = backtrace(frames, 128);
  char line[1024];
  int length = snprintf(line, sizeof line, "\n== native frames: signal %d (%s), address %p, thread %ld ==\n", sig,
                        strsignal(sig), info ? info->si_addr : NULL, (long)syscall(SYS_gettid));
  write_all(line, length);
  for (int i = 0; i < count; ++i) {
    Dl_info where;
    if (dladdr(frames[i], &where) && where.dli_fname && where.dli_fname[0]) {
      length = snprintf(line, sizeof line, "#%-3d %p %s +%#lx %s\n", i, frames[i], where.dli_fname,
                        (unsigned long)((char*)frames[i] - (char*)where.dli_fbase),
                        where.dli_sname ? where.dli_sname : "?");
    } else {
      length = snprintf(line, sizeof line, "#%-3d %p ? +0 ?\n", i, frames[i]);
    }
    if (length > (int)sizeof line - 1) length = (int)sizeof line - 1;
    write_all(line, length);
  }
  write_all("== end of native frames ==\n", 27);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install_native_frames(void) {
  void* warm[1];
  backtrace(warm, 1);  // loads the unwinder now (Note [Formatting in a signal handler])
  int copy = fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 3);
  if (copy >= 0) report_fd = copy;
  static char alternate_stack[1 << 16];  // the loading thread's: a stack overflow there still reports
  stack_t stack = {.ss_sp = alternate_stack, .ss_size = sizeof alternate_stack, .ss_flags = 0};
  sigaltstack(&stack, NULL);
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_sigaction = on_fatal_signal;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < sizeof kFatalSignals / sizeof kFatalSignals[0]; ++i) sigaction(kFatalSignals[i], &action, NULL);
}

// A deliberate fault in a function with debug information, for the test
// that the frames and their source lines come out (check_native_frames.py).
__attribute__((noinline)) void prefire_native_frames_deliberate_fault(void) {
  volatile int* nowhere = (volatile int*)(unsigned long)(sizeof(int) * 4);  // not NULL: no compiler shortcut
  *nowhere = 1;
}
