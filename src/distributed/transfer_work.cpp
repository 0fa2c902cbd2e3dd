// The waits that name the key of a failed leaf (transfer_work.h).

#include "distributed/transfer_work.h"

namespace tdshm::detail {

void wait_keyed(const std::vector<WorkPtr>& works, const std::function<Key(size_t)>& key_of, const char* verb) {
  std::exception_ptr first;
  for (size_t i = 0; i < works.size(); ++i) {
    try {
      works[i]->wait();
    } catch (...) {
      if (!first) first = current_with_context(std::string(verb) + key_of(i).str() + ": ");
    }
  }
  if (first) std::rethrow_exception(first);
}

void wait_keyed(const std::vector<WorkPtr>& works, const std::vector<Key>& keys, const char* verb) {
  wait_keyed(
      works, [&keys](size_t i) { return keys[i]; }, verb);
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

}  // namespace tdshm::detail
