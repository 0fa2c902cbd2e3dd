// tdshm world tcp://HOST:PORT [--group NAME]: a running "shm" world, seen from its store (what no
// segment can show: the ranks of other hosts). The hosts the ranks found (the locality answers
// they published, process_group/locality.h), which route each rank takes to each host, and
// whether each rank's watcher still beats (world_watch.h) or the world is lost, and why.

#include "world.h"

#include "process_group/locality.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdio>
#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace tdshm::tools {

namespace {

void usage(FILE* out) {
  std::fprintf(out,
               "usage: tdshm world tcp://HOST:PORT [--group NAME]\n"
               "  The hosts of a running \"shm\" world whose store is served at HOST:PORT (init_method\n"
               "  tcp://, or MASTER_ADDR:MASTER_PORT with env://), the route between each rank and each\n"
               "  host (shm inside a host, gloo between hosts) and whether each rank still beats.\n"
               "  --group NAME  the group (torch's name: the default group is \"0\", new_group k is k+1)\n");
}

std::string text(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

}  // namespace

int run_world(int argc, char** argv) {
  std::string url;
  std::string group = "0";
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    }
    if (a == "--group" && i + 1 < argc) {
      group = argv[++i];
    } else if (url.empty() && a.rfind("tcp://", 0) == 0) {
      url = a;
    } else {
      usage(stderr);
      return 2;
    }
  }
  const size_t colon = url.rfind(':');
  if (url.empty() || colon == std::string::npos || colon < 6) {
    usage(stderr);
    return 2;
  }
  const std::string host = url.substr(6, colon - 6);
  int port = 0;
  try {
    port = std::stoi(url.substr(colon + 1));
  } catch (const std::exception&) {
  }
  if (host.empty() || port <= 0 || port > 65535) {
    std::fprintf(stderr, "tdshm world: '%s' is not tcp://HOST:PORT\n", url.c_str());
    return 2;
  }
  try {
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(port);
    options.isServer = false;
    options.waitWorkers = false;
    options.timeout = std::chrono::seconds(5);
    auto tcp = c10::make_intrusive<c10d::TCPStore>(host, options);
    auto store =
        c10::make_intrusive<c10d::PrefixStore>(group, c10::make_intrusive<c10d::PrefixStore>("default_pg", tcp));
    const std::string sees = "tdshm_locality/sees/";
    if (!store->check({sees + "0"})) {
      std::fprintf(stderr,
                   "tdshm world: group '%s' of the store at %s has no locality answers: not a \"shm\" group made "
                   "over this store (or not formed yet)\n",
                   group.c_str(), url.c_str());
      return 1;
    }
    const size_t size = store->get(sees + "0").size();
    std::vector<std::vector<bool>> rows;
    for (size_t r = 0; r < size; ++r) {
      if (!store->check({sees + std::to_string(r)})) {
        std::fprintf(stderr, "tdshm world: rank %zu has not answered yet: the world is still forming\n", r);
        return 1;
      }
      const std::vector<uint8_t> row = store->get(sees + std::to_string(r));
      if (row.size() != size) {
        std::fprintf(stderr, "tdshm world: rank %zu's answer is malformed\n", r);
        return 1;
      }
      std::vector<bool> bits;
      for (uint8_t b : row) bits.push_back(b == '1');
      rows.push_back(std::move(bits));
    }
    const detail::Locality l = detail::locality_from(rows);
    std::printf("a \"shm\" world of %zu ranks on %zu host%s (group '%s' of the store at %s)\n", size, l.hosts.size(),
                l.hosts.size() == 1 ? "" : "s", group.c_str(), url.c_str());
    for (size_t h = 0; h < l.hosts.size(); ++h) {
      std::printf("  host %zu: ranks", h);
      for (int r : l.hosts[h]) std::printf(" %d", r);
      std::printf(" (leader %d)\n", l.hosts[h].front());
    }
    if (l.single_host()) {
      std::printf("every pair over shared memory (a ProcessGroupShm)\n");
      return 0;
    }
    // Beats: read twice, more than two beats apart (world_watch.h: every 500 ms), to tell a beating
    // rank from a silent one.
    auto beats = [&] {
      std::vector<std::string> v(size);
      for (size_t r = 0; r < size; ++r) {
        const std::string key = "tdshm_watch/beat/" + std::to_string(r);
        if (store->check({key})) v[r] = text(store->get(key));
      }
      return v;
    };
    const std::vector<std::string> before = beats();
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));
    const std::vector<std::string> after = beats();
    std::printf("%-5s %-5s %-16s %-16s %s\n", "rank", "host", "inside its host", "to other hosts", "heartbeat");
    for (size_t r = 0; r < size; ++r) {
      const bool alone = l.hosts[static_cast<size_t>(l.host_of[r])].size() == 1;
      const char* beat = after[r].empty() ? "none yet" : after[r] != before[r] ? "beating" : "silent";
      std::printf("%-5zu %-5d %-16s %-16s %s\n", r, l.host_of[r], alone ? "-" : "shared memory", "gloo (TCP)", beat);
    }
    if (store->check({"tdshm_watch/failed"})) {
      std::printf("the world is lost: %s\n", text(store->get("tdshm_watch/failed")).c_str());
      return 3;
    }
    std::printf("the world is running\n");
    return 0;
  } catch (const std::exception& e) {
    std::string message = e.what();
    if (const size_t nl = message.find('\n'); nl != std::string::npos) message.resize(nl);
    std::fprintf(stderr, "tdshm world: cannot read the store at %s: %s\n", url.c_str(), message.c_str());
    return 1;
  }
}

}  // namespace tdshm::tools
