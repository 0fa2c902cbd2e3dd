#pragma once
// Who a process is, read from /proc: its pid, its start time (so that a reused pid is not taken
// for it) and its PID namespace; and whether it still runs.

#include <cstdint>

namespace tdshm::shm {

/// Identity of a live process: pid plus its start time, so a reused pid is not mistaken for it,
/// and the PID namespace the pid belongs to (0: not known).
struct ProcessId {
  uint32_t pid = 0;
  uint64_t start_time = 0;
  uint32_t pid_ns = 0;  // inode of /proc/<pid>/ns/pid
};

/// This process's identity.
ProcessId self_process();
/// Whether `id` was recorded by a process of another PID namespace (another container, say):
/// its pid means another process here, or none, so its liveness cannot be checked from here.
bool foreign_pid_namespace(const ProcessId& id);
/// Whether the process `id` still runs (false once it exited or its pid was reused). A process of
/// another PID namespace counts as running: nothing here can prove it dead, so nothing of it is
/// replaced or removed (the rendezvous refuses such a peer; see ShmEngine::rendezvous).
bool process_alive(const ProcessId& id);
/// Whether the process `id` runs, this process included (threads-as-ranks share its pid).
bool alive_or_self(const ProcessId& id);

}  // namespace tdshm::shm
