#pragma once
// Memory blocks of one size kept for reuse by the thread that freed them: the per-message
// objects of the shm path (a receive's Work and its op) are allocated and freed once per
// message, and malloc plus free cost ~150 instructions a pair there. A thread keeps at most
// kKeep blocks per size; the rest go back to the heap, and so do a thread's blocks when it ends.

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
    if (c.count >= kKeep) {
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
  struct Cache {
    Node* head = nullptr;
    size_t count = 0;
    ~Cache() {
      while (head != nullptr) {
        Node* next = head->next;
        ::operator delete(head);
        head = next;
      }
    }
  };
  static Cache& cache() noexcept {
    thread_local Cache c;
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
