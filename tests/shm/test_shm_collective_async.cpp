// Collectives issued without waiting (async_op=True in torch): the call returns at once and the
// collective progresses without its caller, in issue order per group (shm/collective_queue.h).
// The programs below deadlock when a collective runs in the thread that issues it; over gloo
// they work, and so they must over shm: a peer needs a message the caller sends only after the
// call, the caller blocks in a receive (on this group or another) that a peer sends only after
// the collective, or the caller is busy outside tdshm. Also: issue order with waits in any
// order, a wait with a timeout, futures nobody waits for, abort of a collective not started,
// and what destroying the group does to collectives not run.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shm_test_support.h"

namespace tdshm::test {
namespace {

class ShmAsyncCollective : public ShmTest {};

c10::intrusive_ptr<c10d::Work> allreduce(ProcessGroupShm& pg, const at::Tensor& t) {
  std::vector<at::Tensor> v{t};
  return pg.allreduce(v);
}

c10::intrusive_ptr<c10d::Work> broadcast(ProcessGroupShm& pg, const at::Tensor& t, int root) {
  std::vector<at::Tensor> v{t};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  return pg.broadcast(v, o);
}

// A word every rank sees, threads or forked processes alike: an anonymous shared mapping made
// before the ranks start.
class SharedFlag {
 public:
  SharedFlag() {
    void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap of the shared flag failed");
    word_ = new (p) std::atomic<int>(0);
  }
  ~SharedFlag() { munmap(word_, 4096); }
  SharedFlag(const SharedFlag&) = delete;
  SharedFlag& operator=(const SharedFlag&) = delete;
  std::atomic<int>& operator*() const { return *word_; }

 private:
  std::atomic<int>* word_;
};

constexpr Peers kBoth[] = {Peers::kThreads, Peers::kProcesses};

// The issue's program: rank 0 issues an all_reduce and then sends rank 1 the message rank 1
// receives before it enters the all_reduce.
TEST_F(ShmAsyncCollective, ThePeerNeedsAMessageSentAfterTheCall) {
  for (Peers peers : kBoth) {
    SCOPED_TRACE(peers_name(peers));
    const std::string name = unique_name();
    SHM_EXPECT_RANKS_OK(run_ranks(peers, 2, [&](int r) {
      ProcessGroupShm pg(name, r, 2, small_options());
      const at::Tensor t = at::full({1000}, static_cast<float>(r + 1));
      const at::Tensor m = at::arange(70000, at::kInt);  // chunked: it streams while both wait
      if (r == 0) {
        auto w = allreduce(pg, t);
        post_send(pg, m, 1, 7)->wait();
        w->wait();
      } else {
        const at::Tensor got = at::zeros_like(m);
        post_recv(pg, got, 0, 7)->wait();
        SHM_CHECK(at::equal(got, m), "the message before the collective");
        allreduce(pg, t)->wait();
      }
      SHM_CHECK(at::equal(t, at::full({1000}, 3.0f)), "rank " << r << ": the all_reduce's result");
    }));
  }
}

// Rank 0 blocks in a receive that rank 1 sends only after the all_reduce rank 0 issued: the
// collective must run while rank 0 waits for the message, on this group and across groups.
TEST_F(ShmAsyncCollective, TheCallerWaitsForAMessageThePeerSendsAfterTheCollective) {
  for (Peers peers : kBoth) {
    for (bool other_group : {false, true}) {
      SCOPED_TRACE(std::string(peers_name(peers)) + (other_group ? ", receive on another group" : ""));
      const std::string name = unique_name(), name2 = unique_name();
      SHM_EXPECT_RANKS_OK(run_ranks(peers, 2, [&](int r) {
        ProcessGroupShm pg(name, r, 2, small_options());
        ProcessGroupShm pg2(name2, r, 2, small_options());
        ProcessGroupShm& p2p = other_group ? pg2 : pg;
        const at::Tensor t = at::full({300}, static_cast<int64_t>(10 * (r + 1)), at::kLong);
        const at::Tensor m = at::full({5}, 42, at::kInt);
        if (r == 0) {
          auto w = allreduce(pg, t);
          const at::Tensor got = at::zeros_like(m);
          post_recv(p2p, got, 1, 3)->wait();
          SHM_CHECK(at::equal(got, m), "the message after the collective");
          w->wait();
        } else {
          allreduce(pg, t)->wait();
          post_send(p2p, m, 0, 3)->wait();
        }
        SHM_CHECK(at::equal(t, at::full({300}, 30, at::kLong)), "rank " << r << ": the all_reduce's result");
      }));
    }
  }
}

// Rank 0 issues a broadcast and then spins on a plain shared word, calling nothing of tdshm,
// until rank 1 has its result: the collective ran without its caller (the helper thread).
TEST_F(ShmAsyncCollective, ItProgressesWhileTheCallerIsBusyOutsideTdshm) {
  for (Peers peers : kBoth) {
    SCOPED_TRACE(peers_name(peers));
    const std::string name = unique_name();
    SharedFlag flag;
    SHM_EXPECT_RANKS_OK(run_ranks(peers, 2, [&](int r) {
      ProcessGroupShm pg(name, r, 2, small_options());
      const at::Tensor t = r == 0 ? at::arange(1000) : at::zeros({1000}, at::kLong);
      if (r == 0) {
        auto w = broadcast(pg, t, 0);
        const auto give_up = Clock::now() + 20s;
        while ((*flag).load() == 0) {
          SHM_CHECK(Clock::now() < give_up, "rank 1 did not get the broadcast within 20 s");
          std::this_thread::sleep_for(100us);
        }
        w->wait();
      } else {
        broadcast(pg, t, 0)->wait();
        SHM_CHECK(at::equal(t, at::arange(1000)), "the broadcast's result");
        (*flag).store(1);
      }
    }));
  }
}

// Every rank issues three collectives, then waits for them in another order (rank 0 in reverse,
// rank 2 only the last, from another thread): they run in issue order, every result is right.
TEST_F(ShmAsyncCollective, TheyRunInIssueOrderWhateverOrderTheyAreWaitedIn) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 3, [&](int r) {
    ProcessGroupShm pg(name, r, 3, small_options());
    for (int round = 0; round < 20; ++round) {
      const at::Tensor a = at::full({100}, static_cast<double>(r + round), at::kDouble);
      const at::Tensor b = r == round % 3 ? at::arange(3000) + round : at::zeros({3000}, at::kLong);
      const at::Tensor c = at::full({17}, r == 1 ? 2 : 1, at::kInt);
      std::vector<at::Tensor> cv{c};
      c10d::AllreduceOptions prod;
      prod.reduceOp = c10d::ReduceOp::PRODUCT;
      auto wa = allreduce(pg, a);
      auto wb = broadcast(pg, b, round % 3);
      auto wc = pg.allreduce(cv, prod);
      if (r == 0) {
        wc->wait();
        wb->wait();
        wa->wait();
      } else if (r == 1) {
        wa->wait();
        wb->wait();
        wc->wait();
      } else {
        std::thread([&] { wc->wait(); }).join();
        SHM_CHECK(wa->isCompleted() && wb->isCompleted(), "round " << round << ": a later collective completed first");
      }
      SHM_CHECK(at::equal(a, at::full({100}, static_cast<double>(3 + 3 * round), at::kDouble)), "round " << round << ": all_reduce");
      SHM_CHECK(at::equal(b, at::arange(3000) + round), "round " << round << ": broadcast");
      SHM_CHECK(at::equal(c, at::full({17}, 2, at::kInt)), "round " << round << ": product");
    }
  }));
}

// A wait with a timeout that passes throws TimeoutError and leaves the collective to go on;
// a future nobody waits on through the Work completes with the result.
TEST_F(ShmAsyncCollective, AWaitThatTimesOutLeavesItRunningAndFuturesComplete) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    const at::Tensor t = at::full({8}, static_cast<float>(r + 1));
    if (r == 0) {
      auto w = allreduce(pg, t);
      const auto start = Clock::now();
      SHM_CHECK_THROWS(TimeoutError, [&] { w->wait(50ms); }, "timeout");
      SHM_CHECK(Clock::now() - start < 5s, "the wait's timeout was not kept");
      w->wait();
      SHM_CHECK(at::equal(t, at::full({8}, 3.0f)), "the all_reduce after a timed-out wait");
      auto f = allreduce(pg, t)->getFuture();
      f->wait();  // c10's own wait: it never calls into tdshm
      SHM_CHECK(!f->hasError(), "the future failed");
      SHM_CHECK(at::equal(f->value().toTensorVector()[0], at::full({8}, 6.0f)), "the future's value");
    } else {
      std::this_thread::sleep_for(400ms);
      allreduce(pg, t)->wait();
      allreduce(pg, t)->wait();
      SHM_CHECK(at::equal(t, at::full({8}, 6.0f)), "rank 1's results");
    }
  }));
}

// A Work's future asked for after wait() completes at once with the collective's result (it was
// made after the completion that would have marked it, and never completed), for every kind of
// collective, and with the error of one that failed. Never c10's blocking wait on the future: a
// future that never completes is a check that fails, not a hang.
TEST_F(ShmAsyncCollective, AFutureAskedForAfterWaitCompletes) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 3, [&](int r) {
    ProcessGroupShm pg(name, r, 3, small_options());
    auto expect_completed = [&](const c10::intrusive_ptr<c10d::Work>& w, const char* what) {
      w->wait();
      auto f = w->getFuture();
      const auto give_up = Clock::now() + 5s;
      while (!f->completed()) {
        SHM_CHECK(Clock::now() < give_up, std::string("the future of a waited ") + what + " never completed");
        std::this_thread::sleep_for(1ms);
      }
      SHM_CHECK(!f->hasError(), std::string("the future of a waited ") + what + " failed");
      return f->value().toTensorVector();
    };
    const float me = static_cast<float>(r + 1);
    {
      at::Tensor t = at::full({4}, me);
      auto out = expect_completed(allreduce(pg, t), "all_reduce");
      SHM_CHECK(out.size() == 1 && at::equal(out[0], at::full({4}, 6.0f)), "all_reduce's future value");
    }
    {
      at::Tensor t = at::full({4}, me);
      auto out = expect_completed(broadcast(pg, t, 1), "broadcast");
      SHM_CHECK(out.size() == 1 && at::equal(out[0], at::full({4}, 2.0f)), "broadcast's future value");
    }
    {
      std::vector<at::Tensor> v{at::full({4}, me)};
      c10d::ReduceOptions o;
      o.rootRank = 2;
      auto out = expect_completed(pg.reduce(v, o), "reduce");
      if (r == 2) SHM_CHECK(at::equal(out.at(0), at::full({4}, 6.0f)), "reduce's future value at the root");
    }
    {
      std::vector<at::Tensor> in{at::full({2}, me)};
      std::vector<std::vector<at::Tensor>> outs{{at::zeros({2}), at::zeros({2}), at::zeros({2})}};
      expect_completed(pg.allgather(outs, in), "all_gather");
      for (int k = 0; k < 3; ++k) {
        SHM_CHECK(at::equal(outs[0][k], at::full({2}, static_cast<float>(k + 1))), "all_gather's outputs");
      }
    }
    {
      at::Tensor in = at::full({2}, me);
      at::Tensor out = at::zeros({6});
      expect_completed(pg._allgather_base(out, in), "_allgather_base");
      SHM_CHECK(at::equal(out, at::tensor({1.f, 1.f, 2.f, 2.f, 3.f, 3.f})), "_allgather_base's output");
    }
    {
      std::vector<at::Tensor> in{at::full({2}, me)};
      std::vector<std::vector<at::Tensor>> outs;
      if (r == 0) outs = {{at::zeros({2}), at::zeros({2}), at::zeros({2})}};
      c10d::GatherOptions o;
      o.rootRank = 0;
      expect_completed(pg.gather(outs, in, o), "gather");
      if (r == 0) SHM_CHECK(at::equal(outs[0][2], at::full({2}, 3.0f)), "gather's outputs at the root");
    }
    {
      std::vector<at::Tensor> out{at::zeros({2})};
      std::vector<std::vector<at::Tensor>> ins;
      if (r == 0) ins = {{at::full({2}, 10.f), at::full({2}, 11.f), at::full({2}, 12.f)}};
      c10d::ScatterOptions o;
      o.rootRank = 0;
      expect_completed(pg.scatter(out, ins, o), "scatter");
      SHM_CHECK(at::equal(out[0], at::full({2}, 10.f + static_cast<float>(r))), "scatter's output");
    }
    {
      std::vector<at::Tensor> out{at::zeros({2})};
      std::vector<std::vector<at::Tensor>> ins{{at::full({2}, me), at::full({2}, me), at::full({2}, me)}};
      expect_completed(pg.reduce_scatter(out, ins), "reduce_scatter");
      SHM_CHECK(at::equal(out[0], at::full({2}, 6.0f)), "reduce_scatter's output");
    }
    {
      at::Tensor in = at::full({3}, me);
      at::Tensor out = at::zeros({3});
      std::vector<int64_t> none;
      expect_completed(pg.alltoall_base(out, in, none, none), "alltoall_base");
      SHM_CHECK(at::equal(out, at::tensor({1.f, 2.f, 3.f})), "alltoall_base's output");
    }
    {
      std::vector<at::Tensor> v{at::full({4}, me), at::full({2}, me)};
      expect_completed(pg.allreduce_coalesced(v), "allreduce_coalesced");
      SHM_CHECK(at::equal(v[1], at::full({2}, 6.0f)), "allreduce_coalesced's output");
    }
    expect_completed(pg.barrier(), "barrier");
    // A collective that failed (withdrawn before it ran): its late future holds the error.
    if (r == 0) {
      at::Tensor t = at::full({4}, me);
      const auto first = allreduce(pg, t);  // waits for the peers, which sleep below
      const at::Tensor b = at::ones({4});
      auto second = broadcast(pg, b, 0);
      second->abort();
      SHM_CHECK_THROWS(TransportError, [&] { second->wait(); }, "aborted");
      auto f = second->getFuture();
      SHM_CHECK(f->completed(), "the future of a failed, waited collective is not completed");
      SHM_CHECK(f->hasError(), "the future of a failed collective has no error");
      SHM_CHECK(f->tryRetrieveErrorMessage().find("aborted") != std::string::npos,
                "the failed future's error: " + f->tryRetrieveErrorMessage());
      first->wait();
    } else {
      std::this_thread::sleep_for(200ms);
      at::Tensor t = at::full({4}, me);
      allreduce(pg, t)->wait();
    }
    pg.barrier()->wait();
  }));
}

// abort() withdraws a collective that has not started (here: queued behind one that waits for
// a late peer): its wait throws TransportError, and the group's collectives go on in step.
TEST_F(ShmAsyncCollective, AbortWithdrawsACollectiveNotStarted) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    const at::Tensor t = at::full({4}, static_cast<float>(r + 1));
    if (r == 0) {
      auto first = allreduce(pg, t);
      const at::Tensor b = at::ones({4});
      auto second = broadcast(pg, b, 0);
      second->abort();
      SHM_CHECK_THROWS(TransportError, [&] { second->wait(); }, "aborted");
      first->wait();
    } else {
      std::this_thread::sleep_for(200ms);
      allreduce(pg, t)->wait();
    }
    SHM_CHECK(at::equal(t, at::full({4}, 3.0f)), "the collective before the aborted one");
    pg.barrier()->wait();
    exchange(pg);
  }));
}

// Destroying the group fails what it has not run, promptly, with a tdshm::Error; a Work kept
// past the group still answers.
TEST_F(ShmAsyncCollective, DestroyingTheGroupFailsCollectivesNotRun) {
  const std::string name = unique_name();
  SharedFlag flag;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) {
    auto pg = std::make_unique<ProcessGroupShm>(name, r, 2, small_options());
    if (r == 0) {
      const at::Tensor t = at::ones({4});
      auto w1 = allreduce(*pg, t);
      auto w2 = allreduce(*pg, t);
      const auto start = Clock::now();
      pg.reset();
      SHM_CHECK(Clock::now() - start < 5s, "destroying the group waited for its collectives");
      SHM_CHECK(w1->isCompleted() && w2->isCompleted(), "a collective of a destroyed group is pending");
      SHM_CHECK_THROWS(tdshm::Error, [&] { w1->wait(); }, "destroyed");
      SHM_CHECK_THROWS(tdshm::Error, [&] { w2->wait(); }, "destroyed");
      (*flag).store(1);
    } else {
      const auto give_up = Clock::now() + 20s;
      while ((*flag).load() == 0) {
        SHM_CHECK(Clock::now() < give_up, "rank 0 did not finish");
        std::this_thread::sleep_for(1ms);
      }
    }
  }));
}

}  // namespace
}  // namespace tdshm::test
