#pragma once
// The C++ halves of td_peer.py's scenarios, and the Python ranks' arguments for them
// (test_interop.cpp): a cpp_* call gives a C++ rank's body for World::cpp, a py_* call td_peer.py's
// arguments for World::py. Trees and values are interop_trees.h's; every wait has kTimeout.

#include <tdshm/distributed.h>
#include <tdshm/lazy_stack.h>
#include <tdshm/tensordict.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "interop/interop_world.h"

namespace tdshm::test::interop {

// The C++ halves of td_peer.py's scenarios
/// Peer options: dst/src, or group_dst/group_src in `g` when it is defined.
SendOptions to(int peer, const Group& g);

RecvOptions from(int peer, const Group& g);

struct PerLeaf {
  std::string tree = "mixed";
  int64_t salt = 0;
  Api api = Api::kSync;
  int64_t init_tag = 0;
  bool pseudo = false;
  bool loan = false;  // the C++ sender's tree is a loan (tdshm::loan): by reference over shm
  /// Not empty: a LazyStackedTensorDict of these trees (member m at salt + m) instead of `tree`.
  std::vector<std::string> lazy{};
  /// With `lazy`: the stack nested under "ls" of a TensorDict({"a0": float [3], "ls", "zz": int64
  /// [2]}, []) (tensordict's TestSendLazyStackNest shape); td_peer.py --lazy-nest builds the same.
  bool nest = false;
};

/// "a,b,c": td_peer.py's --lazy-members.
std::string comma_joined(const std::vector<std::string>& parts);

LazyStackedTensorDict lazy_stack_of(const std::vector<std::string>& trees, int64_t salt, bool blank);

/// The members of a lazy stack of `trees` at salt + m.
void check_lazy(const LazyStackedTensorDict& s, const std::vector<std::string>& trees, int64_t salt, const std::string& what);

std::function<void(const Group&)> cpp_send(int dst, PerLeaf p);

std::function<void(const Group&)> cpp_recv(int src, PerLeaf p);

std::vector<std::string> py_perleaf(const std::string& role, int peer, PerLeaf p);

/// Two consolidated rounds (salt, then salt + 1 written in place with update_).
std::function<void(const Group&)> cpp_consolidated_send(int dst, const std::string& tree, int64_t salt,
                                                        bool loaned = false);

std::function<void(const Group&)> cpp_consolidated_recv(int src, const std::string& tree, int64_t salt);

/// A consolidated lazy stack of kLazyMembers-like `trees` (member m at salt + m), two rounds into
/// one storage (the second's values at salt + 1 + m, written in place); td_peer.py's consolidated
/// scenario with --lazy-members on the other side.
std::function<void(const Group&)> cpp_consolidated_lazy_send(int dst, std::vector<std::string> trees, int64_t salt);

std::function<void(const Group&)> cpp_consolidated_lazy_recv(int src, std::vector<std::string> trees, int64_t salt);

std::vector<std::string> py_consolidated_lazy(const std::string& role, int peer, const std::vector<std::string>& trees,
                                              int64_t salt);

/// init_remote / from_remote_init of a lazy stack of `trees` (member m at salt + m).
std::function<void(const Group&)> cpp_remote_lazy_send(int dst, std::vector<std::string> trees, int64_t salt);

std::function<void(const Group&)> cpp_remote_lazy_recv(int src, std::vector<std::string> trees, int64_t salt);

/// A TensorDict holding a lazy stack of `trees` (nest_lazy, member m at salt + m), consolidated
/// as tensordict lays it out: one consolidated send, or init_remote.
std::function<void(const Group&)> cpp_nested_lazy_send(int dst, std::vector<std::string> trees, int64_t salt, bool remote);

std::function<void(const Group&)> cpp_nested_lazy_recv(int src, std::vector<std::string> trees, int64_t salt, bool remote);

std::vector<std::string> py_nested_lazy(const std::string& role, int peer, const std::vector<std::string>& trees,
                                        int64_t salt, bool remote);

std::vector<std::string> py_consolidated(const std::string& role, int peer, const std::string& tree, int64_t salt);

/// init_remote, then a consolidated send of the sender's consolidated copy refreshed in place.
std::function<void(const Group&)> cpp_remote_send(int dst, const std::string& tree, int64_t salt);

std::function<void(const Group&)> cpp_remote_recv(int src, const std::string& tree, int64_t salt);

std::vector<std::string> py_remote(const std::string& role, int peer, const std::string& tree, int64_t salt);

/// The root of a broadcast: TensorDict::broadcast, or init_remote(use_broadcast).
std::function<void(const Group&)> cpp_broadcast_root(int src, const std::string& tree, int64_t salt, bool via_init_remote);

std::function<void(const Group&)> cpp_broadcast_member(int src, const std::string& tree, int64_t salt,
                                                       bool via_init_remote);

std::vector<std::string> py_broadcast(const std::string& role, int src, const std::string& tree, int64_t salt,
                                      bool via_init_remote);

/// all_reduce (Api::kSync, or kAsync: async_op) or reduce to `dst` (kSync, kAsync: async_op,
/// kEarly: async_op and return_premature) of "reducible" in a world of `world`.
std::function<void(const Group&)> cpp_reduction(bool all, const std::string& op, Api api, int64_t salt, int world,
                                                int dst = 0);

std::vector<std::string> py_reduction(bool all, const std::string& op, Api api, int64_t salt, int dst = 0);

/// all_gather of trees[rank] at salt + rank (through the tensorclass for "record").
std::function<void(const Group&)> cpp_all_gather(std::vector<std::string> trees, int64_t salt);

/// scatter from `src` of trees[r] at salt + r to rank r.
std::function<void(const Group&)> cpp_scatter(int src, std::vector<std::string> trees, int64_t salt);

std::vector<std::string> py_gather_scatter(const std::string& scenario, const std::vector<std::string>& trees,
                                           int64_t salt, int src = 0);

/// A Python rank that only joins the world.
extern const std::vector<std::string> kPyIdle;

/// A C++ rank that only joins the world.
void cpp_idle(const Group&);

}  // namespace tdshm::test::interop
