// The tensordict transfer API (TensorDict::isend, irecv, send, recv, init_remote,
// from_remote_init, broadcast), written once against c10d::ProcessGroup.
//
// Wire protocol (both peers run tdshm; messages of one transfer share a tag, so MPI's same-tag
// FIFO rule keeps them in order):
//  * per-leaf: a layout descriptor, then one message per tensor leaf in sorted_leaf_keys() order
//    with the tags of transfer_tags(). The descriptor (dtype, ndim and dims per leaf, as int64)
//    travels under the first leaf's tag in a fixed 32-int64 header {magic, words, up to 30 words
//    inline}, plus a second message when it does not fit (more than a few leaves). The receiver
//    posts its leaf receives only once it has checked the descriptor, so a receiver whose keys,
//    dtypes or shapes differ gets an error naming the first key that differs, and the sender's
//    leaves are drained into scratch buffers (nothing stays queued to spoil the next transfer);
//    over shm every message also carries its dtype and shape, checked by the transport.
//    irecv does not block for the descriptor: its works wait for it (see Deferred).
//  * consolidated: a 3-int64 header {magic, schema fingerprint, storage bytes} then the storage,
//    both with tag 0. The receiver checks the header before it posts the storage's receive; on a
//    mismatch it drains the storage into a scratch buffer and throws.
//  * init_remote: a 4-int64 header {magic, schema bytes, storage bytes, reference bytes}, the
//    encoded schema (keys, non-tensor values, tensorclass name), the storage, then (over shm, when
//    the tree has named MemoryMappedTensor leaves) their file references; tag 0, or broadcasts.

#include <tdshm/distributed.h>

#include "common/format.h"
#include "tensordict/impl.h"

#include <ATen/ops/empty.h>

#include <climits>
#include <cstring>
#include <mutex>

namespace tdshm {

namespace {

constexpr int64_t kLayoutMagic = 0x7464736d6c617931;        // "tdsmlay1"
constexpr int64_t kConsolidatedMagic = 0x7464736d636f6e31;  // "tdsmcon1"
constexpr int64_t kRemoteInitMagic = 0x7464736d696e6931;    // "tdsminI1"
constexpr int kConsolidatedTag = 0;
constexpr int kRemoteInitTag = 0;
// Bounds on what a peer's header may announce (a corrupt or hostile peer makes a transfer fail,
// never an absurd allocation): descriptors and schemas are metadata, never this large.
constexpr int64_t kMaxDescriptorWords = int64_t{1} << 24;
// The descriptor header: {magic, words} then up to kInlineWords descriptor words (a tree of a
// few small leaves needs no second message).
constexpr int64_t kHeaderWords = 32;
constexpr int64_t kInlineWords = kHeaderWords - 2;
constexpr int64_t kMaxSchemaBytes = int64_t{1} << 30;
constexpr int64_t kMaxStorageBytes = int64_t{1} << 40;

// ---------------------------------------------------------------------------------------------
// Errors with context

/// Rethrows the exception being handled with `context` in front of its message, keeping its
/// tdshm type; anything else (c10::Error from gloo, std errors) becomes a TransportError.
[[noreturn]] void rethrow_with_context(const std::string& context) {
  try {
    throw;
  } catch (const PeerLostError& e) {
    throw PeerLostError(context + e.what());
  } catch (const TimeoutError& e) {
    throw TimeoutError(context + e.what());
  } catch (const TransportError& e) {
    throw TransportError(context + e.what());
  } catch (const SchemaError& e) {
    throw SchemaError(context + e.what());
  } catch (const Error& e) {
    throw Error(context + e.what());
  } catch (const c10::Error& e) {
    throw TransportError(context + e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw TransportError(context + e.what());
  }
}

std::exception_ptr current_with_context(const std::string& context) {
  try {
    rethrow_with_context(context);
  } catch (...) {
    return std::current_exception();
  }
}

// ---------------------------------------------------------------------------------------------
// A receive that can only be posted once a header from the sender has been checked (the layout
// descriptor, the consolidated header). irecv posts the header's receive and returns; the first
// wait (or isCompleted that finds the header in) runs `rest`, which checks it and posts the real
// receives. So irecv never blocks, and ranks that post receives before sends do not deadlock.

class Deferred {
 public:
  Deferred(WorkPtr header, std::function<std::vector<WorkPtr>()> rest)
      : header_(std::move(header)), rest_(std::move(rest)) {}

  /// The works `rest` posted, once the header is in and checked; rethrows the check's error.
  const std::vector<WorkPtr>& works(std::chrono::milliseconds timeout) {
    std::lock_guard lk(mu_);
    if (!started_) {
      started_ = true;
      try {
        header_->wait(timeout);
        works_ = rest_();
      } catch (...) {
        error_ = std::current_exception();
      }
      rest_ = nullptr;
    }
    if (error_) std::rethrow_exception(error_);
    return works_;
  }
  /// True once works() would not wait for the header.
  bool header_in() {
    {
      std::lock_guard lk(mu_);
      if (started_) return true;
    }
    return header_->isCompleted();
  }

 private:
  std::mutex mu_;
  WorkPtr header_;
  std::function<std::vector<WorkPtr>()> rest_;
  bool started_ = false;
  std::vector<WorkPtr> works_;
  std::exception_ptr error_;
};

// The Work handed to users: backend works (given, or the index-th work of a Deferred) plus what
// to do once they all succeeded (copy a staged leaf back), with errors that name the key.
class TransferWork final : public c10d::Work {
 public:
  TransferWork(std::string context, std::vector<WorkPtr> inner, c10d::OpType type,
               std::function<void()> on_success = {})
      : c10d::Work(-1, type), context_(std::move(context)), inner_(std::move(inner)), on_success_(std::move(on_success)) {}
  TransferWork(std::string context, std::shared_ptr<Deferred> deferred, size_t index, c10d::OpType type,
               std::function<void()> on_success = {})
      : c10d::Work(-1, type),
        context_(std::move(context)),
        deferred_(std::move(deferred)),
        index_(index),
        on_success_(std::move(on_success)) {}

  bool isCompleted() override {
    if (deferred_ && !deferred_->header_in()) return false;
    {
      std::lock_guard lk(mu_);
      take_deferred(kNoTimeout);
      for (auto& w : inner_) {
        if (!w->isCompleted()) return false;
      }
    }
    finalize(kNoTimeout);
    return true;
  }
  bool isSuccess() const override {
    std::lock_guard lk(mu_);
    return finished_ && !error_;
  }
  std::exception_ptr exception() const override {
    std::lock_guard lk(mu_);
    return error_;
  }
  std::vector<at::Tensor> result() override { return {}; }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    finalize(timeout);
    std::lock_guard lk(mu_);
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  void abort() override {
    std::lock_guard lk(mu_);
    for (auto& w : inner_) w->abort();
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    TORCH_CHECK(inner_.size() == 1 && !deferred_ && !on_success_, "this tdshm transfer work has no future; call wait()");
    return inner_[0]->getFuture();
  }

 private:
  // Requires mu_. A deferred work's backend work is the one `rest` posted for it; if the check
  // failed there is none, and error_ holds the check's error (it names the key itself).
  void take_deferred(std::chrono::milliseconds timeout) {
    if (!deferred_ || error_ || !inner_.empty()) return;
    try {
      inner_ = {deferred_->works(timeout).at(index_)};
    } catch (...) {
      error_ = std::current_exception();
    }
  }

  // Waits for every inner work (all of them, even after a failure: nothing stays posted into a
  // leaf the caller may reuse), then runs on_success once.
  void finalize(std::chrono::milliseconds timeout) {
    std::lock_guard lk(mu_);
    if (finished_) return;
    take_deferred(timeout);
    for (auto& w : inner_) {
      try {
        w->wait(timeout);
      } catch (...) {
        if (!error_) error_ = current_with_context(context_);
      }
    }
    if (!error_ && on_success_) {
      try {
        on_success_();
      } catch (...) {
        error_ = current_with_context(context_);
      }
    }
    finished_ = true;
  }

  std::string context_;
  std::vector<WorkPtr> inner_;
  std::shared_ptr<Deferred> deferred_;
  size_t index_ = 0;
  std::function<void()> on_success_;
  mutable std::mutex mu_;
  bool finished_ = false;
  std::exception_ptr error_;
};

/// Waits for every work (all of them) and rethrows the first error, its message prefixed with
/// `verb` and the key of its leaf (works[i] moves keys[i]; the strings are built only on error).
void wait_keyed(const std::vector<WorkPtr>& works, const std::vector<Key>& keys, const char* verb) {
  std::exception_ptr first;
  for (size_t i = 0; i < works.size(); ++i) {
    try {
      works[i]->wait();
    } catch (...) {
      if (!first) first = current_with_context(std::string(verb) + keys[i].str() + ": ");
    }
  }
  if (first) std::rethrow_exception(first);
}

/// Waits for every work (all of them) and rethrows the first error.
void wait_all(const std::vector<WorkPtr>& works) {
  std::exception_ptr first;
  for (const auto& w : works) {
    try {
      w->wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

// ---------------------------------------------------------------------------------------------
// Peers

struct Peer {
  Group group;
  int rank = -1;  // in group
};

/// Resolves exactly one of `global` / `in_group` (SEMANTICS.md, Peers), before any message.
Peer resolve_peer(const char* global_name, const char* group_name, std::optional<int> global,
                  std::optional<int> in_group, const Group& given) {
  const std::string g = global_name, gg = group_name;
  if (given.is_non_member()) throw Error("this rank is not a member of `group` (new_group did not include it)");
  if (in_group && !given.defined()) throw Error("`" + gg + "` requires `group` to be passed.");
  if (global && in_group) throw Error("`" + g + "` and `" + gg + "` are mutually exclusive.");
  if (!global && !in_group) throw Error("Exactly one of `" + g + "` and `" + gg + "` must be provided.");
  Peer p;
  p.group = given.defined() ? given : default_group();
  p.rank = in_group ? *in_group : p.group.group_rank(*global);
  if (p.rank < 0 || p.rank >= p.group.size()) {
    throw Error("`" + (in_group ? gg : g) + "` = " + std::to_string(in_group ? *in_group : *global) +
                " is not a rank of the group (size " + std::to_string(p.group.size()) + ")");
  }
  if (p.rank == p.group.rank()) {
    throw Error("`" + (in_group ? gg : g) + "` = " + std::to_string(in_group ? *in_group : *global) +
                " is this process's own rank: a tensordict cannot be sent to itself");
  }
  return p;
}

bool is_shm(const Group& g) { return g.backend_name() == "shm"; }

int c10d_tag(int64_t tag) {
  if (tag < 0 || tag > INT_MAX) {
    throw Error("tag " + std::to_string(tag) + " is outside [0, " + std::to_string(INT_MAX) + "] (init_tag too large?)");
  }
  return static_cast<int>(tag);
}

WorkPtr send_one(const Group& g, at::Tensor t, int peer, int tag) {
  std::vector<at::Tensor> v{std::move(t)};
  return g.backend().send(v, peer, tag);
}
WorkPtr recv_one(const Group& g, at::Tensor t, int peer, int tag) {
  std::vector<at::Tensor> v{std::move(t)};
  return g.backend().recv(v, peer, tag);
}
void recv_now(const Group& g, const at::Tensor& t, int peer, int tag) { recv_one(g, t, peer, tag)->wait(); }
void broadcast_now(const Group& g, const at::Tensor& t, int root) {
  std::vector<at::Tensor> v{t};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  g.backend().broadcast(v, o)->wait();
}

at::Tensor int64_tensor(std::vector<int64_t> values) {
  auto t = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kLong));
  if (!values.empty()) std::memcpy(t.data_ptr(), values.data(), values.size() * sizeof(int64_t));
  return t;
}

at::Tensor bytes_tensor(int64_t n) { return at::empty({n}, at::TensorOptions().dtype(at::kByte)); }

/// A leaf that can be a message: a defined, dense CPU tensor.
void check_leaf(const at::Tensor& t, const Key& key) {
  if (!t.device().is_cpu()) {
    throw TypeError("key " + key.str() + ": only CPU tensors can be transferred, this leaf is on " + t.device().str());
  }
  if (t.layout() != at::kStrided) throw TypeError("key " + key.str() + ": only dense (strided) tensors can be transferred");
}

// ---------------------------------------------------------------------------------------------
// Layout descriptors (per-leaf mode on backends that carry bytes only)

/// dtype, ndim, dims... per leaf.
std::vector<int64_t> describe_leaves(const std::vector<at::Tensor>& leaves) {
  std::vector<int64_t> d;
  for (const auto& t : leaves) {
    d.push_back(static_cast<int64_t>(t.scalar_type()));
    d.push_back(t.dim());
    for (int64_t s : t.sizes()) d.push_back(s);
  }
  return d;
}

struct LeafLayout {
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
};

/// Parses a peer's descriptor, checking every value (it came from another process).
std::vector<LeafLayout> parse_descriptor(const int64_t* d, int64_t n) {
  std::vector<LeafLayout> out;
  int64_t i = 0;
  auto bad = [](const std::string& what) { return TransportError("malformed layout descriptor from the sender: " + what); };
  while (i < n) {
    if (n - i < 2) throw bad("truncated");
    const int64_t dtype = d[i], ndim = d[i + 1];
    if (dtype < 0 || dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions)) throw bad("dtype " + std::to_string(dtype));
    if (ndim < 0 || ndim > n - i - 2) throw bad("ndim " + std::to_string(ndim));
    LeafLayout l{static_cast<c10::ScalarType>(dtype), {d + i + 2, d + i + 2 + ndim}};
    const auto item = static_cast<int64_t>(c10::elementSize(l.dtype));
    int64_t bytes = item;  // bounded: a drain allocates a scratch leaf of this size
    for (int64_t s : l.shape) {
      if (s < 0 || (s != 0 && bytes > kMaxStorageBytes / s)) throw bad("dimension " + std::to_string(s));
      bytes *= s;
    }
    out.push_back(std::move(l));
    i += 2 + ndim;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Per-leaf transfers

struct Leaves {
  std::vector<Key> keys;
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> tags;
};

Leaves collect(const TensorDict& td, int64_t init_tag, bool pseudo_rand) {
  Leaves l;
  l.keys = td.sorted_leaf_keys();
  for (const auto& k : l.keys) {
    l.tensors.push_back(td.get(k));
    check_leaf(l.tensors.back(), k);
  }
  l.tags = transfer_tags(init_tag, l.keys.size(), pseudo_rand);
  for (int64_t t : l.tags) c10d_tag(t);
  return l;
}

/// The tag the descriptor travels with: the first leaf's (or the one it would have).
int descriptor_tag(const Leaves& l, int64_t init_tag, bool pseudo_rand) {
  return c10d_tag(l.tags.empty() ? transfer_tags(init_tag, 1, pseudo_rand)[0] : l.tags[0]);
}

/// The descriptor header for `desc` (see the file comment): built with plain stores, as small
/// metadata tensors through ATen ops would cost more than the messages themselves.
at::Tensor descriptor_header(const std::vector<int64_t>& desc) {
  auto header = at::empty({kHeaderWords}, at::TensorOptions().dtype(at::kLong));
  auto* h = header.data_ptr<int64_t>();
  std::fill(h, h + kHeaderWords, 0);
  h[0] = kLayoutMagic;
  h[1] = static_cast<int64_t>(desc.size());
  if (static_cast<int64_t>(desc.size()) <= kInlineWords) std::copy(desc.begin(), desc.end(), h + 2);
  return header;
}

/// Checks the sender's descriptor (its `header` is in; a long descriptor is received now); on a
/// mismatch drains all of the sender's leaves (its tags follow from the same init_tag and
/// pseudo_rand) and throws an error naming the first key that differs.
void check_descriptor(const Group& g, int peer, const Leaves& l, int tag, int64_t init_tag, bool pseudo_rand,
                      const at::Tensor& header) {
  const int64_t magic = header.data_ptr<int64_t>()[0], words = header.data_ptr<int64_t>()[1];
  if (magic != kLayoutMagic || words < 0 || words > kMaxDescriptorWords) {
    throw TransportError("the sender's per-leaf header is not a tdshm layout descriptor (is the sender using the same "
                         "mode, per-leaf or consolidated, and tdshm?)");
  }
  at::Tensor long_desc;
  if (words > kInlineWords) {
    long_desc = at::empty({words}, at::TensorOptions().dtype(at::kLong));
    recv_now(g, long_desc, peer, tag);
  }
  const int64_t* desc = words > kInlineWords ? long_desc.data_ptr<int64_t>() : header.data_ptr<int64_t>() + 2;
  const auto theirs = parse_descriptor(desc, words);
  std::string problem;
  for (size_t i = 0; i < std::max(theirs.size(), l.keys.size()) && problem.empty(); ++i) {
    if (i >= theirs.size()) {
      problem = "key " + l.keys[i].str() + ": the sender has no leaf for it (it sends " + std::to_string(theirs.size()) +
                " leaves, this tensordict has " + std::to_string(l.keys.size()) + ")";
    } else if (i >= l.keys.size()) {
      problem = "the sender sends " + std::to_string(theirs.size()) + " leaves, this tensordict has " +
                std::to_string(l.keys.size());
    } else if (theirs[i].dtype != l.tensors[i].scalar_type() || !l.tensors[i].sizes().equals(theirs[i].shape)) {
      problem = "key " + l.keys[i].str() + ": the sender's leaf has dtype " + c10::toString(theirs[i].dtype) + " and shape " +
                detail::shape_str(theirs[i].shape) + ", this one " + c10::toString(l.tensors[i].scalar_type()) + " and " +
                detail::shape_str(l.tensors[i].sizes());
    }
  }
  if (problem.empty()) return;
  // Drain what the sender is sending (it cannot know), so that later transfers stay in step.
  const std::vector<int64_t> their_tags = transfer_tags(init_tag, theirs.size(), pseudo_rand);
  for (size_t i = 0; i < theirs.size(); ++i) {
    // Scratch of the sender's dtype and shape: shm checks both.
    recv_now(g, at::empty(theirs[i].shape, at::TensorOptions().dtype(theirs[i].dtype)), peer, c10d_tag(their_tags[i]));
  }
  throw TransportError(problem);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

void Transfer::wait() const { wait_all(works); }

Transfer TensorDict::isend(const SendOptions& o) const {
  const Peer p = resolve_peer("dst", "group_dst", o.dst, o.group_dst, o.group);
  Transfer out;
  if (o.consolidated) {
    const TensorDict c = consolidate();
    const at::Tensor storage = c.consolidated_storage();
    const auto header = int64_tensor({kConsolidatedMagic, static_cast<int64_t>(c.schema_fingerprint()), storage.numel()});
    std::vector<WorkPtr> inner{send_one(p.group, header, p.rank, kConsolidatedTag),
                               send_one(p.group, storage, p.rank, kConsolidatedTag)};
    if (o.return_early) {
      out.has_works = true;
      out.works.push_back(c10::make_intrusive<TransferWork>("consolidated send: ", std::move(inner), c10d::OpType::SEND));
    } else {
      try {
        wait_all(inner);
      } catch (...) {
        rethrow_with_context("consolidated send: ");
      }
    }
    return out;
  }
  const Leaves l = collect(*this, o.init_tag, o.pseudo_rand);
  std::vector<WorkPtr> descriptor;
  {
    const int tag = descriptor_tag(l, o.init_tag, o.pseudo_rand);
    std::vector<int64_t> desc = describe_leaves(l.tensors);
    const bool long_desc = static_cast<int64_t>(desc.size()) > kInlineWords;
    descriptor.push_back(send_one(p.group, descriptor_header(desc), p.rank, tag));
    if (long_desc) descriptor.push_back(send_one(p.group, int64_tensor(std::move(desc)), p.rank, tag));
  }
  std::vector<WorkPtr> sends;
  for (size_t i = 0; i < l.keys.size(); ++i) {
    // Over shm a strided leaf is packed by the transport; other backends want contiguous bytes.
    at::Tensor t = is_shm(p.group) || l.tensors[i].is_contiguous() ? l.tensors[i] : l.tensors[i].contiguous();
    sends.push_back(send_one(p.group, t, p.rank, static_cast<int>(l.tags[i])));
  }
  if (o.return_early) {
    if (l.keys.empty()) wait_all(descriptor);
    out.has_works = true;
    for (size_t i = 0; i < l.keys.size(); ++i) {
      std::vector<WorkPtr> inner = i == 0 ? std::move(descriptor) : std::vector<WorkPtr>{};
      inner.push_back(std::move(sends[i]));
      out.works.push_back(c10::make_intrusive<TransferWork>("send of key " + l.keys[i].str() + ": ", std::move(inner),
                                                            c10d::OpType::SEND));
    }
    return out;
  }
  // Waited here: no user-facing Work per leaf.
  wait_all(descriptor);
  wait_keyed(sends, l.keys, "send of key ");
  out.last_tag = l.tags.empty() ? o.init_tag - 1 : l.tags.back();
  return out;
}

void TensorDict::send(const SendOptions& o) const {
  SendOptions waited = o;
  waited.return_early = false;
  isend(waited);
}

Transfer TensorDict::irecv(const RecvOptions& o) {
  const Peer p = resolve_peer("src", "group_src", o.src, o.group_src, o.group);
  Transfer out;
  std::vector<WorkPtr> works;
  if (o.consolidated) {
    if (!is_consolidated()) {
      throw Error("irecv(consolidated=True) needs a consolidated receiver: call consolidate() first (it must have the "
                  "sender's schema)");
    }
    const at::Tensor storage = consolidated_storage();
    const uint64_t mine = schema_fingerprint();
    auto header = int64_tensor({0, 0, 0});
    const Group g = p.group;
    const int peer = p.rank;
    auto rest = [g, peer, header, storage, mine]() -> std::vector<WorkPtr> {
      const int64_t magic = header.data_ptr<int64_t>()[0], bytes = header.data_ptr<int64_t>()[2];
      const auto fingerprint = static_cast<uint64_t>(header.data_ptr<int64_t>()[1]);
      if (magic != kConsolidatedMagic || bytes < 0 || bytes > kMaxStorageBytes) {
        throw TransportError("the sender's message is not a consolidated tdshm transfer (is it sending per-leaf?)");
      }
      if (fingerprint != mine || bytes != storage.numel()) {
        recv_now(g, bytes_tensor(bytes), peer, kConsolidatedTag);  // drained: the stream stays in step
        throw SchemaError("the sender's schema (fingerprint " + std::to_string(fingerprint) + ", " +
                          std::to_string(bytes) + " bytes) differs from this tensordict's (fingerprint " +
                          std::to_string(mine) + ", " + std::to_string(storage.numel()) + " bytes); nothing was written");
      }
      return {recv_one(g, storage, peer, kConsolidatedTag)};
    };
    auto deferred = std::make_shared<Deferred>(recv_one(g, header, peer, kConsolidatedTag), std::move(rest));
    works.push_back(c10::make_intrusive<TransferWork>("consolidated recv: ", deferred, 0, c10d::OpType::RECV));
  } else {
    const auto shared = std::make_shared<const Leaves>(collect(*this, o.init_tag, o.pseudo_rand));
    const Leaves& l = *shared;
    const bool shm = is_shm(p.group);
    const int dtag = descriptor_tag(l, o.init_tag, o.pseudo_rand);
    auto header = at::empty({kHeaderWords}, at::TensorOptions().dtype(at::kLong));
    // Over shm a strided leaf is staged by the transport; others receive contiguous bytes,
    // copied into the leaf once they are in.
    std::vector<at::Tensor> targets;
    for (const auto& leaf : l.tensors) {
      targets.push_back(!shm && !leaf.is_contiguous() ? at::empty(leaf.sizes(), leaf.options()) : leaf);
    }
    const Group g = p.group;
    const int peer = p.rank;
    const int64_t init_tag = o.init_tag;
    const bool pseudo = o.pseudo_rand;
    auto rest = [g, peer, shared, dtag, init_tag, pseudo, header, targets]() -> std::vector<WorkPtr> {
      check_descriptor(g, peer, *shared, dtag, init_tag, pseudo, header);
      std::vector<WorkPtr> posted;
      for (size_t i = 0; i < targets.size(); ++i) {
        posted.push_back(recv_one(g, targets[i], peer, static_cast<int>(shared->tags[i])));
      }
      return posted;
    };
    auto deferred = std::make_shared<Deferred>(recv_one(g, header, peer, dtag), std::move(rest));
    if (!o.return_premature) {
      // Waited here: no user-facing Work per leaf.
      wait_keyed(deferred->works(kNoTimeout), l.keys, "recv of key ");
      for (size_t i = 0; i < targets.size(); ++i) {
        if (!targets[i].is_same(l.tensors[i])) l.tensors[i].copy_(targets[i]);
      }
      return out;
    }
    for (size_t i = 0; i < l.keys.size(); ++i) {
      std::function<void()> copy_back;
      if (!targets[i].is_same(l.tensors[i])) {
        copy_back = [leaf = l.tensors[i], target = targets[i]]() mutable { leaf.copy_(target); };
      }
      works.push_back(c10::make_intrusive<TransferWork>("recv of key " + l.keys[i].str() + ": ", deferred, i,
                                                        c10d::OpType::RECV, std::move(copy_back)));
    }
    if (l.keys.empty()) deferred->works(kNoTimeout);  // the descriptor is consumed (and checked) all the same
  }
  if (o.return_premature) {
    out.has_works = true;
    out.works = std::move(works);
  } else {
    wait_all(works);
  }
  return out;
}

int64_t TensorDict::recv(const RecvOptions& o) {
  RecvOptions waited = o;
  waited.return_premature = false;
  irecv(waited);
  if (o.consolidated) return kConsolidatedTag;
  const auto n = sorted_leaf_keys().size();
  return n == 0 ? o.init_tag - 1 : transfer_tags(o.init_tag, n, o.pseudo_rand).back();
}

// ---------------------------------------------------------------------------------------------
// init_remote / from_remote_init / broadcast

namespace {

struct RemotePayload {
  at::Tensor header;  // {magic, schema bytes, storage bytes, reference bytes}
  at::Tensor schema;  // encoded
  at::Tensor storage;
  at::Tensor references;  // encoded MemoryMappedTensor references; empty if none
};

// References of named MemoryMappedTensor leaves: per leaf, the key's parts, the file and the
// offset, each string as u32 length + bytes, the offset as i64 (native byte order: one host).
void put_u32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }
void put_string(std::string& out, const std::string& v) {
  put_u32(out, static_cast<uint32_t>(v.size()));
  out += v;
}

std::string encode_references(const TensorDict& td) {
  std::string out;
  for (const auto& key : td.keys(/*include_nested=*/true, /*leaves_only=*/true)) {
    const Value v = td.get_value(key);
    if (!v.is_tensor()) continue;
    const auto info = MemoryMappedTensor::info(v.tensor());
    if (!info || info->filename.empty() || !v.tensor().is_contiguous()) continue;
    put_u32(out, static_cast<uint32_t>(key.size()));
    for (const auto& part : key.parts()) put_string(out, part);
    put_string(out, info->filename);
    out.append(reinterpret_cast<const char*>(&info->offset), sizeof info->offset);
  }
  return out;
}

/// Replaces the leaves named in `bytes` (from a peer: every length is checked) with mappings of
/// the sender's files. The leaves keep their dtype and shape.
void apply_references(const TensorDict& td, const at::Tensor& bytes) {
  const auto* p = bytes.data_ptr<uint8_t>();
  const auto* end = p + bytes.numel();
  auto bad = []() { return TransportError("from_remote_init: malformed memory-map references from the sender"); };
  auto u32 = [&]() {
    if (end - p < 4) throw bad();
    uint32_t v;
    std::memcpy(&v, p, 4);
    p += 4;
    return v;
  };
  auto str = [&]() {
    const uint32_t n = u32();
    if (static_cast<uint64_t>(end - p) < n) throw bad();
    std::string v(reinterpret_cast<const char*>(p), n);
    p += n;
    return v;
  };
  while (p < end) {
    const uint32_t parts = u32();
    if (parts == 0 || parts > kSchemaMaxDepth + 1) throw bad();
    std::vector<std::string> key_parts;
    for (uint32_t i = 0; i < parts; ++i) key_parts.push_back(str());
    const std::string file = str();
    int64_t offset;
    if (end - p < 8) throw bad();
    std::memcpy(&offset, p, 8);
    p += 8;
    const Key key(std::move(key_parts));
    const at::Tensor leaf = td.get(key);
    const auto mapped = MemoryMappedTensor::from_filename(file, leaf.scalar_type(), leaf.sizes(), offset);
    // The consolidated tensordict is locked: the leaf is swapped in its node directly.
    TensorDict parent = key.size() == 1 ? td : td.get_tensordict(Key(std::vector<std::string>(key.parts().begin(), key.parts().end() - 1)));
    Value* slot = parent.impl()->find(key.back());
    if (slot == nullptr) throw bad();  // td.get(key) found it: cannot happen
    *slot = Value(mapped);
  }
}

RemotePayload prepare_remote(const TensorDict& td, bool by_reference) {
  const TensorDict c = td.consolidate();
  const std::vector<uint8_t> encoded = encode_schema(c.schema());
  RemotePayload r;
  r.schema = bytes_tensor(static_cast<int64_t>(encoded.size()));
  if (!encoded.empty()) std::memcpy(r.schema.data_ptr(), encoded.data(), encoded.size());
  r.storage = c.consolidated_storage();
  if (by_reference) {
    const std::string refs = encode_references(td);
    if (!refs.empty()) {
      r.references = bytes_tensor(static_cast<int64_t>(refs.size()));
      std::memcpy(r.references.data_ptr(), refs.data(), refs.size());
    }
  }
  r.header = int64_tensor({kRemoteInitMagic, r.schema.numel(), r.storage.numel(),
                           r.references.defined() ? r.references.numel() : 0});
  return r;
}

/// Checks a received header and allocates the schema buffer and storage it announces.
RemotePayload allocate_remote(const at::Tensor& header) {
  const int64_t magic = header.data_ptr<int64_t>()[0], schema_bytes = header.data_ptr<int64_t>()[1],
                storage_bytes = header.data_ptr<int64_t>()[2], reference_bytes = header.data_ptr<int64_t>()[3];
  if (magic != kRemoteInitMagic) {
    throw TransportError("from_remote_init: the first message is not a tdshm init_remote header (does the sender call "
                         "init_remote with the same group and mode?)");
  }
  if (schema_bytes <= 0 || schema_bytes > kMaxSchemaBytes || storage_bytes < 0 || storage_bytes > kMaxStorageBytes ||
      reference_bytes < 0 || reference_bytes > kMaxSchemaBytes) {
    throw TransportError("from_remote_init: the sender announces " + std::to_string(schema_bytes) + " schema bytes and " +
                         std::to_string(storage_bytes) + " storage bytes, which is not a valid transfer");
  }
  RemotePayload r;
  r.header = header;
  r.schema = bytes_tensor(schema_bytes);
  r.storage = bytes_tensor(storage_bytes);
  if (reference_bytes > 0) r.references = bytes_tensor(reference_bytes);
  return r;
}

TensorDict rebuild_remote(const RemotePayload& r, const std::optional<c10::Device>& device) {
  Schema schema = decode_schema(std::span<const uint8_t>(r.schema.data_ptr<uint8_t>(), static_cast<size_t>(r.schema.numel())),
                                static_cast<uint64_t>(r.storage.numel()));
  at::Tensor storage = r.storage;
  if (device && *device != storage.device()) storage = storage.to(*device);
  TensorDict td = TensorDict::from_consolidated(storage, std::move(schema));
  if (r.references.defined()) apply_references(td, r.references);
  return td;
}

/// Sends (root) or receives the parts of a payload in order, by broadcast.
void broadcast_parts(const Group& g, RemotePayload& r, int root) {
  broadcast_now(g, r.schema, root);
  broadcast_now(g, r.storage, root);
  if (r.references.defined()) broadcast_now(g, r.references, root);
}

/// The whole exchange as broadcasts from `root` (a group rank); `td` is used on the root only.
TensorDict broadcast_remote(const TensorDict* td, const Group& g, int root, const std::optional<c10::Device>& device) {
  if (g.rank() == root) {
    RemotePayload r = prepare_remote(*td, is_shm(g));
    broadcast_now(g, r.header, root);
    broadcast_parts(g, r, root);
    return td->consolidate();
  }
  auto header = int64_tensor({0, 0, 0, 0});
  broadcast_now(g, header, root);
  RemotePayload r = allocate_remote(header);
  broadcast_parts(g, r, root);
  return rebuild_remote(r, device);
}

Group group_or_default(const Group& g) {
  if (g.is_non_member()) throw Error("this rank is not a member of `group` (new_group did not include it)");
  return g.defined() ? g : default_group();
}

int root_in_group(const Group& g, int src) {
  const int root = g.group_rank(src);
  if (root < 0 || root >= g.size()) throw Error("`src` = " + std::to_string(src) + " is not a rank of the group");
  return root;
}

}  // namespace

void TensorDict::init_remote(const InitRemoteOptions& o) const {
  if (o.use_broadcast) {
    const Group g = group_or_default(o.group);
    broadcast_remote(this, g, g.rank(), o.device);
    return;
  }
  if (!o.dst) throw Error("init_remote: `dst` must be provided (or use_broadcast=True)");
  const Peer p = resolve_peer("dst", "group_dst", o.dst, std::nullopt, o.group);
  RemotePayload r = prepare_remote(*this, is_shm(p.group));
  std::vector<WorkPtr> works{send_one(p.group, r.header, p.rank, kRemoteInitTag),
                             send_one(p.group, r.schema, p.rank, kRemoteInitTag),
                             send_one(p.group, r.storage, p.rank, kRemoteInitTag)};
  if (r.references.defined()) works.push_back(send_one(p.group, r.references, p.rank, kRemoteInitTag));
  wait_all(works);
}

TensorDict TensorDict::from_remote_init(const FromRemoteInitOptions& o) {
  if (!o.src) throw Error("from_remote_init: `src` must be provided");
  if (o.use_broadcast) {
    const Group g = group_or_default(o.group);
    return broadcast_remote(nullptr, g, root_in_group(g, *o.src), o.device);
  }
  const Peer p = resolve_peer("src", "group_src", o.src, std::nullopt, o.group);
  auto header = int64_tensor({0, 0, 0, 0});
  recv_now(p.group, header, p.rank, kRemoteInitTag);
  RemotePayload r = allocate_remote(header);
  recv_now(p.group, r.schema, p.rank, kRemoteInitTag);
  recv_now(p.group, r.storage, p.rank, kRemoteInitTag);
  if (r.references.defined()) recv_now(p.group, r.references, p.rank, kRemoteInitTag);
  return rebuild_remote(r, o.device);
}

TensorDict TensorDict::broadcast(const BroadcastOptions& o) const {
  const Group g = group_or_default(o.group);
  return broadcast_remote(this, g, root_in_group(g, o.src), o.device);
}

}  // namespace tdshm
