// Which ranks can share memory (src/process_group/locality.h), found the way a world that spans
// hosts finds it: through the group's store, with probe files that equal host names cannot fool.
// Hosts are simulated as the OS makes them (benchmarks/sim_hosts.h): a private tmpfs on /dev/shm per
// host, every host named "node"; and two PID namespaces sharing one /dev/shm, which must not be
// taken for one host (neither could judge the other's liveness).
//
//   Locality.*        the partition of the "sees" relation (pure)
//   LocalityHosts.*   real processes on simulated hosts (root; skipped with a message otherwise)
//   SimHosts.*        the simulated hosts' harness

#include "dist/dist_support.h"
#include "sim_hosts.h"
#include "process_group/locality.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <sstream>

namespace tdshm::test {
namespace {

using sim::HostView;
using sim::SimHost;
using sim::run_sim_hosts;
using sim::sim_hosts_unavailable;

using detail::Locality;
using detail::locality_from;

std::vector<std::vector<bool>> sees_from(const std::vector<std::string>& rows) {
  std::vector<std::vector<bool>> out;
  for (const std::string& row : rows) {
    std::vector<bool> r;
    for (char c : row) r.push_back(c == '1');
    out.push_back(r);
  }
  return out;
}

TEST(Locality, PartitionOfTheSeesRelation) {
  // Mutual sight makes a host; one-sided sight does not; classes close transitively.
  const Locality l = locality_from(sees_from({"1101", "1111", "0011", "1101"}));
  EXPECT_EQ(l.hosts, (std::vector<std::vector<int>>{{0, 1, 3}, {2}}));
  EXPECT_EQ(l.host_of, (std::vector<int>{0, 0, 1, 0}));
  EXPECT_TRUE(l.local(1, 3));
  EXPECT_FALSE(l.local(1, 2)) << "1 sees 2 but 2 does not see 1";
  EXPECT_EQ(l.leader_of(3), 0);
  EXPECT_EQ(l.leader_of(2), 2);
  EXPECT_FALSE(l.single_host());
  // 0-2 and 2-1 mutual, 0-1 not: one host by transitivity, led by 0.
  EXPECT_EQ(locality_from(sees_from({"101", "011", "111"})).hosts, (std::vector<std::vector<int>>{{0, 1, 2}}));
  EXPECT_TRUE(locality_from(sees_from({"1"})).single_host());
}

std::string text(const std::vector<std::vector<int>>& hosts) {
  std::ostringstream os;
  for (const auto& h : hosts) {
    os << '[';
    for (size_t i = 0; i < h.size(); ++i) os << (i ? "," : "") << h[i];
    os << ']';
  }
  return os.str();
}

/// Probe files of locality in `dir`.
std::vector<std::string> probes_in(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      if (std::strncmp(e->d_name, "tdshm-probe.", 12) == 0) out.emplace_back(e->d_name);
    }
    ::closedir(d);
  }
  return out;
}

class LocalityHosts : public DistTest {
 protected:
  /// Every rank of `hosts` finds the hosts through one file store, probing in `shm_dir`, and
  /// checks it finds `want`.
  void expect_hosts(const std::vector<SimHost>& hosts, const std::string& shm_dir,
                    const std::vector<std::vector<int>>& want) {
    int size = 0;
    for (const SimHost& h : hosts) size += static_cast<int>(h.ranks.size());
    const std::string store_path = file("locality.store");
    const std::vector<std::string> failures = run_sim_hosts(hosts, [&](int rank) {
      auto store = c10::make_intrusive<c10d::FileStore>(store_path, size);
      const Locality l = detail::discover_locality(*store, rank, size, kGroupTimeout, shm_dir);
      SHM_CHECK(l.hosts == want, "rank " << rank << " found hosts " << text(l.hosts) << ", expected " << text(want));
      SHM_CHECK(l.local(rank, rank) && l.host_of.size() == static_cast<size_t>(size), "rank " << rank);
    });
    for (const std::string& f : failures) ADD_FAILURE() << f;
  }
};

// The harness itself: a rank that fails and a file left in a host's /dev/shm are reported, and
// that /dev/shm is the host's own (the real one never sees the file).
TEST(SimHosts, FailuresAndLeftoversAreReported) {
  if (const auto why = sim_hosts_unavailable()) GTEST_SKIP() << *why;
  const std::string leftover = "tdshm.simhosts." + std::to_string(::getpid());
  const std::vector<std::string> failures = run_sim_hosts({{HostView::kOwnShm, {0, 1}}}, [&](int rank) {
    if (rank == 1) throw std::runtime_error("boom");
    const int fd = ::open(("/dev/shm/" + leftover).c_str(), O_CREAT | O_WRONLY, 0600);
    SHM_CHECK(fd >= 0, "cannot create the leftover");
    ::close(fd);
  });
  std::string all;
  for (const std::string& f : failures) all += f + "\n";
  EXPECT_NE(all.find("rank 1: boom"), std::string::npos) << all;
  EXPECT_NE(all.find("'" + leftover + "' was left in its /dev/shm"), std::string::npos) << all;
  EXPECT_EQ(failures.size(), 2u) << all;
  EXPECT_NE(::access(("/dev/shm/" + leftover).c_str(), F_OK), 0) << "the host's /dev/shm was the real one";
}

// Two machines of three ranks each, ranks interleaved, both named "node": two hosts, whatever the
// names say; nothing left in either /dev/shm (checked by each host).
TEST_F(LocalityHosts, TwoHostsOfThreeRanks) {
  if (const auto why = sim_hosts_unavailable()) GTEST_SKIP() << *why;
  expect_hosts({{HostView::kOwnShm, {0, 2, 4}}, {HostView::kOwnShm, {1, 3, 5}}}, "/dev/shm", {{0, 2, 4}, {1, 3, 5}});
}

// One /dev/shm (here a directory of the test) seen from two PID namespaces: the ranks of each
// namespace are one host, the two are not (neither can tell whether the other's processes run).
TEST_F(LocalityHosts, TwoPidNamespacesSharingOneShmDirectory) {
  if (const auto why = sim_hosts_unavailable()) GTEST_SKIP() << *why;
  expect_hosts({{HostView::kSame, {0, 1}}, {HostView::kOwnPid, {2, 3}}}, dir_.path(), {{0, 1}, {2, 3}});
  EXPECT_TRUE(probes_in(dir_.path()).empty()) << "probe files left behind";
}

// Every rank on this host: one host (no namespaces needed).
TEST_F(LocalityHosts, OneHost) {
  expect_hosts({{HostView::kSame, {0, 1, 2}}}, dir_.path(), {{0, 1, 2}});
  EXPECT_TRUE(probes_in(dir_.path()).empty()) << "probe files left behind";
}

// A shm directory where no probe can be made: an Error naming it, and the others time out
// rather than hang.
TEST_F(LocalityHosts, AnUnusableShmDirectoryIsAnError) {
  auto store = c10::make_intrusive<c10d::FileStore>(file("alone.store"), 1);
  const Caught c = catch_any([&] { (void)detail::discover_locality(*store, 0, 1, kGroupTimeout, dir_.path() + "/missing"); });
  EXPECT_TRUE(c.is<Error>() && c.what.find("cannot create the probe file") != std::string::npos) << c.describe();
  auto two = c10::make_intrusive<c10d::FileStore>(file("two.store"), 2);
  const Caught t = catch_any([&] {
    (void)detail::discover_locality(*two, 0, 2, std::chrono::milliseconds(200), dir_.path());
  });
  EXPECT_TRUE(t.is<TimeoutError>() && t.what.find("rank 1 did not publish") != std::string::npos) << t.describe();
  EXPECT_TRUE(probes_in(dir_.path()).empty()) << "the probe file outlived the failure";
}

}  // namespace
}  // namespace tdshm::test
