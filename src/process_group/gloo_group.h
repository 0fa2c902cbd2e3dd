#pragma once
// Internal: LibTorch's ProcessGroupGloo as tdshm makes it, for the gloo backend
// (src/distributed/group.cpp) and for the network half of a world that spans hosts
// (process_group_hosts.h): the transport device chosen from where the ranks meet.

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

namespace tdshm::detail {

using GlooDevice = std::shared_ptr<::gloo::transport::Device>;

/// Whether `host` names this machine's loopback interface.
bool is_loopback_host(const std::string& host);

/// The transport device of a gloo group whose rendezvous is at `host` (nullopt: not known).
///
/// A rendezvous on a loopback address means every peer is on this host, so the loopback device
/// always reaches them; gloo's default device would instead bind to whatever this machine's
/// hostname resolves to, which may be an address that is firewalled, slow to resolve, or not
/// configured at all. Otherwise we do what torch does: the interface named by GLOO_SOCKET_IFNAME
/// when set (multi-homed hosts), else gloo's default device (the hostname's address, or loopback
/// when it does not resolve).
GlooDevice make_gloo_device(const std::optional<std::string>& host);

/// The host of the TCPStore under `store` (through PrefixStores), if it is one.
std::optional<std::string> tcp_store_host(c10::intrusive_ptr<c10d::Store> store);

/// A ProcessGroupGloo over `store` on `device`, its operations bounded by `timeout`.
c10::intrusive_ptr<c10d::ProcessGroup> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                 std::chrono::milliseconds timeout, const GlooDevice& device);

}  // namespace tdshm::detail
