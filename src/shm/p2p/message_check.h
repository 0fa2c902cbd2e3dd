#pragma once
// What tdshm's transfer layer tells the shm transport about one message, so that the receiver can
// check it although tensordict's wire has no room for it: it rides in the ring entry's own header
// (no extra message). A receive with a check of the same kind as the message's compares the values
// before any byte is written: a key check that differs fails the receive with a TransportError, a
// schema check with a SchemaError (the message is dropped, as on any mismatch). A message or
// receive without a check (kNone: plain c10d calls, Python ranks) is not compared. A key check may
// also carry the number of leaves of the transfer (0: unknown); when both sides give one and they
// differ, the receive fails with a TransportError whose message says "the sender's tree has N
// leaves". Torch-free.

#include <cstdint>

namespace tdshm {

struct MessageCheck {
  enum class Kind : uint8_t { kNone, kKey, kSchema };
  Kind kind = Kind::kNone;
  uint32_t value = 0;
  uint16_t leaves = 0;
};

}  // namespace tdshm
