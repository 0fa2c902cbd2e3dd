#pragma once
// Memory blocks of one size kept for reuse by the thread that freed them: the per-message
// objects of the shm path (a receive's Work and its op) are allocated and freed once per
// message, and malloc plus free cost ~150 instructions a pair there. A thread keeps at most
// kKeep blocks per size; the rest go back to the heap, and so do a thread's blocks when it ends
// (and any block freed after that).

#include <cstddef>
#include <memory>
#include <new>

namespace tdshm::detail {

template <size_t Bytes>
class RecycledBlocks {
 public:
  static_assert(Bytes >= sizeof(void*), "a free block holds the link to the next");

  static void* get() {
    Cache& c = cache();
    if (c.head == nullptr) return ::operator new(Bytes);
    Node* n = c.head;
    c.head = n->next;
    --c.count;
    return n;
  }

  static void put(void* p) noexcept {
    Cache& c = cache();
    if (c.closed || c.count >= kKeep) {
      ::operator delete(p);
      return;
    }
    c.head = ::new (p) Node{c.head};
    ++c.count;
  }

 private:
  static constexpr size_t kKeep = 64;
  struct Node {
    Node* next;
  };
  // Trivially destructible, so that it stays usable to the very end of its thread: objects of
  // static storage duration (a process group a static holds, with its Work) are destroyed after
  // the main thread's thread_local objects, and may still free blocks then.
  struct Cache {
    Node* head;
    size_t count;
    bool closed;  // the thread is ending: blocks go straight back to the heap
  };
  // Gives the thread's blocks back to the heap when the thread ends.
  struct Reaper {
    Cache* cache;
    ~Reaper() {
      cache->closed = true;
      while (cache->head != nullptr) {
        Node* next = cache->head->next;
        ::operator delete(cache->head);
        cache->head = next;
      }
      cache->count = 0;
    }
  };
  static Cache& cache() noexcept {
    thread_local Cache c{nullptr, 0, false};
    thread_local Reaper reaper{&c};
    (void)reaper;
    return c;
  }
};

/// An allocator over RecycledBlocks for std::allocate_shared: single objects (the object and its
/// control block, one block) come from the thread's cache; arrays from the heap.
template <class T>
struct RecyclingAllocator {
  using value_type = T;
  RecyclingAllocator() = default;
  template <class U>
  RecyclingAllocator(const RecyclingAllocator<U>&) noexcept {}
  static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__, "blocks come from plain operator new");

  T* allocate(size_t n) {
    if (n == 1) return static_cast<T*>(RecycledBlocks<sizeof(T)>::get());
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n == 1) {
      RecycledBlocks<sizeof(T)>::put(p);
      return;
    }
    std::allocator<T>().deallocate(p, n);
  }
  template <class U>
  bool operator==(const RecyclingAllocator<U>&) const noexcept {
    return true;
  }
};

}  // namespace tdshm::detail
