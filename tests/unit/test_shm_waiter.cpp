// Waiting, on plain memory (shm/parts/waiter.h): the wake-up pair between two threads (no lost
// wake-up, no system call for a rank that does not sleep), the spin budget's adaptation, and the
// order in which spin_then_sleep calls its hooks (progress restarts the budget, the deadline
// ends the wait, a budget of 0 never spins).

#include "shm/layout/segment_layout.h"
#include "shm/parts/waiter.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace tdshm::shm;
using namespace std::chrono_literals;

struct alignas(kCacheLine) Slot {
  RankSlot slot{};
};

TEST(ShmWaiter, WakeWithoutASleeperChangesNothing) {
  Slot s;
  wake(s.slot);
  EXPECT_EQ(s.slot.wake_seq.load(), 0u) << "a rank that announced no sleeper is not woken";
  EXPECT_EQ(s.slot.sleepers.load(), 0u);
}

TEST(ShmWaiter, ASleeperIsAnnouncedWhileItLivesAndWokenByThePublisher) {
  Slot s;
  std::atomic<bool> published{false};
  std::atomic<bool> woke{false};
  std::thread sleeper([&] {
    while (!published.load(std::memory_order_acquire)) {
      SleepAnnouncement asleep(s.slot);
      if (published.load(std::memory_order_acquire)) break;  // the re-check after announcing
      asleep.sleep(WaitClock::now() + 10s);
    }
    woke.store(true);
  });
  // Wait until it announced itself, then publish and wake it.
  const auto give_up = WaitClock::now() + 10s;
  while (s.slot.sleepers.load() == 0 && WaitClock::now() < give_up) std::this_thread::sleep_for(100us);
  ASSERT_EQ(s.slot.sleepers.load(), 1u) << "the sleeper never announced itself";
  const auto start = WaitClock::now();
  published.store(true, std::memory_order_release);
  wake(s.slot);
  sleeper.join();
  EXPECT_TRUE(woke.load());
  EXPECT_LT(WaitClock::now() - start, 5s) << "the wake-up was lost: the sleeper ran into its 10 s limit";
  EXPECT_GE(s.slot.wake_seq.load(), 1u) << "the publisher saw the sleeper and bumped its word";
  EXPECT_EQ(s.slot.sleepers.load(), 0u) << "the announcement ends with the sleeper";
}

// Many rounds of publish/sleep between two threads: every round's wake-up arrives (a lost one
// shows as a round that needs its whole 2 s limit).
TEST(ShmWaiter, NoWakeUpIsLostOverManyRounds) {
  Slot s;
  std::atomic<uint64_t> value{0};
  constexpr uint64_t kRounds = 2000;
  std::atomic<int> slow_rounds{0};
  std::thread consumer([&] {
    for (uint64_t want = 1; want <= kRounds; ++want) {
      const auto start = WaitClock::now();
      while (value.load(std::memory_order_acquire) < want) {
        SleepAnnouncement asleep(s.slot);
        if (value.load(std::memory_order_acquire) >= want) break;
        asleep.sleep(WaitClock::now() + 2s);
      }
      if (WaitClock::now() - start > 1s) slow_rounds.fetch_add(1);
    }
  });
  for (uint64_t v = 1; v <= kRounds; ++v) {
    value.store(v, std::memory_order_release);
    wake(s.slot);
    if (v % 64 == 0) std::this_thread::yield();
  }
  consumer.join();
  EXPECT_EQ(slow_rounds.load(), 0);
  EXPECT_EQ(s.slot.sleepers.load(), 0u);
}

TEST(ShmWaiter, TheAnnouncementEndsWhenTheRecheckThrows) {
  Slot s;
  try {
    SleepAnnouncement asleep(s.slot);
    EXPECT_EQ(s.slot.sleepers.load(), 1u);
    throw std::runtime_error("re-check failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(s.slot.sleepers.load(), 0u) << "a throwing re-check left a sleeper announced: peers would wake it forever";
}

TEST(ShmWaiter, SpinBudgetDoublesOnShortWaitsHalvesOnLongOnesAndStaysInBounds) {
  SpinBudget b(std::chrono::microseconds(256));
  EXPECT_TRUE(b.spins());
  EXPECT_EQ(b.get(), 256us);
  b.note(2ms);  // > 4 x max: halves
  EXPECT_EQ(b.get(), 128us);
  b.note(500us);  // between max and 4 x max: unchanged
  EXPECT_EQ(b.get(), 128us);
  for (int i = 0; i < 20; ++i) b.note(10ms);
  EXPECT_EQ(b.get(), 1us) << "never below 1 us";
  b.note(10us);  // served by spinning: doubles
  EXPECT_EQ(b.get(), 2us);
  for (int i = 0; i < 20; ++i) b.note(0us);
  EXPECT_EQ(b.get(), 256us) << "never above the maximum";

  SpinBudget none(0ns);
  EXPECT_FALSE(none.spins());
  none.note(0us);
  none.note(1s);
  EXPECT_EQ(none.get(), 0ns) << "a blocking-only budget stays 0";
}

TEST(ShmWaiter, YieldsStopWhileTheyRunNobodyElseAndComeBackWhenOneDoes) {
  SpinBudget b(std::chrono::microseconds(256));
  for (uint32_t read = 1; read <= 10; ++read) EXPECT_TRUE(b.yields_at(read)) << "at first every clock read yields";
  for (uint32_t i = 0; i + 1 < SpinBudget::kUselessYields; ++i) b.yielded(1us);
  EXPECT_TRUE(b.yields_at(1)) << "one useless yield short of the limit";
  b.yielded(1us);
  uint32_t probes = 0;
  for (uint32_t read = 1; read <= 4 * SpinBudget::kProbeEvery; ++read) probes += b.yields_at(read) ? 1 : 0;
  EXPECT_EQ(probes, 4u) << "past the limit, one clock read in kProbeEvery yields";
  b.yielded(1us);
  EXPECT_FALSE(b.yields_at(1)) << "more useless yields keep it so";
  b.yielded(SpinBudget::kRanAnother);  // a probe that let another thread run
  EXPECT_TRUE(b.yields_at(1)) << "a yield that ran another thread: every clock read yields again";
  for (uint32_t i = 0; i + 1 < SpinBudget::kUselessYields; ++i) b.yielded(0us);
  EXPECT_TRUE(b.yields_at(1)) << "the count starts again from 0";
}

/// Hooks that record what spin_then_sleep asked of them.
struct Recorder {
  std::vector<Poll> script;  // what poll() answers, in turn (then kIdle)
  size_t polls = 0, clock_reads = 0, sleeps = 0;
  bool over_at_clock = false;
  bool timed_out_called = false;
  WaitClock::time_point first_sleep{};

  Poll poll() {
    const Poll p = polls < script.size() ? script[polls] : Poll::kIdle;
    ++polls;
    return p;
  }
  bool at_clock(WaitClock::time_point) {
    ++clock_reads;
    return over_at_clock;
  }
  void timed_out() {
    timed_out_called = true;
    throw std::runtime_error("timed out");
  }
  void sleep(WaitClock::time_point, WaitClock::time_point first) {
    if (sleeps == 0) first_sleep = first;
    EXPECT_EQ(first, first_sleep) << "first_sleep is the time of the first sleep, at every sleep";
    ++sleeps;
    std::this_thread::sleep_for(100us);
  }
};

TEST(ShmWaiter, AWaitThatIsDoneAtOnceReadsNoClockAndGrowsTheBudget) {
  SpinBudget b(std::chrono::microseconds(64));
  b.note(1s);  // 32 us
  Recorder r;
  r.script = {Poll::kDone};
  spin_then_sleep(b, Judge::kSinceProgress, WaitClock::now() + 10s, r);
  EXPECT_EQ(r.polls, 1u);
  EXPECT_EQ(r.clock_reads, 0u);
  EXPECT_EQ(r.sleeps, 0u);
  EXPECT_EQ(b.get(), 64us) << "a wait served at once counts as served by spinning";
}

TEST(ShmWaiter, QuietChecksComeBeforeTheFirstClockRead) {
  SpinBudget b(std::chrono::milliseconds(100));
  Recorder r;
  r.over_at_clock = true;  // the first clock read ends it
  spin_then_sleep(b, Judge::kSinceProgress, WaitClock::now() + 10s, r);
  EXPECT_EQ(r.clock_reads, 1u);
  EXPECT_EQ(r.polls, tdshm::detail::SpinChecks::kQuietChecks) << "the first clock read comes after the quiet checks";
  EXPECT_EQ(r.sleeps, 0u);
}

TEST(ShmWaiter, ABlockingOnlyBudgetSleepsWithoutSpinning) {
  SpinBudget b(0ns);
  Recorder r;
  r.script = {Poll::kIdle, Poll::kIdle, Poll::kIdle, Poll::kDone};
  spin_then_sleep(b, Judge::kSinceProgress, WaitClock::now() + 10s, r);
  EXPECT_EQ(r.polls, 4u);
  EXPECT_EQ(r.clock_reads, 3u) << "every idle check reads the clock";
  EXPECT_EQ(r.sleeps, 3u) << "and goes to sleep";
}

TEST(ShmWaiter, ProgressStartsTheBudgetAgain) {
  // A budget of 2 ms and a wait that moves every ~0.5 ms for 5 ms: it never sleeps, although
  // the wait as a whole is longer than the budget.
  SpinBudget b(std::chrono::milliseconds(2));
  struct Moving : Recorder {
    WaitClock::time_point start = WaitClock::now(), last_move = start;
    Poll poll() {
      ++polls;
      const auto now = WaitClock::now();
      if (now - start > 5ms) return Poll::kDone;
      if (now - last_move > 500us) {
        last_move = now;
        return Poll::kMoved;
      }
      return Poll::kIdle;
    }
  } r;
  spin_then_sleep(b, Judge::kSinceProgress, WaitClock::now() + 10s, r);
  EXPECT_EQ(r.sleeps, 0u) << "a wait that keeps moving keeps spinning";
  EXPECT_GT(r.clock_reads, 0u);
}

TEST(ShmWaiter, TheDeadlineEndsTheWaitThroughTimedOut) {
  SpinBudget b(std::chrono::microseconds(50));
  Recorder r;
  const auto start = WaitClock::now();
  EXPECT_THROW(spin_then_sleep(b, Judge::kSinceProgress, start + 20ms, r), std::runtime_error);
  EXPECT_TRUE(r.timed_out_called);
  EXPECT_GE(WaitClock::now() - start, 20ms);
  EXPECT_GT(r.sleeps, 0u) << "past its 50 us budget the waiter slept until the deadline";
}

TEST(ShmWaiter, JudgedByTimeAsleepAShortSleepGrowsTheBudget) {
  // The budget has shrunk to 1 us; the wait spins that long, sleeps ~100 us (well within 4 x the
  // 10 ms maximum, even on a loaded machine) and is done: judged by its time asleep it was
  // served, so the budget doubles; judged since progress (the whole wait, within the maximum)
  // it doubles too.
  for (Judge judge : {Judge::kTimeAsleep, Judge::kSinceProgress}) {
    SpinBudget b(std::chrono::milliseconds(10));
    for (int i = 0; i < 20; ++i) b.note(1s);
    ASSERT_EQ(b.get(), 1us);
    struct SleepsOnce : Recorder {
      Poll poll() {
        ++polls;
        return sleeps > 0 ? Poll::kDone : Poll::kIdle;
      }
    } r;
    spin_then_sleep(b, judge, WaitClock::now() + 10s, r);
    EXPECT_EQ(r.sleeps, 1u);
    EXPECT_EQ(b.get(), 2us) << (judge == Judge::kTimeAsleep ? "kTimeAsleep" : "kSinceProgress");
  }
}

}  // namespace
