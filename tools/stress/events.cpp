// The event lines of `tdshm stress`: a worker writes one line per event to fd 3, a pipe to the
// driver, and the driver parses them. The line is "TAG NS TYPE TEXT": NS is CLOCK_MONOTONIC in
// nanoseconds (comparable between the processes of one host), TYPE is "-" or the demangled
// dynamic type of an exception. Tags: READY (set up; waits for a byte on fd 0), ENTER (got it),
// PHASE (a coarse step, in TEXT), INIT (init_process_group returned), DONE (every received value
// checked), EXIT (the group is destroyed; leaving), ERR (an exception), WRONG (received values
// differ from what was sent), DESTROY_ERR (destroy_process_group threw after an error), END
// (recreate: the counts).

#include "stress_internal.h"

#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <sstream>

namespace tdshm::tools::stress {

int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

void emit(const char* tag, const std::string& type, const std::string& text) {
  std::string line = tag;
  line += ' ';
  line += std::to_string(now_ns());
  line += ' ';
  line += type.empty() ? "-" : type;
  line += ' ';
  std::string body = text.substr(0, 1500);  // one write below PIPE_BUF: never interleaved
  for (char& c : body) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  line += body;
  line += '\n';
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    const ssize_t n = ::write(kReportFd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
}

Event parse_event(const std::string& line) {
  Event e;
  std::istringstream is(line);
  is >> e.tag >> e.ns >> e.type;
  std::getline(is, e.text);
  if (!e.text.empty() && e.text[0] == ' ') e.text.erase(0, 1);
  return e;
}

}  // namespace tdshm::tools::stress
