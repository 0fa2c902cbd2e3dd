#pragma once
// What the files of ShmEngine share (engine.cpp: construction, rendezvous, posting;
// engine_peers.cpp: liveness; engine_wait.cpp: waiting and the helper thread). Private to them.

#include "shm/engine/engine.h"

#include <chrono>

namespace tdshm::detail {

using Clock = std::chrono::steady_clock;

inline Clock::rep ticks(Clock::time_point t) { return t.time_since_epoch().count(); }
inline Clock::time_point from_ticks(Clock::rep r) { return Clock::time_point(Clock::duration(r)); }

}  // namespace tdshm::detail
