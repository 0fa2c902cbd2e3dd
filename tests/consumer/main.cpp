// A downstream program built against the installed tdshm (see run_consumer_test.cmake).
// It uses only the public headers and the installed library; prints "consumer ok" when the
// library behaved as documented.

#include <tdshm/tensorclass.h>
#include <tdshm/tensordict.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/ones.h>

#include <iostream>
#include <string>

TDSHM_TENSORCLASS(ConsumerPair, "tdshm.consumer.Pair", left, right);

int main() {
  tdshm::TensorDict td({{{"a", "b"}, at::ones({2})}, {"c", at::ones({2, 3})}}, {2});
  tdshm::TensorDict c = td.consolidate();
  if (c.schema().total_bytes != 32 || !(c == 1).all()) {
    std::cerr << "consumer: unexpected consolidation\n" << c.repr();
    return 1;
  }
  try {
    td.set("c", at::ones({3, 2}));
    std::cerr << "consumer: a batch-size mismatch was accepted\n";
    return 1;
  } catch (const tdshm::ShapeError&) {
  }
  ConsumerPair pair({{"left", at::ones({2})}, {"right", at::ones({2})}}, {2});
  if (!tdshm::is_tensorclass_registered("tdshm.consumer.Pair") || pair.left().numel() != 2) {
    std::cerr << "consumer: tensorclass not registered\n";
    return 1;
  }
  std::cout << "consumer ok\n";
  return 0;
}
