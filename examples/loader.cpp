// A data loader in C++: 3 worker processes hand batches to the main process through a tdshm feed
// (include/tdshm/feed.h). Each worker fills a loan of its heap in place and puts it; main takes
// the batches in order (worker 0, 1, 2, 0, ...) as views, no copy, and checks every one.
//
//     build/examples/tdshm_example_loader

#include <tdshm/feed.h>
#include <tdshm/tensordict.h>

#include <ATen/ATen.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

constexpr int kWorkers = 3;
constexpr int64_t kBatches = 200;  // per worker
constexpr int64_t kBatch = 32;

// {"image": uint8 [32,3,64,64], "label": int64 [32]}, batch size [32].
tdshm::TensorDict like() {
  return tdshm::TensorDict({{"image", at::zeros({kBatch, 3, 64, 64}, at::kByte)}, {"label", at::zeros({kBatch}, at::kLong)}},
                           {kBatch});
}

// Batch `b` of worker `w`: label i = global sample index, image = label % 256.
void fill(const tdshm::TensorDict& td, int w, int64_t b) {
  const int64_t first = (b * kWorkers + w) * kBatch;
  td.get("label").copy_(at::arange(first, first + kBatch, at::kLong));
  td.get("image").copy_((td.get("label") % 256).to(at::kByte).view({kBatch, 1, 1, 1}).expand({kBatch, 3, 64, 64}));
}

int worker(const std::string& name, int w) {
  tdshm::FeedProducer feed(name, w, {.timeout = std::chrono::seconds(30), .watch_pid = getppid()});
  const tdshm::TensorDict shape = like().consolidate();
  for (int64_t b = 0; b < kBatches; ++b) {
    // A loan of the heap when there is room (the first batch sizes the heap, so it has none).
    std::optional<tdshm::TensorDict> slot = feed.try_loan(shape);
    const tdshm::TensorDict batch = slot ? *slot : like();
    fill(batch, w, b);
    feed.put(batch);  // by reference when it is a loan, else copied into one
  }
  feed.close();
  return 0;
}

}  // namespace

int main() {
  const std::string name = "example-loader-" + std::to_string(getpid());
  std::vector<pid_t> workers;
  for (int w = 0; w < kWorkers; ++w) {
    const pid_t pid = fork();
    if (pid == 0) _exit(worker(name, w));
    workers.push_back(pid);
  }
  tdshm::FeedConsumer feed(name, kWorkers, {.timeout = std::chrono::seconds(30)});
  for (int w = 0; w < kWorkers; ++w) feed.watch(w, workers[static_cast<size_t>(w)]);
  const auto start = std::chrono::steady_clock::now();
  int64_t seen = 0;
  while (std::optional<tdshm::TensorDict> batch = feed.next()) {
    const at::Tensor label = batch->get("label");
    const int64_t first = seen * kBatch;
    if (!at::equal(label, at::arange(first, first + kBatch, at::kLong)) ||
        !at::equal(batch->get("image").select(1, 0).select(1, 0).select(1, 0), (label % 256).to(at::kByte))) {
      std::fprintf(stderr, "batch %lld holds the wrong samples\n", static_cast<long long>(seen));
      return 1;
    }
    ++seen;
  }  // each batch's views go back to its worker when dropped
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int failed = 0;
  for (pid_t pid : workers) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  if (failed != 0 || seen != kWorkers * kBatches) {
    std::fprintf(stderr, "%d workers failed; %lld batches of %lld\n", failed, static_cast<long long>(seen),
                 static_cast<long long>(kWorkers * kBatches));
    return 1;
  }
  std::printf("%lld batches from %d workers in order: %.0f batches/s\n", static_cast<long long>(seen), kWorkers,
              static_cast<double>(seen) / seconds);
  return 0;
}
