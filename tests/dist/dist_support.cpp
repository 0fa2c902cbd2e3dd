// Helpers of the process-group tests: see dist_support.h.

#include "dist/dist_support.h"

#include "common/loopback_port.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <stdexcept>
#include <system_error>
#include <thread>

namespace tdshm::test {

const char* method_name(Method m) {
  switch (m) {
    case Method::kShm:
      return "shm";
    case Method::kGlooFile:
      return "gloo_file";
    case Method::kGlooTcp:
      return "gloo_tcp";
    case Method::kGlooEnv:
      return "gloo_env";
  }
  return "?";
}

std::string backend_of(Method m) { return m == Method::kShm ? "shm" : "gloo"; }

uint16_t free_port() {
  const int port = tdshm::detail::free_loopback_port();
  if (port < 0) throw std::system_error(errno, std::generic_category(), "bind/getsockname on 127.0.0.1:0");
  return static_cast<uint16_t>(port);
}

TempDir::TempDir() {
  std::string tmpl = "/tmp/tdshm_dist_XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::system_error(errno, std::generic_category(), "mkdtemp");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

InitOptions init_options(const Rendezvous& rv, int rank, int world) {
  InitOptions o;
  o.rank = rank;
  o.world_size = world;
  o.timeout = kGroupTimeout;
  o.shm = small_options();  // small rings: a world of 3 needs well under 1 MiB of /dev/shm
  switch (rv.method) {
    case Method::kShm:
      o.init_method = "shm://" + rv.shm_name;
      break;
    case Method::kGlooFile:
      o.init_method = "file://" + rv.file;
      break;
    case Method::kGlooTcp:
      o.init_method = "tcp://127.0.0.1:" + std::to_string(rv.port);
      break;
    case Method::kGlooEnv:
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(rv.port).c_str(), 1);
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      o.rank = -1;
      o.world_size = -1;
      o.init_method = "env://";
      break;
  }
  return o;
}

c10::intrusive_ptr<c10d::Store> user_store(const Rendezvous& rv, int rank, int world, const std::string& prefix) {
  if (rv.method == Method::kShm) throw std::invalid_argument("user_store: the shm method has no store");
  if (rv.method == Method::kGlooFile) return c10::make_intrusive<c10d::FileStore>(rv.file, world);
  c10d::TCPStoreOptions so;
  so.port = rv.port;
  so.isServer = rank == 0;
  so.numWorkers = world;
  so.timeout = kGroupTimeout;
  return c10::make_intrusive<c10d::PrefixStore>(prefix, c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so));
}

void wait_until(const std::atomic<int>& value, int at_least, const char* what, const std::atomic<int>* failed) {
  const auto deadline = Clock::now() + kGroupTimeout;
  while (value.load(std::memory_order_acquire) < at_least) {
    SHM_CHECK(Clock::now() < deadline, "timed out waiting for " << what);
    SHM_CHECK(failed == nullptr || failed->load(std::memory_order_acquire) == 0,
              "stopped waiting for " << what << ": another rank failed");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void finish(Flags& flags, int world) {
  flags.done.fetch_add(1, std::memory_order_acq_rel);
  wait_until(flags.done, world, "every rank to finish", &flags.failed);
  destroy_process_group();
}

std::function<void(int)> counting_failures(Flags& flags, std::function<void(int)> body) {
  return [&flags, body = std::move(body)](int rank) {
    try {
      body(rank);
    } catch (...) {
      flags.failed.fetch_add(1, std::memory_order_acq_rel);
      throw;
    }
  };
}

void DistTest::run_default_world(Method m, int world, const std::function<void(int, Flags&)>& scenario,
                                 const std::function<void(int, InitOptions&)>& adjust) {
  const Rendezvous rv = rendezvous(m);
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, world, counting_failures(*flags, [&](int rank) {
    InitOptions o = init_options(rv, rank, world);
    if (adjust) adjust(rank, o);
    init_process_group(backend_of(m), o);
    scenario(rank, *flags);
    finish(*flags, world);
  })));
}

Rendezvous DistTest::rendezvous(Method m) {
  Rendezvous rv;
  rv.method = m;
  switch (m) {
    case Method::kShm:
      rv.shm_name = unique_name();
      break;
    case Method::kGlooFile:
      rv.file = dir_.path() + "/store" + std::to_string(++files_);
      break;
    case Method::kGlooTcp:
    case Method::kGlooEnv:
      rv.port = distinct_free_port();
      break;
  }
  return rv;
}

uint16_t DistTest::distinct_free_port() {
  for (;;) {
    const uint16_t port = free_port();
    if (ports_.insert(port).second) return port;
  }
}

std::string param_name(const ::testing::TestParamInfo<Method>& info) { return method_name(info.param); }

}  // namespace tdshm::test
