// Which ranks of a group can share memory (locality.h).

#include "process_group/locality.h"

#include "common/format.h"
#include "common/random_name.h"
#include "shm/parts/trust.h"

#include <tdshm/errors.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <numeric>
#include <tuple>
#include <sstream>
#include <utility>

namespace tdshm::detail {

namespace {

constexpr const char* kProbePrefix = "tdshm_locality/probe/";
constexpr const char* kSeesPrefix = "tdshm_locality/sees/";
const std::string kProbeFilePrefix = shm::kProbeFilePrefix;

/// What a rank publishes: its probe file and its PID namespace, each as (device, inode).
struct Probe {
  std::string name;  // "tdshm-probe.<pid>.<32 hex digits>" (shm::kProbeFilePrefix) in the shm directory
  uint64_t dev = 0;
  uint64_t ino = 0;
  uint64_t ns_dev = 0;
  uint64_t ns_ino = 0;

  std::string encode() const {
    std::ostringstream os;
    os << name << ' ' << dev << ' ' << ino << ' ' << ns_dev << ' ' << ns_ino;
    return os.str();
  }
  static Probe decode(const std::vector<uint8_t>& bytes, int rank) {
    std::istringstream is(std::string(bytes.begin(), bytes.end()));
    Probe p;
    is >> p.name >> p.dev >> p.ino >> p.ns_dev >> p.ns_ino;
    // Only our own names: nothing read from the shared store may point elsewhere.
    if (is.fail() || !(is >> std::ws).eof() || p.name.rfind(kProbeFilePrefix, 0) != 0 ||
        p.name.find('/') != std::string::npos || p.name.size() > 128) {
      throw Error("locality: rank " + std::to_string(rank) + " published a malformed probe in the store");
    }
    return p;
  }
};

/// This process's PID namespace as (device, inode) of /proc/self/ns/pid.
std::pair<uint64_t, uint64_t> pid_namespace() {
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) != 0) {
    throw Error(std::string("locality: cannot stat /proc/self/ns/pid: ") + std::strerror(errno));
  }
  return {st.st_dev, st.st_ino};
}

/// The probe file: created here, removed when this goes (whatever happens in between).
class ProbeFile {
 public:
  explicit ProbeFile(const std::string& dir) {
    probe_.name = kProbeFilePrefix + std::to_string(::getpid()) + "." + random_hex128();
    path_ = dir + "/" + probe_.name;
    const int fd = ::open(path_.c_str(), O_CREAT | O_EXCL | O_RDONLY | O_CLOEXEC, 0400);
    if (fd < 0) throw Error("locality: cannot create the probe file '" + path_ + "': " + std::strerror(errno));
    struct stat st {};
    const int rc = ::fstat(fd, &st);
    ::close(fd);
    if (rc != 0) {
      ::unlink(path_.c_str());
      throw Error("locality: cannot stat the probe file '" + path_ + "': " + std::strerror(errno));
    }
    probe_.dev = st.st_dev;
    probe_.ino = st.st_ino;
    std::tie(probe_.ns_dev, probe_.ns_ino) = pid_namespace();
  }
  ~ProbeFile() { ::unlink(path_.c_str()); }
  ProbeFile(const ProbeFile&) = delete;
  ProbeFile& operator=(const ProbeFile&) = delete;

  const Probe& probe() const noexcept { return probe_; }

 private:
  Probe probe_;
  std::string path_;
};

/// Whether this process sees `other`'s probe file in `dir` and runs in its PID namespace.
bool sees(const std::string& dir, const Probe& mine, const Probe& other) {
  if (other.ns_dev != mine.ns_dev || other.ns_ino != mine.ns_ino) return false;
  struct stat st {};
  if (::stat((dir + "/" + other.name).c_str(), &st) != 0) return false;
  return st.st_dev == other.dev && st.st_ino == other.ino;
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

/// Waits for `key` of `from` in the store, then reads it.
std::vector<uint8_t> wait_get(c10d::Store& store, const std::string& key, int from, std::chrono::milliseconds timeout) {
  try {
    store.wait({key}, timeout);
  } catch (const std::exception& e) {
    std::string message = e.what();
    message = detail::first_line(std::move(message));
    throw TimeoutError("locality: rank " + std::to_string(from) + " did not publish '" + key + "' within " +
                       std::to_string(timeout.count()) + " ms (" + message + ")");
  }
  return store.get(key);
}

}  // namespace

Locality locality_from(const std::vector<std::vector<bool>>& sees) {
  const size_t n = sees.size();
  std::vector<size_t> parent(n);
  std::iota(parent.begin(), parent.end(), size_t{0});
  auto root = [&](size_t i) {
    while (parent[i] != i) i = parent[i] = parent[parent[i]];
    return i;
  };
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = i + 1; j < n; ++j) {
      if (sees[i][j] && sees[j][i]) {
        const size_t a = root(i), b = root(j);
        parent[std::max(a, b)] = std::min(a, b);  // the lowest rank stays the root
      }
    }
  }
  Locality out;
  out.host_of.assign(n, -1);
  for (size_t i = 0; i < n; ++i) {
    const size_t r = root(i);
    if (out.host_of[r] < 0) {  // r <= i: its host was numbered when r was met
      out.host_of[r] = static_cast<int>(out.hosts.size());
      out.hosts.emplace_back();
    }
    out.host_of[i] = out.host_of[r];
    out.hosts[static_cast<size_t>(out.host_of[i])].push_back(static_cast<int>(i));
  }
  return out;
}

Locality discover_locality(c10d::Store& store, int rank, int size, std::chrono::milliseconds timeout,
                           const std::string& shm_dir) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw Error("locality: rank " + std::to_string(rank) + " of a group of " + std::to_string(size));
  }
  const ProbeFile file(shm_dir);
  store.set(kProbePrefix + std::to_string(rank), bytes_of(file.probe().encode()));
  std::string mine(static_cast<size_t>(size), '0');
  for (int r = 0; r < size; ++r) {
    const Probe other = r == rank ? file.probe() : Probe::decode(wait_get(store, kProbePrefix + std::to_string(r), r, timeout), r);
    if (r == rank || sees(shm_dir, file.probe(), other)) mine[static_cast<size_t>(r)] = '1';
  }
  store.set(kSeesPrefix + std::to_string(rank), bytes_of(mine));
  // Every rank publishes what it sees only after it looked at every probe: once all have
  // published, this rank's probe file is no longer needed (it goes with `file`).
  std::vector<std::vector<bool>> all(static_cast<size_t>(size), std::vector<bool>(static_cast<size_t>(size)));
  for (int r = 0; r < size; ++r) {
    const std::vector<uint8_t> row = r == rank ? bytes_of(mine) : wait_get(store, kSeesPrefix + std::to_string(r), r, timeout);
    if (row.size() != static_cast<size_t>(size)) {
      throw Error("locality: rank " + std::to_string(r) + " published an answer of " + std::to_string(row.size()) +
                  " ranks for a group of " + std::to_string(size));
    }
    for (int c = 0; c < size; ++c) {
      const uint8_t b = row[static_cast<size_t>(c)];
      if (b != '0' && b != '1') throw Error("locality: rank " + std::to_string(r) + " published a malformed answer");
      all[static_cast<size_t>(r)][static_cast<size_t>(c)] = b == '1';
    }
  }
  return locality_from(all);
}

}  // namespace tdshm::detail
