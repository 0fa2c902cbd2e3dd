// The CPU allocator that carves a producer's large allocations out of its loan heap (see
// heap_allocator.h).

#include "feed/heap_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <unistd.h>

#include <mutex>
#include <unordered_map>
#include <utility>

namespace tdshm::feed {

namespace heap_redirect {

thread_local const HeapSource* t_source = nullptr;
// Set while a source's take() runs: an allocation it makes itself (the engine receiving by
// value while it looks for room) must not come back into take().
thread_local bool t_taking = false;

// The loans behind the redirected allocations, by address.
struct Table {
  std::mutex mu;
  std::unordered_map<const void*, std::pair<at::Tensor, uint64_t>> loans;  // the loan, its bytes
  uint64_t live_bytes = 0;
};

Table& table() {
  static Table* t = new Table();  // never destroyed: DataPtrs may be freed during exit
  return *t;
}

// Drops the loan behind `p`; false when `p` is not a redirected allocation.
bool release(void* p) {
  at::Tensor loan;
  {
    Table& t = table();
    std::lock_guard lk(t.mu);
    auto it = t.loans.find(p);
    if (it == t.loans.end()) return false;
    loan = std::move(it->second.first);
    t.live_bytes -= it->second.second;
    t.loans.erase(it);
  }
  return true;  // the loan's bytes go back to its heap here (or once the consumer's views go)
}

void release_redirected(void* p) { release(p); }

class Redirect final : public c10::Allocator {
 public:
  explicit Redirect(c10::Allocator* next) : next_(next) { next_raw_deleter_ = next->raw_deleter(); }

  c10::DataPtr allocate(size_t n) const override {
    const HeapSource* s = t_source;
    if (s != nullptr && !t_taking && n >= s->min_bytes && n > 0 && ::getpid() == s->pid) {
      if (c10::DataPtr p = from_heap(*s, n); p) return p;
    }
    return next_->allocate(n);
  }

  // raw_allocate gives back through this: a redirected address, or one of the next allocator.
  c10::DeleterFnPtr raw_deleter() const override { return &release_any; }

 private:
  c10::DataPtr from_heap(const HeapSource& s, size_t n) const {
    Table& t = table();
    at::Tensor loan;
    t_taking = true;
    try {
      loan = s.take(n);
    } catch (...) {
      loan = at::Tensor();  // an unusable group: the ordinary allocator serves
    }
    t_taking = false;
    if (!loan.defined()) return {};
    void* p = loan.data_ptr();
    {
      std::lock_guard lk(t.mu);
      t.live_bytes += n;
      t.loans.emplace(p, std::make_pair(std::move(loan), uint64_t{n}));
    }
    return {p, p, &release_redirected, c10::Device(c10::DeviceType::CPU)};
  }

  static void release_any(void* p) {
    if (release(p)) return;
    if (next_raw_deleter_ != nullptr) next_raw_deleter_(p);
  }

  c10::Allocator* next_;
  static inline c10::DeleterFnPtr next_raw_deleter_ = nullptr;
};

// Installs the redirect once; whether c10 now hands it out.
bool install() {
  static Redirect* redirect = [] {
    c10::Allocator* next = c10::GetCPUAllocator();
    auto* r = new Redirect(next);  // lives as long as the process: c10 keeps a raw pointer
    c10::SetCPUAllocator(r, /*priority=*/0);
    return r;
  }();
  return c10::GetCPUAllocator() == redirect;
}

}  // namespace heap_redirect

const HeapSource* set_thread_heap_source(const HeapSource* source, bool* installed) {
  const bool ok = source == nullptr || heap_redirect::install();
  if (installed != nullptr) *installed = ok;
  const HeapSource* previous = heap_redirect::t_source;
  heap_redirect::t_source = ok ? source : nullptr;
  return previous;
}

uint64_t heap_allocations_live_bytes() {
  heap_redirect::Table& t = heap_redirect::table();
  std::lock_guard lk(t.mu);
  return t.live_bytes;
}

uint64_t redirected_bytes(const void* data) {
  heap_redirect::Table& t = heap_redirect::table();
  std::lock_guard lk(t.mu);
  const auto it = t.loans.find(data);
  return it == t.loans.end() ? 0 : it->second.second;
}

}  // namespace tdshm::feed
