#pragma once
/// \file
/// The typed errors tdshm throws. Every error derives from tdshm::Error, so a caller can catch
/// all of them in one place, or one kind precisely. Messages say what was wrong and what to do.

#include <stdexcept>
#include <string>

namespace tdshm {

/// Base of every exception tdshm throws on bad input or OS failure.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A key is empty, has an empty part, is missing, or names a leaf where a subtree is needed
/// (or the reverse).
class KeyError : public Error {
 public:
  using Error::Error;
};

/// A shape does not fit: a leaf's leading dimensions differ from the batch size, or a tensor
/// written in place has another shape than the leaf it lands in.
class ShapeError : public Error {
 public:
  using Error::Error;
};

/// A value has the wrong kind or dtype: a non-tensor value where a tensor is needed, a dtype
/// mismatch on an in-place write, an unregistered tensorclass name.
class TypeError : public Error {
 public:
  using Error::Error;
};

/// The tensordict is locked (for instance because it is consolidated): new keys and deletions
/// are refused; in-place writes are allowed.
class LockedError : public Error {
 public:
  using Error::Error;
};

/// Schema bytes could not be decoded: truncated, oversized, corrupted, or of an unknown version.
/// Raised by the decoder, which reads bytes that may have been written by another process.
class SchemaError : public Error {
 public:
  using Error::Error;
};

/// A memory-mapped file could not be created, opened or mapped: missing, too small, not
/// writable when writing was asked for, or out of space.
class MemmapError : public Error {
 public:
  using Error::Error;
};

/// A shared-memory segment could not be created or attached: bad name, mismatched world size or
/// layout version, a rank taken by a live process, not enough room in /dev/shm, or a header
/// that fails validation.
class SegmentError : public Error {
 public:
  using Error::Error;
};

/// A transfer failed: the message does not fit the tensor it lands in (size, dtype, shape), or
/// bytes read from the segment are out of range (a corrupted or hostile peer).
class TransportError : public Error {
 public:
  using Error::Error;
};

/// A peer process died (or left) while a transfer to or from it was pending.
class PeerLostError : public Error {
 public:
  using Error::Error;
};

/// A rank gave up a group's rendezvous (its construction timed out or failed) before the group
/// formed: the other ranks' constructions fail with this. Nobody died: constructing the group
/// again, on every rank, may succeed.
class RendezvousAbandonedError : public PeerLostError {
 public:
  using PeerLostError::PeerLostError;
};

/// A wait reached its deadline (the group's timeout, or the one given to wait()).
class TimeoutError : public Error {
 public:
  using Error::Error;
};

}  // namespace tdshm
