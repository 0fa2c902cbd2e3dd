// The watcher of a world across hosts (world_watch.h).

#include "process_group/world_watch.h"

#include "common/format.h"

#include <exception>
#include <utility>

namespace tdshm::detail {

namespace {

constexpr const char* kFailedKey = "tdshm_watch/failed";
constexpr const char* kLostKey = "tdshm_watch/lost";

std::string beat_key(int rank) { return "tdshm_watch/beat/" + std::to_string(rank); }
std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

WorldWatch::WorldWatch(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                       std::function<std::string(int)> describe, std::function<void(const std::string&)> on_failure)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      describe_(std::move(describe)),
      on_failure_(std::move(on_failure)),
      thread_([this] { loop(); }) {}

WorldWatch::~WorldWatch() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::optional<std::string> WorldWatch::failure() const {
  std::lock_guard lk(mu_);
  return failure_;
}

void WorldWatch::report(const std::string& what) { fail(what, true); }

void WorldWatch::fail(const std::string& what, bool publish) {
  {
    std::lock_guard lk(mu_);
    if (failure_) return;
    failure_ = what;
  }
  if (publish) {
    try {
      store_->set(kFailedKey, bytes_of(what));  // the message first: a watcher that counts a loss reads it
      store_->add(kLostKey, 1);
    } catch (const std::exception&) {
      // A store that no longer answers: the others learn it from their own store operations.
    }
  }
  on_failure_(what);
}

void WorldWatch::loop() {
  using Clock = std::chrono::steady_clock;
  std::vector<int64_t> last(static_cast<size_t>(size_), -1);
  std::vector<Clock::time_point> moved(static_cast<size_t>(size_), Clock::now());
  for (;;) {
    {
      std::unique_lock lk(mu_);
      if (stopping_ || failure_) return;
    }
    try {
      // add() reads and writes in one operation, and makes a key that is not there yet.
      store_->add(beat_key(rank_), 1);
      if (store_->add(kLostKey, 0) > 0) {
        const std::vector<uint8_t> v = store_->get(kFailedKey);
        fail(std::string(v.begin(), v.end()), false);
        return;
      }
      if (rank_ == 0) {  // the one that reads every beat
        const auto now = Clock::now();
        for (int r = 1; r < size_; ++r) {
          const auto i = static_cast<size_t>(r);
          const int64_t b = store_->add(beat_key(r), 0);
          if (b != last[i]) {
            last[i] = b;
            moved[i] = now;
          } else if (now - moved[i] > kSilence) {
            fail(describe_(r) + " is gone (no heartbeat for " + std::to_string(kSilence.count()) + " ms)", true);
            return;
          }
        }
      }
    } catch (const std::exception& e) {
      fail("the group's store no longer answers (" + first_line(e.what()) + "): the rank that serves it is gone", false);
      return;
    }
    std::unique_lock lk(mu_);
    cv_.wait_for(lk, kBeat, [&] { return stopping_; });
  }
}

}  // namespace tdshm::detail
