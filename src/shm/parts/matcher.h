#pragma once
// Which receive a message lands in, as MPI and c10d define it: a receive names a source (or any
// source, -1) and a tag; user messages and a collective's control messages never match each
// other. Two queues, both in order: receives posted and not yet matched (posting order), and
// messages that arrived before any receive took them ("early", arrival order).
//
//  * A message from `src` takes the oldest posted receive that accepts it (find_posted, then
//    take_posted once the engine keeps the message), so two receives with one tag complete in
//    posting order.
//  * A receive takes the oldest early message it accepts (take_early) before it is posted, so
//    a source's messages on one tag are received in the order they were sent, and an any-source
//    receive takes the message that arrived first.
//
// Only the order and the keys are here; what a match does with the bytes (checks, sizes, copies)
// is the channel receiver's (receiver.cpp). Op needs the fields peer (-1: any), tag and control; Msg
// needs src, tag and control. Not thread-safe: the engine holds its mutex.

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>

namespace tdshm::shm {

template <class Op, class Msg>
class Matcher {
 public:
  using OpPtr = std::shared_ptr<Op>;
  using MsgPtr = std::shared_ptr<Msg>;

  /// The oldest early message that a receive from `src` (-1: any) with `tag` accepts, removed
  /// from the queue; null if none.
  MsgPtr take_early(int src, int64_t tag, bool control) {
    if (early_count_ == 0) return nullptr;  // the common case
    auto by_tag = early_.find(Key{tag, control});
    if (by_tag == early_.end()) return nullptr;
    auto& sources = by_tag->second;
    // From `src`, the oldest of its queue; from any source, the oldest of the queues' heads.
    auto pick = sources.end();
    for (auto it = sources.begin(); it != sources.end(); ++it) {
      if (src >= 0 && it->first != src) continue;
      if (pick == sources.end() || it->second.front().first < pick->second.front().first) pick = it;
    }
    if (pick == sources.end()) return nullptr;
    MsgPtr msg = std::move(pick->second.front().second);
    pick->second.pop_front();
    if (pick->second.empty()) sources.erase(pick);
    if (sources.empty()) early_.erase(by_tag);
    --early_count_;
    return msg;
  }

  /// Queues a receive that found no early message.
  void post(OpPtr op) { posted_.push_back(std::move(op)); }

  /// Where find_posted found a receive; valid until the queue changes.
  using Found = typename std::deque<OpPtr>::iterator;

  /// The oldest posted receive that accepts a message from `src` with `tag`, left in the queue
  /// until take_posted; `none()` if there is none.
  Found find_posted(int src, int64_t tag, bool control) {
    auto accepts = [&](const OpPtr& op) {
      return (op->peer < 0 || op->peer == src) && op->tag == tag && op->control == control;
    };
    // The common cases, without the deque's iterators: none posted, or the oldest takes it.
    if (posted_.empty()) return posted_.end();
    if (accepts(posted_.front())) return posted_.begin();
    return std::find_if(std::next(posted_.begin()), posted_.end(), accepts);
  }
  Found none() noexcept { return posted_.end(); }

  /// Removes the receive that find_posted found and hands it over.
  // Inline, its general erase out of line: the whole of it stopped being inlined into the
  // channel's entry handler once that grew (loans), ~30 instructions a message more.
  [[gnu::always_inline]] OpPtr take_posted(Found found) {
    OpPtr op = std::move(*found);
    if (found == posted_.begin()) [[likely]] {
      posted_.pop_front();  // the common case, much cheaper than a general erase
    } else {
      erase_posted(found);
    }
    return op;
  }
  [[gnu::noinline]] void erase_posted(Found found) { posted_.erase(found); }

  /// Whether some posted receive accepts messages from `src`, whatever their tag.
  bool waits_on(int src) const {
    return std::any_of(posted_.begin(), posted_.end(),
                       [&](const OpPtr& op) { return op->peer < 0 || op->peer == src; });
  }

  /// Queues a message that no posted receive took.
  void add_early(MsgPtr msg) {
    const int src = msg->src;
    early_[Key{msg->tag, msg->control}][src].emplace_back(next_arrival_++, std::move(msg));
    ++early_count_;
  }

  /// Removes `msg` from the early queue; false if it was not there.
  bool remove_early(const MsgPtr& msg) {
    auto by_tag = early_.find(Key{msg->tag, msg->control});
    if (by_tag == early_.end()) return false;
    auto from = by_tag->second.find(msg->src);
    if (from == by_tag->second.end()) return false;
    auto& queue = from->second;
    auto it = std::find_if(queue.begin(), queue.end(), [&](const auto& entry) { return entry.second == msg; });
    if (it == queue.end()) return false;
    queue.erase(it);
    if (queue.empty()) by_tag->second.erase(from);
    if (by_tag->second.empty()) early_.erase(by_tag);
    --early_count_;
    return true;
  }

  /// Removes a posted receive (its caller gave up); false if it was not posted.
  bool withdraw(const OpPtr& op) { return std::erase(posted_, op) != 0; }

  /// Removes every posted receive for which `pred(op)` holds, oldest first, handing each to
  /// `dropped` after it left the queue.
  template <class Pred, class Dropped>
  void drop_posted_if(Pred pred, Dropped dropped) {
    for (auto it = posted_.begin(); it != posted_.end();) {
      if (pred(**it)) {
        OpPtr op = std::move(*it);
        it = posted_.erase(it);
        dropped(op);
      } else {
        ++it;
      }
    }
  }

  /// Empties both queues, handing each posted receive to `dropped` (oldest first).
  template <class Dropped>
  void clear(Dropped dropped) {
    std::deque<OpPtr> posted;
    posted.swap(posted_);
    early_.clear();
    early_count_ = 0;
    for (const auto& op : posted) dropped(op);
  }

  size_t posted_count() const noexcept { return posted_.size(); }
  size_t early_count() const noexcept { return early_count_; }

 private:
  std::deque<OpPtr> posted_;  // posting order
  // Early messages by (tag, control), then by source, each queue in arrival order (the number
  // before each message orders any-source receives across sources). A data loader's main rank
  // can hold thousands of them (up to ShmOptions::max_unexpected_bytes): a linear scan of one
  // queue per receive took 10 % of its samples and made it slower the further it fell behind.
  struct Key {
    int64_t tag;
    bool control;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const noexcept { return std::hash<int64_t>()(k.tag) * 2 + (k.control ? 1 : 0); }
  };
  std::unordered_map<Key, std::map<int, std::deque<std::pair<uint64_t, MsgPtr>>>, KeyHash> early_;
  size_t early_count_ = 0;
  uint64_t next_arrival_ = 0;
};

}  // namespace tdshm::shm
