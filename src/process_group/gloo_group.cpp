// ProcessGroupGloo as tdshm makes it (gloo_group.h).

#include "process_group/gloo_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <signal.h>
#include <cstdlib>

namespace tdshm::detail {

bool is_loopback_host(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

GlooDevice make_gloo_device(const std::optional<std::string>& host) {
  if (host && is_loopback_host(*host)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0') {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

std::optional<std::string> tcp_store_host(c10::intrusive_ptr<c10d::Store> store) {
  while (store) {
    if (auto* prefix = dynamic_cast<c10d::PrefixStore*>(store.get())) {
      store = prefix->getUnderlyingStore();
    } else if (auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get())) {
      return tcp->getHost();
    } else {
      break;
    }
  }
  return std::nullopt;
}

// gloo writes to its sockets without MSG_NOSIGNAL: a write to a peer that died kills the writer
// with SIGPIPE instead of failing its operation (a leader of a world across hosts whose peer was
// killed died so, 1 run in ~7 of DistHosts.ARankKilledIsATypedErrorOnEveryHostNamingIt). Python
// ignores SIGPIPE from its start; a C++ program gets the same here, unless it chose a
// disposition of its own (docs/hosts.md).
static void ignore_sigpipe_unless_handled() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) != 0) return;
  if ((current.sa_flags & SA_SIGINFO) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                 std::chrono::milliseconds timeout, const GlooDevice& device) {
  ignore_sigpipe_unless_handled();
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(device);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

}  // namespace tdshm::detail
