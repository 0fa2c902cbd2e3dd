// A downstream program built against the installed tdshm (see run_consumer_test.cmake).
// It uses only what the public headers give; prints "consumer ok" when all went as expected.

#include <tdshm/errors.h>
#include <tdshm/schema.h>

#include <iostream>
#include <string>

int main() {
  static_assert(tdshm::kSchemaVersion >= 1, "the installed schema.h defines a schema version");

  // Public types are usable by value: a one-leaf layout, built without the library's code.
  tdshm::SchemaTensor leaf;
  leaf.shape = {2, 3};
  leaf.stop = 2 * 3 * sizeof(float);

  try {
    throw tdshm::KeyError("key 'a' is missing");
  } catch (const tdshm::KeyError& e) {
    if (std::string(e.what()) != "key 'a' is missing" || leaf.stop != 24) {
      std::cerr << "consumer: unexpected state: " << e.what() << '\n';
      return 1;
    }
  }
  std::cout << "consumer ok\n";
  return 0;
}
