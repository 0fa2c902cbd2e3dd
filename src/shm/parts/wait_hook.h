#pragma once
// What a process group hands to its transport's waits (ShmEngine::add_wait_hook): work the group
// left to run in the background that a peer may be waiting for, such as the collectives it issued
// and nobody has started (a peer may send what this wait needs only after that collective). Every
// point-to-point wait and collective step of the engine calls before_wait() before it may block.
// Torch-free; the hooks live above this layer (src/process_group/collective_queue.h).

namespace tdshm::shm {

class WaitHook {
 public:
  /// Starts (or asks a helper thread to start) what is due. Called on every wait: one load when
  /// there is nothing to do. Any thread; must not block or throw.
  virtual void before_wait() noexcept = 0;

 protected:
  ~WaitHook() = default;
};

}  // namespace tdshm::shm
