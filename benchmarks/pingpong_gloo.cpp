// The gloo baseline: c10d::ProcessGroupGloo (shipped inside LibTorch) over TCP on 127.0.0.1.
// Rank 0 serves a c10d::TCPStore on a port the kernel picks (port 0) and hands the port to rank 1
// through the control block; gloo's own connections then go over the loopback device.

#include "pingpong_gloo.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <exception>

namespace tdshm::bench::detail {

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(Link& link, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions store_options;
  store_options.numWorkers = 2;
  store_options.waitWorkers = false;
  store_options.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  uint32_t& port_word = link.block().gloo_port.value;
  if (link.rank() == 0) {
    std::exception_ptr failed;
    try {
      store_options.port = 0;
      store_options.isServer = true;
      auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
      // Plain store: Link::sync's release store publishes it.
      port_word = server->getPort();
      store = server;
    } catch (const std::exception& e) {
      link.set_error(e.what());
      failed = std::current_exception();
    }
    const bool both = link.sync(failed == nullptr);
    if (failed) std::rethrow_exception(failed);
    if (!both) throw PeerFailed("rank 1 could not join the gloo rendezvous");
  } else {
    if (!link.sync(true)) throw PeerFailed("rank 0 could not start the TCPStore: " + link.peer_error());
    // Read after the sync's acquire load that saw rank 0's arrival.
    store_options.port = static_cast<uint16_t>(port_word);
    store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
  }
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, link.rank(), 2, options);
}

}  // namespace tdshm::bench::detail
