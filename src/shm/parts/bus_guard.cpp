// The SIGBUS guard of segment mappings (see bus_guard.h).

#include "shm/parts/bus_guard.h"

#include <signal.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace tdshm::shm {

namespace {

// A fixed table the signal handler can scan without locks or allocation. A process holds one
// mapping per live group, so 256 is far more than any real program has.
constexpr int kMaxGuarded = 256;

struct Guarded {
  std::atomic<uintptr_t> base{0};  // 0: free
  std::atomic<size_t> bytes{0};
  std::atomic<bool> poisoned{false};
};

Guarded g_guarded[kMaxGuarded];
struct sigaction g_previous {};
std::once_flag g_installed;

void forward(int sig, siginfo_t* info, void* context) {
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler == SIG_IGN) return;
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  // Default action: restore it. A fault then repeats on return and ends the process as it would
  // have without tdshm; a SIGBUS sent by kill() is raised again.
  signal(SIGBUS, SIG_DFL);
  if (info == nullptr || info->si_code <= 0) raise(SIGBUS);
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info != nullptr ? info->si_addr : nullptr);
  for (auto& g : g_guarded) {
    const uintptr_t base = g.base.load(std::memory_order_acquire);
    const size_t bytes = g.bytes.load(std::memory_order_acquire);
    if (base == 0 || addr < base || addr - base >= bytes) continue;
    // Same addresses, private zero pages: every later access succeeds and reads zeros.
    if (mmap(reinterpret_cast<void*>(base), bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1,
             0) != MAP_FAILED) {
      g.poisoned.store(true, std::memory_order_release);
      return;
    }
    break;  // cannot repair it: behave as without tdshm
  }
  forward(sig, info, context);
}

void install() noexcept {
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &g_previous);
}

}  // namespace

int BusGuard::add(void* base, size_t bytes) noexcept {
  try {
    std::call_once(g_installed, install);
  } catch (...) {
    return -1;
  }
  for (int i = 0; i < kMaxGuarded; ++i) {
    Guarded& g = g_guarded[i];
    uintptr_t expected = 0;
    // Claim the entry with a placeholder, publish the size, then the real base.
    if (!g.base.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) continue;
    g.poisoned.store(false, std::memory_order_relaxed);
    g.bytes.store(bytes, std::memory_order_release);
    g.base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    return i;
  }
  return -1;
}

void BusGuard::remove(int id) noexcept {
  if (id < 0 || id >= kMaxGuarded) return;
  g_guarded[id].bytes.store(0, std::memory_order_release);
  g_guarded[id].base.store(0, std::memory_order_release);
}

const std::atomic<bool>* BusGuard::flag(int id) noexcept {
  return id >= 0 && id < kMaxGuarded ? &g_guarded[id].poisoned : nullptr;
}

bool BusGuard::poisoned(int id) noexcept {
  return id >= 0 && id < kMaxGuarded && g_guarded[id].poisoned.load(std::memory_order_acquire);
}

}  // namespace tdshm::shm
