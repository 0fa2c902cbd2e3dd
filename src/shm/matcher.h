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
// is the engine's (engine_receive.cpp). Op needs the fields peer (-1: any), tag and control; Msg
// needs src, tag and control. Not thread-safe: the engine holds its mutex.

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>

namespace tdshm::shm {

template <class Op, class Msg>
class Matcher {
 public:
  using OpPtr = std::shared_ptr<Op>;
  using MsgPtr = std::shared_ptr<Msg>;

  /// The oldest early message that a receive from `src` (-1: any) with `tag` accepts, removed
  /// from the queue; null if none.
  MsgPtr take_early(int src, int64_t tag, bool control) {
    if (early_.empty()) return nullptr;  // the common case: no scan, no call
    auto it = std::find_if(early_.begin(), early_.end(), [&](const MsgPtr& m) {
      return (src < 0 || m->src == src) && m->tag == tag && m->control == control;
    });
    if (it == early_.end()) return nullptr;
    MsgPtr msg = std::move(*it);
    early_.erase(it);
    return msg;
  }

  /// Queues a receive that found no early message.
  void post(OpPtr op) { posted_.push_back(std::move(op)); }

  /// Where find_posted found a receive; valid until the queue changes.
  using Found = typename std::deque<OpPtr>::iterator;

  /// The oldest posted receive that accepts a message from `src` with `tag`, left in the queue
  /// until take_posted; `none()` if there is none.
  Found find_posted(int src, int64_t tag, bool control) {
    return std::find_if(posted_.begin(), posted_.end(), [&](const OpPtr& op) {
      return (op->peer < 0 || op->peer == src) && op->tag == tag && op->control == control;
    });
  }
  Found none() noexcept { return posted_.end(); }

  /// Removes the receive that find_posted found and hands it over.
  OpPtr take_posted(Found found) {
    OpPtr op = std::move(*found);
    posted_.erase(found);
    return op;
  }

  /// Whether some posted receive accepts messages from `src`, whatever their tag.
  bool waits_on(int src) const {
    return std::any_of(posted_.begin(), posted_.end(), [&](const OpPtr& op) { return op->peer < 0 || op->peer == src; });
  }

  /// Queues a message that no posted receive took.
  void add_early(MsgPtr msg) { early_.push_back(std::move(msg)); }

  /// Removes `msg` from the early queue; false if it was not there.
  bool remove_early(const MsgPtr& msg) { return std::erase(early_, msg) != 0; }

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
    for (const auto& op : posted) dropped(op);
  }

  size_t posted_count() const noexcept { return posted_.size(); }
  size_t early_count() const noexcept { return early_.size(); }

 private:
  std::deque<OpPtr> posted_;  // posting order
  std::deque<MsgPtr> early_;  // arrival order
};

}  // namespace tdshm::shm

