#pragma once
// The private representation behind the TensorDict handle, shared by tensordict.cpp,
// consolidate.cpp and the transfer layer.

#include <tdshm/tensordict.h>

#include "common/format.h"

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace tdshm::detail {

/// The storage and schema of a consolidated tensordict (held by its root only).
struct Consolidation {
  at::Tensor storage;  // 1-D uint8
  Schema schema;
  uint64_t fingerprint = 0;
};

struct TensorDictImpl {
  std::vector<std::pair<std::string, Value>> entries;  // insertion order
  std::unordered_map<std::string, size_t> index;       // key -> position in entries
  std::vector<int64_t> batch_size;
  std::optional<c10::Device> device;
  std::string class_name;
  bool locked = false;
  // The tensordict whose lock_() locked this one (itself when locked directly); a nested
  // tensordict locked through its parent cannot be unlocked on its own.
  std::weak_ptr<const TensorDictImpl> locked_by;
  std::shared_ptr<const Consolidation> consolidation;

  const Value* find(const std::string& key) const {
    auto it = index.find(key);
    return it == index.end() ? nullptr : &entries[it->second].second;
  }
  Value* find(const std::string& key) {
    auto it = index.find(key);
    return it == index.end() ? nullptr : &entries[it->second].second;
  }
  void append(std::string key, Value value) {
    index.emplace(key, entries.size());
    entries.emplace_back(std::move(key), std::move(value));
  }
};


}  // namespace tdshm::detail
