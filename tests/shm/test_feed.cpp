// The feed (include/tdshm/feed.h) between real processes: items arrive in order from every
// producer, loans by reference and the rest by copy, held items are never overwritten, a heap
// that an item outgrows grows, a producer killed is a PeerLostError naming it, a consumer gone
// ends its producers, the timeout holds, frames a hostile peer writes are refused; nothing is
// left in /dev/shm.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/errors.h>
#include <tdshm/feed.h>
#include <tdshm/process_group.h>

#include <c10/core/CPUAllocator.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "feed/feed_wire.h"
#include "shm_test_support.h"

namespace tdshm::test {
namespace {

class Feed : public ShmTest {};

/// {"x": float [n] all `v`, ("meta", "seq"): int64 [2] = {k, seq}}, batch size [].
TensorDict item(int64_t n, int k, int64_t seq) {
  return TensorDict({{"x", at::full({n}, static_cast<double>(seq * 10 + k))},
                     {{"meta", "seq"}, at::tensor(std::vector<int64_t>{k, seq}, at::kLong)}},
                    {});
}

/// Whether `td` is item(n, k, seq), every element checked.
bool is_item(const TensorDict& td, int64_t n, int k, int64_t seq) {
  const at::Tensor x = td.get("x");
  const at::Tensor meta = td.get(Key("meta") / "seq");
  return x.numel() == n && at::all(x == static_cast<double>(seq * 10 + k)).item<bool>() &&
         meta[0].item<int64_t>() == k && meta[1].item<int64_t>() == seq;
}

// Three producers, 30 items each, every other one filled in place in a loan (zero copy) and the
// others plain tensordicts (copied into a loan); the consumer takes them round-robin and keeps
// every one (list(loader)): all arrive intact and in order though the heaps are held.
TEST_F(Feed, ItemsArriveInOrderAndHeldOnesAreNeverOverwritten) {
  set_deadline(120s);
  const std::string name = unique_name();
  constexpr int kProducers = 3;
  constexpr int64_t kItems = 30, kFloats = 16 * 1024;
  std::vector<Child> children;
  for (int k = 0; k < kProducers; ++k) {
    children.emplace_back([&, k] {
      FeedProducer p(name, k, {.timeout = 30s, .watch_pid = getppid()});
      int64_t loaned = 0;
      for (int64_t s = 0; s < kItems; ++s) {
        std::optional<TensorDict> slot = s % 2 == 1 ? p.try_loan(item(kFloats, 0, 0)) : std::nullopt;
        if (slot) {
          slot->update_(item(kFloats, k, s));
          SHM_CHECK(p.is_loan(slot->consolidated_storage()), "try_loan gave a tensordict outside the heap");
          p.put(*slot);
          ++loaned;
        } else {
          p.put(item(kFloats, k, s));
        }
      }
      SHM_CHECK(loaned > 0, "no item went in a loan");
      SHM_CHECK(p.items() == static_cast<uint64_t>(kItems), "items() counts the puts");
      p.close();
      SHM_CHECK_THROWS(
          Error, [&] { p.put(item(4, k, 0)); }, "put after close");
    });
  }
  FeedConsumer c(name, kProducers, {.timeout = 30s});
  std::vector<TensorDict> kept;
  for (int64_t s = 0; s < kItems; ++s) {
    for (int k = 0; k < kProducers; ++k) {
      std::optional<TensorDict> td = c.next();
      ASSERT_TRUE(td.has_value()) << "item " << s << " of producer " << k;
      ASSERT_TRUE(is_item(*td, kFloats, k, s)) << "item " << s << " of producer " << k;
      kept.push_back(std::move(*td));
    }
  }
  EXPECT_FALSE(c.next().has_value()) << "every producer closed";
  for (int k = 0; k < kProducers; ++k) EXPECT_TRUE(c.closed(k));
  ASSERT_TRUE(wait_all(children, 60s));
  for (const Child& ch : children) EXPECT_TRUE(ch.ok()) << ch.describe();
  for (size_t i = 0; i < kept.size(); ++i) {
    EXPECT_TRUE(is_item(kept[i], kFloats, static_cast<int>(i % kProducers), static_cast<int64_t>(i / kProducers)))
        << "held item " << i << " was overwritten";
  }
}

// Raw items: header bytes and tensors of every kind (a loan, a plain one, a strided one, none),
// then items that outgrow the heap: the group grows (new generations) and every byte arrives.
TEST_F(Feed, RawItemsAndAGrowingHeap) {
  set_deadline(120s);
  const std::string name = unique_name();
  const std::vector<int64_t> sizes{16, 1 << 10, 64 << 10, 1 << 20, 4 << 20};  // floats
  Child producer([&] {
    FeedProducer p(name, 0, {.timeout = 30s, .first_heap_bytes = 256 << 10, .watch_pid = getppid()});
    const std::vector<uint8_t> hello{'h', 'i'};
    p.put(hello, {});  // a header alone: the group opens at its first size
    SHM_CHECK(p.generation() == 0, "a header alone grows nothing");
    at::Tensor loan = p.try_loan({8}, at::kInt);
    SHM_CHECK(loan.defined(), "room for 32 bytes");
    loan.copy_(at::arange(8, at::kInt));
    const at::Tensor strided = at::arange(20, at::kLong).view({4, 5}).t();
    p.put(hello, {loan, at::full({3}, 2.5), strided});
    for (size_t i = 0; i < sizes.size(); ++i) {
      const std::vector<uint8_t> h{static_cast<uint8_t>(i)};
      p.put(h, {at::full({sizes[i]}, static_cast<double>(i + 1))});
    }
    SHM_CHECK(p.generation() >= 2, "items of 4 and 16 MiB outgrew a 256 KiB heap; generation " << p.generation());
    p.close();
  });
  FeedConsumer c(name, 1, {.timeout = 30s, .first_heap_bytes = 256 << 10});
  std::optional<FeedItem> a = c.next_from(0);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->header, (std::vector<uint8_t>{'h', 'i'}));
  EXPECT_TRUE(a->tensors.empty());
  std::optional<FeedItem> b = c.next_from(0);
  ASSERT_TRUE(b);
  ASSERT_EQ(b->tensors.size(), 3u);
  EXPECT_TRUE(at::equal(b->tensors[0], at::arange(8, at::kInt)));
  EXPECT_TRUE(at::equal(b->tensors[1], at::full({3}, 2.5)));
  EXPECT_TRUE(at::equal(b->tensors[2], at::arange(20, at::kLong).view({4, 5}).t()));
  EXPECT_TRUE(release_view(b->tensors[0])) << "a loan goes by reference, however small";
  EXPECT_FALSE(release_view(b->tensors[1])) << "a small tensor that is no loan travels by value";
  EXPECT_FALSE(release_view(b->tensors[2])) << "a small strided one too";
  std::vector<FeedItem> held;
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::optional<FeedItem> it = c.next_from(0);
    ASSERT_TRUE(it) << "item " << i;
    ASSERT_EQ(it->header, std::vector<uint8_t>{static_cast<uint8_t>(i)});
    ASSERT_EQ(it->tensors.size(), 1u);
    EXPECT_EQ(it->tensors[0].numel(), sizes[i]);
    EXPECT_TRUE(at::all(it->tensors[0] == static_cast<double>(i + 1)).item<bool>()) << "item " << i;
    held.push_back(std::move(*it));
  }
  EXPECT_FALSE(c.next_from(0).has_value());
  EXPECT_FALSE(c.next_from(0).has_value()) << "closed stays closed";
  ASSERT_TRUE(producer.wait(60s));
  EXPECT_TRUE(producer.ok()) << producer.describe();
  // Views of earlier generations stay readable after their groups are gone.
  for (size_t i = 0; i < held.size(); ++i) {
    EXPECT_TRUE(at::all(held[i].tensors[0] == static_cast<double>(i + 1)).item<bool>()) << "held item " << i;
  }
}

// Tensors of at most 4 KiB that are no loans travel inside their item's frame: every dtype and
// shape a frame holds (a scalar, an empty one, bool, 16-byte complex, a conjugate view, a strided
// one) arrives with its values, in its place among the others; one of 7 dimensions goes as a
// message of its own, a loan by reference, a larger tensor copied into a loan.
TEST_F(Feed, SmallTensorsTravelInsideTheirFrame) {
  set_deadline(60s);
  const std::string name = unique_name();
  const auto expected = [] {
    return std::vector<at::Tensor>{
        at::scalar_tensor(2.5, at::kDouble),
        at::zeros({0, 3}, at::kInt),
        at::arange(3, at::kLong).remainder(2).to(at::kBool),
        at::arange(6, at::kDouble).view({3, 2}).to(at::kComplexDouble) * c10::complex<double>(0, 1),
        at::arange(4, at::kFloat).to(at::kComplexFloat) + c10::complex<float>(0, 1),  // sent as its conj()
        at::arange(2, at::kChar).view({1, 1, 1, 1, 1, 2, 1}),
        at::arange(16, at::kFloat),  // sent as a loan
        at::arange(20, at::kLong).view({4, 5}).t(),
        at::arange(1280, at::kFloat),  // 5 KiB: copied into a loan
    };
  };
  Child producer([&] {
    FeedProducer p(name, 0, {.timeout = 30s, .watch_pid = getppid()});
    p.put(std::vector<uint8_t>{'a'}, {at::zeros({1 << 14})});  // the heap
    std::vector<at::Tensor> t = expected();
    t[4] = t[4].conj().resolve_conj().conj();  // the same values, through a conjugate view
    SHM_CHECK(t[4].is_conj(), "a conjugate view");
    at::Tensor loan = p.try_loan({16}, at::kFloat);
    SHM_CHECK(loan.defined(), "room for a loan");
    loan.copy_(t[6]);
    t[6] = loan;
    p.put(std::vector<uint8_t>{'h', 'i'}, t);
    p.close();
  });
  FeedConsumer c(name, 1, {.timeout = 30s});
  ASSERT_TRUE(c.next_from(0));
  std::optional<FeedItem> item;
  try {
    item = c.next_from(0);
  } catch (const std::exception& e) {
    ASSERT_TRUE(producer.wait(30s));
    FAIL() << e.what() << "; the producer: " << producer.describe();
  }
  ASSERT_TRUE(item);
  EXPECT_EQ(item->header, (std::vector<uint8_t>{'h', 'i'}));
  const std::vector<at::Tensor> want = expected();
  ASSERT_EQ(item->tensors.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const at::Tensor& got = item->tensors[i];
    EXPECT_EQ(got.scalar_type(), want[i].scalar_type()) << "tensor " << i;
    EXPECT_EQ(got.sizes(), want[i].sizes()) << "tensor " << i;
    EXPECT_TRUE(at::equal(got, want[i])) << "tensor " << i << ": " << got << " against " << want[i];
    EXPECT_FALSE(got.is_conj()) << "tensor " << i;
  }
  for (size_t i : {0, 1, 2, 3, 4, 5, 7}) EXPECT_FALSE(release_view(item->tensors[i])) << "tensor " << i << " by value";
  EXPECT_TRUE(release_view(item->tensors[6])) << "a loan by reference";
  EXPECT_TRUE(release_view(item->tensors[8])) << "5 KiB copied into a loan";
  EXPECT_FALSE(c.next_from(0).has_value());
  ASSERT_TRUE(producer.wait(30s));
  EXPECT_TRUE(producer.ok()) << producer.describe();
}

// FeedProducer::HeapAllocations: inside the scope, what torch allocates on this thread (large
// enough, once a heap exists) lies in the heap and travels by reference; smaller allocations,
// other threads, a forked child, allocations held past half the heap (items in flight do not
// count) and those after the scope are torch's ordinary ones; c10's raw_allocate works; a
// redirected tensor outlives its producer.
TEST_F(Feed, AllocationsInTheHeapScopeLieInTheHeap) {
  set_deadline(90s);
  const std::string name = unique_name();
  constexpr int64_t kFloats = 32 << 10;  // 128 KiB
  Child producer([&] {
    FeedProducer p(name, 0, {.timeout = 30s, .watch_pid = getppid()});
    {
      FeedProducer::HeapAllocations early(p, 16 << 10);
      SHM_CHECK(early.active(), "torch kept another CPU allocator");
      SHM_CHECK(!p.is_loan(at::full({kFloats}, 1.0f)), "no heap before the first put");
    }
    p.put(item(kFloats, 0, 0));  // the heap: sized from this item
    at::Tensor kept;
    {
      FeedProducer::HeapAllocations scope(p, 16 << 10);
      at::Tensor big = at::full({kFloats}, 7.0f);
      SHM_CHECK(p.is_loan(big), "a 128 KiB tensor made in the scope lies in the heap");
      SHM_CHECK(!p.is_loan(at::full({100}, 1.0f)), "a small one is torch's");
      c10::Allocator* cpu = c10::GetCPUAllocator();
      void* raw = cpu->raw_allocate(64 << 10);
      std::memset(raw, 3, 64 << 10);
      SHM_CHECK(p.is_loan(at::from_blob(raw, {64 << 10}, at::kByte)), "raw_allocate goes to the heap too");
      cpu->raw_deallocate(raw);
      bool thread_in_heap = true;
      std::thread([&] { thread_in_heap = p.is_loan(at::full({kFloats}, 1.0f)); }).join();
      SHM_CHECK(!thread_in_heap, "another thread allocates as usual");
      const pid_t child = ::fork();
      if (child == 0) ::_exit(p.is_loan(at::full({kFloats}, 1.0f)) ? 1 : 0);
      int status = 0;
      SHM_CHECK(::waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                "a child forked in the scope allocates as usual");
      // Held allocations stop at half the heap: the items' own loans keep room.
      std::vector<at::Tensor> cache;
      while (cache.size() < 64) {
        cache.push_back(at::empty({kFloats}, at::kFloat));
        if (!p.is_loan(cache.back())) break;
      }
      SHM_CHECK(cache.size() > 2 && cache.size() < 64 && !p.is_loan(cache.back()),
                "held allocations stop short of the whole heap (" << cache.size() << ")");
      SHM_CHECK(p.try_loan({kFloats}, at::kFloat).defined(), "room for an item's loan remains");
      cache.clear();
      p.put(std::vector<uint8_t>{1}, {big, at::full({3}, 2.0f)});
      // Items in flight (the consumer holds them) are the items' own loans, not held allocations:
      // a producer running ahead still makes its next tensor in the heap.
      for (int k = 0; k < 3; ++k) p.put(std::vector<uint8_t>{2}, {at::full({kFloats}, static_cast<float>(10 + k))});
      SHM_CHECK(p.is_loan(at::full({kFloats}, 1.0f)), "items in flight leave room for the next one's tensor");
      kept = at::full({kFloats}, 9.0f);
    }
    SHM_CHECK(!p.is_loan(at::full({kFloats}, 1.0f)), "after the scope, torch's allocator");
    SHM_CHECK(p.is_loan(kept), "a redirected tensor stays a loan after the scope");
    p.close();
    p = FeedProducer(name + "-gone", 0);  // the first producer's state is destroyed
    SHM_CHECK(at::all(kept == 9.0f).item<bool>(), "a redirected tensor outlives its producer");
  });
  FeedConsumer c(name, 1, {.timeout = 30s});
  // A failed check ends the producer, and a read then fails: say what the producer said.
  auto guarded = [&](auto read) -> decltype(read()) {
    try {
      return read();
    } catch (const std::exception& e) {
      (void)producer.wait(30s);
      ADD_FAILURE() << e.what() << "; the producer: " << producer.describe();
      return std::nullopt;
    }
  };
  auto next = [&] { return guarded([&] { return c.next_from(0); }); };
  const auto first = guarded([&] { return c.next(); });
  ASSERT_TRUE(first && is_item(*first, kFloats, 0, 0));
  std::optional<FeedItem> it = next();
  ASSERT_TRUE(it);
  ASSERT_EQ(it->tensors.size(), 2u);
  EXPECT_TRUE(at::all(it->tensors[0] == 7.0f).item<bool>());
  EXPECT_TRUE(at::equal(it->tensors[1], at::full({3}, 2.0f)));
  std::vector<FeedItem> in_flight;  // held until the producer is done
  for (int k = 0; k < 3; ++k) {
    std::optional<FeedItem> f = next();
    ASSERT_TRUE(f);
    ASSERT_EQ(f->tensors.size(), 1u);
    EXPECT_TRUE(at::all(f->tensors[0] == static_cast<float>(10 + k)).item<bool>()) << "item " << k;
    in_flight.push_back(std::move(*f));
  }
  EXPECT_TRUE(release_view(it->tensors[0])) << "the heap's tensor arrives as a view of the producer's loan";
  EXPECT_FALSE(release_view(it->tensors[1])) << "a tensor of at most 4 KiB travels by value";
  EXPECT_FALSE(next().has_value());
  ASSERT_TRUE(producer.wait(60s));
  EXPECT_TRUE(producer.ok()) << producer.describe();
}

// A producer killed mid-feed: the consumer gets what it sent, then a PeerLostError within ~1 s.
TEST_F(Feed, AProducerKilledIsAPeerLostError) {
  set_deadline(60s);
  const std::string name = unique_name();
  // The producer dies once the consumer took an item (one killed while the consumer's rendezvous
  // still polls: AProducerKilledRightAfterItsPutsStillDeliversThem).
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  Child producer([&] {
    FeedProducer p(name, 0, {.timeout = 30s, .watch_pid = getppid()});
    p.put(item(64, 0, 0));
    pollfd ready{go[0], POLLIN, 0};
    char byte = 0;
    SHM_CHECK(::poll(&ready, 1, 20000) == 1 && ::read(go[0], &byte, 1) == 1, "no word from the consumer");
    p.put(item(64, 0, 1));
    p.put(item(64, 0, 2));
    ::raise(SIGKILL);
  });
  FeedConsumer c(name, 1, {.timeout = 30s});
  ASSERT_TRUE(is_item(*c.next(), 64, 0, 0));
  ASSERT_EQ(::write(go[1], "g", 1), 1);
  ::close(go[0]);
  ::close(go[1]);
  ASSERT_TRUE(is_item(*c.next(), 64, 0, 1));
  ASSERT_TRUE(is_item(*c.next(), 64, 0, 2));
  ASSERT_TRUE(producer.wait(20s));
  EXPECT_EQ(producer.signal(), SIGKILL);
  const auto start = Clock::now();
  try {
    (void)c.next();
    ADD_FAILURE() << "next() after the producer died returned";
  } catch (const PeerLostError& e) {
    EXPECT_LT(Clock::now() - start, 2s);
    EXPECT_NE(std::string(e.what()).find("producer 0: rank 1 (pid " + std::to_string(producer.pid()) + ")"),
              std::string::npos)
        << e.what();
  }
}

// A producer killed while it waits for the consumer to join its first group leaves the group in
// /dev/shm (its rank never left), and the consumer, who never came to it, knew no name to sweep:
// its shutdown now sweeps every producer's group it never joined. (A Python main raising a
// worker's error and exiting left the other workers' groups so.)
TEST_F(Feed, AConsumerRemovesTheGroupOfAProducerKilledBeforeItCame) {
  set_deadline(60s);
  const std::string name = unique_name();
  const std::string group = feed::group_name(name, 1, 0);
  FeedConsumer c(name, 2, {.timeout = 30s});
  bool left_behind = false;
  for (int attempt = 0; attempt < 10 && !left_behind; ++attempt) {
    Child producer([&] {
      FeedProducer p(name, 1, {.timeout = 30s});
      p.put(item(64, 1, 0));  // waits for the consumer, in slices that each make the group anew
    });
    ASSERT_TRUE(wait_segment_ready(group, {1}, 10s)) << producer.describe();
    ASSERT_EQ(::kill(producer.pid(), SIGKILL), 0);
    ASSERT_TRUE(producer.wait(10s));
    // Killed inside a slice: the group stays, its rank 1 dead (between two slices: none; again).
    left_behind = std::filesystem::exists(segment_path(group));
  }
  ASSERT_TRUE(left_behind) << "the producer was never killed inside a slice";
  c.shutdown();
  EXPECT_FALSE(std::filesystem::exists(segment_path(group))) << "the consumer's shutdown left it";
}

// A producer that puts its items and is killed while the consumer's rendezvous (it attached
// first) has not looked yet: the group had formed on the producer's side, so the consumer gets
// every item, then a PeerLostError naming the producer. (Its rendezvous took such a producer for
// one that "died before the group formed", and the items were lost, also when the consumer's
// periodic liveness check came before its next look at the arrivals.) The consumer is stopped
// (SIGSTOP) in its rendezvous poll until the producer is dead, so the order is certain.
TEST_F(Feed, AProducerKilledRightAfterItsPutsStillDeliversThem) {
  set_deadline(60s);
  const std::string name = unique_name();
  int pid_pipe[2];
  ASSERT_EQ(::pipe(pid_pipe), 0);
  Child consumer([&] {
    ::close(pid_pipe[1]);
    FeedConsumer c(name, 1, {.timeout = 30s});
    for (int64_t s = 0; s < 3; ++s) {
      const std::optional<TensorDict> td = c.next();  // the first joins the group
      SHM_CHECK(td && is_item(*td, 64, 0, s), "item " << s << " did not arrive");
    }
    pid_t producer = 0;
    SHM_CHECK(::read(pid_pipe[0], &producer, sizeof producer) == sizeof producer, "no pid from the test");
    SHM_CHECK_THROWS(
        PeerLostError, [&] { (void)c.next(); }, "producer 0: rank 1 (pid " + std::to_string(producer) + ")");
  });
  ::close(pid_pipe[0]);
  // Stopped once it attached and let go of the segment's lock, so in its rendezvous poll.
  const bool waiting = wait_segment_ready(feed::group_name(name, 0, 0), {0}, 10s);
  ASSERT_TRUE(waiting && stop_outside_segment_lock(consumer.pid(), feed::group_name(name, 0, 0), 10s))
      << "the consumer never joined; " << consumer.describe();
  Child producer([&] {
    FeedProducer p(name, 0, {.timeout = 30s});
    for (int64_t s = 0; s < 3; ++s) p.put(item(64, 0, s));
    ::raise(SIGKILL);
  });
  const bool died = producer.wait(20s);
  const pid_t producer_pid = producer.pid();
  const bool told = ::write(pid_pipe[1], &producer_pid, sizeof producer_pid) == sizeof producer_pid;
  ::close(pid_pipe[1]);
  ASSERT_EQ(::kill(consumer.pid(), SIGCONT), 0);
  ASSERT_TRUE(died) << producer.describe();
  EXPECT_EQ(producer.signal(), SIGKILL) << producer.describe();
  ASSERT_TRUE(told);
  ASSERT_TRUE(consumer.wait(30s));
  EXPECT_TRUE(consumer.ok()) << consumer.describe();
}

// A consumer that leaves ends a producer's put (PeerLostError); a producer whose consumer died
// before joining gives up through watch_pid; a consumer whose producer never comes times out.
TEST_F(Feed, EitherSideGoneOrLateEndsTheOthersWait) {
  set_deadline(90s);
  {
    const std::string name = unique_name();
    Child producer([&] {
      FeedProducer p(name, 0, {.timeout = 30s, .watch_pid = getppid()});
      SHM_CHECK_THROWS(
          PeerLostError,
          [&] {
            for (int64_t s = 0; s < 1000; ++s) p.put(item(1 << 16, 0, s));
          },
          "left the group");
    });
    {
      FeedConsumer c(name, 1, {.timeout = 30s});
      ASSERT_TRUE(is_item(*c.next(), 1 << 16, 0, 0));
    }  // leaves without reading the rest
    ASSERT_TRUE(producer.wait(30s));
    EXPECT_TRUE(producer.ok()) << producer.describe();
  }
  {
    const std::string name = unique_name();
    Child watcher([&] {
      Child gone([] { ::_exit(0); });  // the "consumer": gone before it joins
      SHM_CHECK(gone.wait(10s), "the short-lived child");
      FeedProducer p(name, 0, {.watch_pid = gone.pid()});
      const auto start = Clock::now();
      SHM_CHECK_THROWS(
          PeerLostError, [&] { p.put(item(4, 0, 0)); }, "is gone");
      SHM_CHECK(Clock::now() - start < 5s, "gave up late");
    });
    ASSERT_TRUE(watcher.wait(30s));
    EXPECT_TRUE(watcher.ok()) << watcher.describe();
  }
  {
    const std::string name = unique_name();
    FeedConsumer c(name, 2, {.timeout = 300ms});
    const auto start = Clock::now();
    EXPECT_THROW((void)c.next_from(1), TimeoutError);
    EXPECT_GE(Clock::now() - start, 290ms);
    EXPECT_LT(Clock::now() - start, 5s);
  }
}

// FeedOptions::check ends a wait (Ctrl-C in a Python main), joined or not; watch() ends the
// consumer's wait for a producer that died before it joined.
TEST_F(Feed, ACheckOrAWatchedProducerEndsTheConsumersWait) {
  set_deadline(60s);
  struct Interrupted {};
  for (const bool joined : {false, true}) {
    const std::string name = unique_name();
    Child producer([&] {
      FeedProducer p(name, 0, {.timeout = 20s, .watch_pid = getppid()});
      if (joined) p.put(item(4, 0, 0));
      std::this_thread::sleep_for(30s);  // never sends (more): killed at the end
    });
    int checks = 0;
    FeedConsumer c(name, 1, {.timeout = 20s, .check = [&] {
                               if (++checks == 3) throw Interrupted{};
                             }});
    if (joined) {
      ASSERT_TRUE(is_item(*c.next(), 4, 0, 0));
    }
    const auto start = Clock::now();
    EXPECT_THROW((void)c.next_from(0), Interrupted);
    EXPECT_LT(Clock::now() - start, 3s);
    EXPECT_EQ(c.closed(0), joined) << "a receive withdrawn closes the producer; an interrupted join does not";
    producer.kill();
    ASSERT_TRUE(producer.wait(10s));
  }
  {
    const std::string name = unique_name();
    Child early([] { ::_exit(0); });  // a producer that died before its first put
    FeedConsumer c(name, 1, {.timeout = 20s});
    c.watch(0, early.pid());
    ASSERT_TRUE(early.wait(10s));
    const auto start = Clock::now();
    try {
      (void)c.next_from(0);
      ADD_FAILURE() << "a producer that never came gave an item";
    } catch (const PeerLostError& e) {
      EXPECT_NE(std::string(e.what()).find("producer 0 (process " + std::to_string(early.pid())), std::string::npos)
          << e.what();
    }
    EXPECT_LT(Clock::now() - start, 2s);
  }
}

// Items of many small tensors (a frame of 64-128 KiB) put inside a HeapAllocations scope, as the
// Python loader's workers put every batch, while the consumer keeps every item (list(loader)):
// the frame was made in the heap, went by reference, and the put waited for the consumer to drop
// it: both sides waited forever.
TEST_F(Feed, AFrameOfSmallTensorsIsNeverALoanTheConsumerMustDrop) {
  set_deadline(60s);
  const std::string name = unique_name();
  constexpr int kItems = 12;
  // 20 tensors of 1024 floats (4 KiB each): all inside the frame, with the header.
  auto many = [](int64_t seq) {
    std::vector<at::Tensor> t;
    for (int j = 0; j < 20; ++j) t.push_back(at::full({1024}, static_cast<float>(seq * 100 + j)));
    return t;
  };
  Child producer([&] {
    FeedProducer p(name, 0, {.timeout = 20s, .watch_pid = getppid()});
    p.put(std::vector<uint8_t>{0}, many(0));  // the heap
    FeedProducer::HeapAllocations scope(p, 16 << 10);
    SHM_CHECK(scope.active(), "torch kept another CPU allocator");
    for (int64_t s = 1; s < kItems; ++s) p.put(std::vector<uint8_t>{static_cast<uint8_t>(s)}, many(s));
    p.close();
  });
  FeedConsumer c(name, 1, {.timeout = 20s});
  std::vector<FeedItem> kept;
  while (std::optional<FeedItem> item = c.next_from(0)) kept.push_back(std::move(*item));
  ASSERT_EQ(kept.size(), static_cast<size_t>(kItems));
  for (int64_t s = 0; s < kItems; ++s) {
    const FeedItem& item = kept[static_cast<size_t>(s)];
    ASSERT_EQ(item.header, std::vector<uint8_t>{static_cast<uint8_t>(s)});
    ASSERT_EQ(item.tensors.size(), 20u);
    for (int j = 0; j < 20; ++j) {
      ASSERT_TRUE(at::all(item.tensors[static_cast<size_t>(j)] == static_cast<float>(s * 100 + j)).item<bool>())
          << "item " << s << " tensor " << j;
    }
  }
  ASSERT_TRUE(producer.wait(20s));
  EXPECT_TRUE(producer.ok()) << producer.describe();
}

// A consumer that shuts down without asking for a producer's items (a loader's `break` after
// its first batch) refuses the group that producer made and waits in: the producer's wait ends
// at once with the consumer gone, not at its timeout (30 s here; 200 ms slices with a loader's
// check), though the consumer's process runs on.
TEST_F(Feed, AConsumerThatShutsDownRefusesTheProducerWaitingToMeetIt) {
  set_deadline(60s);
  const std::string name = unique_name();
  FeedConsumer c(name, 1, {.timeout = 30s});
  Child producer([&] {
    FeedProducer p(name, 0, {.timeout = 30s, .watch_pid = getppid()});
    const auto start = Clock::now();
    SHM_CHECK_THROWS(
        PeerLostError,
        [&] {
          for (int64_t s = 0; s < 1000; ++s) p.put(item(1 << 12, 0, s));
        },
        "left the group");
    SHM_CHECK(Clock::now() - start < 10s, "the producer's wait ended late");
  });
  ASSERT_TRUE(wait_segment_ready(feed::group_name(name, 0, 0), {1}, 20s)) << "the producer never made its group";
  const auto start = Clock::now();
  c.shutdown();
  ASSERT_TRUE(producer.wait(20s));
  EXPECT_TRUE(producer.ok()) << producer.describe();
  EXPECT_LT(Clock::now() - start, 5s);
  c.shutdown();  // again, once the producer has ended: nothing of it is left
  EXPECT_TRUE(shm_entries_of(name).empty());
}

// Bad arguments, and frames a hostile producer writes: each a typed error naming the producer.
TEST_F(Feed, BadArgumentsAndHostileFramesAreTypedErrors) {
  set_deadline(60s);
  EXPECT_THROW(FeedConsumer(unique_name(), 0), Error);
  EXPECT_THROW(FeedProducer(unique_name(), -1), Error);
  EXPECT_THROW(FeedProducer("bad/name", 0), SegmentError);
  {
    FeedConsumer c(unique_name(), 2);
    EXPECT_THROW((void)c.next_from(2), Error);
    EXPECT_THROW((void)c.next_from(-1), Error);
  }
  {
    FeedProducer p(unique_name(), 0);
    EXPECT_THROW(p.put(std::vector<uint8_t>{}, {at::Tensor()}), TypeError);
    EXPECT_FALSE(p.try_loan({4}, at::kFloat).defined()) << "no heap before the first put";
  }
  // A peer that joins producer 0's group and sends frames of its own.
  for (const std::string bad : {"short", "magic", "kind", "grow", "inline-count", "inline-table", "inline-dtype",
                                "inline-size", "inline-order"}) {
    const std::string name = unique_name();
    Child hostile([&] {
      ShmOptions so;
      so.loan_bytes = 1 << 20;
      so.loan_tickets = 64;
      so.slots_per_rank = 8;
      so.window_bytes = 64 << 10;
      so.timeout = 20s;
      ProcessGroupShm pg(name + "-0-g0", 1, 2, so);
      const bool inl = bad.starts_with("inline");
      at::Tensor frame =
          at::zeros({bad == "short" ? 8 : (inl && bad != "inline-table" ? 32 + 2 * 64 + 64 : 48)}, at::kByte);
      uint32_t magic = bad == "magic" ? 1 : 0x44464454;
      std::memcpy(frame.data_ptr<uint8_t>(), &magic, 4);
      frame[4] = bad == "kind" ? 9 : (bad == "grow" ? 2 : 1);
      if (bad == "grow") frame[12] = 5;  // generation 5 after 0
      if (inl) {
        feed::FrameHead head;
        head.tensors = bad == "inline-count" ? 1 : 2;
        head.inline_tensors = bad == "inline-table" ? 1 : 2;
        feed::InlineTensor e[2];
        for (uint32_t i = 0; i < 2; ++i) {
          e[i].index = bad == "inline-order" ? 1 - i : i;
          e[i].dtype = static_cast<uint8_t>(bad == "inline-dtype" && i == 1 ? 200 : 6);  // float
          e[i].ndim = 1;
          e[i].sizes[0] = 4;
          e[i].bytes = bad == "inline-size" && i == 1 ? 8 : 16;
        }
        std::memcpy(frame.data_ptr<uint8_t>(), &head, sizeof head);
        std::memcpy(frame.data_ptr<uint8_t>() + sizeof head, e,
                    std::min<size_t>(sizeof e, frame.numel() - sizeof head));
      }
      post_send(pg, frame, 0, 7)->wait();
      std::this_thread::sleep_for(500ms);
    });
    FeedConsumer c(name, 1, {.timeout = 20s});
    try {
      (void)c.next_from(0);
      ADD_FAILURE() << bad << ": a hostile frame was taken";
    } catch (const TransportError& e) {
      EXPECT_NE(std::string(e.what()).find("producer 0 sent"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(c.next_from(0).has_value()) << "a producer that sent garbage is closed";
    ASSERT_TRUE(hostile.wait(20s));
  }
}

}  // namespace
}  // namespace tdshm::test
