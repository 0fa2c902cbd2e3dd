// The tensorclass registry and the type-erased base.

#include <tdshm/tensorclass.h>

#include "common/log.h"
#include "tensordict/impl.h"

#include <algorithm>
#include <map>
#include <mutex>

namespace tdshm {

namespace {

struct Registration {
  std::vector<std::string> fields;
  TensorClassFactory factory;
};

struct Registry {
  std::mutex mutex;
  std::map<std::string, Registration, std::less<>> types;
};

Registry& registry() {
  static Registry r;  // constructed on first use, so static registrations in any order work
  return r;
}

// A new dictionary with the same entries (leaves and nested handles shared).
TensorDict shallow_copy(const TensorDict& td, std::string class_name) {
  auto impl = std::make_shared<detail::TensorDictImpl>(*td.impl());
  impl->class_name = std::move(class_name);
  if (impl->locked) impl->locked_by = td.impl()->locked_by.lock() == td.impl() ? impl : td.impl()->locked_by;
  return TensorDict(impl);
}

}  // namespace

TensorClassBase::TensorClassBase(const TensorDict& td, std::string_view name,
                                 std::span<const std::string_view> fields) {
  for (const auto& [k, v] : td.impl()->entries) {
    if (std::find(fields.begin(), fields.end(), k) == fields.end()) {
      std::string list;
      for (auto f : fields) list += (list.empty() ? "" : ", ") + std::string(f);
      throw KeyError("key '" + k + "' is not a field of tensorclass '" + std::string(name) + "' (fields: " + list + ")");
    }
  }
  td_ = shallow_copy(td, std::string(name));
}

TensorDict TensorClassBase::to_tensordict() const { return shallow_copy(td_, ""); }

Value TensorClassBase::get_value(const std::string& field) const { return td_.get_value(Key(field)); }

void register_tensorclass(const std::string& name, std::vector<std::string> fields, TensorClassFactory factory) {
  if (name.empty()) throw TypeError("a tensorclass needs a non-empty registered name");
  if (!factory) throw TypeError("tensorclass '" + name + "' registered without a factory");
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  auto it = r.types.find(name);
  if (it != r.types.end()) {
    if (it->second.fields != fields) {
      throw TypeError("tensorclass name '" + name + "' is already registered with other fields");
    }
    return;
  }
  r.types.emplace(name, Registration{std::move(fields), std::move(factory)});
}

bool is_tensorclass_registered(const std::string& name) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  return r.types.count(name) != 0;
}

std::vector<std::string> tensorclass_fields(const std::string& name) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  auto it = r.types.find(name);
  if (it == r.types.end()) throw TypeError("tensorclass '" + name + "' is not registered");
  return it->second.fields;
}

std::shared_ptr<TensorClassBase> make_tensorclass(const TensorDict& td) {
  if (td.class_name().empty()) throw TypeError("this tensordict carries no tensorclass name");
  TensorClassFactory factory;
  {
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    auto it = r.types.find(td.class_name());
    if (it == r.types.end()) {
      throw TypeError("tensorclass '" + td.class_name() +
                      "' is not registered in this process (declare it with TDSHM_TENSORCLASS)");
    }
    factory = it->second.factory;
  }
  return factory(td);
}

namespace detail {

bool register_at_startup(const std::function<bool()>& reg, std::string_view name) noexcept {
  try {
    return reg();
  } catch (const std::exception& e) {
    log().error("cannot register tensorclass '{}': {}", name, e.what());
    return false;
  }
}

}  // namespace detail

}  // namespace tdshm
