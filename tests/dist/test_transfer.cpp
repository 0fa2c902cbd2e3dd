// The tensordict transfer API (TensorDict / tensorclass isend, send, irecv, recv, init_remote,
// from_remote_init, broadcast) over real processes, on both backends: "shm" and "gloo".
//
// Every scenario runs in forked ranks (run_ranks with Peers::kProcesses): each rank calls
// init_process_group, plays its part, then meets the others (finish) and destroys its groups.
// What a rank checks (values received, return values, errors and their messages) fails the test
// through SHM_CHECK. Every wait has a deadline (kGroupTimeout, the groups' own timeout, or the
// watchdog of the fixture); segment names, store files, ports and memory-mapped files are unique
// to the test and removed with it.
//
// The suites follow the matrix of the transfer API's issue:
//   TransferSeed        the isend/irecv example, every combination of the send and receive calls
//   TransferStandalone  a group never registered (from a store, or a ProcessGroupShm), group_dst
//   TransferPeers       the peer-validation errors, before any communication
//   TransferRemote      init_remote / from_remote_init (the example, non-tensor values, memmaps)
//   TransferBroadcast   init_remote(use_broadcast) and TensorDict::broadcast, 3 ranks
//   TransferConsolidated  repeated consolidated sends after update_
//   TransferTensorClass   a tensorclass through init_remote and consolidated sends
//   TransferMismatch    receivers of other keys, shapes, dtypes, schema or tensorclass name, and
//                       receivers whose leaves cannot take bytes in place (expanded, read-only
//                       memory maps); the next transfer after each
//   TransferEarly       isend(return_early) whose works are waited after the receiver received
//   TransferTwoSenders  two senders with pseudo-random tags to one receiver
//   TransferPolling     Work::isCompleted of irecv's works never waits for a message; the plain
//                       wire's works used by polling and futures alone
//   TransferErrors      (no processes) context added to an error keeps its type
//   TransferLayout      (no processes) the layout descriptor: key hashes, checks, hostile input

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/distributed.h>
#include <tdshm/errors.h>
#include <tdshm/memmap.h>
#include <tdshm/process_group.h>
#include <tdshm/tensorclass.h>
#include <tdshm/tensordict.h>

#include <c10/util/Exception.h>

#include <sys/stat.h>

#include <climits>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <typeinfo>
#include <variant>
#include <vector>

#include "dist/dist_support.h"
#include "distributed/layout_descriptor.h"
#include "distributed/transfer_errors.h"

namespace tdshm::test {

TDSHM_TENSORCLASS(XferTransition, "tdshm.test.xfer.Transition", obs, action, reward);
TDSHM_TENSORCLASS(XferOther, "tdshm.test.xfer.Other", x);
TDSHM_TENSORCLASS(XferTwin, "tdshm.test.xfer.Twin", obs, action, reward);  // XferTransition's fields

namespace {

// ---------------------------------------------------------------------------------------------
// Trees

/// The tree of the isend example, in its insertion order: ("a", "b") [2], "c" [2, 3], "_"
/// [2, 1, 5]; batch size [2]; every element `value`. Per-leaf order: "_", ("a", "b"), "c".
TensorDict seed_tree(float value) {
  return TensorDict({{{"a", "b"}, at::full({2}, value)}, {"c", at::full({2, 3}, value)}, {"_", at::full({2, 1, 5}, value)}},
                    {2});
}

/// seed_tree plus ("d", "e"): `memmap` (a named MemoryMappedTensor [2, ...]), filled with `value`.
/// Per-leaf order: "_", ("a", "b"), "c", ("d", "e").
TensorDict seed_tree_with_memmap(float value, const MemoryMappedTensor& memmap) {
  memmap->fill_(value);
  TensorDict td = seed_tree(value);
  td.set({"d", "e"}, memmap);
  return td;
}

/// seed_tree with 'c' named 'd' (same shape and dtype, same place in the per-leaf order).
TensorDict seed_tree_renamed(float value) {
  TensorDict td = seed_tree(value);
  const at::Tensor c = td.get("c");
  td.erase("c");
  td.set("d", c);
  return td;
}

/// Writes `value` into every tensor leaf in place (a memory-mapped leaf: into its file).
void fill_leaves(TensorDict& td, float value) {
  td.apply_([value](const at::Tensor& t) { return at::full_like(t, value); });
}

/// True if every element of every tensor leaf equals `value`.
bool all_equal(const TensorDict& td, float value) { return (td == value).all(); }

/// "'_' = 1, ('a', 'b') = 1, 'c' = 0..1": each tensor leaf's range of values, for messages.
std::string values(const TensorDict& td) {
  std::ostringstream os;
  for (const Key& k : td.sorted_leaf_keys()) {
    const at::Tensor t = td.get(k).to(at::kDouble);
    os << (os.tellp() > 0 ? ", " : "") << k.str() << " = ";
    if (t.numel() == 0) {
      os << "(empty)";
      continue;
    }
    const double lo = t.min().item<double>(), hi = t.max().item<double>();
    os << lo;
    if (hi != lo) os << ".." << hi;
  }
  return os.str();
}

/// The data pointers of the tensor leaves, in per-leaf order.
std::vector<const void*> leaf_pointers(const TensorDict& td) {
  std::vector<const void*> out;
  for (const Key& k : td.sorted_leaf_keys()) out.push_back(td.get(k).data_ptr());
  return out;
}

/// The tags of n leaves from init_tag, computed here (docs/semantics.md, "Per-leaf mode") rather than by
/// transfer_tags: init_tag, +1, ... or t0 = pseudo_rand_tag(init_tag), t(i+1) = pseudo_rand_tag(t(i) + 1).
std::vector<int64_t> expected_tags(int64_t init_tag, int64_t n, bool pseudo) {
  std::vector<int64_t> tags;
  for (int64_t i = 0; i < n; ++i) {
    if (!pseudo) {
      tags.push_back(init_tag + i);
    } else {
      tags.push_back(pseudo_rand_tag(i == 0 ? init_tag : tags.back() + 1));
    }
  }
  return tags;
}

int64_t expected_last_tag(int64_t init_tag, int64_t n, bool pseudo) {
  return n == 0 ? init_tag - 1 : expected_tags(init_tag, n, pseudo).back();
}

// ---------------------------------------------------------------------------------------------
// Checks

/// Waits for every work with the test's deadline; each must succeed.
void wait_works(const Transfer& t, const char* what) {
  for (size_t i = 0; i < t.works.size(); ++i) {
    SHM_CHECK(t.works[i], what << ": work " << i << " is null");
    SHM_CHECK(t.works[i]->wait(kGroupTimeout), what << ": work " << i << " did not complete");
  }
}

/// Runs fn, which must throw exactly an E (not a subclass) with exactly `message`.
template <typename E, typename Fn>
void check_exact_error(const char* file, int line, Fn&& fn, const std::string& message) {
  const Caught c = check_throws<E>(file, line, std::forward<Fn>(fn));
  if (c.type != demangle(typeid(E).name())) fail_check(file, line, "expected exactly " + demangle(typeid(E).name()) + ", got " + c.describe());
  if (c.what != message) fail_check(file, line, "expected the message \"" + message + "\", got \"" + c.what + "\"");
}
#define CHECK_EXACT_ERROR(E, fn, message) check_exact_error<E>(__FILE__, __LINE__, fn, message)

/// Runs fn, which must throw exactly an E (not a subclass) whose message contains every needle.
template <typename E, typename Fn>
Caught check_exact_throws(const char* file, int line, Fn&& fn, const std::vector<std::string>& needles) {
  const Caught c = check_throws<E>(file, line, std::forward<Fn>(fn), needles);
  if (c.type != demangle(typeid(E).name())) fail_check(file, line, "expected exactly " + demangle(typeid(E).name()) + ", got " + c.describe());
  return c;
}
#define CHECK_EXACT_THROWS(E, fn, ...) check_exact_throws<E>(__FILE__, __LINE__, fn, std::vector<std::string>{__VA_ARGS__})

class TransferTest : public DistTest, public ::testing::WithParamInterface<Method> {
 protected:
  /// Runs scenario(rank, flags) in `world` forked ranks: each joins a default group of the
  /// test's method (deadline `timeout`), plays its part, then meets the others and destroys its
  /// groups (finish). A rank that fails fails the test, and its peers stop waiting for it.
  void run_world(int world, const std::function<void(int, Flags&)>& scenario,
                 std::chrono::milliseconds timeout = kGroupTimeout) {
    run_default_world(GetParam(), world, scenario, [&](int, InitOptions& o) { o.timeout = timeout; });
  }
};

class TransferSeed : public TransferTest {};
class TransferStandalone : public TransferTest {};
class TransferPeers : public TransferTest {};
class TransferRemote : public TransferTest {};
class TransferBroadcast : public TransferTest {};
class TransferConsolidated : public TransferTest {};
class TransferTensorClass : public TransferTest {};
class TransferEarly : public TransferTest {};
class TransferTwoSenders : public TransferTest {};

const auto kBothBackends = ::testing::Values(Method::kShm, Method::kGlooFile);

// ---------------------------------------------------------------------------------------------
// 1. The isend/irecv example, every combination

enum class SendCall { kSend, kIsend, kIsendEarly };
enum class RecvCall { kRecv, kIrecv, kIrecvPremature };
/// How the peer is named: a global rank through the default group, a global rank through a
/// subgroup (resolved by it), or a rank inside the subgroup (group_dst / group_src).
enum class Via { kDefault, kSubgroupGlobal, kSubgroupRank };

struct Combo {
  SendCall send;
  RecvCall recv;
  bool pseudo;
  Via via;
  int64_t init_tag;
};

std::string describe(const Combo& c) {
  static const char* sends[] = {"send", "isend", "isend(return_early)"};
  static const char* recvs[] = {"recv", "irecv", "irecv(return_premature)"};
  static const char* vias[] = {"default group", "subgroup by dst", "subgroup by group_dst"};
  return std::string(sends[static_cast<int>(c.send)]) + " -> " + recvs[static_cast<int>(c.recv)] +
         (c.pseudo ? ", pseudo_rand" : "") + ", " + vias[static_cast<int>(c.via)] + ", init_tag " +
         std::to_string(c.init_tag);
}

std::vector<Combo> seed_combos() {
  std::vector<Combo> out;
  for (SendCall s : {SendCall::kSend, SendCall::kIsend, SendCall::kIsendEarly}) {
    for (RecvCall r : {RecvCall::kRecv, RecvCall::kIrecv, RecvCall::kIrecvPremature}) {
      for (bool pseudo : {false, true}) {
        for (Via via : {Via::kDefault, Via::kSubgroupGlobal, Via::kSubgroupRank}) {
          out.push_back({s, r, pseudo, via, static_cast<int64_t>(out.size())});
        }
      }
    }
  }
  return out;
}

/// The options of one side of combination `c` (SendOptions or RecvOptions): its tags, and the
/// peer as `global` = global_peer (through the default group or `sub`) or as `in_group` =
/// group_peer (inside `sub`).
template <class Options>
Options combo_options(const Combo& c, const Group& sub, std::optional<int> Options::*global, int global_peer,
                      std::optional<int> Options::*in_group, int group_peer) {
  Options o;
  o.init_tag = c.init_tag;
  o.pseudo_rand = c.pseudo;
  if (c.via != Via::kDefault) o.group = sub;
  if (c.via == Via::kSubgroupRank) {
    o.*in_group = group_peer;
  } else {
    o.*global = global_peer;
  }
  return o;
}

// World of 3: rank 1 sends to rank 0 (rank 2 only takes part in new_group), the subgroup is
// new_group({1, 0}) (group rank 0 is global rank 1: group ranks and global ranks differ). Rank 1
// sends k + 1 in combination k, rank 0 zeroes its leaves and receives. The two ranks go in
// lockstep (step[0]): a named MemoryMappedTensor travels over shm by reference and is read from
// the sender's file when received, so the sender must not refill it before that.
TEST_P(TransferSeed, EveryCombinationOfSendAndReceive) {
  const std::string send_file = file("seed_send.mm"), recv_file = file("seed_recv.mm");
  run_world(3, [&](int rank, Flags& flags) {
    const Group sub = new_group({1, 0});
    // The reference values of docs/semantics.md ("Per-leaf mode") for this test's tag computation.
    SHM_CHECK((expected_tags(0, 4, true) == std::vector<int64_t>{9651, 3450, 3834, 3840}));
    SHM_CHECK((expected_tags(1, 4, true) == std::vector<int64_t>{1907, 3796, 8050, 3441}));
    const std::vector<Combo> combos = seed_combos();
    if (rank == 1) {
      TensorDict td = seed_tree_with_memmap(1, MemoryMappedTensor::zeros({2, 2}, at::kFloat, send_file));
      for (size_t k = 0; k < combos.size(); ++k) {
        const Combo& c = combos[k];
        wait_until(flags.step[0], static_cast<int>(k), "the receiver to finish the previous combination", &flags.failed);
        fill_leaves(td, static_cast<float>(k + 1));
        SendOptions o = combo_options(c, sub, &SendOptions::dst, 0, &SendOptions::group_dst, 1);
        const int64_t last = expected_last_tag(c.init_tag, 4, c.pseudo);
        if (c.send == SendCall::kSend) {
          td.send(o);
        } else {
          o.return_early = c.send == SendCall::kIsendEarly;
          const Transfer t = td.isend(o);
          if (o.return_early) {
            SHM_CHECK(t.has_works && t.works.size() == 4 && !t.last_tag, describe(c) << ": " << t.works.size() << " works");
            wait_works(t, "isend(return_early)");
          } else {
            SHM_CHECK(!t.has_works && t.works.empty(), describe(c));
            SHM_CHECK(t.last_tag && *t.last_tag == last,
                      describe(c) << ": isend returned " << (t.last_tag ? std::to_string(*t.last_tag) : "no tag")
                                  << ", expected " << last);
          }
        }
      }
    } else if (rank == 0) {
      TensorDict td = seed_tree_with_memmap(0, MemoryMappedTensor::zeros({2, 2}, at::kFloat, recv_file));
      const std::vector<const void*> pointers = leaf_pointers(td);
      for (size_t k = 0; k < combos.size(); ++k) {
        const Combo& c = combos[k];
        fill_leaves(td, 0);
        RecvOptions o = combo_options(c, sub, &RecvOptions::src, 1, &RecvOptions::group_src, 0);
        const int64_t last = expected_last_tag(c.init_tag, 4, c.pseudo);
        if (c.recv == RecvCall::kRecv) {
          const int64_t tag = td.recv(o);
          SHM_CHECK(tag == last, describe(c) << ": recv returned " << tag << ", expected " << last);
        } else {
          o.return_premature = c.recv == RecvCall::kIrecvPremature;
          const Transfer t = td.irecv(o);
          SHM_CHECK(!t.last_tag, describe(c) << ": irecv returned a tag");
          if (o.return_premature) {
            SHM_CHECK(t.has_works && t.works.size() == 4, describe(c) << ": " << t.works.size() << " works");
            wait_works(t, "irecv(return_premature)");
          } else {
            SHM_CHECK(!t.has_works && t.works.empty(), describe(c));
          }
        }
        SHM_CHECK((td != 0).all(), describe(c) << ": some leaf was not received");
        SHM_CHECK(all_equal(td, static_cast<float>(k + 1)), describe(c) << ": other values received:\n" << values(td));
        SHM_CHECK(leaf_pointers(td) == pointers, describe(c) << ": a leaf was replaced instead of received in place");
        const auto info = MemoryMappedTensor::info(td.get({"d", "e"}));
        SHM_CHECK(info && info->filename == recv_file, describe(c) << ": the memory-mapped leaf no longer maps "
                                                                   << recv_file);
        flags.step[0].store(static_cast<int>(k + 1), std::memory_order_release);
      }
      // The receiver's file holds what it received.
      const auto back = MemoryMappedTensor::from_filename(recv_file, at::kFloat, {2, 2});
      SHM_CHECK(at::equal(back.tensor(), at::full({2, 2}, static_cast<float>(combos.size()))));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, TransferSeed, ::testing::Values(Method::kShm, Method::kGlooFile, Method::kGlooTcp),
                         param_name);

// ---------------------------------------------------------------------------------------------
// 2. A standalone group: never registered, addressed with group_dst / group_src

/// A group of 2 that init_process_group never saw: a ProcessGroupShm of its own (kShm), or a
/// gloo group over a FileStore (kGlooFile) or over a TCPStore behind a PrefixStore (kGlooTcp).
Group standalone_group(Method m, const Rendezvous& rv, int rank) {
  if (m == Method::kShm) {
    ShmOptions o = small_options();
    o.timeout = kGroupTimeout;
    return Group(c10::make_intrusive<ProcessGroupShm>(rv.shm_name, rank, 2, o));
  }
  return gloo_group_from_store(user_store(rv, rank, 2, "xfer/"), rank, 2, kGroupTimeout);
}

// No default group exists at all: the transfers must use the group's own backend.
TEST_P(TransferStandalone, GroupDstAndGroupSrc) {
  const Method m = GetParam();
  const Rendezvous rv = rendezvous(m);
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, counting_failures(*flags, [&](int rank) {
    {
      const Group g = standalone_group(m, rv, rank);
      SHM_CHECK(g.defined() && !g.registered() && !is_initialized());
      if (rank == 1) {
        TensorDict td = seed_tree(3);
        SHM_CHECK_THROWS(Error, [&] { td.send({.dst = 0, .group = g}); }, "standalone", "group_dst");
        td.send({.group = g, .group_dst = 0, .init_tag = 5});
        fill_leaves(td, 4);
        const Transfer t = td.isend({.group = g, .group_dst = 0, .init_tag = 9, .pseudo_rand = true});
        SHM_CHECK(t.last_tag && *t.last_tag == expected_last_tag(9, 3, true));
        fill_leaves(td, 5);
        td.consolidate().send({.group = g, .group_dst = 0, .consolidated = true});
      } else {
        TensorDict td = seed_tree(0);
        SHM_CHECK_THROWS(Error, [&] { td.recv({.src = 1, .group = g}); }, "standalone", "group_src");
        SHM_CHECK(td.recv({.group = g, .group_src = 1, .init_tag = 5}) == 7);
        SHM_CHECK(all_equal(td, 3), values(td));
        const Transfer t =
            td.irecv({.group = g, .group_src = 1, .init_tag = 9, .pseudo_rand = true, .return_premature = true});
        SHM_CHECK(t.has_works && t.works.size() == 3);
        wait_works(t, "irecv");
        SHM_CHECK(all_equal(td, 4), values(td));
        TensorDict c = seed_tree(0).consolidate();
        SHM_CHECK(c.recv({.group = g, .group_src = 1, .consolidated = true}) == 0);
        SHM_CHECK(all_equal(c, 5), values(c));
      }
      // Both ranks are done with the group before either leaves it.
      flags->done.fetch_add(1, std::memory_order_acq_rel);
      wait_until(flags->done, 2, "both ranks to finish", &flags->failed);
    }
    SHM_CHECK(!is_initialized());
  })));
}

INSTANTIATE_TEST_SUITE_P(Stores, TransferStandalone,
                         ::testing::Values(Method::kShm, Method::kGlooFile, Method::kGlooTcp), param_name);

// ---------------------------------------------------------------------------------------------
// 3. Peer validation: refused before any communication

// World of 3, subgroup {0, 1}. Every refused call posts nothing: ranks 0 and 1 then exchange an
// empty tensordict and the seed tree with the tags the refused calls would have used.
TEST_P(TransferPeers, ValidationErrors) {
  const Method m = GetParam();
  const Rendezvous rv = rendezvous(m);
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 3, counting_failures(*flags, [&](int rank) {
    TensorDict td = seed_tree(1);
    TensorDict c = seed_tree(1).consolidate();
    const std::string dst_needs_group = "`group_dst` requires `group` to be passed.";
    const std::string dst_both = "`dst` and `group_dst` are mutually exclusive.";
    const std::string dst_neither = "Exactly one of `dst` and `group_dst` must be provided.";
    const std::string src_needs_group = "`group_src` requires `group` to be passed.";
    const std::string src_both = "`src` and `group_src` are mutually exclusive.";
    const std::string src_neither = "Exactly one of `src` and `group_src` must be provided.";

    // Before init_process_group: the checks need no group at all. (Rule 1 comes before rule 2:
    // dst and group_dst without a group is "requires `group`".)
    for (bool consolidated : {false, true}) {
      CHECK_EXACT_ERROR(Error, [&] { td.send({.group_dst = 0, .consolidated = consolidated}); }, dst_needs_group);
      CHECK_EXACT_ERROR(Error, [&] { td.isend({.group_dst = 0, .consolidated = consolidated}); }, dst_needs_group);
      CHECK_EXACT_ERROR(Error, [&] { td.send({.dst = 0, .group_dst = 0, .consolidated = consolidated}); }, dst_needs_group);
      CHECK_EXACT_ERROR(Error, [&] { td.send({.consolidated = consolidated}); }, dst_neither);
      CHECK_EXACT_ERROR(Error, [&] { td.isend({.init_tag = 3, .consolidated = consolidated}); }, dst_neither);
      TensorDict& receiver = consolidated ? c : td;
      CHECK_EXACT_ERROR(Error, [&] { receiver.recv({.group_src = 0, .consolidated = consolidated}); }, src_needs_group);
      CHECK_EXACT_ERROR(Error, [&] { receiver.irecv({.group_src = 0, .consolidated = consolidated}); }, src_needs_group);
      CHECK_EXACT_ERROR(Error, [&] { receiver.recv({.src = 0, .group_src = 0, .consolidated = consolidated}); },
                        src_needs_group);
      CHECK_EXACT_ERROR(Error, [&] { receiver.recv({.consolidated = consolidated}); }, src_neither);
      CHECK_EXACT_ERROR(Error, [&] { receiver.irecv({.return_premature = true, .consolidated = consolidated}); },
                        src_neither);
    }

    init_process_group(backend_of(m), init_options(rv, rank, 3));
    const Group world = default_group();
    const Group sub = new_group({0, 1});
    for (bool consolidated : {false, true}) {
      TensorDict& receiver = consolidated ? c : td;
      // Both given.
      CHECK_EXACT_ERROR(Error, [&] { td.send({.dst = 1, .group = world, .group_dst = 1, .consolidated = consolidated}); },
                        dst_both);
      CHECK_EXACT_ERROR(Error, [&] { td.isend({.dst = 1, .group = world, .group_dst = 1, .return_early = true}); },
                        dst_both);
      CHECK_EXACT_ERROR(Error,
                        [&] { receiver.irecv({.src = 1, .group = world, .group_src = 1, .consolidated = consolidated}); },
                        src_both);
      CHECK_EXACT_ERROR(Error, [&] { receiver.recv({.src = 1, .group = world, .group_src = 1}); }, src_both);
      // Neither, with a group.
      CHECK_EXACT_ERROR(Error, [&] { td.send({.group = world, .consolidated = consolidated}); }, dst_neither);
      CHECK_EXACT_ERROR(Error, [&] { receiver.recv({.group = world, .consolidated = consolidated}); }, src_neither);
      // Its own rank.
      SHM_CHECK_THROWS(Error, [&] { td.send({.dst = rank, .consolidated = consolidated}); },
                       "`dst` = " + std::to_string(rank), "own rank");
      SHM_CHECK_THROWS(Error, [&] { td.isend({.group = world, .group_dst = rank, .consolidated = consolidated}); },
                       "`group_dst` = " + std::to_string(rank), "own rank");
      SHM_CHECK_THROWS(Error, [&] { receiver.recv({.src = rank, .consolidated = consolidated}); },
                       "`src` = " + std::to_string(rank), "own rank");
      SHM_CHECK_THROWS(Error, [&] { receiver.irecv({.group = world, .group_src = rank, .consolidated = consolidated}); },
                       "`group_src` = " + std::to_string(rank), "own rank");
      // Out of range: a global rank is not a member of the default group; a group rank is not
      // in [0, size).
      for (int bad : {3, -1}) {
        SHM_CHECK_THROWS(Error, [&] { td.send({.dst = bad, .consolidated = consolidated}); },
                         "global rank " + std::to_string(bad), "not a member");
        SHM_CHECK_THROWS(Error, [&] { receiver.recv({.src = bad, .consolidated = consolidated}); },
                         "global rank " + std::to_string(bad), "not a member");
        SHM_CHECK_THROWS(Error, [&] { td.send({.group = world, .group_dst = bad, .consolidated = consolidated}); },
                         "`group_dst` = " + std::to_string(bad), "not a rank of the group (size 3)");
        SHM_CHECK_THROWS(Error, [&] { receiver.irecv({.group = world, .group_src = bad, .consolidated = consolidated}); },
                         "`group_src` = " + std::to_string(bad), "not a rank of the group (size 3)");
      }
    }
    // init_remote / from_remote_init: a peer is needed, and not this rank.
    CHECK_EXACT_ERROR(Error, [&] { td.init_remote({}); }, "init_remote: `dst` must be provided (or use_broadcast=True)");
    CHECK_EXACT_ERROR(Error, [&] { TensorDict::from_remote_init({}); }, "from_remote_init: `src` must be provided");
    SHM_CHECK_THROWS(Error, [&] { td.init_remote({.dst = rank}); }, "own rank");
    SHM_CHECK_THROWS(Error, [&] { TensorDict::from_remote_init({.src = rank}); }, "own rank");
    SHM_CHECK_THROWS(Error, [&] { td.init_remote({.dst = 5}); }, "global rank 5", "not a member");
    // Tags that do not fit c10d's int: refused before the first message.
    SHM_CHECK_THROWS(Error, [&] { td.send({.dst = (rank + 1) % 3, .init_tag = INT_MAX}); }, "tag 2147483648", "outside");
    SHM_CHECK_THROWS(Error, [&] { td.recv({.src = (rank + 1) % 3, .init_tag = -1}); }, "tag -1", "outside");
    SHM_CHECK_THROWS(Error, [&] { td.send({.dst = (rank + 1) % 3, .init_tag = -1, .pseudo_rand = true}); });

    if (rank == 0 || rank == 1) {
      // Subgroup {0, 1}: global rank 2 is not a member; its own group rank is refused.
      SHM_CHECK_THROWS(Error, [&] { td.send({.dst = 2, .group = sub}); }, "global rank 2", "not a member");
      SHM_CHECK_THROWS(Error, [&] { td.recv({.src = 2, .group = sub}); }, "global rank 2", "not a member");
      SHM_CHECK_THROWS(Error, [&] { td.send({.group = sub, .group_dst = sub.rank()}); }, "own rank");
      SHM_CHECK_THROWS(Error, [&] { td.send({.group = sub, .group_dst = 2}); }, "not a rank of the group (size 2)");
    }

    // Nothing was posted by the refused calls: the same tags carry the real transfers.
    if (rank == 1) {
      const Transfer empty = TensorDict(std::vector<int64_t>{2}).isend({.dst = 0, .init_tag = 7});
      SHM_CHECK(empty.last_tag && *empty.last_tag == 6, "isend of no leaves returns init_tag - 1");
      td.send({.dst = 0});
      c.send({.dst = 0, .consolidated = true});
    } else if (rank == 0) {
      TensorDict empty(std::vector<int64_t>{2});
      SHM_CHECK(empty.recv({.src = 1, .init_tag = 7}) == 6, "recv of no leaves returns init_tag - 1");
      TensorDict r = seed_tree(0);
      SHM_CHECK(r.recv({.src = 1}) == 2);
      SHM_CHECK(all_equal(r, 1), values(r));
      TensorDict rc = seed_tree(0).consolidate();
      SHM_CHECK(rc.recv({.src = 1, .consolidated = true}) == 0);
      SHM_CHECK(all_equal(rc, 1), values(rc));
    }
    finish(*flags, 3);
  })));
}

INSTANTIATE_TEST_SUITE_P(Methods, TransferPeers, kBothBackends, param_name);

// ---------------------------------------------------------------------------------------------
// 4, 5. init_remote / from_remote_init

/// The tree of the init_remote example: ("a", "b"), "c", ("d", "e", "f") (a MemoryMappedTensor of
/// `memmap_file`, or an anonymous one), all ones, batch [2], then expand(1, 2).contiguous().
TensorDict remote_example_tree(const std::string& memmap_file) {
  return TensorDict({{{"a", "b"}, at::ones({2})},
                     {"c", at::ones({2})},
                     {{"d", "e", "f"}, MemoryMappedTensor::from_tensor(at::ones({2, 2}), memmap_file)}},
                    {2})
      .expand({1, 2})
      .contiguous();
}

TEST_P(TransferRemote, SeedExample) {
  const std::string memmap_file = file("remote_example.mm");
  const bool shm = GetParam() == Method::kShm;
  run_world(2, [&](int rank, Flags&) {
    if (rank == 0) {
      remote_example_tree(memmap_file).init_remote({.dst = 1});
    } else {
      const TensorDict r = TensorDict::from_remote_init({.src = 0});
      std::set<std::string> keys;
      for (const Key& k : r.keys()) keys.insert(k.str());
      SHM_CHECK((keys == std::set<std::string>{"'a'", "'c'", "'d'"}), values(r));
      SHM_CHECK((r == 1).all(), values(r));
      SHM_CHECK(r.is_locked());
      SHM_CHECK((r.batch_size() == std::vector<int64_t>{1, 2}));
      SHM_CHECK((r.get({"a", "b"}).sizes().vec() == std::vector<int64_t>{1, 2}));
      SHM_CHECK((r.get({"d", "e", "f"}).sizes().vec() == std::vector<int64_t>{1, 2, 2}));
      SHM_CHECK(r.class_name().empty());
      // Over gloo, the same layout as the sender's consolidation (same keys, order, dtypes, shapes).
      if (!shm) SHM_CHECK(r.schema_fingerprint() == remote_example_tree("").consolidate().schema_fingerprint());
      // Over gloo every leaf views the one storage, the memory-mapped one too: tensordict's wire
      // (metadata pickle, then the storage) has no room for a file. Over shm between two C++ ranks
      // the memory-mapped leaf maps the sender's file and the others view the storage.
      const auto info = MemoryMappedTensor::info(r.get({"d", "e", "f"}));
      SHM_CHECK(shm == (info && info->filename == memmap_file), values(r));
      SHM_CHECK(r.is_consolidated() == !shm);
      if (!shm) {
        const at::Tensor storage = r.consolidated_storage();
        for (const Key& k : r.sorted_leaf_keys()) SHM_CHECK(r.get(k).is_alias_of(storage), k.str());
      } else {
        SHM_CHECK(r.get({"a", "b"}).storage().is_alias_of(r.get("c").storage()));
      }
    }
  });
}

// Over gloo init_remote speaks tensordict's wire (the metadata pickle, then the storage): a
// MemoryMappedTensor leaf travels by value, and the receiver's leaf views its own storage. Over
// shm between two C++ ranks it travels by reference: the receiver's leaf maps the sender's file
// (writes are shared both ways, as the receiver asked with memmap_writable) and its bytes never
// cross the segment; an anonymous memmap, or a strided view of one, still goes by value.
TEST_P(TransferRemote, MemmapLeafByReferenceOverShm) {
  const bool shm = GetParam() == Method::kShm;
  const std::string memmap_file = file("remote_leaf.mm");
  const std::string strided_file = file("remote_strided.mm");
  run_world(2, [&](int rank, Flags& flags) {
    const at::Tensor expected = at::arange(4, at::kFloat).reshape({2, 2});
    if (rank == 0) {
      const MemoryMappedTensor mm = MemoryMappedTensor::from_tensor(expected, memmap_file);
      const MemoryMappedTensor strided = MemoryMappedTensor::from_tensor(expected.t().contiguous(), strided_file);
      TensorDict td({{"x", at::ones({2})},
                     {{"d", "e"}, mm.tensor()},
                     {"anon", MemoryMappedTensor::from_tensor(expected).tensor()},
                     {"strided", strided.tensor().t()},
                     {"z", at::full({2}, 5.0)}},
                    {2});
      td.init_remote({.dst = 1});
      wait_until(flags.step[0], 1, "the receiver's write");
      SHM_CHECK(mm.tensor()[1][1].item<float>() == (shm ? 42.0f : 3.0f), "the sender's file after the receiver wrote");
    } else {
      const TensorDict r = TensorDict::from_remote_init({.src = 0, .memmap_writable = true});
      for (const char* k : {"anon", "strided"}) SHM_CHECK(at::equal(r.get(k), expected), k);
      SHM_CHECK(at::equal(r.get({"d", "e"}), expected), values(r));
      SHM_CHECK(at::equal(r.get("x"), at::ones({2})) && at::equal(r.get("z"), at::full({2}, 5.0)), values(r));
      const auto info = MemoryMappedTensor::info(r.get({"d", "e"}));
      SHM_CHECK(shm == (info && info->filename == memmap_file && info->offset == 0),
                "over " << (shm ? "shm" : "gloo") << " the memory-mapped leaf " << (shm ? "does not map" : "maps")
                        << " the sender's file");
      for (const char* k : {"anon", "strided", "x"}) {
        const auto other = MemoryMappedTensor::info(r.get(k));
        SHM_CHECK(!(other && !other->filename.empty()), k << " travels by value");
      }
      r.get({"d", "e"})[1][1].fill_(42.0f);  // into the file (over shm), into the storage (gloo)
      flags.step[0].store(1);
    }
  });
}

// A memory-mapped leaf passed by reference whose name is no longer a regular file when the
// receiver maps it (here a FIFO nobody opens for writing, put in its place): from_remote_init
// refuses it with a MemmapError naming the leaf at once, and never blocks in open(); by default
// the receiver's leaf of a good file is read-only although the sender's is writable, and the pair
// stays in step.
TEST_P(TransferRemote, APeersMemmapThatIsNotAFileIsRefusedWithoutBlocking) {
  if (GetParam() != Method::kShm) GTEST_SKIP() << "references travel over shm only";
  const std::string memmap_file = file("swapped.mm");
  const std::string good_file = file("kept.mm");
  run_world(2, [&](int rank, Flags& flags) {
    const at::Tensor expected = at::arange(6, at::kFloat);
    if (rank == 0) {
      const MemoryMappedTensor mm = MemoryMappedTensor::from_tensor(expected, memmap_file);
      flags.step[0].store(1);  // the file exists: the receiver may replace it
      TensorDict({{"x", at::ones({2})}, {{"d", "m"}, mm.tensor()}}, {}).init_remote({.dst = 1});
      TensorDict({{"m", MemoryMappedTensor::from_tensor(expected, good_file).tensor()}}, {}).init_remote({.dst = 1});
      wait_until(flags.step[1], 1, "the receiver's checks");
      SHM_CHECK(at::equal(MemoryMappedTensor::from_filename(good_file, at::kFloat, {6}).tensor(), expected),
                "the receiver's write reached the sender's file through a read-only mapping");
    } else {
      wait_until(flags.step[0], 1, "the sender's memmap");
      std::filesystem::rename(memmap_file, memmap_file + ".old");
      SHM_CHECK(::mkfifo(memmap_file.c_str(), 0600) == 0, "mkfifo: " << std::strerror(errno));
      const auto start = std::chrono::steady_clock::now();
      CHECK_EXACT_THROWS(MemmapError, [&] { (void)TensorDict::from_remote_init({.src = 0}); }, "leaf ('d', 'm')",
                         "a FIFO");
      SHM_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5), "the refusal took long");
      const TensorDict r = TensorDict::from_remote_init({.src = 0});
      SHM_CHECK(at::equal(r.get("m"), expected), values(r));
      const auto info = MemoryMappedTensor::info(r.get("m"));
      SHM_CHECK(info && !info->writable, "the receiver's leaf is writable without memmap_writable");
      r.get("m").fill_(-1);  // private to this process
      flags.step[1].store(1);
      std::filesystem::remove(memmap_file);
    }
  });
}

// A rank that turns ShmOptions::memmap_by_reference off (as the Python backend does) gets the
// bytes from a rank that has it on: both ends agree from the segment, so neither waits for a
// message the other does not send.
TEST_P(TransferRemote, MemmapByValueWhenOneRankOptsOut) {
  if (GetParam() != Method::kShm) GTEST_SKIP() << "an option of the shm backend";
  const std::string memmap_file = file("remote_optout.mm");
  const Rendezvous rv = rendezvous(GetParam());
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, counting_failures(*flags, [&](int rank) {
    InitOptions o = init_options(rv, rank, 2);
    o.shm.memmap_by_reference = rank == 0;
    init_process_group("shm", o);
    const at::Tensor expected = at::arange(6, at::kDouble);
    for (int round = 0; round < 2; ++round) {  // each direction
      if (rank == round) {
        TensorDict({{"m", MemoryMappedTensor::from_tensor(expected, memmap_file + std::to_string(round)).tensor()}}, {6})
            .init_remote({.dst = 1 - rank});
      } else {
        const TensorDict r = TensorDict::from_remote_init({.src = 1 - rank});
        SHM_CHECK(at::equal(r.get("m"), expected) && r.is_consolidated(), values(r));
        SHM_CHECK(r.get("m").is_alias_of(r.consolidated_storage()), "round " << round);
      }
    }
    finish(*flags, 2);
  })));
}

TEST_P(TransferRemote, NonTensorValues) {
  const std::string with_nul("a\0b", 3);
  run_world(2, [&](int rank, Flags&) {
    if (rank == 1) {
      TensorDict td({{"x", at::full({3}, 2.0)},
                     {"name", "hello"},
                     {"empty", ""},
                     {"bytes", with_nul},
                     {"count", int64_t{-(int64_t{1} << 40)}},
                     {"small", 42},
                     {"ratio", 0.25},
                     {"flag", true},
                     {"off", false},
                     {{"meta", "label"}, "inner"},
                     {{"meta", "y"}, at::full({3, 2}, 3.0)}},
                    {3});
      td.init_remote({.dst = 0});
    } else {
      const TensorDict r = TensorDict::from_remote_init({.src = 1});
      const auto text = [&](const Key& k) { return std::get<std::string>(r.get_non_tensor(k)); };
      SHM_CHECK(text("name") == "hello");
      SHM_CHECK(text("empty").empty());
      SHM_CHECK(text("bytes") == with_nul, "a string with a NUL byte came back as " << text("bytes").size() << " bytes");
      SHM_CHECK(std::get<int64_t>(r.get_non_tensor("count")) == -(int64_t{1} << 40));
      SHM_CHECK(std::get<int64_t>(r.get_non_tensor("small")) == 42);
      SHM_CHECK(std::get<double>(r.get_non_tensor("ratio")) == 0.25);
      SHM_CHECK(std::get<bool>(r.get_non_tensor("flag")));
      SHM_CHECK(!std::get<bool>(r.get_non_tensor("off")));
      SHM_CHECK(text({"meta", "label"}) == "inner");
      SHM_CHECK(at::equal(r.get("x"), at::full({3}, 2.0)));
      SHM_CHECK(at::equal(r.get({"meta", "y"}), at::full({3, 2}, 3.0)));
      SHM_CHECK(r.is_consolidated());
      SHM_CHECK((r.batch_size() == std::vector<int64_t>{3}));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, TransferRemote, ::testing::Values(Method::kShm, Method::kGlooFile, Method::kGlooTcp),
                         param_name);

// ---------------------------------------------------------------------------------------------
// 6. Broadcast, 3 ranks

TEST_P(TransferBroadcast, InitRemoteWithBroadcastAndBroadcast) {
  run_world(3, [&](int rank, Flags&) {
    // init_remote(use_broadcast) from rank 1; dst is ignored (it names rank 2, rank 0 receives too).
    if (rank == 1) {
      seed_tree(7).init_remote({.dst = 2, .use_broadcast = true});
    } else {
      const TensorDict r = TensorDict::from_remote_init({.src = 1, .use_broadcast = true});
      SHM_CHECK(r.is_consolidated() && all_equal(r, 7), values(r));
      SHM_CHECK(r.same_structure(seed_tree(0)), values(r));
    }
    // TensorDict::broadcast from rank 2: every rank, the root too, returns a consolidated copy.
    const TensorDict b = (rank == 2 ? seed_tree(9) : TensorDict()).broadcast({.src = 2});
    SHM_CHECK(b.is_consolidated() && all_equal(b, 9) && b.same_structure(seed_tree(0)), "rank " << rank << ": " << values(b));
    // Over a subgroup {2, 0}: src is a global rank (group rank 1), rank 1 is outside.
    const Group sub = new_group({2, 0});
    if (rank != 1) {
      const TensorDict s = (rank == 0 ? seed_tree(11) : TensorDict()).broadcast({.src = 0, .group = sub});
      SHM_CHECK(s.is_consolidated() && all_equal(s, 11), "rank " << rank << ": " << values(s));
      if (rank == 0) {
        seed_tree(12).init_remote({.group = sub, .use_broadcast = true});
      } else {
        const TensorDict r = TensorDict::from_remote_init({.src = 0, .group = sub, .use_broadcast = true});
        SHM_CHECK(all_equal(r, 12), values(r));
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, TransferBroadcast, kBothBackends, param_name);

// ---------------------------------------------------------------------------------------------
// 7. init_remote, then repeated consolidated sends after update_

TEST_P(TransferConsolidated, RepeatedSendsAfterUpdate) {
  const std::string memmap_file = file("consolidated_send.mm");
  constexpr int kRounds = 7;
  run_world(2, [&](int rank, Flags&) {
    if (rank == 1) {
      TensorDict td = seed_tree_with_memmap(0, MemoryMappedTensor::zeros({2, 2}, at::kFloat, memmap_file));
      TensorDict c = td.consolidate();
      c.init_remote({.dst = 0});
      for (int k = 1; k <= kRounds; ++k) {
        const auto v = static_cast<float>(k);
        if (k <= 5) {
          // The consolidated copy, refreshed in place.
          c.update_(seed_tree_with_memmap(v, MemoryMappedTensor::zeros({2, 2})));
          if (k == 1 || k == 3) {
            c.send({.dst = 0, .consolidated = true});
          } else if (k == 2) {
            // init_tag and pseudo_rand are ignored by a consolidated send.
            c.send({.dst = 0, .init_tag = 77, .pseudo_rand = true, .consolidated = true});
          } else if (k == 4) {
            const Transfer t = c.isend({.dst = 0, .consolidated = true});
            SHM_CHECK(!t.has_works && t.works.empty() && !t.last_tag, "isend(consolidated) returns nothing");
          } else {
            const Transfer t = c.isend({.dst = 0, .return_early = true, .consolidated = true});
            SHM_CHECK(t.has_works && t.works.size() == 1 && !t.last_tag, t.works.size() << " works");
            wait_works(t, "isend(consolidated, return_early)");
          }
        } else {
          // A sender that is not consolidated consolidates (copies) on every call.
          fill_leaves(td, v);
          td.send({.dst = 0, .consolidated = true});
          SHM_CHECK(!td.is_consolidated());
        }
      }
    } else {
      TensorDict r = TensorDict::from_remote_init({.src = 1});
      SHM_CHECK(r.is_consolidated() && all_equal(r, 0), values(r));
      const void* storage = r.consolidated_storage().data_ptr();
      const std::vector<const void*> pointers = leaf_pointers(r);
      for (int k = 1; k <= kRounds; ++k) {
        if (k % 2 == 1) {
          SHM_CHECK(r.recv({.src = 1, .consolidated = true}) == 0, "recv(consolidated) returns tag 0");
        } else {
          const Transfer t = r.irecv({.src = 1, .return_premature = true, .consolidated = true});
          SHM_CHECK(t.has_works && t.works.size() == 1, t.works.size() << " works");
          wait_works(t, "irecv(consolidated, return_premature)");
        }
        SHM_CHECK(all_equal(r, static_cast<float>(k)), "round " << k << ":\n" << values(r));
        SHM_CHECK(r.consolidated_storage().data_ptr() == storage && leaf_pointers(r) == pointers,
                  "round " << k << ": not received in place");
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, TransferConsolidated, kBothBackends, param_name);

// ---------------------------------------------------------------------------------------------
// 8. tensorclass

XferTransition transition(float v) {
  return XferTransition({{"obs", at::full({4, 3}, v)}, {"action", at::full({4}, v)}, {"reward", at::full({4, 1}, v)}},
                        {4});
}

TEST_P(TransferTensorClass, InitRemoteAndConsolidatedSends) {
  run_world(2, [&](int rank, Flags&) {
    const std::string name(XferTransition::kTypeName);
    if (rank == 1) {
      transition(1).init_remote({.dst = 0});
      transition(2).init_remote({.dst = 0});
      transition(3).init_remote({.dst = 0});  // received as XferOther: refused
      seed_tree(4).init_remote({.dst = 0});   // a plain tensordict, received as XferTransition: refused
      XferTransition c = transition(0).consolidate();
      for (int k = 5; k <= 6; ++k) {
        c.update_(transition(static_cast<float>(k)).to_tensordict());
        c.send({.dst = 0, .consolidated = true});
      }
      // Per-leaf too: "action", "obs", "reward" with tags 3, 4, 5.
      const Transfer t = transition(7).isend({.dst = 0, .init_tag = 3});
      SHM_CHECK(t.last_tag && *t.last_tag == 5);
      const XferTransition b = transition(8).broadcast({.src = 1});
      SHM_CHECK(b.type_name() == name && b.is_consolidated());
    } else {
      const TensorDict plain = TensorDict::from_remote_init({.src = 1});
      SHM_CHECK(plain.class_name() == name, "class_name() '" << plain.class_name() << "'");
      SHM_CHECK(plain.is_consolidated() && all_equal(plain, 1));
      const auto any = make_tensorclass(plain);
      SHM_CHECK(dynamic_cast<XferTransition*>(any.get()) != nullptr, "make_tensorclass gave another type");

      XferTransition back = XferTransition::from_remote_init({.src = 1});
      SHM_CHECK(back.type_name() == name && back.is_consolidated());
      SHM_CHECK(at::equal(back.obs(), at::full({4, 3}, 2.0)) && at::equal(back.reward(), at::full({4, 1}, 2.0)));

      SHM_CHECK_THROWS(TypeError, [] { XferOther::from_remote_init({.src = 1}); }, name, "tdshm.test.xfer.Other");
      SHM_CHECK_THROWS(TypeError, [] { XferTransition::from_remote_init({.src = 1}); }, "class ''", name);

      const void* storage = back.tensordict().consolidated_storage().data_ptr();
      for (int k = 5; k <= 6; ++k) {
        SHM_CHECK(back.recv({.src = 1, .consolidated = true}) == 0);
        SHM_CHECK(all_equal(back.tensordict(), static_cast<float>(k)), values(back.tensordict()));
      }
      SHM_CHECK(back.tensordict().consolidated_storage().data_ptr() == storage);
      const Transfer t = back.irecv({.src = 1, .init_tag = 3, .return_premature = true});
      SHM_CHECK(t.has_works && t.works.size() == 3);
      wait_works(t, "tensorclass irecv");
      SHM_CHECK(all_equal(back.tensordict(), 7), values(back.tensordict()));

      const XferTransition b = XferTransition({}, {4}).broadcast({.src = 1});
      SHM_CHECK(b.type_name() == name && at::equal(b.action(), at::full({4}, 8.0)));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, TransferTensorClass, kBothBackends, param_name);

// ---------------------------------------------------------------------------------------------
// 9. Mismatched receivers

/// Receives per-leaf from rank 1 into `receiver` with irecv(return_premature): irecv itself
/// returns at once (the layout descriptor is checked when the works are waited), and waiting
/// fails with exactly an E whose message contains every needle.
/// Over gloo (tdshm's checked protocol, both ranks tdshm) the layout descriptor refuses the whole
/// transfer, so every work fails. Over shm the wire is tensordict's (one message per leaf, the
/// checks inside each message), so only the leaves that differ fail (`every_work_fails` false):
/// at least one work fails and every work completes.
template <class E>
void expect_refused(TensorDict receiver, const std::vector<std::string>& needles, const std::string& what,
                    bool every_work_fails = true) {
  Transfer t;
  const Caught at_irecv = catch_any([&] { t = receiver.irecv({.src = 1, .return_premature = true}); });
  SHM_CHECK(!at_irecv.threw, what << ": irecv itself threw " << at_irecv.describe());
  SHM_CHECK(t.has_works, what);
  const Caught error = catch_any([&] { t.wait(); });
  SHM_CHECK(error.type == demangle(typeid(E).name()),
            what << ": expected exactly " << demangle(typeid(E).name()) << ", got " << error.describe());
  for (const std::string& n : needles) {
    SHM_CHECK(contains_nocase(error.what, n), what << ": the message does not mention " << n << ": " << error.what);
  }
  // Every work completes; every one (or at least one, per leaf) reports a failure, and it stays failed.
  size_t failed = 0;
  for (const WorkPtr& w : t.works) {
    SHM_CHECK(w->isCompleted(), what);
    if (!w->isSuccess() && w->exception()) ++failed;
  }
  SHM_CHECK(every_work_fails ? failed == t.works.size() : failed >= 1,
            what << ": " << failed << " of " << t.works.size() << " works failed");
}

/// A layout mismatch: exactly a TransportError.
void expect_per_leaf_mismatch(TensorDict receiver, const std::vector<std::string>& needles, const std::string& what,
                              bool every_work_fails = true) {
  expect_refused<TransportError>(std::move(receiver), needles, what, every_work_fails);
}

/// Rank 1's side of a mismatch test: for each case, the seed tree with a "bad" value (the
/// receiver refuses it), then with a "good" one (it must arrive whole).
void send_bad_then_good(int cases) {
  for (int i = 0; i < cases; ++i) {
    seed_tree(static_cast<float>(100 + i)).send({.dst = 0});
    seed_tree(static_cast<float>(200 + i)).send({.dst = 0});
  }
}

/// Rank 0's side: the next correct transfer between the same peers works (the stream is in step).
void expect_good(int i, const std::string& after) {
  TensorDict r = seed_tree(0);
  SHM_CHECK(r.recv({.src = 1}) == 2, "after " << after);
  SHM_CHECK(all_equal(r, static_cast<float>(200 + i)), "after " << after << ", the next transfer received:\n" << values(r));
}

class TransferMismatch : public TransferTest {
 protected:
  /// Rank 1 sends the seed tree twice. Rank 0 receives the first into a seed tree changed by
  /// `change`: a TransportError that mentions every one of `needles`, within half the group's deadline
  /// `timeout`; then the second into a correct receiver.
  void check_key_mismatch(const std::function<void(TensorDict&)>& change, const std::vector<std::string>& needles,
                          const std::string& what, std::chrono::milliseconds timeout = kGroupTimeout) {
    run_world(
        2,
        [&](int rank, Flags&) {
          if (rank == 1) {
            send_bad_then_good(1);
            return;
          }
          TensorDict bad = seed_tree(0);
          change(bad);
          const auto start = Clock::now();
          expect_per_leaf_mismatch(bad, needles, what, GetParam() != Method::kShm);
          const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
          SHM_CHECK(elapsed < timeout / 2, what << ": the error came after " << elapsed.count()
                                                << " ms (group timeout " << timeout.count() << " ms)");
          expect_good(0, what);
        },
        timeout);
  }
};

TEST_P(TransferMismatch, PerLeafShapeAndDtype) {
  struct Case {
    const char* what;
    Key key;
    at::Tensor leaf;
    std::string needle;
  };
  const bool shm_wire = GetParam() == Method::kShm;
  run_world(2, [&](int rank, Flags&) {
    const std::vector<Case> cases = {
        {"'c' of shape [2, 4] (more bytes)", "c", at::zeros({2, 4}), "'c'"},
        {"'c' of shape [2, 3, 1] (same bytes)", "c", at::zeros({2, 3, 1}), "'c'"},
        {"'c' of dtype int32 (same bytes)", "c", at::zeros({2, 3}, at::kInt), "'c'"},
        {"'c' of dtype float64", "c", at::zeros({2, 3}, at::kDouble), "'c'"},
        {"('a', 'b') of shape [2, 2]", {"a", "b"}, at::zeros({2, 2}), "('a', 'b')"},
        {"'_' of shape [2, 5, 1] (same bytes), with recv", "_", at::zeros({2, 5, 1}), "'_'"},
    };
    if (rank == 1) {
      send_bad_then_good(static_cast<int>(cases.size()));
    } else {
      for (size_t i = 0; i < cases.size(); ++i) {
        const Case& c = cases[i];
        TensorDict bad = seed_tree(0);
        bad.set(c.key, c.leaf);
        if (i + 1 < cases.size()) {
          expect_per_leaf_mismatch(bad, {c.needle}, c.what, shm_wire == false);
        } else {
          SHM_CHECK_THROWS(TransportError, [&] { bad.recv({.src = 1}); }, c.needle);
        }
        expect_good(static_cast<int>(i), c.what);
      }
    }
  });
}

// The receiver lacks a key in the middle of the order: the leaves after it meet the sender's
// messages of other leaves. The error names the receiver's leaf where that shows ('c'); over shm
// the messages' leaf count says first that the trees differ (3 leaves against 2), and the
// sender's extra message is taken, so the next transfer is in step.
TEST_P(TransferMismatch, ReceiverLacksAKey) {
  if (GetParam() == Method::kShm) {
    check_key_mismatch([](TensorDict& td) { td.erase("a"); }, {"the sender's tree has 3 leaves", "has 2"},
                       "a receiver without ('a', 'b')");
    return;
  }
  check_key_mismatch([](TensorDict& td) { td.erase("a"); }, {"'c'", "does not have"}, "a receiver without ('a', 'b')");
}

// The receiver lacks the last key of the order: the sender sends one message more than the
// receiver expects. That must be an error too, and must not stay in the stream.
TEST_P(TransferMismatch, ReceiverLacksTheLastKey) {
  check_key_mismatch([](TensorDict& td) { td.erase("c"); }, {"3 leaves"}, "a receiver without 'c'");
}

// The receiver has a key the sender lacks ('b', between ('a', 'b') and 'c'): the sender sends one
// message fewer than the receiver expects. The error names 'b' and comes at once, not at the
// group's deadline (4 s here).
TEST_P(TransferMismatch, ReceiverHasAnExtraKey) {
  check_key_mismatch([&](TensorDict& td) { td.set("b", at::zeros({2})); },
                     GetParam() == Method::kShm ? std::vector<std::string>{"the sender's tree has 3 leaves", "has 4"}
                                                : std::vector<std::string>{"'b'", "sends 'c' in its place"},
                     "a receiver with an extra 'b'",
                     std::chrono::milliseconds(4000));
}

// Consolidated: another schema is a SchemaError before a byte is written; a receiver that is not
// consolidated is refused before any communication.
TEST_P(TransferMismatch, Consolidated) {
  run_world(2, [&](int rank, Flags&) {
    // Receivers of another schema: more bytes; same bytes, another dtype; same keys, dtypes and
    // shapes in another insertion order (another layout of the same byte count).
    std::vector<std::pair<std::string, TensorDict>> receivers;
    TensorDict wider = seed_tree(0);
    wider.set("c", at::zeros({2, 4}));
    receivers.emplace_back("'c' of shape [2, 4]", wider);
    TensorDict as_int = seed_tree(0);
    as_int.set("c", at::zeros({2, 3}, at::kInt));
    receivers.emplace_back("'c' of dtype int32", as_int);
    receivers.emplace_back("another insertion order",
                           TensorDict({{"_", at::zeros({2, 1, 5})}, {"c", at::zeros({2, 3})}, {{"a", "b"}, at::zeros({2})}}, {2}));
    if (rank == 1) {
      TensorDict c = seed_tree(0).consolidate();
      for (size_t i = 0; i < receivers.size(); ++i) {
        c.update_(seed_tree(static_cast<float>(100 + i)));
        c.send({.dst = 0, .consolidated = true});
        c.update_(seed_tree(static_cast<float>(200 + i)));
        c.send({.dst = 0, .consolidated = true});
      }
      c.update_(seed_tree(300));
      c.send({.dst = 0, .consolidated = true});
    } else {
      TensorDict good = seed_tree(0).consolidate();
      for (size_t i = 0; i < receivers.size(); ++i) {
        const std::string& what = receivers[i].first;
        TensorDict bad = receivers[i].second.consolidate();
        bad.consolidated_storage().fill_(0x5A);
        const at::Tensor before = bad.consolidated_storage().clone();
        SHM_CHECK_THROWS(SchemaError, [&] { bad.recv({.src = 1, .consolidated = true}); }, "schema",
                         "nothing was written");
        SHM_CHECK(at::equal(bad.consolidated_storage(), before), what << ": the refused receiver's storage changed");
        SHM_CHECK(good.recv({.src = 1, .consolidated = true}) == 0);
        SHM_CHECK(all_equal(good, static_cast<float>(200 + i)), "after " << what << ":\n" << values(good));
      }
      const std::string not_consolidated =
          "irecv(consolidated=True) needs a consolidated receiver: call consolidate() first (it must have the "
          "sender's schema)";
      TensorDict plain = seed_tree(0);
      CHECK_EXACT_ERROR(Error, [&] { plain.recv({.src = 1, .consolidated = true}); }, not_consolidated);
      CHECK_EXACT_ERROR(Error, [&] { plain.irecv({.src = 1, .return_premature = true, .consolidated = true}); },
                        not_consolidated);
      SHM_CHECK(all_equal(plain, 0));
      SHM_CHECK(good.recv({.src = 1, .consolidated = true}) == 0);
      SHM_CHECK(all_equal(good, 300), "after the refused plain receiver:\n" << values(good));
    }
  });
}

// Keys that differ where shapes and dtypes agree: without key names in the layout descriptor
// these would be received silently into the wrong leaves. The descriptor's key hashes make each
// a TransportError naming the receiver's key; the sender's leaves are drained, the refused
// receiver is untouched, and the next transfer on the pair arrives whole.
TEST_P(TransferMismatch, KeysThatDifferWhereShapesAndDtypesAgree) {
  struct Case {
    const char* what;
    std::function<TensorDict()> receiver;
    std::vector<std::string> needles;
    Key refused;  // the receiver's leaf that differs
  };
  // Over shm the key hash rides in each message: the leaf whose key differs fails, naming the
  // receiver's key and saying the sender's is another.
  const bool shm_wire = GetParam() == Method::kShm;
  const std::string lacking = shm_wire ? "another key" : "does not have";
  run_world(2, [&](int rank, Flags&) {
    const std::vector<Case> cases = {
        {"'c' named 'd'",
         [] { return TensorDict({{{"a", "b"}, at::zeros({2})}, {"d", at::zeros({2, 3})}, {"_", at::zeros({2, 1, 5})}}, {2}); },
         {"'d'", lacking}, Key("d")},
        {"('a', 'b') named ('a', 'x')",
         [] { return TensorDict({{{"a", "x"}, at::zeros({2})}, {"c", at::zeros({2, 3})}, {"_", at::zeros({2, 1, 5})}}, {2}); },
         {"('a', 'x')"}, Key({"a", "x"})},
        {"('a', 'b') as the flat key 'a.b'",
         [] { return TensorDict({{"a.b", at::zeros({2})}, {"c", at::zeros({2, 3})}, {"_", at::zeros({2, 1, 5})}}, {2}); },
         {"'a.b'"}, Key("a.b")},
        {"'_' named 'A' (first in the order), with recv",
         [] { return TensorDict({{{"a", "b"}, at::zeros({2})}, {"c", at::zeros({2, 3})}, {"A", at::zeros({2, 1, 5})}}, {2}); },
         {"'A'"}, Key("A")},
    };
    if (rank == 1) {
      send_bad_then_good(static_cast<int>(cases.size()));
      return;
    }
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      TensorDict bad = c.receiver();
      if (i + 1 < cases.size()) {
        expect_per_leaf_mismatch(bad, c.needles, c.what, !shm_wire);
      } else {
        const Caught e = CHECK_EXACT_THROWS(TransportError, [&] { bad.recv({.src = 1}); }, c.needles[0]);
        SHM_CHECK(contains_nocase(e.what, shm_wire ? "another key" : "") && (shm_wire || !contains_nocase(e.what, "recv of key")),
                  "the check's own message, not a backend error: " << e.what);
      }
      // Over gloo the descriptor refuses the whole transfer; over shm (one message per leaf, as
      // tensordict) the leaves whose keys agree are received and the one that differs is not.
      SHM_CHECK(shm_wire ? at::all(bad.get(c.refused) == 0).item<bool>() : all_equal(bad, 0),
                c.what << ": the refused receiver changed:\n" << values(bad));
      expect_good(static_cast<int>(i), c.what);
    }
  });
}

// Leaves that cannot take bytes in place are refused before any receive is posted, with a typed
// error naming the key: an expanded tensor (stride 0: several elements share one place) is a
// TypeError, a read-only MemoryMappedTensor (its writes are private, they would never reach the
// file) a MemmapError. The sender's leaves are drained all the same, so the next transfer on the
// pair arrives whole.
TEST_P(TransferMismatch, ReceiveTargetsThatCannotTakeBytesInPlace) {
  const std::string memmap_file = file("read_only_target.mm");
  struct Case {
    const char* what;
    Key key;
    std::function<at::Tensor()> leaf;
    bool memmap;  // a MemmapError, else a TypeError
    bool blocking;
    std::string needle;
  };
  run_world(2, [&](int rank, Flags&) {
    const auto read_only = [&] {
      return MemoryMappedTensor::from_filename(memmap_file, at::kFloat, {2, 3}, 0, MemmapMode::kReadOnly).tensor();
    };
    const std::vector<Case> cases = {
        {"'c' expanded from [1, 3]", "c", [] { return at::zeros({1, 3}).expand({2, 3}); }, false, false, "'c'"},
        {"('a', 'b') expanded from [1]", {"a", "b"}, [] { return at::zeros({1}).expand({2}); }, false, false, "('a', 'b')"},
        {"'_' expanded in its last dimension, with recv", "_", [] { return at::zeros({2, 1, 1}).expand({2, 1, 5}); }, false,
         true, "'_'"},
        {"'c' a read-only MemoryMappedTensor", "c", read_only, true, false, "'c'"},
        {"'c' a read-only MemoryMappedTensor, with recv", "c", read_only, true, true, "'c'"},
    };
    if (rank == 1) {
      send_bad_then_good(static_cast<int>(cases.size()));
      return;
    }
    MemoryMappedTensor::zeros({2, 3}, at::kFloat, memmap_file);
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      TensorDict bad = seed_tree(0);
      bad.set(c.key, c.leaf());
      const std::vector<std::string> needles = {c.needle, c.memmap ? "read-only" : "overlap", "nothing was received"};
      if (c.blocking) {
        if (c.memmap) {
          CHECK_EXACT_THROWS(MemmapError, [&] { bad.recv({.src = 1}); }, needles[0], needles[1], needles[2]);
        } else {
          CHECK_EXACT_THROWS(TypeError, [&] { bad.recv({.src = 1}); }, needles[0], needles[1], needles[2]);
        }
      } else if (c.memmap) {
        expect_refused<MemmapError>(bad, needles, c.what);
      } else {
        expect_refused<TypeError>(bad, needles, c.what);
      }
      SHM_CHECK(all_equal(bad, 0), c.what << ": the refused receiver changed:\n" << values(bad));
      expect_good(static_cast<int>(i), c.what);
    }
    const at::Tensor in_file = MemoryMappedTensor::from_filename(memmap_file, at::kFloat, {2, 3}).tensor();
    SHM_CHECK(at::equal(in_file, at::zeros({2, 3})), "the read-only leaf's file changed");
  });
}

// A consolidated receiver whose storage is a read-only mapping of a consolidated file is refused
// (MemmapError) before its storage's receive is posted; the sender's storage is drained, and the
// next consolidated transfer arrives whole.
TEST_P(TransferMismatch, ConsolidatedIntoAReadOnlyStorage) {
  const std::string td_file = file("read_only.td");
  run_world(2, [&](int rank, Flags&) {
    if (rank == 1) {
      TensorDict c = seed_tree(0).consolidate();
      for (float v : {100.0f, 200.0f}) {
        c.update_(seed_tree(v));
        c.send({.dst = 0, .consolidated = true});
      }
      return;
    }
    seed_tree(0).consolidate({.filename = td_file});
    TensorDict read_only = TensorDict::from_consolidated_file(td_file, MemmapMode::kReadOnly);
    SHM_CHECK(read_only.is_consolidated());
    CHECK_EXACT_THROWS(MemmapError, [&] { read_only.recv({.src = 1, .consolidated = true}); }, "consolidated storage",
                       "read-only", "nothing was received");
    SHM_CHECK(all_equal(read_only, 0), values(read_only));
    SHM_CHECK(all_equal(TensorDict::from_consolidated_file(td_file), 0), "the consolidated file changed");
    TensorDict good = seed_tree(0).consolidate();
    SHM_CHECK(good.recv({.src = 1, .consolidated = true}) == 0);
    SHM_CHECK(all_equal(good, 200), "after the read-only receiver:\n" << values(good));
  });
}

// The schema fingerprint names the tensorclass: a consolidated XferTransition is not received
// into an XferTwin of the same fields, nor into a plain tensordict of the same leaves (the same
// bytes, another type): SchemaError, nothing written, the next transfer arrives whole.
TEST_P(TransferMismatch, ConsolidatedTensorClassOfAnotherName) {
  run_world(2, [&](int rank, Flags&) {
    const auto plain = [](float v) {
      return TensorDict({{"obs", at::full({4, 3}, v)}, {"action", at::full({4}, v)}, {"reward", at::full({4, 1}, v)}}, {4});
    };
    if (rank == 1) {
      XferTransition c = transition(0).consolidate();
      for (int i = 0; i < 2; ++i) {
        c.update_(plain(static_cast<float>(100 + i)));
        c.send({.dst = 0, .consolidated = true});
        c.update_(plain(static_cast<float>(200 + i)));
        c.send({.dst = 0, .consolidated = true});
      }
      return;
    }
    std::vector<std::pair<std::string, TensorDict>> receivers;
    receivers.emplace_back("an XferTwin", XferTwin(plain(0)).consolidate().tensordict());
    receivers.emplace_back("a plain tensordict", plain(0).consolidate());
    XferTransition good = transition(0).consolidate();
    for (size_t i = 0; i < receivers.size(); ++i) {
      TensorDict& bad = receivers[i].second;
      SHM_CHECK(bad.consolidated_storage().numel() == good.tensordict().consolidated_storage().numel(),
                "the same bytes: only the class name differs");
      CHECK_EXACT_THROWS(SchemaError, [&] { bad.recv({.src = 1, .consolidated = true}); }, "schema", "tensorclass",
                         "nothing was written");
      SHM_CHECK(all_equal(bad, 0), receivers[i].first << ": the refused receiver changed:\n" << values(bad));
      SHM_CHECK(good.recv({.src = 1, .consolidated = true}) == 0);
      SHM_CHECK(all_equal(good.tensordict(), static_cast<float>(200 + i)),
                "after " << receivers[i].first << ":\n" << values(good.tensordict()));
    }
  });
}

// A layout descriptor of version 1 (an older tdshm: no key names) is refused with a message that
// says so, not misread. Rank 1 plays the old sender with one raw header of no leaves.
TEST_P(TransferMismatch, LayoutDescriptorOfVersionOne) {
  if (GetParam() == Method::kShm) GTEST_SKIP() << "the layout descriptor exists only in the checked gloo protocol";
  run_world(2, [&](int rank, Flags&) {
    if (rank == 1) {
      at::Tensor header = at::zeros({detail::kHeaderWords}, at::kLong);
      header.data_ptr<int64_t>()[0] = detail::kLayoutMagicV1;
      std::vector<at::Tensor> v{header};
      SHM_CHECK(default_group().backend().send(v, 0, 0)->wait(kGroupTimeout));
      send_bad_then_good(1);
      return;
    }
    TensorDict r = seed_tree(0);
    CHECK_EXACT_THROWS(TransportError, [&] { r.recv({.src = 1}); }, "version 1", "same tdshm version");
    SHM_CHECK(all_equal(r, 0), values(r));
    expect_per_leaf_mismatch(TensorDict({{"x", at::zeros({2})}}, {2}), {"'x'"}, "the first tree into another");
    expect_good(0, "an old descriptor");
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, TransferMismatch, kBothBackends, param_name);

// ---------------------------------------------------------------------------------------------
// 10. isend(return_early): the works are waited after the receiver received

/// Rank 1's side of one phase: once rank 0 received (step[phase] reached 2), the works of
/// `posted` complete. Over shm they do without a wait (a small send, or a memmap reference, is
/// complete when posted); c10d's gloo SendWork only reports completion from wait(), so there
/// only wait() is checked.
void wait_after_receiver(Method m, Flags& flags, int phase, const Transfer& posted) {
  flags.step[phase].store(1, std::memory_order_release);
  wait_until(flags.step[phase], 2, "the receiver to receive", &flags.failed);
  for (const WorkPtr& w : posted.works) {
    if (m == Method::kShm) {
      const auto deadline = Clock::now() + kGroupTimeout;
      while (!w->isCompleted()) {
        SHM_CHECK(Clock::now() < deadline, "phase " << phase << ": a send work never completed");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    SHM_CHECK(w->wait(kGroupTimeout) && w->isSuccess() && !w->exception(), "phase " << phase);
  }
}

// Phase 0, per-leaf: two small leaves (one shm slot each) and a named MemoryMappedTensor of
// 64 KiB (one ring entry over shm whatever its size). Phase 1, consolidated: header and storage,
// both small. Each phase fits the 4-entry rings of the test's shm groups, so the receiver gets
// everything while the sender is not inside any tdshm call (over shm nothing moves otherwise).
TEST_P(TransferEarly, WorksWaitedAfterTheReceiverReceived) {
  const Method m = GetParam();
  const std::string send_file = file("early_send.mm"), recv_file = file("early_recv.mm");
  run_world(2, [&](int rank, Flags& flags) {
    const auto tree = [](float v, const std::string& f) {
      const MemoryMappedTensor mm = MemoryMappedTensor::full({2, 8192}, v, at::kFloat, f);
      return TensorDict({{"_", at::full({2, 1, 5}, v)}, {{"a", "b"}, at::full({2}, v)}, {{"d", "e"}, mm}}, {2});
    };
    if (rank == 1) {
      const Transfer t = tree(5, send_file).isend({.dst = 0, .init_tag = 4, .return_early = true});
      SHM_CHECK(t.has_works && t.works.size() == 3 && !t.last_tag, t.works.size() << " works");
      wait_after_receiver(m, flags, 0, t);
      const Transfer tc = seed_tree(6).isend({.dst = 0, .return_early = true, .consolidated = true});
      SHM_CHECK(tc.has_works && tc.works.size() == 1 && !tc.last_tag, tc.works.size() << " works");
      wait_after_receiver(m, flags, 1, tc);
    } else {
      wait_until(flags.step[0], 1, "the sender to post its sends", &flags.failed);
      TensorDict r = tree(0, recv_file);
      SHM_CHECK(r.recv({.src = 1, .init_tag = 4}) == 6);
      SHM_CHECK(all_equal(r, 5), values(r));
      flags.step[0].store(2, std::memory_order_release);
      wait_until(flags.step[1], 1, "the sender to post its consolidated send", &flags.failed);
      TensorDict rc = seed_tree(0).consolidate();
      SHM_CHECK(rc.recv({.src = 1, .consolidated = true}) == 0);
      SHM_CHECK(all_equal(rc, 6), values(rc));
      flags.step[1].store(2, std::memory_order_release);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, TransferEarly, kBothBackends, param_name);

// ---------------------------------------------------------------------------------------------
// 11. Two senders, one receiver, pseudo-random tags

/// Ten leaves "k0".."k9" of distinct shapes [2, i + 1], leaf i = base + i.
TensorDict ten_leaves(float base) {
  TensorDict td(std::vector<int64_t>{2});
  for (int i = 0; i < 10; ++i) td.set("k" + std::to_string(i), at::full({2, i + 1}, base + static_cast<float>(i)));
  return td;
}

bool holds_ten_leaves(const TensorDict& td, float base) {
  for (int i = 0; i < 10; ++i) {
    if (!at::equal(td.get("k" + std::to_string(i)), at::full({2, i + 1}, base + static_cast<float>(i)))) return false;
  }
  return true;
}

// Rank 1 uses init_tag 1, whose chain repeats (tags 2 and 10 are both 3796: equal tags from one
// sender are matched in order), rank 2 init_tag 0. Three rounds; rank 0 posts both receives
// before waiting, in one order then the other.
TEST_P(TransferTwoSenders, PseudoRandTags) {
  run_world(3, [&](int rank, Flags&) {
    SHM_CHECK((expected_tags(1, 10, true) ==
               std::vector<int64_t>{1907, 3796, 8050, 3441, 8330, 6044, 5283, 6066, 755, 3796}));
    const auto init_tag_of = [](int sender) { return sender == 1 ? int64_t{1} : int64_t{0}; };
    for (int round = 0; round < 3; ++round) {
      const auto base = [round](int sender) { return static_cast<float>(1000 * round + 100 * sender); };
      if (rank != 0) {
        const Transfer t = ten_leaves(base(rank)).isend({.dst = 0, .init_tag = init_tag_of(rank), .pseudo_rand = true});
        SHM_CHECK(t.last_tag && *t.last_tag == expected_last_tag(init_tag_of(rank), 10, true));
      } else {
        TensorDict from[3] = {TensorDict(), ten_leaves(0), ten_leaves(0)};
        std::vector<Transfer> transfers;
        for (int sender : round % 2 == 0 ? std::vector<int>{1, 2} : std::vector<int>{2, 1}) {
          transfers.push_back(from[sender].irecv(
              {.src = sender, .init_tag = init_tag_of(sender), .pseudo_rand = true, .return_premature = true}));
        }
        for (const Transfer& t : transfers) wait_works(t, "irecv from two senders");
        for (int sender : {1, 2}) {
          SHM_CHECK(holds_ten_leaves(from[sender], base(sender)), "round " << round << ", from rank " << sender << ":\n"
                                                                           << values(from[sender]));
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, TransferTwoSenders, kBothBackends, param_name);

// ---------------------------------------------------------------------------------------------
// 12. isCompleted only polls

class TransferPolling : public TransferTest {};

/// Rank 1's raw sends (the default group's backend, as the transfer layer sends them): each
/// waited.
void send_raw(const at::Tensor& t, int tag) {
  std::vector<at::Tensor> v{t};
  SHM_CHECK(default_group().backend().send(v, 0, tag)->wait(kGroupTimeout), "raw send, tag " << tag);
}

constexpr int kSyncTag = 7777;

/// Rank 0: once the sender's message on kSyncTag is in, so is everything it sent before it (the
/// transports deliver one sender's messages in order), here the layout descriptor's header.
void receive_sync() {
  std::vector<at::Tensor> v{at::zeros({1}, at::kLong)};
  SHM_CHECK(default_group().backend().recv(v, 1, kSyncTag)->wait(kGroupTimeout));
}

/// Rank 0: polls every work many times; none may complete (what they wait for is not sent yet),
/// and a poll that waited for it would never return (the sender sends it only after this).
void poll_incomplete(const Transfer& t, const char* what) {
  for (int round = 0; round < 50; ++round) {
    for (const WorkPtr& w : t.works) SHM_CHECK(!w->isCompleted(), what << ": a work completed before its message was sent");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

// The sender (raw sends, the layout descriptor built by the transfer layer's own functions) holds
// back what the receiver's works need next while the receiver polls isCompleted: phase 0 the long
// descriptor's second message (the ten leaves' descriptor does not fit the header), phase 1 the
// leaves a refused receiver must drain. isCompleted must return false without waiting for them;
// in phase 0 also while another thread is inside wait() for one of the works. Afterwards wait()
// completes the transfer (phase 0) or fails naming the key (phase 1), and the next transfer on
// the pair arrives whole. (Over gloo a backend receive only reports completion from wait(), so
// there the polls cannot even see the header; over shm they do.)
TEST_P(TransferPolling, IsCompletedNeverWaits) {
  // The stages polled here (descriptor header, long descriptor, leaves) exist only in the checked
  // gloo protocol; over shm a per-leaf irecv posts plain receives, whose polling is ShmWork's.
  if (GetParam() == Method::kShm) GTEST_SKIP() << "the layout descriptor exists only in the checked gloo protocol";
  run_world(2, [&](int rank, Flags& flags) {
    if (rank == 1) {
      // Phase 0: ten leaves, tags 0..9.
      const TensorDict ten = ten_leaves(100);
      const std::vector<Key> keys = ten.sorted_leaf_keys();
      std::vector<at::Tensor> leaves;
      for (const Key& k : keys) leaves.push_back(ten.get(k));
      const std::vector<int64_t> desc = detail::describe_leaves(keys, leaves);
      SHM_CHECK(static_cast<int64_t>(desc.size()) > detail::kInlineWords, desc.size() << " words fit the header");
      send_raw(detail::descriptor_header(desc), 0);
      send_raw(at::zeros({1}, at::kLong), kSyncTag);
      wait_until(flags.step[0], 1, "the receiver to poll", &flags.failed);
      send_raw(at::tensor(desc, at::kLong), 0);
      for (size_t i = 0; i < leaves.size(); ++i) send_raw(leaves[i], static_cast<int>(i));
      // Phase 1: the seed tree (an inline descriptor), tags 0..2, to a receiver of other keys.
      const TensorDict seed = seed_tree(300);
      const std::vector<Key> seed_keys = seed.sorted_leaf_keys();
      std::vector<at::Tensor> seed_leaves;
      for (const Key& k : seed_keys) seed_leaves.push_back(seed.get(k));
      send_raw(detail::descriptor_header(detail::describe_leaves(seed_keys, seed_leaves)), 0);
      send_raw(at::zeros({1}, at::kLong), kSyncTag);
      wait_until(flags.step[1], 1, "the receiver to poll", &flags.failed);
      for (size_t i = 0; i < seed_leaves.size(); ++i) send_raw(seed_leaves[i], static_cast<int>(i));
      send_bad_then_good(1);
      return;
    }
    TensorDict ten = ten_leaves(0);
    const Transfer t = ten.irecv({.src = 1, .return_premature = true});
    SHM_CHECK(t.works.size() == 10);
    receive_sync();
    poll_incomplete(t, "phase 0 (long descriptor held back)");
    // A thread waits for the first leaf meanwhile: polls must not wait for that thread either.
    Caught waiter_result;
    std::thread waiter([&] { waiter_result = catch_any([&] { t.works[0]->wait(kGroupTimeout); }); });
    poll_incomplete(t, "phase 0, with a thread in wait()");
    flags.step[0].store(1, std::memory_order_release);
    waiter.join();
    SHM_CHECK(!waiter_result.threw, waiter_result.describe());
    wait_works(t, "phase 0");
    SHM_CHECK(holds_ten_leaves(ten, 100), values(ten));

    TensorDict other = seed_tree_renamed(0);
    const Transfer refused = other.irecv({.src = 1, .return_premature = true});
    receive_sync();
    poll_incomplete(refused, "phase 1 (the leaves to drain held back)");
    flags.step[1].store(1, std::memory_order_release);
    CHECK_EXACT_THROWS(TransportError, [&] { refused.wait(); }, "'d'");
    SHM_CHECK(all_equal(other, 0), values(other));
    expect_per_leaf_mismatch(other, {"'d'"}, "phase 1, the next bad tree");
    expect_good(0, "polled transfers");
  });
}

/// Rank 0: polls every work until it completes (isCompleted only), at most kGroupTimeout.
void poll_until_complete(const Transfer& t, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + kGroupTimeout;
  for (const WorkPtr& w : t.works) {
    while (!w->isCompleted()) {
      SHM_CHECK(std::chrono::steady_clock::now() < deadline, what << ": a work did not complete by polling");
      std::this_thread::yield();
    }
  }
}

// The works of a plain-wire irecv(return_premature) (over shm: one message of the batch per leaf)
// used without wait(): polled with isCompleted before and after the sender sent (phase 0), or
// through their futures (phase 1); a receiver of another shape for 'c' (phase 2) sees, by polling
// alone, exactly the leaf that differs fail with a TransportError naming 'c' (the same error at
// every exception() call, and from wait()), the other leaves arrive, and the next transfer on the
// pair arrives whole.
TEST_P(TransferPolling, PlainWireWorksWithoutWait) {
  if (GetParam() != Method::kShm) GTEST_SKIP() << "over gloo two tdshm ranks use the checked protocol (IsCompletedNeverWaits)";
  run_world(2, [&](int rank, Flags& flags) {
    if (rank == 1) {
      wait_until(flags.step[0], 1, "the receiver to post and poll", &flags.failed);
      seed_tree(7).send({.dst = 0});
      seed_tree(8).send({.dst = 0});
      send_bad_then_good(1);
      return;
    }
    TensorDict polled = seed_tree(0);
    const Transfer t = polled.irecv({.src = 1, .return_premature = true});
    SHM_CHECK(t.has_works && t.works.size() == 3, t.works.size() << " works");
    poll_incomplete(t, "phase 0 (nothing sent yet)");
    flags.step[0].store(1, std::memory_order_release);
    poll_until_complete(t, "phase 0");
    for (const WorkPtr& w : t.works) SHM_CHECK(w->isSuccess() && !w->exception(), "phase 0");
    SHM_CHECK(all_equal(polled, 7), values(polled));

    TensorDict futured = seed_tree(0);
    const Transfer f = futured.irecv({.src = 1, .return_premature = true});
    for (const WorkPtr& w : f.works) {
      auto future = w->getFuture();
      SHM_CHECK(future, "getFuture() returned null");
      SHM_CHECK(future == w->getFuture(), "a second getFuture() returned another future");
      future->wait();
      SHM_CHECK(!future->hasError(), "phase 1: " << (future->hasError() ? future->tryRetrieveErrorMessage() : ""));
    }
    SHM_CHECK(all_equal(futured, 8), values(futured));
    f.wait();  // already complete

    TensorDict bad = seed_tree(0);
    bad.set("c", at::zeros({2, 4}));
    const Transfer b = bad.irecv({.src = 1, .return_premature = true});
    poll_until_complete(b, "phase 2");
    size_t failed = 0;
    for (size_t i = 0; i < b.works.size(); ++i) {
      const WorkPtr& w = b.works[i];
      if (w->isSuccess()) continue;
      ++failed;
      const std::exception_ptr e = w->exception();
      SHM_CHECK(e && e == w->exception(), "phase 2: the failed work's exception() changes or is null");
      CHECK_EXACT_THROWS(TransportError, [&] { std::rethrow_exception(e); }, "recv of key 'c'");
      CHECK_EXACT_THROWS(TransportError, [&] { w->wait(); }, "recv of key 'c'");
    }
    SHM_CHECK(failed == 1, "phase 2: " << failed << " of " << b.works.size() << " works failed");
    expect_good(0, "polled mismatch");
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, TransferPolling, kBothBackends, param_name);

// ---------------------------------------------------------------------------------------------
// 13. Errors keep their type (no processes)

/// Adds context to an E in flight: the result must be exactly an E with the context in front.
template <class E>
void expect_context_keeps_type() {
  const std::string name = demangle(typeid(E).name());
  try {
    try {
      throw E("inner");
    } catch (...) {
      detail::rethrow_with_context("ctx: ");
    }
  } catch (const std::exception& e) {
    EXPECT_EQ(demangle(typeid(e).name()), name);
    EXPECT_STREQ(e.what(), "ctx: inner") << name;
    return;
  }
  ADD_FAILURE() << name << ": nothing was thrown";
}

template <class... E>
void expect_every_type_kept(std::tuple<E...>* /*list*/) {
  (expect_context_keeps_type<E>(), ...);
}

template <class... E>
std::set<std::string> names_of(std::tuple<E...>* /*list*/) {
  return {demangle(typeid(E).name())...};
}

TEST(TransferErrors, ContextKeepsTheTypeOfEveryTdshmError) {
  expect_every_type_kept(static_cast<detail::KnownErrors*>(nullptr));
  // And through an exception_ptr, as works store them.
  std::exception_ptr p;
  try {
    throw KeyError("no such key");
  } catch (...) {
    p = detail::current_with_context("recv of key 'c': ");
  }
  EXPECT_THROW(std::rethrow_exception(p), KeyError);
}

TEST(TransferErrors, OtherExceptionsBecomeTransportErrors) {
  const auto context_of = [](auto&& throwing) {
    try {
      try {
        throwing();
      } catch (...) {
        detail::rethrow_with_context("ctx: ");
      }
    } catch (const std::exception& e) {
      return Caught{true, demangle(typeid(e).name()), e.what(), std::current_exception()};
    }
    return Caught{};
  };
  const Caught from_c10 = context_of([] { TORCH_CHECK(false, "gloo said no"); });
  EXPECT_EQ(from_c10.type, demangle(typeid(TransportError).name()));
  EXPECT_EQ(from_c10.what.rfind("ctx: ", 0), 0u) << from_c10.what;
  EXPECT_TRUE(contains_nocase(from_c10.what, "gloo said no")) << from_c10.what;
  const Caught from_std = context_of([] { throw std::out_of_range("index 3"); });
  EXPECT_EQ(from_std.type, demangle(typeid(TransportError).name()));
  EXPECT_EQ(from_std.what, "ctx: index 3");
}

// Should a class be missing from KnownErrors, its exceptions keep their type (and lose the
// context), never becoming another type.
TEST(TransferErrors, AClassMissingFromTheListKeepsItsType) {
  struct Unlisted : KeyError {
    using KeyError::KeyError;
  };
  try {
    try {
      throw Unlisted("inner");
    } catch (...) {
      detail::rethrow_with_context("ctx: ");
    }
  } catch (const std::exception& e) {
    EXPECT_EQ(typeid(e), typeid(Unlisted));
    EXPECT_STREQ(e.what(), "inner");
    return;
  }
  ADD_FAILURE() << "nothing was thrown";
}

// KnownErrors lists exactly the classes of include/tdshm/errors.h: a class added there and
// forgotten in the list fails here (the header is read from the source tree next to this file).
TEST(TransferErrors, EveryClassOfErrorsHIsKnown) {
  const std::filesystem::path header =
      std::filesystem::path(__FILE__).parent_path().parent_path().parent_path() / "include" / "tdshm" / "errors.h";
  std::ifstream in(header);
  ASSERT_TRUE(in) << "cannot read " << header;
  std::string text, line;
  while (std::getline(in, line)) text += line + "\n";
  std::set<std::string> declared;
  const std::regex class_decl(R"(\bclass\s+(\w+)\s*(final\s*)?:\s*public\b)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), class_decl); it != std::sregex_iterator(); ++it) {
    declared.insert("tdshm::" + (*it)[1].str());
  }
  EXPECT_EQ(declared.size(), 12u) << "errors.h changed: check KnownErrors in src/distributed/transfer_errors.h";
  EXPECT_EQ(declared, names_of(static_cast<detail::KnownErrors*>(nullptr)));
}

// ---------------------------------------------------------------------------------------------
// 14. The layout descriptor (no processes)

TEST(TransferLayout, KeyHashIsPinned) {
  // The same in every process and build: FNV-1a over the part count and length-prefixed parts,
  // then a 64-bit mixer (layout_descriptor.h).
  EXPECT_EQ(detail::key_hash("c"), 0xa5d0ebc27ff61e13ull);
  EXPECT_EQ(detail::key_hash("_"), 0x25d5f86c8159629eull);
  EXPECT_EQ(detail::key_hash({"a", "b"}), 0x30912bc77258f6beull);
  EXPECT_EQ(detail::key_hash("ab"), 0xa21e5781667dbbc8ull);
  EXPECT_EQ(detail::key_hash("a.b"), 0x9b4ef6ecd8c99fb7ull);
}

/// The descriptor of `td`'s leaves, parsed back as a receiver would.
std::vector<detail::LeafLayout> layouts_of(const TensorDict& td) {
  std::vector<at::Tensor> leaves;
  const std::vector<Key> keys = td.sorted_leaf_keys();
  for (const Key& k : keys) leaves.push_back(td.get(k));
  const std::vector<int64_t> desc = detail::describe_leaves(keys, leaves);
  const at::Tensor header = detail::descriptor_header(desc);
  const int64_t words = detail::descriptor_words(header);
  EXPECT_EQ(words, static_cast<int64_t>(desc.size()));
  return detail::parse_descriptor(words <= detail::kInlineWords ? header.data_ptr<int64_t>() + 2 : desc.data(), words);
}

/// layout_problem of a sender `theirs` against the receiver `td`.
std::string problem(const std::vector<detail::LeafLayout>& theirs, const TensorDict& td) {
  std::vector<at::Tensor> leaves;
  const std::vector<Key> keys = td.sorted_leaf_keys();
  for (const Key& k : keys) leaves.push_back(td.get(k));
  return detail::layout_problem(theirs, keys, leaves);
}

TEST(TransferLayout, SmallTreesFitTheHeader) {
  const TensorDict seed = seed_tree(0);
  std::vector<at::Tensor> leaves;
  for (const Key& k : seed.sorted_leaf_keys()) leaves.push_back(seed.get(k));
  EXPECT_EQ(detail::describe_leaves(seed.sorted_leaf_keys(), leaves).size(), 12u);  // (2 + ndim) per leaf
  const TensorDict tr = transition(0).to_tensordict();
  leaves.clear();
  for (const Key& k : tr.sorted_leaf_keys()) leaves.push_back(tr.get(k));
  EXPECT_LE(static_cast<int64_t>(detail::describe_leaves(tr.sorted_leaf_keys(), leaves).size()), detail::kInlineWords);
}

TEST(TransferLayout, ChecksKeysThenDtypesAndShapes) {
  const auto theirs = layouts_of(seed_tree(1));
  ASSERT_EQ(theirs.size(), 3u);
  EXPECT_EQ(theirs[1].key_hash, detail::key_hash({"a", "b"}));
  EXPECT_EQ(theirs[2].dtype, at::kFloat);
  EXPECT_EQ(theirs[2].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(problem(theirs, seed_tree(0)), "");
  const TensorDict renamed = seed_tree_renamed(0);
  EXPECT_TRUE(contains_nocase(problem(theirs, renamed), "key 'd': the sender sends a key this tensordict does not have"))
      << problem(theirs, renamed);
  TensorDict extra = seed_tree(0);
  extra.set("b", at::zeros({2}));
  EXPECT_TRUE(contains_nocase(problem(theirs, extra), "key 'b': the sender sends 'c' in its place")) << problem(theirs, extra);
  TensorDict as_int = seed_tree(0);
  as_int.set("c", at::zeros({2, 3}, at::kInt));
  EXPECT_TRUE(contains_nocase(problem(theirs, as_int), "key 'c'") && contains_nocase(problem(theirs, as_int), "dtype"));
  // A key and a dtype differ at the same leaf: the key is named first.
  TensorDict both = seed_tree(0);
  both.erase("c");
  both.set("d", at::zeros({2, 3}, at::kInt));
  EXPECT_TRUE(contains_nocase(problem(theirs, both), "key 'd'") && !contains_nocase(problem(theirs, both), "dtype"))
      << problem(theirs, both);
  // A long descriptor (ten leaves) parses back the same way.
  EXPECT_EQ(problem(layouts_of(ten_leaves(0)), ten_leaves(1)), "");
}

TEST(TransferLayout, HostileDescriptorsAreTransportErrors) {
  at::Tensor header = detail::descriptor_header({});
  header.data_ptr<int64_t>()[0] = detail::kLayoutMagicV1;
  EXPECT_THROW(detail::descriptor_words(header), TransportError);
  header.data_ptr<int64_t>()[0] = 0x1234;
  EXPECT_THROW(detail::descriptor_words(header), TransportError);
  header = detail::descriptor_header({});
  header.data_ptr<int64_t>()[1] = -1;
  EXPECT_THROW(detail::descriptor_words(header), TransportError);
  header.data_ptr<int64_t>()[1] = detail::kMaxDescriptorWords + 1;
  EXPECT_THROW(detail::descriptor_words(header), TransportError);
  const auto parse = [](std::vector<int64_t> d) { return detail::parse_descriptor(d.data(), static_cast<int64_t>(d.size())); };
  const int64_t f = static_cast<int64_t>(at::kFloat);
  EXPECT_EQ(parse({7, f + 256 * 2, 2, 3}).size(), 1u);
  EXPECT_THROW(parse({7}), TransportError);                                   // truncated
  EXPECT_THROW(parse({7, -1}), TransportError);                               // negative dtype/ndim word
  EXPECT_THROW(parse({7, 255}), TransportError);                              // unknown dtype
  EXPECT_THROW(parse({7, static_cast<int64_t>(c10::ScalarType::Undefined)}), TransportError);
  EXPECT_THROW(parse({7, f + 256 * 3, 2, 3}), TransportError);                // ndim past the end
  EXPECT_THROW(parse({7, f + 256 * 1, -2}), TransportError);                  // negative dimension
  EXPECT_THROW(parse({7, f + 256 * 2, int64_t{1} << 40, int64_t{1} << 40}), TransportError);  // absurd size
}


}  // namespace
}  // namespace tdshm::test
