// The watcher of a world across hosts (world_watch.h).

#include "process_group/world_watch.h"

#include "common/format.h"

#include <exception>
#include <utility>

namespace tdshm::detail {

namespace {

constexpr const char* kFailedKey = "tdshm_watch/failed";
constexpr const char* kLostKey = "tdshm_watch/lost";
constexpr const char* kVerdictKey = "tdshm_watch/verdict";
constexpr const char* kVerdictsKey = "tdshm_watch/verdicts";
constexpr const char* kToldKey = "tdshm_watch/told";

std::string beat_key(int rank) { return "tdshm_watch/beat/" + std::to_string(rank); }
std::vector<uint8_t> message_bytes(const std::string& s) { return {s.begin(), s.end()}; }

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
  if (rank_ == 0 && failure()) {
    // At least one rank is gone; the others read the verdict from this process's store.
    const auto until = std::chrono::steady_clock::now() + kLinger;
    try {
      while (store_->add(kToldKey, 0) < size_ - 1 && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } catch (const std::exception&) {
    }
  }
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

void WorldWatch::publish_verdict(const std::string& what) {
  try {
    store_->set(kVerdictKey, message_bytes(what));  // the message first, as for a loss
    store_->add(kVerdictsKey, 1);
  } catch (const std::exception&) {
    // The store's server is gone: nobody can read it anyway.
  }
}

std::optional<std::string> WorldWatch::verdict() {
  try {
    if (store_->add(kVerdictsKey, 0) == 0) return std::nullopt;
    const std::vector<uint8_t> v = store_->get(kVerdictKey);
    return std::string(v.begin(), v.end());
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::vector<int64_t> WorldWatch::beats() {
  std::vector<int64_t> out(static_cast<size_t>(size_), -1);
  try {
    for (int r = 0; r < size_; ++r) out[static_cast<size_t>(r)] = store_->add(beat_key(r), 0);
  } catch (const std::exception&) {
    return {};
  }
  return out;
}

void WorldWatch::fail(const std::string& what, bool publish) {
  {
    std::lock_guard lk(mu_);
    if (failure_) return;
    failure_ = what;
  }
  try {
    if (publish) {
      store_->set(kFailedKey, message_bytes(what));  // the message first: a watcher that counts a loss reads it
      store_->add(kLostKey, 1);
    }
    store_->add(kToldKey, 1);
  } catch (const std::exception&) {
    // A store that no longer answers: the others learn it from their own store operations.
  }
  on_failure_(what);
}

void WorldWatch::loop() {
  using Clock = std::chrono::steady_clock;
  std::vector<int64_t> last(static_cast<size_t>(size_), -1);
  std::vector<Clock::time_point> moved(static_cast<size_t>(size_), Clock::now());
  for (;;) {
    bool failed = false;
    {
      std::unique_lock lk(mu_);
      if (stopping_) return;
      failed = failure_.has_value();
    }
    try {
      // add() reads and writes in one operation, and makes a key that is not there yet.
      store_->add(beat_key(rank_), 1);
      if (failed) {
        // After a loss it only beats: a survivor still looking for the verdict sees it answer.
      } else if (store_->add(kLostKey, 0) > 0) {
        const std::vector<uint8_t> v = store_->get(kFailedKey);
        fail(std::string(v.begin(), v.end()), false);
      } else if (rank_ == 0) {  // the one that reads every beat
        const auto now = Clock::now();
        for (int r = 1; r < size_; ++r) {
          const auto i = static_cast<size_t>(r);
          const int64_t b = store_->add(beat_key(r), 0);
          if (b != last[i]) {
            last[i] = b;
            moved[i] = now;
          } else if (now - moved[i] > kSilence) {
            const std::string what = describe_(r) + " is gone (no heartbeat for " + std::to_string(kSilence.count()) + " ms)";
            publish_verdict(what);
            fail(what, true);
            break;
          }
        }
      }
    } catch (const std::exception& e) {
      fail("the group's store no longer answers (" + first_line(e.what()) + "): the rank that serves it is gone", false);
      return;  // nothing to beat into
    }
    std::unique_lock lk(mu_);
    cv_.wait_for(lk, kBeat, [&] { return stopping_; });
  }
}

}  // namespace tdshm::detail
