// ProcessGroupGloo as tdshm makes it (gloo_group.h).

#include "process_group/gloo_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

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

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                 std::chrono::milliseconds timeout, const GlooDevice& device) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(device);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

}  // namespace tdshm::detail
