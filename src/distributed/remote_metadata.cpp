// tdshm's Schema <-> tensordict's init_remote metadata dict (see remote_metadata.h for the
// format and the mapping decisions).

#include "distributed/remote_metadata.h"

#include "common/format.h"
#include "schema/schema_internal.h"

#include "tdshm/errors.h"

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <exception>
#include <limits>
#include <memory>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace tdshm::detail {

namespace {

using pickle::PyDict;
using pickle::PyKind;
using pickle::PyValue;

template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  tdshm::detail::throw_streamed<SchemaError>("tdshm metadata: ", args...);
}

struct DtypeName {
  c10::ScalarType dtype;
  std::string_view name;  // str(torch.<dtype>)
};
// The dtypes a tdshm leaf may have (schema_layout.cpp's is_storable_dtype) and their torch names.
constexpr std::array<DtypeName, 13> kDtypeNames = {{
    {c10::ScalarType::Byte, "torch.uint8"},
    {c10::ScalarType::Char, "torch.int8"},
    {c10::ScalarType::Short, "torch.int16"},
    {c10::ScalarType::Int, "torch.int32"},
    {c10::ScalarType::Long, "torch.int64"},
    {c10::ScalarType::Half, "torch.float16"},
    {c10::ScalarType::Float, "torch.float32"},
    {c10::ScalarType::Double, "torch.float64"},
    {c10::ScalarType::ComplexHalf, "torch.complex32"},
    {c10::ScalarType::ComplexFloat, "torch.complex64"},
    {c10::ScalarType::ComplexDouble, "torch.complex128"},
    {c10::ScalarType::Bool, "torch.bool"},
    {c10::ScalarType::BFloat16, "torch.bfloat16"},
}};

// The fields of a node dict; any other key is a child.
constexpr std::array<std::string_view, 5> kNodeFields = {"cls", "non_tensors", "leaves", "cls_metadata", "size"};
// The fields init_remote / broadcast add to the root.
constexpr std::array<std::string_view, 3> kRootFields = {"_total_bytes", "_storage_device", "_tensorclass_type"};
constexpr std::string_view kTensorDictCls = "TensorDict";
constexpr std::string_view kLazyStackCls = "LazyStackedTensorDict";
constexpr size_t kMaxDeviceChars = 64;

template <size_t N>
bool contains(const std::array<std::string_view, N>& names, std::string_view key) {
  for (auto n : names) {
    if (n == key) return true;
  }
  return false;
}

std::string join(const std::vector<std::string>& path, std::string_view last = {}) {
  std::string out;
  for (const auto& p : path) {
    if (!out.empty()) out += '.';
    out += p;
  }
  if (!last.empty()) {
    if (!out.empty()) out += '.';
    out += last;
  }
  return out.empty() ? "<root>" : out;
}

std::string quoted(const std::vector<std::string>& path, std::string_view last = {}) {
  return "'" + join(path, last) + "'";
}

c10::Device parse_device(const std::string& s, const std::string& where) {
  if (s.empty() || s.size() > kMaxDeviceChars) fail(where, ": device string of ", s.size(), " characters");
  try {
    return c10::Device(s);
  } catch (const std::exception&) {
    fail(where, ": '", s, "' is not a torch device string (e.g. \"cpu\", \"cuda:0\")");
  }
}

// --- writing ---------------------------------------------------------------------------------

PyValue int_list(const std::vector<int64_t>& dims) {
  std::vector<PyValue> items;
  items.reserve(dims.size());
  for (int64_t d : dims) items.push_back(PyValue::integer(d));
  return PyValue::list(std::move(items));
}

PyValue device_value(const std::optional<c10::Device>& device) {
  return device ? PyValue::str(device->str()) : PyValue::none();
}

PyValue non_tensor_value(const NonTensorData& v) {
  return std::visit(
      [](const auto& x) -> PyValue {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>)
          return PyValue::str(x);
        else if constexpr (std::is_same_v<T, int64_t>)
          return PyValue::integer(x);
        else if constexpr (std::is_same_v<T, double>)
          return PyValue::floating(x);
        else
          return PyValue::boolean(x);
      },
      v);
}

PyValue class_ref_for(const std::string& class_name, const std::vector<std::string>& path) {
  const size_t dot = class_name.rfind('.');
  if (dot == std::string::npos || dot == 0 || dot + 1 == class_name.size()) {
    fail("node ", quoted(path), " is a tensorclass named '", class_name,
         "': a nested tensorclass travels as a Python class reference, so its name must be 'module.QualName'");
  }
  return PyValue::class_ref(class_name.substr(0, dot), class_name.substr(dot + 1));
}

PyValue node_to_metadata(const SchemaNode& node, std::vector<std::string>& path, bool root) {
  PyValue non_tensors = PyValue::dict();
  PyValue leaves = PyValue::dict();
  std::vector<std::pair<std::string, PyValue>> children;
  const PyValue batch = int_list(node.batch_size);
  for (const auto& entry : node.entries) {
    if (const auto* t = std::get_if<SchemaTensor>(&entry.value)) {
      leaves.as_dict("leaves").entries.push_back(
          {PyValue::str(entry.key),
           PyValue::tuple({PyValue::str(dtype_to_torch_string(t->dtype)), int_list(t->shape),
                           PyValue::integer(static_cast<int64_t>(t->start)),
                           PyValue::integer(static_cast<int64_t>(t->stop + t->pad)), PyValue::integer(t->pad)})});
    } else if (const auto* v = std::get_if<NonTensorData>(&entry.value)) {
      non_tensors.as_dict("non_tensors")
          .entries.push_back(
              {PyValue::str(entry.key), PyValue::tuple({non_tensor_value(*v), batch, device_value(node.device)})});
    } else {
      const auto& child = std::get<std::shared_ptr<SchemaNode>>(entry.value);
      if (contains(kNodeFields, entry.key) || (root && contains(kRootFields, entry.key))) {
        fail("child ", quoted(path, entry.key),
             " cannot be sent to tensordict: its key is a field of the metadata dict");
      }
      path.push_back(entry.key);
      children.emplace_back(entry.key, node_to_metadata(*child, path, false));
      path.pop_back();
    }
  }
  PyValue out = PyValue::dict();
  // The root's class travels in "_tensorclass_type" (tensordict's tensorclass init_remote sends
  // the inner TensorDict); a nested tensorclass's as its type.
  if (node.lazy_stack_dim) {
    out.set("cls", PyValue::str(std::string(kLazyStackCls)));
  } else {
    out.set("cls", root || node.class_name.empty() ? PyValue::str(std::string(kTensorDictCls))
                                                   : class_ref_for(node.class_name, path));
  }
  out.set("non_tensors", std::move(non_tensors));
  out.set("leaves", std::move(leaves));
  PyValue cls_metadata = PyValue::dict();
  if (node.lazy_stack_dim) {
    // LazyStackedTensorDict._reduce_get_metadata's; the batch size follows from the members.
    cls_metadata.set("stack_dim", PyValue::integer(*node.lazy_stack_dim));
    cls_metadata.set("stack_dim_name", PyValue::none());
  } else {
    cls_metadata.set("device", device_value(node.device));
    cls_metadata.set("names", PyValue::list(std::vector<PyValue>(node.batch_size.size(), PyValue::none())));
    cls_metadata.set("batch_size", batch);
  }
  cls_metadata.set("is_locked", PyValue::boolean(false));
  out.set("cls_metadata", std::move(cls_metadata));
  for (auto& [key, child] : children) out.as_dict("node").entries.push_back({PyValue::str(key), std::move(child)});
  return out;
}

// --- reading ---------------------------------------------------------------------------------

class Reader {
 public:
  explicit Reader(uint64_t storage_bytes) : storage_bytes_(storage_bytes) {}

  SchemaNode node(const PyValue& value, size_t depth, bool root) {
    if (depth > kSchemaMaxDepth) {
      fail("node ", quoted(path_), " is nested ", depth, " levels deep, more than kSchemaMaxDepth = ", kSchemaMaxDepth);
    }
    const NodeFields f = fields_of(value, root);
    const PyValue* cls = f.cls;
    const PyValue* non_tensors = f.non_tensors;
    const PyValue* leaves = f.leaves;
    const PyValue* cls_metadata = f.cls_metadata;
    const auto& child_values = f.children;

    SchemaNode out;
    const bool lazy = cls->kind() == PyKind::kStr && std::get<std::string>(cls->v) == kLazyStackCls;
    if (lazy) {
      read_lazy_cls_metadata(*cls_metadata, out);
    } else {
      out.class_name = class_name(*cls);
      read_cls_metadata(*cls_metadata, out);
    }

    // Non-tensors first, in dict order (as tensordict's reader rebuilds them).
    for (const auto& e : non_tensors->as_dict("\"non_tensors\" of node " + quoted(path_)).entries) {
      const std::string& key = entry_key(e.key, "non_tensors");
      out.entries.push_back(SchemaEntry{key, non_tensor(e.value, key)});
    }

    // Leaves and children, merged by offset: the sender's depth-first insertion order.
    std::vector<SchemaEntry> leaf_entries;
    for (const auto& e : leaves->as_dict("\"leaves\" of node " + quoted(path_)).entries) {
      const std::string& key = entry_key(e.key, "leaves");
      leaf_entries.push_back(SchemaEntry{key, leaf(e.value, key)});
    }
    std::vector<std::pair<SchemaEntry, uint64_t>> child_entries;  // and the offset that places it
    uint64_t previous = 0;
    for (const auto& [key, child_value] : child_values) {
      if (key.empty()) fail("node ", quoted(path_), " has a child with an empty key");
      if (child_value->kind() != PyKind::kDict) {
        fail("node ", quoted(path_), " has the entry '", key, "' of type ", pickle::type_name(*child_value), " (",
             pickle::repr(*child_value), "): not a field of the metadata dict, nor a child tensordict");
      }
      path_.push_back(key);
      auto child = std::make_shared<SchemaNode>(node(*child_value, depth + 1, false));
      path_.pop_back();
      if (const auto first = first_start(*child)) previous = *first;
      child_entries.emplace_back(SchemaEntry{key, std::move(child)}, previous);
    }
    size_t li = 0;
    size_t ci = 0;
    while (li < leaf_entries.size() || ci < child_entries.size()) {
      const bool take_leaf = ci == child_entries.size() ||
                             (li < leaf_entries.size() &&
                              std::get<SchemaTensor>(leaf_entries[li].value).start <= child_entries[ci].second);
      out.entries.push_back(take_leaf ? std::move(leaf_entries[li++]) : std::move(child_entries[ci++].first));
    }
    if (lazy) lazy_batch_size(out);
    return out;
  }

 private:
  // The fields of a node's metadata dict, and its children (its other keys but the root's own).
  struct NodeFields {
    const PyValue* cls = nullptr;
    const PyValue* non_tensors = nullptr;
    const PyValue* leaves = nullptr;
    const PyValue* cls_metadata = nullptr;
    std::vector<std::pair<std::string, const PyValue*>> children;
  };
  NodeFields fields_of(const PyValue& value, bool root) {
    const PyDict& dict = value.as_dict("node " + quoted(path_));
    NodeFields f;
    for (const auto& e : dict.entries) {
      if (e.key.kind() != PyKind::kStr) {
        fail("node ", quoted(path_), " has a key of type ", pickle::type_name(e.key), " (", pickle::repr(e.key),
             "); keys are str");
      }
      const std::string& key = std::get<std::string>(e.key.v);
      if (key == "cls") {
        f.cls = &e.value;
      } else if (key == "non_tensors") {
        f.non_tensors = &e.value;
      } else if (key == "leaves") {
        f.leaves = &e.value;
      } else if (key == "cls_metadata") {
        f.cls_metadata = &e.value;
      } else if (key == "size") {
        const int64_t size = e.value.as_int("'size' of node " + quoted(path_));
        if (size < 0) fail("node ", quoted(path_), " has a negative size ", size);
      } else if (root && contains(kRootFields, key)) {
        continue;  // read by from_metadata
      } else {
        f.children.emplace_back(key, &e.value);
      }
    }
    if (f.cls == nullptr || f.non_tensors == nullptr || f.leaves == nullptr || f.cls_metadata == nullptr) {
      fail("node ", quoted(path_), " lacks ",
           f.cls == nullptr           ? "\"cls\""
           : f.non_tensors == nullptr ? "\"non_tensors\""
           : f.leaves == nullptr      ? "\"leaves\""
                                      : "\"cls_metadata\"",
           " (not a tensordict metadata dict)");
    }
    return f;
  }

  static std::optional<uint64_t> first_start(const SchemaNode& n) {
    for (const auto& e : n.entries) {
      if (const auto* t = std::get_if<SchemaTensor>(&e.value)) return t->start;
      if (const auto* c = std::get_if<std::shared_ptr<SchemaNode>>(&e.value)) {
        if (auto s = first_start(**c)) return s;
      }
    }
    return std::nullopt;
  }

  const std::string& entry_key(const PyValue& key, const char* field) const {
    if (key.kind() != PyKind::kStr) {
      fail("\"", field, "\" of node ", quoted(path_), " has a key of type ", pickle::type_name(key), " (",
           pickle::repr(key), "); keys are str");
    }
    const auto& s = std::get<std::string>(key.v);
    if (s.empty()) fail("\"", field, "\" of node ", quoted(path_), " has an empty key");
    if (s.size() > kSchemaMaxKeyBytes) {
      fail("\"", field, "\" of node ", quoted(path_), " has a key of ", s.size(),
           " bytes, more than kSchemaMaxKeyBytes = ", kSchemaMaxKeyBytes);
    }
    return s;
  }

  std::string class_name(const PyValue& cls) const {
    if (cls.kind() == PyKind::kClassRef) {
      const auto& ref = std::get<pickle::PyClassRef>(cls.v);
      std::string name = ref.module + "." + ref.name;
      if (name.size() > kSchemaMaxKeyBytes) fail("class name of node ", quoted(path_), " is ", name.size(), " bytes");
      return name;
    }
    if (cls.kind() == PyKind::kStr && std::get<std::string>(cls.v) == kTensorDictCls) return {};
    fail("node ", quoted(path_), " has \"cls\" ", pickle::repr(cls),
         ": tdshm reads TensorDict and tensorclasses (a class reference), not other tensordict types");
  }

  std::vector<int64_t> dims(const PyValue& v, const std::string& what) const {
    if (v.kind() != PyKind::kList && v.kind() != PyKind::kTuple) {
      fail(what, " is a ", pickle::type_name(v), " (", pickle::repr(v), "), expected a list of int");
    }
    const auto& items =
        v.kind() == PyKind::kList ? std::get<pickle::PyList>(v.v).items : std::get<pickle::PyTuple>(v.v).items;
    if (items.size() > kSchemaMaxDims)
      fail(what, " has ", items.size(), " dimensions, more than kSchemaMaxDims = ", kSchemaMaxDims);
    std::vector<int64_t> out;
    out.reserve(items.size());
    for (const auto& item : items) {
      if (item.kind() != PyKind::kInt)
        fail(what, " holds a ", pickle::type_name(item), " (", pickle::repr(v), "), expected int");
      const int64_t d = std::get<int64_t>(item.v);
      if (d < 0) fail(what, " ", pickle::repr(v), " has a negative dimension");
      out.push_back(d);
    }
    return out;
  }

  std::optional<c10::Device> optional_device(const PyValue& v, const std::string& what) const {
    if (v.is_none()) return std::nullopt;
    return parse_device(v.as_str(what), what);
  }

  void read_cls_metadata(const PyValue& v, SchemaNode& out) const {
    const std::string where = "\"cls_metadata\" of node " + quoted(path_);
    const PyValue* device = nullptr;
    const PyValue* names = nullptr;
    const PyValue* batch_size = nullptr;
    const PyValue* is_locked = nullptr;
    for (const auto& e : v.as_dict(where).entries) {
      const std::string& key = e.key.as_str("a key of " + where);
      if (key == "device")
        device = &e.value;
      else if (key == "names")
        names = &e.value;
      else if (key == "batch_size")
        batch_size = &e.value;
      else if (key == "is_locked")
        is_locked = &e.value;
      else
        fail(where, " has the unknown field '", key, "'");
    }
    if (batch_size == nullptr) fail(where, " lacks \"batch_size\"");
    out.batch_size = dims(*batch_size, "batch_size of node " + quoted(path_));
    if (device != nullptr) out.device = optional_device(*device, "device of node " + quoted(path_));
    if (names != nullptr && !names->is_none()) {
      const auto& items = names->as_list("names of node " + quoted(path_)).items;
      if (items.size() != out.batch_size.size()) {
        fail("names of node ", quoted(path_), " has ", items.size(), " entries for ", out.batch_size.size(),
             " batch dimensions");
      }
      for (const auto& n : items) {
        if (!n.is_none()) n.as_str("a name of node " + quoted(path_));
      }
    }
    if (is_locked != nullptr) is_locked->as_bool("is_locked of node " + quoted(path_));
  }

  // A LazyStackedTensorDict's cls_metadata (its _reduce_get_metadata).
  void read_lazy_cls_metadata(const PyValue& v, SchemaNode& out) const {
    const std::string where = "\"cls_metadata\" of lazy stack " + quoted(path_);
    const PyValue* stack_dim = nullptr;
    for (const auto& e : v.as_dict(where).entries) {
      const std::string& key = e.key.as_str("a key of " + where);
      if (key == "stack_dim") {
        stack_dim = &e.value;
      } else if (key == "stack_dim_name") {
        if (!e.value.is_none()) e.value.as_str("stack_dim_name of lazy stack " + quoted(path_));
      } else if (key == "is_locked") {
        e.value.as_bool("is_locked of lazy stack " + quoted(path_));
      } else {
        fail(where, " has the unknown field '", key, "'");
      }
    }
    if (stack_dim == nullptr) fail(where, " lacks \"stack_dim\"");
    const int64_t dim = stack_dim->as_int("stack_dim of lazy stack " + quoted(path_));
    if (dim < 0 || dim > static_cast<int64_t>(kSchemaMaxDims))
      fail("lazy stack ", quoted(path_), " has stack_dim ", dim);
    out.lazy_stack_dim = dim;
  }

  // A lazy stack's batch size: its members' with their count inserted at stack_dim (members
  // and their batch sizes are checked by validate_schema).
  void lazy_batch_size(SchemaNode& out) const {
    for (const auto& e : out.entries) {
      if (!std::holds_alternative<std::shared_ptr<SchemaNode>>(e.value)) {
        fail("lazy stack ", quoted(path_), " holds the ",
             std::holds_alternative<SchemaTensor>(e.value) ? "leaf" : "non-tensor", " '", e.key,
             "': a lazy stack holds only its members");
      }
    }
    std::vector<int64_t> batch;
    if (!out.entries.empty()) batch = std::get<std::shared_ptr<SchemaNode>>(out.entries[0].value)->batch_size;
    const int64_t dim = *out.lazy_stack_dim;
    if (dim > static_cast<int64_t>(batch.size())) {
      fail("lazy stack ", quoted(path_), " has stack_dim ", dim, " but its members have ", batch.size(),
           " batch dimensions");
    }
    batch.insert(batch.begin() + dim, static_cast<int64_t>(out.entries.size()));
    out.batch_size = std::move(batch);
  }

  NonTensorData non_tensor(const PyValue& v, const std::string& key) const {
    const std::string what = "non-tensor " + quoted(path_, key);
    const auto& items = v.as_tuple(what).items;
    if (items.size() != 3) fail(what, " is a tuple of ", items.size(), " items, expected (value, batch_size, device)");
    dims(items[1], "batch_size of " + what);
    optional_device(items[2], "device of " + what);
    const PyValue& value = items[0];
    switch (value.kind()) {
      case PyKind::kStr: return std::get<std::string>(value.v);
      case PyKind::kInt: return std::get<int64_t>(value.v);
      case PyKind::kFloat: return std::get<double>(value.v);
      case PyKind::kBool: return std::get<bool>(value.v);
      default:
        fail(what, " holds a ", pickle::type_name(value), " (", pickle::repr(value),
             "); tdshm's non-tensor values are str, int, float and bool");
    }
  }

  SchemaTensor leaf(const PyValue& v, const std::string& key) const {
    const std::string what = "leaf " + quoted(path_, key);
    if (key.rfind("<NJT", 0) == 0) fail(what, " is part of a nested jagged tensor, which tdshm does not support");
    const auto& items = v.as_tuple(what).items;
    if (items.size() == 6) fail(what, " is a ragged (nested jagged) leaf, which tdshm does not support");
    if (items.size() != 5)
      fail(what, " is a tuple of ", items.size(), " items, expected (dtype, shape, start, stop, pad)");
    SchemaTensor t;
    const std::string& dtype_name = items[0].as_str("dtype of " + what);
    const auto dtype = dtype_from_torch_string(dtype_name);
    if (!dtype) {
      fail(what, " has dtype '", dtype_name.substr(0, 64),
           "', which tdshm does not store (torch.uint8, int8, int16, int32, int64, float16, float32, float64, "
           "complex32, complex64, complex128, bool, bfloat16)");
    }
    t.dtype = *dtype;
    t.shape = dims(items[1], "shape of " + what);
    const int64_t start = items[2].as_int("start of " + what);
    const int64_t stop = items[3].as_int("stop of " + what);
    const int64_t pad = items[4].as_int("pad of " + what);
    if (start < 0 || stop < 0 || pad < 0 || pad > 7) {
      fail(what, " has start ", start, ", stop ", stop, ", pad ", pad,
           ": offsets must be non-negative and pad at most 7");
    }
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
        fail(what, " has a shape whose element count overflows 64 bits");
      }
    }
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, uint64_t{c10::elementSize(t.dtype)}, &nbytes)) {
      fail(what, " has a shape whose byte count overflows 64 bits");
    }
    const auto ustart = static_cast<uint64_t>(start);
    const auto ustop = static_cast<uint64_t>(stop);
    if (ustop < ustart || ustop - ustart != nbytes + static_cast<uint64_t>(pad)) {
      fail(what, " spans stop - start = ", stop, " - ", start, " bytes but its shape needs numel ", numel,
           " * itemsize ", c10::elementSize(t.dtype), " + pad ", pad, " = ", nbytes + static_cast<uint64_t>(pad));
    }
    if (ustop > storage_bytes_) fail(what, " ends at byte ", stop, ", past the storage of ", storage_bytes_, " bytes");
    t.start = ustart;
    t.stop = ustop - static_cast<uint64_t>(pad);
    t.pad = static_cast<uint32_t>(pad);
    return t;
  }

  uint64_t storage_bytes_;
  std::vector<std::string> path_;
};

}  // namespace

std::string dtype_to_torch_string(c10::ScalarType dtype) {
  for (const auto& d : kDtypeNames) {
    if (d.dtype == dtype) return std::string(d.name);
  }
  fail("dtype ", c10::toString(dtype), " is not one tdshm stores");
}

std::optional<c10::ScalarType> dtype_from_torch_string(const std::string& name) {
  for (const auto& d : kDtypeNames) {
    if (d.name == name) return d.dtype;
  }
  return std::nullopt;
}

PyValue to_metadata(const Schema& schema, std::optional<std::string> storage_device) {
  validate_schema(schema);
  if (storage_device) parse_device(*storage_device, "storage device");
  std::vector<std::string> path;
  PyValue out = node_to_metadata(schema.root, path, true);
  if (schema.total_bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    fail("total_bytes ", schema.total_bytes, " does not fit in int64");
  }
  // The order init_remote (_total_bytes, _tensorclass_type) and broadcast (_total_bytes,
  // _storage_device, _tensorclass_type) add them in.
  out.set("_total_bytes", PyValue::integer(static_cast<int64_t>(schema.total_bytes)));
  if (storage_device) out.set("_storage_device", PyValue::str(*storage_device));
  if (!schema.root.class_name.empty()) out.set("_tensorclass_type", PyValue::str(schema.root.class_name));
  return out;
}

Schema from_metadata(const PyValue& metadata, uint64_t storage_bytes) {
  metadata.as_dict("the metadata");
  if (const PyValue* total = metadata.find("_total_bytes")) {
    const int64_t claimed = total->as_int("_total_bytes");
    if (claimed < 0 || static_cast<uint64_t>(claimed) != storage_bytes) {
      fail("_total_bytes is ", claimed, " but the storage has ", storage_bytes, " bytes");
    }
  }
  metadata_storage_device(metadata);
  Schema schema;
  schema.total_bytes = storage_bytes;
  Reader reader(storage_bytes);
  schema.root = reader.node(metadata, 0, true);
  if (const PyValue* tc = metadata.find("_tensorclass_type")) {
    const std::string& name = tc->as_str("_tensorclass_type");
    if (name.empty() || name.size() > kSchemaMaxKeyBytes) fail("_tensorclass_type has ", name.size(), " bytes");
    if (!schema.root.class_name.empty() && schema.root.class_name != name) {
      fail("_tensorclass_type '", name, "' differs from the root's class '", schema.root.class_name, "'");
    }
    schema.root.class_name = name;
  }
  validate_schema(schema, storage_bytes);
  return schema;
}

uint64_t metadata_total_bytes(const PyValue& metadata) {
  const PyValue* total = metadata.find("_total_bytes");
  if (total == nullptr) fail("the metadata has no \"_total_bytes\"");
  const int64_t v = total->as_int("_total_bytes");
  if (v < 0) fail("_total_bytes is negative: ", v);
  return static_cast<uint64_t>(v);
}

std::optional<std::string> metadata_storage_device(const PyValue& metadata) {
  const PyValue* device = metadata.find("_storage_device");
  if (device == nullptr) return std::nullopt;
  const std::string& s = device->as_str("_storage_device");
  parse_device(s, "_storage_device");
  return s;
}

pickle::Limits metadata_pickle_limits() {
  pickle::Limits limits;
  limits.allow_class_refs = true;
  return limits;
}

}  // namespace tdshm::detail
