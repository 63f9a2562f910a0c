// Calls (client) and running handlers (server) ordered by when they are due
// (runtime-internal): an intrusive doubly linked list, earliest first. A new
// entry is placed by walking back from the latest, which is one step when
// deadlines come in the order they are set (one default timeout).
#pragma once

#include <anydoor/rpc/detail/call_op.hpp>

namespace anydoor::rpc::detail {

class deadline_list {
 public:
  // Links n by n.due (after entries due at the same time); entries due
  // never (time_point::max()) are not linked. True when n is now first.
  bool insert(deadline_hook& n) noexcept {
    if (n.due == deadline_hook::clock::time_point::max()) return false;
    deadline_hook* after = tail_;
    while (after != nullptr && after->due > n.due) after = after->dl_prev;
    n.dl_prev = after;
    n.dl_next = after != nullptr ? after->dl_next : head_;
    if (n.dl_next != nullptr) {
      n.dl_next->dl_prev = &n;
    } else {
      tail_ = &n;
    }
    if (after != nullptr) {
      after->dl_next = &n;
    } else {
      head_ = &n;
    }
    n.dl_linked = true;
    return head_ == &n;
  }

  void remove(deadline_hook& n) noexcept {
    if (!n.dl_linked) return;
    if (n.dl_prev != nullptr) {
      n.dl_prev->dl_next = n.dl_next;
    } else {
      head_ = n.dl_next;
    }
    if (n.dl_next != nullptr) {
      n.dl_next->dl_prev = n.dl_prev;
    } else {
      tail_ = n.dl_prev;
    }
    n.dl_next = n.dl_prev = nullptr;
    n.dl_linked = false;
  }

  deadline_hook* first() const noexcept { return head_; }

 private:
  deadline_hook* head_ = nullptr;
  deadline_hook* tail_ = nullptr;
};

}  // namespace anydoor::rpc::detail
