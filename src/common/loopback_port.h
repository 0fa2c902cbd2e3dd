#pragma once
// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, read back, closed): for a
// server started next by this process or another one (the demo's gloo store, ucx_perftest's
// handshake, the tests' stores). Another process may take it meanwhile; callers that can let
// the server pick its own port (c10d's TCPStore with port 0) should.

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

namespace tdshm::detail {

/// The port, or -1 with errno set when no socket could be bound.
inline int free_loopback_port() noexcept {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  const int err = errno;
  ::close(fd);
  errno = err;
  return port;
}

}  // namespace tdshm::detail
