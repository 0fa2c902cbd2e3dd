// An actor-learner loop in C++: the learner publishes its weights on a tdshm::Board (readers get
// the newest complete version, never a torn one, and the learner never waits for them); actors
// send their trajectories back through a tdshm feed (loans filled in place, views on the learner's
// side, no copy).
//
//     build/examples/tdshm_example_actor_learner

#include <tdshm/board.h>
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

constexpr int kActors = 2;
constexpr int64_t kEpisodes = 100;  // per actor
constexpr int64_t kSteps = 64;

// The policy's weights: two layers; version v holds v in every element.
tdshm::TensorDict weights(double v) {
  return tdshm::TensorDict({{"w1", at::full({32, 8}, v)}, {"w2", at::full({4, 32}, v)}}, {});
}

tdshm::TensorDict trajectory() {
  return tdshm::TensorDict({{"obs", at::zeros({kSteps, 8})},
                            {"action", at::zeros({kSteps}, at::kLong)},
                            {"version", at::zeros({1}, at::kLong)}},
                           {});
}

int actor(const std::string& board_name, const std::string& feed_name, int a) {
  tdshm::Board board = tdshm::Board::open(board_name);
  tdshm::FeedProducer feed(feed_name, a, {.timeout = std::chrono::seconds(30), .watch_pid = getppid()});
  tdshm::TensorDict mine = board.like();
  const tdshm::TensorDict shape = trajectory().consolidate();
  for (int64_t e = 0; e < kEpisodes; ++e) {
    const uint64_t version = board.read(mine);  // the newest complete version, copied
    if (!at::all(mine.get("w1") == static_cast<double>(version)).item<bool>()) return 2;
    std::optional<tdshm::TensorDict> slot = feed.try_loan(shape);
    const tdshm::TensorDict traj = slot ? *slot : trajectory();
    traj.get("obs").normal_();
    const at::Tensor hidden = at::tanh(at::matmul(traj.get("obs"), mine.get("w1").t()));
    traj.get("action").copy_(at::matmul(hidden, mine.get("w2").t()).argmax(-1));
    traj.get("version").fill_(static_cast<int64_t>(version));
    feed.put(traj);
  }
  feed.close();
  return 0;
}

}  // namespace

int main() {
  const std::string board_name = "example-al-" + std::to_string(getpid());
  const std::string feed_name = board_name + "-traj";
  tdshm::Board board = tdshm::Board::create(board_name, weights(0), {.readers = kActors});
  uint64_t version = board.publish(weights(1));
  std::vector<pid_t> actors;
  for (int a = 0; a < kActors; ++a) {
    const pid_t pid = fork();
    if (pid == 0) _exit(actor(board_name, feed_name, a));
    actors.push_back(pid);
  }
  tdshm::FeedConsumer feed(feed_name, kActors, {.timeout = std::chrono::seconds(30)});
  for (int a = 0; a < kActors; ++a) feed.watch(a, actors[static_cast<size_t>(a)]);
  const auto start = std::chrono::steady_clock::now();
  int64_t episodes = 0;
  uint64_t stale = 0;
  while (std::optional<tdshm::TensorDict> traj = feed.next()) {
    const auto used = static_cast<uint64_t>(traj->get("version")[0].item<int64_t>());
    const at::Tensor action = traj->get("action");
    if (used < 1 || used > version || !at::all((action >= 0) & (action < 4)).item<bool>()) {
      std::fprintf(stderr, "episode %lld: version %llu of %llu, or an action out of range\n",
                   static_cast<long long>(episodes), static_cast<unsigned long long>(used),
                   static_cast<unsigned long long>(version));
      return 1;
    }
    stale += version - used;
    ++episodes;
    version = board.publish(weights(static_cast<double>(version + 1)));  // never waits for an actor
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int failed = 0;
  for (pid_t pid : actors) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  if (failed != 0 || episodes != kActors * kEpisodes) {
    std::fprintf(stderr, "%d actors failed (2: torn weights); %lld episodes\n", failed, static_cast<long long>(episodes));
    return 1;
  }
  std::printf("%lld episodes of %d actors in %.3f s, %llu weight versions; weights %.2f versions old on average\n",
              static_cast<long long>(episodes), kActors, seconds, static_cast<unsigned long long>(version),
              static_cast<double>(stale) / static_cast<double>(episodes));
  return 0;
}
