// The loader scenario's batch (loader_batch.h).

#include "loader_batch.h"

#include <ATen/ops/zeros.h>

#include <cstring>
#include <stdexcept>

namespace tdshm::bench {

namespace {

// What every byte of worker w's image holds in batch `seq`.
uint8_t image_value(int64_t seq, int worker) { return static_cast<uint8_t>(seq * 31 + worker * 7 + 1); }
int64_t label_of(int64_t seq, int64_t i, int worker) { return (seq * kBatch + i + worker) % 1000; }

}  // namespace

TensorDict make_batch() {
  return TensorDict({{"image", at::zeros({kBatch, 3, 64, 64}, at::kByte)},
                     {"label", at::zeros({kBatch}, at::kLong)},
                     {{"meta", "idx"}, at::zeros({kBatch}, at::kLong)},
                     {{"meta", "worker"}, at::zeros({kBatch}, at::kLong)}},
                    {kBatch});
}


BatchView view(const TensorDict& td) {
  return {td.get("image").data_ptr<uint8_t>(), td.get("label").data_ptr<int64_t>(),
          td.get({"meta", "idx"}).data_ptr<int64_t>(), td.get({"meta", "worker"}).data_ptr<int64_t>()};
}

// The in-place reference's buffer as a batch.
BatchView view(const InplaceChannel& ch) {
  auto* ints = reinterpret_cast<int64_t*>(ch.payload() + kImageBytes);  // kImageBytes is a multiple of 8
  return {ch.payload(), ints, ints + kBatch, ints + 2 * kBatch};
}

// Every byte written once, in every transport (the production a worker does anyway), so that
// what differs between transports is only what they add.
void fill_batch(const BatchView& v, int w, int64_t seq) {
  std::memset(v.image, image_value(seq, w), static_cast<size_t>(kImageBytes));
  for (int64_t i = 0; i < kBatch; ++i) {
    v.label[i] = label_of(seq, i, w);
    v.idx[i] = seq * kBatch + i;
    v.worker[i] = w;
  }
}

// Every byte read once, in every transport (the consumption).
void check_batch(const BatchView& v, int w, int64_t seq, const std::string& where) {
  auto fail = [&](const std::string& what, int64_t got, int64_t expected) {
    throw std::runtime_error(where + ": batch " + std::to_string(seq) + " of worker " + std::to_string(w) + ": " +
                             what + " is " + std::to_string(got) + ", expected " + std::to_string(expected));
  };
  for (int64_t i = 0; i < kBatch; ++i) {
    if (v.worker[i] != w) fail("meta.worker[" + std::to_string(i) + "]", v.worker[i], w);
    if (v.idx[i] != seq * kBatch + i) fail("meta.idx[" + std::to_string(i) + "]", v.idx[i], seq * kBatch + i);
    if (v.label[i] != label_of(seq, i, w)) fail("label[" + std::to_string(i) + "]", v.label[i], label_of(seq, i, w));
  }
  // Eight bytes at a time: every byte is read, at the speed a consumer would read it.
  const uint64_t want = uint64_t{image_value(seq, w)} * 0x0101010101010101ull;
  uint64_t differ = 0;
  for (int64_t i = 0; i < kImageBytes; i += 8) {
    uint64_t word;
    std::memcpy(&word, v.image + i, sizeof word);
    differ |= word ^ want;
  }
  if (differ != 0) {
    for (int64_t i = 0; i < kImageBytes; ++i) {
      if (v.image[i] != image_value(seq, w)) fail("image byte " + std::to_string(i), v.image[i], image_value(seq, w));
    }
  }
}

}  // namespace tdshm::bench
