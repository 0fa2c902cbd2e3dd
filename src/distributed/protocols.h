#pragma once
// The transfer protocols (one file each: per_leaf.cpp, consolidated.cpp, loans.cpp), called by
// TensorDict's methods once the peer is resolved (messages.h). Internal to the distributed layer.

#include <tdshm/distributed.h>
#include <tdshm/lazy_stack.h>

#include "distributed/messages.h"

#include <cstdint>

namespace tdshm::detail {

/// How a protocol's entry point completes: as its options say (isend's return_early, irecv's
/// return_premature), or waited whatever they say (send, recv: no copy of the options per call).
enum class Completion { kAsOptions, kWaited };

Transfer isend_per_leaf(const TensorDict& td, const Peer& p, const SendOptions& o,
                        Completion c = Completion::kAsOptions);
/// `last_tag`, when given, is set to the transfer's last tag (what recv returns).
Transfer irecv_per_leaf(const TensorDict& td, const Peer& p, const RecvOptions& o, int64_t* last_tag = nullptr,
                        Completion c = Completion::kAsOptions);
/// The same for a lazy stack: its members' leaves in order, the tags running on.
Transfer isend_per_leaf(const LazyStackedTensorDict& stack, const Peer& p, const SendOptions& o,
                        Completion c = Completion::kAsOptions);
Transfer irecv_per_leaf(const LazyStackedTensorDict& stack, const Peer& p, const RecvOptions& o,
                        int64_t* last_tag = nullptr, Completion c = Completion::kAsOptions);
Transfer isend_consolidated(const TensorDict& td, const Peer& p, const SendOptions& o,
                            Completion c = Completion::kAsOptions);
Transfer irecv_consolidated(const TensorDict& td, const Peer& p, const RecvOptions& o,
                            Completion c = Completion::kAsOptions);
inline constexpr int kConsolidatedTag = 0;  // tensordict's consolidated transfers use tag 0
TensorDict recv_view(const TensorDict& td, const Peer& p, const RecvOptions& o);  // loans.cpp

}  // namespace tdshm::detail
