// pseudo_rand_tag and transfer_tags against numpy: tags a peer running tensordict must agree
// with bit for bit. The reference table (tests/data/pseudo_rand_tags.tsv) holds numpy's tag for
// every seed 0..10000; TDSHM_PSEUDO_RAND_TABLE is its path, set by tests/CMakeLists.txt.

#include "tdshm/distributed.h"
#include "tdshm/errors.h"

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace {

using tdshm::pseudo_rand_tag;
using tdshm::transfer_tags;

TEST(PseudoRand, MatchesNumpyTable) {
  std::ifstream table(TDSHM_PSEUDO_RAND_TABLE);
  ASSERT_TRUE(table) << "cannot open " << TDSHM_PSEUDO_RAND_TABLE;
  std::string line;
  size_t rows = 0;
  int64_t expected_seed = 0;
  while (std::getline(table, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    int64_t seed = -1, tag = -1;
    ASSERT_TRUE(fields >> seed >> tag) << "malformed row: " << line;
    // The table lists consecutive seeds; a gap would mean a truncated or edited file.
    ASSERT_EQ(seed, expected_seed++);
    EXPECT_EQ(pseudo_rand_tag(seed), tag) << "seed " << seed;
    ++rows;
  }
  EXPECT_EQ(rows, 10001u);
}

// Seeds of two 32-bit entropy words, the edges of the first word, and the largest int64.
// Reference values computed with Debian's python3-numpy 1.24.2:
//   int.from_bytes(np.random.default_rng(s).bytes(8), "big") % 10000
TEST(PseudoRand, LargeSeedsMatchNumpy) {
  struct Case {
    int64_t seed;
    int64_t tag;
  };
  const Case cases[] = {
      {4294967295LL, 5616},            // 2^32 - 1: the last one-word seed
      {4294967296LL, 8339},            // 2^32: the first two-word seed
      {4294967297LL, 1060},            // 2^32 + 1
      {1099511640121LL, 5312},         // 2^40 + 12345
      {123456789012345LL, 9847},
      {4611686018427387904LL, 7745},   // 2^62
      {9223372036854775806LL, 2361},   // 2^63 - 2
      {9223372036854775807LL, 5036},   // 2^63 - 1
  };
  for (const Case& c : cases) EXPECT_EQ(pseudo_rand_tag(c.seed), c.tag) << "seed " << c.seed;
}

TEST(PseudoRand, ChainsMatchTensordict) {
  EXPECT_EQ(transfer_tags(0, 4, true), (std::vector<int64_t>{9651, 3450, 3834, 3840}));
  EXPECT_EQ(transfer_tags(1, 10, true),
            (std::vector<int64_t>{1907, 3796, 8050, 3441, 8330, 6044, 5283, 6066, 755, 3796}));
}

TEST(PseudoRand, NegativeSeedThrowsNamingIt) {
  for (int64_t seed : {int64_t{-1}, std::numeric_limits<int64_t>::min()}) {
    try {
      pseudo_rand_tag(seed);
      ADD_FAILURE() << "no error for seed " << seed;
    } catch (const tdshm::Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(seed)), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(transfer_tags(-3, 2, true), tdshm::Error);
}

TEST(PseudoRand, SequentialTags) {
  EXPECT_EQ(transfer_tags(7, 4, false), (std::vector<int64_t>{7, 8, 9, 10}));
  // Without pseudo_rand a tag is only a number: negative tags are kept, as in Python.
  EXPECT_EQ(transfer_tags(-2, 3, false), (std::vector<int64_t>{-2, -1, 0}));
  const int64_t max = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(transfer_tags(max - 1, 2, false), (std::vector<int64_t>{max - 1, max}));
  EXPECT_THROW(transfer_tags(max - 1, 3, false), tdshm::Error);
}

TEST(PseudoRand, ZeroLeavesGiveNoTags) {
  EXPECT_TRUE(transfer_tags(5, 0, false).empty());
  EXPECT_TRUE(transfer_tags(5, 0, true).empty());
  // Nothing is drawn, so even a seed that would be refused is not looked at.
  EXPECT_TRUE(transfer_tags(-1, 0, true).empty());
}

}  // namespace
