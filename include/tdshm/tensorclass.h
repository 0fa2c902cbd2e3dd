#pragma once
/// \file
/// tensorclass: a typed record whose fields are the leaves of an inner TensorDict, declared in
/// one line and registered under a stable name, so that a receiver can rebuild the type from a
/// tensordict (or a schema) that carries the name.
///
/// \code
/// TDSHM_TENSORCLASS(Transition, "demo.Transition", obs, action, reward);
///
/// Transition tr({{"obs", at::zeros({4, 3})}, {"action", at::ones({4})}}, /*batch_size=*/{4});
/// at::Tensor obs = tr.obs();            // a field accessor per field
/// tr.set_reward(at::zeros({4}));        // and a setter
/// tdshm::TensorDict body = tr.tensordict();                // class_name() == "demo.Transition"
/// auto any = tdshm::make_tensorclass(body);                // std::shared_ptr<TensorClassBase>
/// Transition back = tdshm::tensorclass_cast<Transition>(body);
/// \endcode
///
/// A field may hold a tensor, a nested tensordict or a non-tensor value; a field never set is
/// absent (Python's None) and its accessor throws KeyError. Keys that are not fields are refused
/// with KeyError. Thread safety: registration is thread safe; objects behave like TensorDict.

#include <tdshm/tensordict.h>

#include <array>
#include <functional>
#include <span>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tdshm {

/// Type-erased base of every tensorclass.
class TensorClassBase {
 public:
  virtual ~TensorClassBase() = default;
  TensorClassBase(const TensorClassBase&) = default;
  TensorClassBase& operator=(const TensorClassBase&) = default;
  TensorClassBase(TensorClassBase&&) noexcept = default;
  TensorClassBase& operator=(TensorClassBase&&) noexcept = default;

  /// The registered name of the type.
  const std::string& type_name() const noexcept { return td_.class_name(); }
  /// The inner tensordict (a handle: writes through it change this object); its class_name()
  /// is type_name(), which is how the type travels.
  const TensorDict& tensordict() const noexcept { return td_; }
  /// A plain TensorDict with the same leaves (shared), without the type name.
  TensorDict to_tensordict() const;
  const std::vector<int64_t>& batch_size() const noexcept { return td_.batch_size(); }
  /// The value of a field by name. Throws KeyError if it is not a field or was never set.
  Value get_value(const std::string& field) const;

 protected:
  /// Takes a shallow copy of `td` (same leaves) typed as `name`, after checking that every key
  /// of `td` is one of `fields` (KeyError otherwise).
  TensorClassBase(const TensorDict& td, std::string_view name, std::span<const std::string_view> fields);
  TensorDict td_;
};

/// Creates a tensorclass object from a tensordict of the same fields.
using TensorClassFactory = std::function<std::shared_ptr<TensorClassBase>(const TensorDict&)>;

/// Registers `name` with its fields and factory. Registering the same name again with the same
/// fields is a no-op; with other fields it throws TypeError. Thread safe.
void register_tensorclass(const std::string& name, std::vector<std::string> fields, TensorClassFactory factory);
/// Whether `name` is registered. Thread safe.
bool is_tensorclass_registered(const std::string& name);
/// The fields of a registered tensorclass, in declaration order. Throws TypeError if unknown.
std::vector<std::string> tensorclass_fields(const std::string& name);
/// Rebuilds the registered type named by td.class_name() around `td`'s leaves.
/// Throws TypeError if td carries no class name or an unregistered one, KeyError if its keys
/// are not fields of the type.
std::shared_ptr<TensorClassBase> make_tensorclass(const TensorDict& td);

/// CRTP base that TDSHM_TENSORCLASS uses; Derived provides kTypeName and kFields.
template <class T>
T tensorclass_cast(const TensorDict& td);

template <class Derived>
class TensorClass : public TensorClassBase {
 public:
  /// An object holding `items` (keys must be fields).
  TensorClass(std::initializer_list<TensorDict::Item> items, std::vector<int64_t> batch_size = {},
              std::optional<c10::Device> device = std::nullopt)
      : TensorClassBase(TensorDict(items, std::move(batch_size), device), Derived::kTypeName, Derived::kFields) {}
  /// An object over `td`'s leaves (shared; keys must be fields).
  explicit TensorClass(const TensorDict& td) : TensorClassBase(td, Derived::kTypeName, Derived::kFields) {}

  Derived clone() const { return Derived(td_.clone()); }
  Derived contiguous() const { return Derived(td_.contiguous()); }
  Derived to(c10::Device device) const { return Derived(td_.to(device)); }
  Derived expand(std::vector<int64_t> batch_size) const { return Derived(td_.expand(std::move(batch_size))); }
  /// The consolidated form: the body is consolidated and carries type_name() in its schema.
  Derived consolidate(const ConsolidateOptions& options = {}) const { return Derived(td_.consolidate(options)); }
  bool is_consolidated() const noexcept { return td_.is_consolidated(); }
  Derived& update_(const TensorDict& other) {
    td_.update_(other);
    return static_cast<Derived&>(*this);
  }

  // The transfer methods of the inner tensordict (see TensorDict), defined in
  // <tdshm/distributed.h>. init_remote carries type_name(): from_remote_init and broadcast
  // rebuild a Derived (TypeError if the sender's type is another one).
  Transfer isend(const SendOptions& options) const;
  void send(const SendOptions& options) const;
  Transfer irecv(const RecvOptions& options);
  int64_t recv(const RecvOptions& options);
  void init_remote(const InitRemoteOptions& options) const;
  static Derived from_remote_init(const FromRemoteInitOptions& options);
  Derived broadcast(const BroadcastOptions& options) const;
  /// The collectives of the inner tensordict. As under tensordict (they are in its
  /// _FALLBACK_METHOD_FROM_TD_NOWRAP list), all_gather and scatter return plain TensorDicts, not
  /// Derived.
  Transfer reduce(const ReduceOptions& options);
  Transfer all_reduce(const AllReduceOptions& options);
  std::vector<TensorDict> all_gather(const AllGatherOptions& options) const;
  TensorDict scatter(const ScatterOptions& options) const;

  /// Registers Derived (TDSHM_TENSORCLASS does this at start-up).
  static bool register_type() {
    std::vector<std::string> fields(Derived::kFields.begin(), Derived::kFields.end());
    register_tensorclass(std::string(Derived::kTypeName), std::move(fields),
                         [](const TensorDict& td) -> std::shared_ptr<TensorClassBase> { return std::make_shared<Derived>(td); });
    return true;
  }
};

/// `td` as a T: td.class_name() must be T's registered name (TypeError otherwise).
template <class T>
T tensorclass_cast(const TensorDict& td) {
  if (td.class_name() != T::kTypeName) {
    throw TypeError("cannot view a tensordict of class '" + td.class_name() + "' as tensorclass '" +
                    std::string(T::kTypeName) + "'");
  }
  return T(td);
}

namespace detail {
/// Registration at static initialisation: logs instead of throwing (nothing can catch there).
bool register_at_startup(const std::function<bool()>& reg, std::string_view name) noexcept;
}  // namespace detail

}  // namespace tdshm

// --- the declaration macro ---------------------------------------------------------------------
// A bounded FOR_EACH built on __VA_OPT__ (C++20): up to 64 fields.
#define TDSHM_PP_PARENS ()
#define TDSHM_PP_EXPAND(...) TDSHM_PP_EXPAND3(TDSHM_PP_EXPAND3(TDSHM_PP_EXPAND3(TDSHM_PP_EXPAND3(__VA_ARGS__))))
#define TDSHM_PP_EXPAND3(...) TDSHM_PP_EXPAND2(TDSHM_PP_EXPAND2(TDSHM_PP_EXPAND2(TDSHM_PP_EXPAND2(__VA_ARGS__))))
#define TDSHM_PP_EXPAND2(...) TDSHM_PP_EXPAND1(TDSHM_PP_EXPAND1(TDSHM_PP_EXPAND1(TDSHM_PP_EXPAND1(__VA_ARGS__))))
#define TDSHM_PP_EXPAND1(...) __VA_ARGS__
#define TDSHM_PP_FOR_EACH(macro, ...) __VA_OPT__(TDSHM_PP_EXPAND(TDSHM_PP_FOR_EACH_STEP(macro, __VA_ARGS__)))
#define TDSHM_PP_FOR_EACH_STEP(macro, first, ...) \
  macro(first) __VA_OPT__(TDSHM_PP_FOR_EACH_AGAIN TDSHM_PP_PARENS(macro, __VA_ARGS__))
#define TDSHM_PP_FOR_EACH_AGAIN() TDSHM_PP_FOR_EACH_STEP

#define TDSHM_TC_FIELD_NAME(field) std::string_view(#field),
#define TDSHM_TC_ACCESSORS(field)                                                \
  at::Tensor field() const { return this->td_.get(#field); }                     \
  auto& set_##field(const ::tdshm::Value& value) {                               \
    this->td_.set(#field, value);                                                \
    return *this;                                                                \
  }

/// Declares tensorclass `Type` registered as `name` with the given fields, at namespace scope:
/// `TDSHM_TENSORCLASS(Transition, "demo.Transition", obs, action, reward);`
#define TDSHM_TENSORCLASS(Type, name, ...)                                                           \
  struct Type : ::tdshm::TensorClass<Type> {                                                         \
    static constexpr std::string_view kTypeName = name;                                              \
    static constexpr std::array kFields = {TDSHM_PP_FOR_EACH(TDSHM_TC_FIELD_NAME, __VA_ARGS__)};     \
    using ::tdshm::TensorClass<Type>::TensorClass;                                                   \
    TDSHM_PP_FOR_EACH(TDSHM_TC_ACCESSORS, __VA_ARGS__)                                               \
  };                                                                                                 \
  inline const bool tdshm_registered_##Type =                                                        \
      ::tdshm::detail::register_at_startup([] { return Type::register_type(); }, name)
