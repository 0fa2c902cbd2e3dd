// Collectives over the segment's windows (engine/collectives.h).

#include "shm/engine/collectives.h"

#include <tdshm/errors.h>

#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace tdshm::detail {

namespace {

enum class Kind : uint8_t { kBarrier = 1, kBroadcast, kReduce, kGather, kScatter, kReduceScatter, kAlltoall };

// What a step is, as every rank must agree: the collective, its parameters, the piece.
uint64_t describe(Kind kind, uint64_t bytes, int root = -1, uint32_t extra = 0, uint64_t piece = 0) {
  uint64_t x = (uint64_t{static_cast<uint8_t>(kind)} << 56) ^ (uint64_t{extra} << 24) ^
               (static_cast<uint64_t>(static_cast<uint32_t>(root)) << 32);
  x ^= bytes * 0xc2b2ae3d27d4eb4full;
  x ^= piece * 0x165667b19e3779f9ull;
  return x;
}

uint32_t reduce_code(at::ScalarType dtype, ReduceKind op) {
  return (static_cast<uint32_t>(dtype) << 8) | static_cast<uint32_t>(op);
}

// Whom a step waits for: every peer, one rank (>= 0), or nobody.
constexpr int kEveryPeer = -1;
constexpr int kNobody = -2;

// Runs one step: `write` fills this rank's part, `read` takes what it needs once `from` has
// published; the part is released after `read`.
template <class Write, class Read>
void step(ShmEngine& e, uint64_t what, Deadline deadline, Write write, Read read, int from = kEveryPeer) {
  const uint64_t s = e.steps().begin_step(what, deadline);
  write(e.steps().my_part(s));
  e.steps().publish_step(s);
  if (from != kNobody) e.steps().await_step(s, deadline, from);
  read(s);
  e.steps().end_step(s);
}

// Whom piece k of a rooted collective waits for. The first piece waits for every peer, so that
// every rank checks every other's description of the collective; once it matched, later pieces
// of the same collective wait only for the ranks whose parts they read (with more ranks than
// cores, a step that waits for everyone needs every rank scheduled). `to_root`: the others
// write and the root reads (gather, reduce), else the root writes and the others read.
int rooted_from(uint64_t piece, int me, int root, bool to_root) {
  if (piece == 0) return kEveryPeer;
  if (to_root) return me == root ? kEveryPeer : kNobody;
  return me == root ? kNobody : root;
}

uint64_t pieces(uint64_t bytes, uint64_t per_piece) {
  return std::max<uint64_t>(1, (bytes + per_piece - 1) / per_piece);
}

// The error for a window whose parts are too small for `what` among the group's ranks.
TypeError window_too_small(const ShmEngine& e, const std::string& what) {
  return TypeError("shm collective: a window of " + std::to_string(e.steps().part_bytes() * shm::kWindowParts) +
                   " bytes (" + std::to_string(shm::kWindowParts) + " parts) cannot " + what + " of " +
                   std::to_string(e.size()) + " ranks; make ShmOptions::window_bytes larger");
}

// Bytes per rank within one part when it is cut into `world` equal pieces (cache-line multiples).
uint64_t share(const ShmEngine& e, uint64_t unit) {
  const uint64_t per = e.steps().part_bytes() / static_cast<uint64_t>(e.size());
  const uint64_t aligned = per >= 64 ? per / 64 * 64 : per;
  const uint64_t out = aligned / unit * unit;
  if (out == 0) throw window_too_small(e, "hold a share for each");
  return out;
}

// out (m elements) = the parts of every rank in step s at `offset`, reduced in rank order
// (rank 0 op rank 1 op ...); AVG divided by the world. `out` may be any rank's part.
void reduce_parts(ShmEngine& e, uint8_t* out, uint64_t s, uint64_t offset, uint64_t m, at::ScalarType dtype,
                  ReduceKind op) {
  if (m == 0) return;
  const int world = e.size();
  if (world == 1) {
    std::memmove(out, e.steps().part_of(0, s) + offset, m * c10::elementSize(dtype));
  } else {
    reduce_into(out, e.steps().part_of(0, s) + offset, e.steps().part_of(1, s) + offset, m, dtype, op);
    for (int r = 2; r < world; ++r) reduce_into(out, out, e.steps().part_of(r, s) + offset, m, dtype, op);
  }
  if (op == ReduceKind::kAvg) divide_by(out, m, dtype, world);
}

// A scatter or gather whose share per rank takes more than one step goes point to point
// instead: through the window, the root's part is cut into world shares, so each step moves only
// part / world bytes per rank and every step is a rendezvous of all ranks (64 MiB to 8 ranks:
// 2048 of them). One step still checks that every rank is in the same collective; then the
// shares travel as control messages (matched apart from user tags, tagged with that step's
// number, which every rank knows), one copy in at the sender and one out at the receiver.
bool goes_point_to_point(const ShmEngine& e, uint64_t bytes) {
  return e.size() > 1 && bytes > e.steps().part_bytes() / static_cast<uint64_t>(e.size());
}

at::Tensor bytes_view(const uint8_t* data, uint64_t bytes) {
  // Sends never write through it.
  return at::from_blob(const_cast<uint8_t*>(data), {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
}

// Waits for `ops` (point-to-point control messages of a collective); their first error fails
// the group's collectives and is thrown.
void finish_ops(ShmEngine& e, const std::vector<std::shared_ptr<ShmOp>>& ops, Deadline deadline) {
  try {
    e.wait(ops, deadline);
  } catch (...) {
    e.steps().fail(std::current_exception());
    throw;
  }
  for (const auto& op : ops) {
    if (op && op->error) {
      e.steps().fail(op->error);
      std::rethrow_exception(op->error);
    }
  }
}

// Reductions of more than this many bytes per piece are split: each rank reduces 1/world of it
// (reduce-scatter), then every rank copies the others' results (all-gather). Smaller ones are
// reduced whole by every rank, which costs one step instead of two.
constexpr uint64_t kSplitBytes = uint64_t{32} << 10;

}  // namespace

void shm_barrier(ShmEngine& e, Deadline deadline) {
  step(
      e, describe(Kind::kBarrier, 0), deadline, [](uint8_t*) {}, [](uint64_t) {});
}

void shm_broadcast(ShmEngine& e, uint8_t* data, uint64_t bytes, int root, Deadline deadline) {
  const uint64_t part = e.steps().part_bytes();
  const bool is_root = e.rank() == root;
  for (uint64_t k = 0, n = pieces(bytes, part); k < n; ++k) {
    const uint64_t off = k * part, len = std::min(part, bytes - off);
    step(
        e, describe(Kind::kBroadcast, bytes, root, 0, k), deadline,
        [&](uint8_t* mine) {
          if (is_root && len) std::memcpy(mine, data + off, len);
        },
        [&](uint64_t s) {
          if (!is_root && len) std::memcpy(data + off, e.steps().part_of(root, s), len);
        },
        rooted_from(k, e.rank(), root, /*to_root=*/false));
  }
}

void shm_reduce(ShmEngine& e, uint8_t* data, uint64_t n, at::ScalarType dtype, ReduceKind op, int root,
                Deadline deadline) {
  const uint64_t es = c10::elementSize(dtype);
  const int world = e.size(), me = e.rank();
  const bool wants = root < 0 || root == me;
  const uint64_t per_piece = e.steps().part_bytes() / es;  // elements
  const uint64_t total = n * es;
  const uint32_t code = reduce_code(dtype, op);
  for (uint64_t k = 0, np = pieces(n, per_piece); k < np; ++k) {
    const uint64_t first = k * per_piece, m = std::min(per_piece, n - first);
    uint8_t* piece = data + first * es;
    const bool split = world > 2 && m * es > kSplitBytes;
    const uint64_t what = describe(Kind::kReduce, total, root, code, k);
    if (!split) {
      step(
          e, what, deadline,
          [&](uint8_t* mine) {
            if (m) std::memcpy(mine, piece, m * es);  // an empty tensor's data pointer may be null
          },
          [&](uint64_t s) {
            if (wants) reduce_parts(e, piece, s, 0, m, dtype, op);
          },
          root < 0 ? kEveryPeer : rooted_from(k, me, root, /*to_root=*/true));
      continue;
    }
    // Rank r owns elements [m * r / world, m * (r + 1) / world) of the piece.
    auto lo = [&](int r) { return m * static_cast<uint64_t>(r) / static_cast<uint64_t>(world); };
    const uint64_t a = e.steps().begin_step(what, deadline);
    std::memcpy(e.steps().my_part(a), piece, m * es);
    e.steps().publish_step(a);
    e.steps().await_step(a, deadline);
    // The owned slice goes to the same offset of the next step's part.
    const uint64_t b = e.steps().begin_step(what ^ 1, deadline);
    reduce_parts(e, e.steps().my_part(b) + lo(me) * es, a, lo(me) * es, lo(me + 1) - lo(me), dtype, op);
    e.steps().end_step(a);
    e.steps().publish_step(b);
    e.steps().await_step(b, deadline);
    if (wants) {
      for (int r = 0; r < world; ++r) {
        const uint64_t off = lo(r) * es, len = (lo(r + 1) - lo(r)) * es;
        if (len) std::memcpy(piece + off, e.steps().part_of(r, b) + off, len);
      }
    }
    e.steps().end_step(b);
  }
}

void shm_gather(ShmEngine& e, const uint8_t* in, uint64_t bytes, std::span<uint8_t* const> outs, int root,
                Deadline deadline) {
  const uint64_t part = e.steps().part_bytes();
  const int me = e.rank();
  const bool wants = root < 0 || root == me;
  if (root >= 0 && goes_point_to_point(e, bytes)) {
    step(
        e, describe(Kind::kGather, bytes, root, 1), deadline, [](uint8_t*) {}, [](uint64_t) {});
    const auto tag = static_cast<int64_t>(e.steps().last_step());
    std::vector<std::shared_ptr<ShmOp>> ops;
    if (me == root) {
      for (int r = 0; r < e.size(); ++r) {
        if (r != me) ops.push_back(e.post_recv(bytes_view(outs[static_cast<size_t>(r)], bytes), r, tag, true));
      }
      std::memcpy(outs[static_cast<size_t>(me)], in, bytes);
    } else {
      ops.push_back(e.post_send(bytes_view(in, bytes), root, tag, true));
    }
    finish_ops(e, ops, deadline);
    return;
  }
  for (uint64_t k = 0, n = pieces(bytes, part); k < n; ++k) {
    const uint64_t off = k * part, len = std::min(part, bytes - off);
    step(
        e, describe(Kind::kGather, bytes, root, 0, k), deadline,
        [&](uint8_t* mine) {
          if (len) std::memcpy(mine, in + off, len);
        },
        [&](uint64_t s) {
          if (!wants || len == 0) return;
          for (int r = 0; r < e.size(); ++r) {
            std::memcpy(outs[static_cast<size_t>(r)] + off, r == me ? in + off : e.steps().part_of(r, s), len);
          }
        },
        root < 0 ? kEveryPeer : rooted_from(k, me, root, /*to_root=*/true));
  }
}

void shm_scatter(ShmEngine& e, std::span<const uint8_t* const> ins, uint8_t* out, uint64_t bytes, int root,
                 Deadline deadline) {
  const int me = e.rank(), world = e.size();
  if (goes_point_to_point(e, bytes)) {
    step(
        e, describe(Kind::kScatter, bytes, root, 1), deadline, [](uint8_t*) {}, [](uint64_t) {});
    const auto tag = static_cast<int64_t>(e.steps().last_step());
    std::vector<std::shared_ptr<ShmOp>> ops;
    if (me == root) {
      for (int r = 0; r < world; ++r) {
        if (r != me) ops.push_back(e.post_send(bytes_view(ins[static_cast<size_t>(r)], bytes), r, tag, true));
      }
      std::memcpy(out, ins[static_cast<size_t>(me)], bytes);
    } else {
      ops.push_back(e.post_recv(bytes_view(out, bytes), root, tag, true));
    }
    finish_ops(e, ops, deadline);
    return;
  }
  const uint64_t per = share(e, 1);
  for (uint64_t k = 0, n = pieces(bytes, per); k < n; ++k) {
    const uint64_t off = k * per, len = std::min(per, bytes - off);
    step(
        e, describe(Kind::kScatter, bytes, root, 0, k), deadline,
        [&](uint8_t* mine) {
          if (me != root || len == 0) return;
          for (int r = 0; r < world; ++r) {
            if (r != me) std::memcpy(mine + static_cast<uint64_t>(r) * per, ins[static_cast<size_t>(r)] + off, len);
          }
        },
        [&](uint64_t s) {
          if (len == 0) return;
          std::memcpy(out + off,
                      me == root ? ins[static_cast<size_t>(me)] + off
                                 : e.steps().part_of(root, s) + static_cast<uint64_t>(me) * per,
                      len);
        },
        rooted_from(k, me, root, /*to_root=*/false));
  }
}

void shm_reduce_scatter(ShmEngine& e, std::span<const uint8_t* const> ins, uint8_t* out, uint64_t n,
                        at::ScalarType dtype, ReduceKind op, Deadline deadline) {
  const uint64_t es = c10::elementSize(dtype);
  const uint64_t per = share(e, es) / es;  // elements per rank per step
  const int me = e.rank(), world = e.size();
  for (uint64_t k = 0, np = pieces(n, per); k < np; ++k) {
    const uint64_t first = k * per, m = std::min(per, n - first);
    step(
        e, describe(Kind::kReduceScatter, n * es, -1, reduce_code(dtype, op), k), deadline,
        [&](uint8_t* mine) {
          for (int r = 0; r < world; ++r) {
            if (m)
              std::memcpy(mine + static_cast<uint64_t>(r) * per * es, ins[static_cast<size_t>(r)] + first * es, m * es);
          }
        },
        [&](uint64_t s) { reduce_parts(e, out + first * es, s, static_cast<uint64_t>(me) * per * es, m, dtype, op); });
  }
}

void shm_alltoall(ShmEngine& e, const uint8_t* in, std::span<const uint64_t> send_bytes, uint8_t* out,
                  std::span<const uint64_t> recv_bytes, Deadline deadline) {
  const int world = e.size(), me = e.rank();
  const auto w = static_cast<size_t>(world);
  if (e.steps().part_bytes() < 16 * w) throw window_too_small(e, "hold the alltoall sizes");
  // First step: every rank's send and receive sizes, so that every rank checks every pair and
  // knows how many steps the largest pair takes.
  uint64_t longest = 0;
  std::string problem;
  step(
      e, describe(Kind::kAlltoall, 0), deadline,
      [&](uint8_t* mine) {
        std::memcpy(mine, send_bytes.data(), 8 * w);
        std::memcpy(mine + 8 * w, recv_bytes.data(), 8 * w);
      },
      [&](uint64_t s) {
        std::vector<uint64_t> sends(w * w), recvs(w * w);
        for (size_t r = 0; r < w; ++r) {
          const uint8_t* p = r == static_cast<size_t>(me) ? nullptr : e.steps().part_of(static_cast<int>(r), s);
          std::memcpy(&sends[r * w], p ? p : reinterpret_cast<const uint8_t*>(send_bytes.data()), 8 * w);
          std::memcpy(&recvs[r * w], p ? p + 8 * w : reinterpret_cast<const uint8_t*>(recv_bytes.data()), 8 * w);
        }
        for (size_t a = 0; a < w && problem.empty(); ++a) {
          for (size_t b = 0; b < w; ++b) {
            if (sends[a * w + b] != recvs[b * w + a]) {
              problem = "shm alltoall: rank " + std::to_string(a) + " sends " + std::to_string(sends[a * w + b]) +
                        " bytes to rank " + std::to_string(b) + ", which expects " + std::to_string(recvs[b * w + a]);
              break;
            }
            longest = std::max(longest, sends[a * w + b]);
          }
        }
      });
  if (!problem.empty()) throw TransportError(problem);  // every rank found the same
  std::vector<uint64_t> send_off(w + 1, 0), recv_off(w + 1, 0);
  for (size_t r = 0; r < w; ++r) {
    send_off[r + 1] = send_off[r] + send_bytes[r];
    recv_off[r + 1] = recv_off[r] + recv_bytes[r];
  }
  const uint64_t per = share(e, 1);
  for (uint64_t k = 0, n = pieces(longest, per); k < n && longest != 0; ++k) {
    const uint64_t off = k * per;
    auto chunk = [&](uint64_t total) { return off >= total ? 0 : std::min(per, total - off); };
    step(
        e, describe(Kind::kAlltoall, longest, -1, 0, k + 1), deadline,
        [&](uint8_t* mine) {
          for (size_t d = 0; d < w; ++d) {
            const uint64_t len = chunk(send_bytes[d]);
            if (len && d != static_cast<size_t>(me)) std::memcpy(mine + d * per, in + send_off[d] + off, len);
          }
        },
        [&](uint64_t s) {
          for (size_t r = 0; r < w; ++r) {
            const uint64_t len = chunk(recv_bytes[r]);
            if (len == 0) continue;
            const uint8_t* src = r == static_cast<size_t>(me)
                                     ? in + send_off[r] + off
                                     : e.steps().part_of(static_cast<int>(r), s) + static_cast<uint64_t>(me) * per;
            std::memcpy(out + recv_off[r] + off, src, len);
          }
        });
  }
}

}  // namespace tdshm::detail
