// Loans (see loan_pool.h): the owner's allocator and tickets, and the receiver's side of a lent
// region (the bytes a reference names, giving a ticket back, a view that gives it back when dropped).

#include "shm/p2p/loan_pool.h"

#include "shm/parts/waiter.h"

#include <ATen/ops/from_blob.h>
#include <c10/core/TensorOptions.h>

#include <algorithm>

namespace tdshm::shm {

namespace {
// Every allocation starts on a cache line (and takes at least one), so two loans never share one.
constexpr uint64_t kLoanAlign = kCacheLine;
}  // namespace

LoanPool::LoanPool(const Segment& segment, uint32_t owner)
    : mapping_(segment.mapping()), region_(LoanRegionView::of(segment, owner)), owner_(owner) {
  if (region_.heap_bytes != 0) free_.emplace(0, region_.heap_bytes);
  ticket_allocation_.assign(region_.ticket_count, 0);
  out_.assign(region_.ticket_count, 0);
}

at::Tensor LoanPool::allocate(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  uint64_t numel = 1;
  for (const int64_t d : sizes) numel *= static_cast<uint64_t>(d);  // sizes are checked by the caller
  const uint64_t want = std::max<uint64_t>(round_up(numel * c10::elementSize(dtype), kLoanAlign), kLoanAlign);
  uint64_t offset = 0;
  {
    std::lock_guard lk(mu_);
    auto it = std::find_if(free_.begin(), free_.end(), [&](const auto& f) { return f.second >= want; });
    if (it == free_.end()) return {};
    offset = it->first;
    const uint64_t left = it->second - want;
    free_.erase(it);
    if (left != 0) free_.emplace(offset + want, left);
    allocations_[offset] = Allocation{want};
  }
  ever_lent_.store(true, std::memory_order_relaxed);
  // The deleter holds the pool (and so the mapping): a loan may outlive its group.
  auto self = shared_from_this();
  return at::from_blob(
      region_.heap + offset, sizes, [self, offset](void*) { self->drop(offset); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

std::optional<LoanPool::Place> LoanPool::find(const void* data, uint64_t bytes) const {
  const auto* p = static_cast<const uint8_t*>(data);
  if (p < region_.heap || p >= region_.heap + region_.heap_bytes) return std::nullopt;  // the common case
  const uint64_t offset = static_cast<uint64_t>(p - region_.heap);
  std::lock_guard lk(mu_);
  auto it = allocations_.upper_bound(offset);
  if (it == allocations_.begin()) return std::nullopt;
  --it;
  if (!it->second.tensor_alive || offset + bytes > it->first + it->second.bytes) return std::nullopt;
  return Place{offset, it->first};
}

std::optional<uint32_t> LoanPool::take_ticket(uint32_t dst, uint64_t allocation) {
  const uint32_t n = region_.ticket_count;
  std::lock_guard lk(mu_);
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t t = next_ticket_;
    next_ticket_ = next_ticket_ + 1 == n ? 0 : next_ticket_ + 1;
    // A ticket that came back is taken again only once its send has seen it (ticket_returned).
    if (out_[t]) continue;
    auto& state = region_.tickets[t].state;
    if (state.load(std::memory_order_acquire) != kSlotFree) continue;
    state.store(dst + 1, std::memory_order_relaxed);  // published by the entry that names it (release)
    out_[t] = 1;
    ticket_allocation_[t] = allocation;
    ++allocations_.at(allocation).tickets_out;
    return t;
  }
  return std::nullopt;
}

void LoanPool::ticket_returned(uint32_t t) {
  std::lock_guard lk(mu_);
  out_[t] = 0;
  auto it = allocations_.find(ticket_allocation_[t]);
  if (it == allocations_.end() || it->second.tickets_out == 0) return;
  if (--it->second.tickets_out == 0 && !it->second.tensor_alive) free_locked(it->first);
}

uint32_t LoanPool::reclaim(uint32_t dst) {
  uint32_t n = 0;
  for (uint32_t t = 0; t < region_.ticket_count; ++t) {
    auto& state = region_.tickets[t].state;
    if (state.load(std::memory_order_acquire) == dst + 1) {
      state.store(kSlotFree, std::memory_order_release);
      ++n;
    }
  }
  return n;
}

std::string LoanPool::holders() const {
  std::vector<uint64_t> count, bytes;
  {
    std::lock_guard lk(mu_);
    for (uint32_t t = 0; t < region_.ticket_count; ++t) {
      const uint32_t state = region_.tickets[t].state.load(std::memory_order_relaxed);
      if (state == kSlotFree) continue;
      const uint32_t r = state - 1;
      if (r >= count.size()) {
        count.resize(r + 1);
        bytes.resize(r + 1);
      }
      ++count[r];
      if (auto it = allocations_.find(ticket_allocation_[t]); it != allocations_.end()) bytes[r] += it->second.bytes;
    }
  }
  std::string out;
  for (size_t r = 0; r < count.size(); ++r) {
    if (count[r] == 0) continue;
    out += (out.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " holds " + std::to_string(count[r]) +
           (count[r] == 1 ? " loan" : " loans") + " of rank " + std::to_string(owner_) + " (" +
           std::to_string(bytes[r]) + " bytes)";
  }
  return out;
}

void LoanPool::drop(uint64_t allocation) {
  std::lock_guard lk(mu_);
  auto it = allocations_.find(allocation);
  if (it == allocations_.end()) return;
  it->second.tensor_alive = false;
  if (it->second.tickets_out == 0) free_locked(allocation);
}

void LoanPool::free_locked(uint64_t allocation) {
  auto it = allocations_.find(allocation);
  uint64_t offset = it->first, bytes = it->second.bytes;
  allocations_.erase(it);
  // Coalesce with the free ranges on either side.
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first == offset + bytes) {
    bytes += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += bytes;
      return;
    }
  }
  free_.emplace(offset, bytes);
}

const uint8_t* lent_bytes(const LoanRegionView& region, const LoanReference& ref, uint64_t bytes,
                          uint32_t me) noexcept {
  if (ref.ticket >= region.ticket_count || ref.offset > region.heap_bytes || bytes > region.heap_bytes - ref.offset) {
    return nullptr;
  }
  if (region.tickets[ref.ticket].state.load(std::memory_order_acquire) != me + 1) return nullptr;
  return region.heap + ref.offset;
}

bool still_lent(const LoanRegionView& region, uint32_t t, uint32_t me) noexcept {
  std::atomic_thread_fence(std::memory_order_acquire);  // the copy's loads before the ticket's
  return t < region.ticket_count && region.tickets[t].state.load(std::memory_order_relaxed) == me + 1;
}

void give_back(const LoanRegionView& region, uint32_t t, RankSlot& owner_slot) noexcept {
  region.tickets[t].state.store(kSlotFree, std::memory_order_release);  // pairs with the owner's acquire
  wake(owner_slot);
}

namespace {

// What a view's storage carries: its ticket, given back once (by release_view, or when the
// storage goes), and the mapping it keeps alive.
struct ViewContext {
  std::shared_ptr<const Mapping> mapping;
  LoanRegionView region;
  uint32_t ticket;
  RankSlot* owner;
  std::atomic<bool> given_back{false};
  bool give_back_once() noexcept {
    if (given_back.exchange(true, std::memory_order_acq_rel)) return false;
    give_back(region, ticket, *owner);
    return true;
  }
};

void delete_view_context(void* p) {
  auto* ctx = static_cast<ViewContext*>(p);
  ctx->give_back_once();
  delete ctx;
}

}  // namespace

at::Tensor view_of_loan(std::shared_ptr<const Mapping> mapping, const LoanRegionView& region, uint32_t t,
                        RankSlot& owner_slot, const uint8_t* data, c10::IntArrayRef sizes, c10::ScalarType dtype) {
  auto ctx = std::make_unique<ViewContext>();
  ctx->mapping = std::move(mapping);
  ctx->region = region;
  ctx->ticket = t;
  ctx->owner = &owner_slot;
  // The view is read-only in spirit (the bytes are the sender's), but torch has no read-only
  // tensors: writing into it writes into the sender's loan, which the sender does not read back.
  at::Tensor view = at::for_blob(const_cast<uint8_t*>(data), sizes)
                        .context(ctx.get(), &delete_view_context)
                        .options(at::TensorOptions().dtype(dtype).device(at::kCPU))
                        .make_tensor();
  ctx.release();  // owned by the view's storage now
  return view;
}

bool release_view(const at::Tensor& view) noexcept {
  if (!view.defined() || !view.has_storage()) return false;
  const c10::DataPtr& data = view.storage().data_ptr();
  if (data.get_deleter() != &delete_view_context) return false;
  return static_cast<ViewContext*>(data.get_context())->give_back_once();
}

}  // namespace tdshm::shm
