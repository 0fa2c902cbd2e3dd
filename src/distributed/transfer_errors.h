#pragma once
// Context for errors that cross the transfer layer ("recv of key 'c': ...") without changing
// their type: a caller that catches tdshm::KeyError or tdshm::MemmapError still catches it after
// the transfer layer added the key to its message.
//
// std::runtime_error's message cannot be changed, so adding context means throwing a new object.
// The new object must be of the same dynamic type, which C++ cannot name at run time; hence one
// list of every class in <tdshm/errors.h> (KnownErrors), matched by typeid. A test
// (TransferErrors.EveryClassOfErrorsHIsKnown) reads errors.h and fails when a class there is
// missing from the list, so a new error class cannot be forgotten silently; and should one be
// forgotten all the same, its exceptions are rethrown unchanged (type kept, context lost), never
// turned into another type.

#include <tdshm/errors.h>

#include <c10/util/Exception.h>

#include <exception>
#include <string>
#include <tuple>
#include <typeinfo>

namespace tdshm::detail {

/// Every exception class of <tdshm/errors.h>, the base Error included. Keep in step with that
/// file (the test above enforces it).
using KnownErrors = std::tuple<Error, KeyError, ShapeError, TypeError, LockedError, SchemaError, MemmapError,
                               SegmentError, TransportError, PeerLostError, RendezvousAbandonedError, TimeoutError>;

/// Throws an exception of e's dynamic type with `message`, when that type is in the tuple
/// `Errors`; returns otherwise.
template <class... Errors>
void throw_as(const Error& e, const std::string& message, std::tuple<Errors...>* /*list*/) {
  // The first type whose typeid is e's own throws; exact matches only, so a subclass is never
  // sliced into its base.
  ((typeid(e) == typeid(Errors) ? throw Errors(message) : void()), ...);
}

/// Rethrows the exception being handled (call it from a catch block only) with `context` in
/// front of its message. A tdshm error keeps its exact type; a c10::Error (gloo, ATen) or any
/// other std::exception becomes a TransportError; anything else is rethrown as is.
[[noreturn]] inline void rethrow_with_context(const std::string& context) {
  try {
    throw;
  } catch (const Error& e) {
    throw_as(e, context + e.what(), static_cast<KnownErrors*>(nullptr));
    throw;  // a class missing from KnownErrors: its type matters more than the context
  } catch (const c10::Error& e) {
    throw TransportError(context + e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw TransportError(context + e.what());
  }
}

/// rethrow_with_context's result as an exception_ptr (call it from a catch block only).
inline std::exception_ptr current_with_context(const std::string& context) {
  try {
    rethrow_with_context(context);
  } catch (...) {
    return std::current_exception();
  }
}

}  // namespace tdshm::detail
