// What the ranks of `tdshm stress` send and check: the bodies of scenarios b-f and h, the checked
// exchange of a, g and the recovery groups, and the recreate loop's exchange. A received value
// that differs from what was sent throws WrongData; `phase` always says where a rank is.

#include "stress_internal.h"

#include <tdshm/distributed.h>
#include <tdshm/process_group.h>
#include <tdshm/tensordict.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <chrono>
#include <deque>
#include <initializer_list>
#include <thread>
#include <variant>

namespace tdshm::tools::stress {
namespace {

using namespace std::chrono_literals;

constexpr int kP2PRounds = 150;
constexpr int kBigTransfers = 5;
constexpr int64_t kBigFloats = int64_t{16} << 20;  // 64 MiB of float32
constexpr int kRemoteRounds = 30;
constexpr int kBroadcastRounds = 60;
constexpr int kFullRingRounds = 2;
constexpr auto kFullRingSleep = 150ms;
constexpr int kLoanRounds = 300;
constexpr int kLoanBuffers = 3;  // two per-leaf loans, then a consolidated one
constexpr int kLoanCopyEvery = 5;  // every fifth round rank 0 copies the loan out instead of a view

void expect(bool ok, const std::string& what) {
  if (!ok) throw WrongData(what);
}

at::Tensor i64(std::initializer_list<int64_t> values) {
  at::Tensor t = at::zeros({static_cast<int64_t>(values.size())}, at::kLong);
  int64_t* p = t.data_ptr<int64_t>();
  for (const int64_t v : values) *p++ = v;
  return t;
}

std::string i64_str(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  std::string out = "[";
  for (int64_t i = 0; i < c.numel(); ++i) out += (i ? ", " : "") + std::to_string(c.data_ptr<int64_t>()[i]);
  return out + "]";
}

bool i64_eq(const at::Tensor& t, std::initializer_list<int64_t> values) {
  if (t.scalar_type() != at::kLong || t.numel() != static_cast<int64_t>(values.size())) return false;
  const at::Tensor c = t.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  for (const int64_t v : values) {
    if (*p++ != v) return false;
  }
  return true;
}

void fill_all(const TensorDict& td, int64_t v) {
  for (const Key& k : td.sorted_leaf_keys()) td.get(k).fill_(v);
}

std::string round_phase(int i, const char* what) { return "round " + std::to_string(i) + ": " + what; }

TensorDict p2p_tree() {
  return TensorDict({{"a", at::zeros({1000}, at::kFloat)},
                     {"b", at::zeros({64}, at::kLong)},
                     {{"n", "c"}, at::zeros({100000}, at::kFloat)},
                     {{"n", "d"}, at::zeros({3}, at::kByte)}});
}

TensorDict big_tree() {
  return TensorDict({{"x", at::zeros({kBigFloats}, at::kFloat)}, {"i", at::zeros({1}, at::kLong)}}).consolidate();
}

TensorDict loan_tree() {
  return TensorDict({{"x", at::zeros({98304}, at::kByte)}, {{"n", "y"}, at::zeros({1000}, at::kFloat)}, {"i", at::zeros({1}, at::kLong)}});
}

bool loan_round_consolidated(int i) { return i % kLoanBuffers == kLoanBuffers - 1; }
int64_t loan_round_value(int i) { return i % 250 + 1; }

void fill_loan_round(const TensorDict& td, int i) {
  td.get("x").fill_(loan_round_value(i));
  td.get({"n", "y"}).fill_(loan_round_value(i));
  td.get("i").fill_(i);
}

void check_loan_round(const TensorDict& td, int i, const std::string& what) {
  const int64_t v = loan_round_value(i);
  expect(td.get("i").item<int64_t>() == i, what + ": leaf i is " + i64_str(td.get("i")));
  expect(td.get("x").eq(v).all().item<bool>() && td.get({"n", "y"}).eq(v).all().item<bool>(),
         what + ": a leaf is not all " + std::to_string(v));
}

// (h), the sender: kLoanBuffers loans filled in turn, each sent by reference once its previous
// send completed (rank 0 dropped its view or copied it). If rank 0 dies, the loans' room must come
// back: with every loan dropped, the whole heap can be lent again.
void loans_sender(std::string& phase) {
  const TensorDict like = loan_tree();
  std::vector<TensorDict> loans;
  for (int b = 0; b < kLoanBuffers; ++b) loans.push_back(loan(like, {.dst = 0, .consolidated = loan_round_consolidated(b)}));
  std::vector<Transfer> sent(kLoanBuffers);
  try {
    for (int i = 0; i < kLoanRounds; ++i) {
      const auto b = static_cast<size_t>(i % kLoanBuffers);
      phase = round_phase(i, "wait for the loan's previous send");
      sent[b].wait();
      fill_loan_round(loans[b], i);
      phase = round_phase(i, "isend a loan");
      sent[b] = loans[b].isend({.dst = 0, .return_early = true, .consolidated = loan_round_consolidated(i)});
    }
    phase = "wait for the last sends";
    for (const Transfer& t : sent) t.wait();
  } catch (const PeerLostError&) {
    sent.clear();
    loans.clear();
    const std::string failed = phase;
    phase = failed + "; PeerLostError, then lending the whole loan heap";
    const auto heap = static_cast<int64_t>(ShmOptions{}.loan_bytes);
    expect(loan({heap}, at::kByte, {.dst = 0}).defined(), phase + ": no loan");
    phase = failed;
    throw;
  }
}

// (h), the receiver: views of rounds i - 1 and i held (checked on arrival and again before they
// are dropped: nothing overwrote them), every fifth round a copy out of the loan instead. If rank
// 1 dies, the views held must still read what was sent.
void loans_receiver(std::string& phase) {
  TensorDict own = loan_tree();
  TensorDict own_consolidated = loan_tree().consolidate();  // also the schema of consolidated views
  std::deque<std::pair<TensorDict, int>> held;
  auto recheck = [&](const char* when) {
    for (const auto& [view, round] : held) check_loan_round(view, round, round_phase(round, when));
  };
  try {
    for (int i = 0; i < kLoanRounds; ++i) {
      const bool consolidated = loan_round_consolidated(i);
      if (i % kLoanCopyEvery == kLoanCopyEvery - 1) {
        phase = round_phase(i, "recv (a copy out of the loan)");
        TensorDict& into = consolidated ? own_consolidated : own;
        into.recv({.src = 1, .consolidated = consolidated});
        check_loan_round(into, i, phase);
      } else {
        phase = round_phase(i, "recv_view");
        const TensorDict& like = consolidated ? own_consolidated : own;  // gives keys or schema, not written
        held.emplace_back(like.recv_view({.src = 1, .consolidated = consolidated}), i);
        check_loan_round(held.back().first, i, phase);
      }
      while (!held.empty() && held.front().second < i - 1) {  // the sender refills that loan next
        check_loan_round(held.front().first, held.front().second, round_phase(held.front().second, "view before its drop"));
        held.pop_front();
      }
    }
  } catch (const PeerLostError&) {
    recheck("a view held when the sender was lost");
    throw;
  }
}

}  // namespace

/// Rank 0 sends (value, r, 1) to every other rank r as a one-leaf TensorDict; r checks it and
/// answers (value, r, 2), which rank 0 checks.
void checked_exchange(const WorkerSpec& w, int64_t value, std::string& phase) {
  if (w.rank == 0) {
    for (int r = 1; r < w.world; ++r) {
      phase = "exchange: send to rank " + std::to_string(r);
      TensorDict({{"x", i64({value, r, 1})}}).send({.dst = r});
    }
    for (int r = 1; r < w.world; ++r) {
      phase = "exchange: recv from rank " + std::to_string(r);
      TensorDict got({{"x", at::zeros({3}, at::kLong)}});
      got.recv({.src = r});
      expect(i64_eq(got.get("x"), {value, r, 2}), "rank 0 received " + i64_str(got.get("x")) + " from rank " +
                                                       std::to_string(r) + ", expected " +
                                                       i64_str(i64({value, r, 2})));
    }
  } else {
    phase = "exchange: recv from rank 0";
    TensorDict got({{"x", at::zeros({3}, at::kLong)}});
    got.recv({.src = 0});
    expect(i64_eq(got.get("x"), {value, w.rank, 1}),
           "received " + i64_str(got.get("x")) + ", expected " + i64_str(i64({value, w.rank, 1})));
    phase = "exchange: reply to rank 0";
    TensorDict({{"x", i64({value, w.rank, 2})}}).send({.dst = 0});
  }
}

// (b) rank 1 isends, rank 0 irecvs (return_premature, then waits) and answers the same way.
void body_p2p(const WorkerSpec& w, std::string& phase) {
  const TensorDict out = p2p_tree();
  TensorDict in = p2p_tree();
  for (int i = 0; i < kP2PRounds; ++i) {
    const int64_t to0 = (2 * i) % 251, to1 = (2 * i + 1) % 251;  // values fit uint8 and differ per message
    if (w.rank == 1) {
      phase = round_phase(i, "isend to 0");
      fill_all(out, to0);
      out.isend({.dst = 0});
      phase = round_phase(i, "irecv from 0");
      in.irecv({.src = 0, .return_premature = true}).wait();
      expect(in.eq(to1).all(), phase + ": a leaf differs from " + std::to_string(to1));
    } else {
      phase = round_phase(i, "irecv from 1");
      in.irecv({.src = 1, .return_premature = true}).wait();
      expect(in.eq(to0).all(), phase + ": a leaf differs from " + std::to_string(to0));
      phase = round_phase(i, "isend to 1");
      fill_all(out, to1);
      out.isend({.dst = 1});
    }
  }
}

// (c) rank 1 sends 64 MiB consolidated, rank 0 receives it consolidated and checks every element.
void body_consolidated(const WorkerSpec& w, std::string& phase) {
  TensorDict td = big_tree();
  for (int i = 0; i < kBigTransfers; ++i) {
    const int64_t v = i + 1;
    if (w.rank == 1) {
      phase = round_phase(i, "consolidated send");
      td.get("x").fill_(v);
      td.get("i").fill_(v);
      td.send({.dst = 0, .consolidated = true});
    } else {
      phase = round_phase(i, "consolidated recv");
      td.recv({.src = 1, .consolidated = true});
      const int64_t got = td.get("i").item<int64_t>();
      expect(got == v, phase + ": index leaf " + std::to_string(got) + ", expected " + std::to_string(v));
      expect(td.get("x").eq(v).all().item<bool>(), phase + ": the 64 MiB leaf is not all " + std::to_string(v));
    }
  }
}

// (d) rank 0 init_remote's a fresh tree each round; rank 1 rebuilds it with from_remote_init.
void body_remote(const WorkerSpec& w, std::string& phase) {
  for (int i = 0; i < kRemoteRounds; ++i) {
    const int64_t v = i + 1;
    if (w.rank == 0) {
      phase = round_phase(i, "init_remote");
      TensorDict td({{{"a", "b"}, at::full({2}, v, at::kFloat)},
                     {"c", at::full({2, 3}, v, at::kLong)},
                     {"big", at::full({2, 131072}, v, at::kFloat)},
                     {"step", v}},
                    {2});
      td.init_remote({.dst = 1});
    } else {
      phase = round_phase(i, "from_remote_init");
      const TensorDict r = TensorDict::from_remote_init({.src = 0});
      expect(r.contains("big") && r.contains({"a", "b"}) && r.contains("c"), phase + ": keys missing");
      const auto step = r.get_non_tensor("step");
      expect(std::holds_alternative<int64_t>(step) && std::get<int64_t>(step) == v,
             phase + ": non-tensor \"step\" is not " + std::to_string(v));
      expect(r.eq(v).all(), phase + ": a leaf is not all " + std::to_string(v));
    }
  }
}

// (e) 3 ranks; root i % 3; even rounds TensorDict::broadcast, odd rounds ProcessGroupShm::broadcast.
void body_broadcast(const WorkerSpec& w, std::string& phase) {
  for (int i = 0; i < kBroadcastRounds; ++i) {
    const int root = i % w.world;
    const int64_t v = i + 1;
    if (i % 2 == 0) {
      phase = round_phase(i, "TensorDict::broadcast");
      const TensorDict src = w.rank == root ? TensorDict({{"v", at::full({65536}, v, at::kFloat)},
                                                          {"w", at::full({3}, v, at::kLong)}})
                                            : TensorDict();
      const TensorDict got = src.broadcast({.src = root});
      expect(got.contains("v") && got.contains("w") && got.eq(v).all(),
             phase + ": the result is not {v, w} all " + std::to_string(v));
    } else {
      phase = round_phase(i, "ProcessGroupShm::broadcast");
      std::vector<at::Tensor> t{w.rank == root ? at::full({100000}, v, at::kFloat) : at::zeros({100000}, at::kFloat)};
      c10d::BroadcastOptions o;
      o.rootRank = root;
      default_group().backend().broadcast(t, o)->wait();
      expect(t[0].eq(v).all().item<bool>(), phase + ": the tensor is not all " + std::to_string(v));
    }
  }
}

// (f) rank 1 sends 1 MiB per-leaf through a 16 KiB ring while rank 0 sleeps outside tdshm.
void body_fullring(const WorkerSpec& w, std::string& phase) {
  TensorDict td({{"x", at::zeros({262144}, at::kFloat)}, {"y", at::zeros({16}, at::kLong)}});
  for (int i = 0; i < kFullRingRounds; ++i) {
    const int64_t v = i + 1;
    if (w.rank == 1) {
      phase = round_phase(i, "send into the full ring");
      fill_all(td, v);
      td.send({.dst = 0});
    } else {
      phase = round_phase(i, "sleeping, not receiving");
      std::this_thread::sleep_for(kFullRingSleep);
      phase = round_phase(i, "recv");
      td.recv({.src = 1});
      expect(td.eq(v).all(), phase + ": a leaf is not all " + std::to_string(v));
    }
  }
}

// (h) rank 1 sends loans by reference, rank 0 takes views and copies (docs/loans.md).
void body_loans(const WorkerSpec& w, std::string& phase) {
  if (w.rank == 1) {
    loans_sender(phase);
  } else {
    loans_receiver(phase);
  }
}

/// One cycle's transfer over the c10d group: rank 0 sends (cycle, r, 1) to every rank r, r checks
/// it and answers (cycle, r, 2). A message left over from another cycle shows as a wrong value.
void recreate_exchange(const WorkerSpec& w, int64_t cycle, std::string& phase) {
  c10d::ProcessGroup& pg = default_group().backend();
  constexpr int kTagDown = 11, kTagUp = 12;
  if (w.rank == 0) {
    for (int r = 1; r < w.world; ++r) {
      phase = "send to rank " + std::to_string(r);
      std::vector<at::Tensor> t{i64({cycle, r, 1})};
      pg.send(t, r, kTagDown)->wait();
    }
    for (int r = 1; r < w.world; ++r) {
      phase = "recv from rank " + std::to_string(r);
      std::vector<at::Tensor> t{at::zeros({3}, at::kLong)};
      pg.recv(t, r, kTagUp)->wait();
      expect(i64_eq(t[0], {cycle, r, 2}), phase + ": received " + i64_str(t[0]) + ", expected " + i64_str(i64({cycle, r, 2})));
    }
  } else {
    phase = "recv from rank 0";
    std::vector<at::Tensor> t{at::zeros({3}, at::kLong)};
    pg.recv(t, 0, kTagDown)->wait();
    expect(i64_eq(t[0], {cycle, w.rank, 1}),
           phase + ": received " + i64_str(t[0]) + ", expected " + i64_str(i64({cycle, w.rank, 1})));
    phase = "reply to rank 0";
    std::vector<at::Tensor> back{i64({cycle, w.rank, 2})};
    pg.send(back, 0, kTagUp)->wait();
  }
}

}  // namespace tdshm::tools::stress
