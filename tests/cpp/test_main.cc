// The main() of every C++ test executable: runs the registered cases.
//
//   foo_test            run every case
//   foo_test Substr     run the cases whose name contains Substr
//   foo_test --list     print the case names
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "test_util.h"

namespace embedcore_test {

int RunAll(int argc, char** argv) {
  const char* filter = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--list") == 0) {
      for (const Case& c : Registry()) std::printf("%s\n", c.name);
      return 0;
    }
    filter = argv[i];
  }
  int passed = 0, failed = 0;
  for (const Case& c : Registry()) {
    if (filter != nullptr && std::strstr(c.name, filter) == nullptr) continue;
    std::printf("[ RUN      ] %s\n", c.name);
    std::fflush(stdout);
    CaseFailures() = 0;
    const auto start = std::chrono::steady_clock::now();
    try {
      c.fn();
    } catch (const std::exception& e) {
      Fail(c.name, 0, std::string("uncaught exception: ") + e.what());
    } catch (...) {
      Fail(c.name, 0, "uncaught exception of unknown type");
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (CaseFailures() == 0) {
      ++passed;
      std::printf("[       OK ] %s (%.0f ms)\n", c.name, ms);
    } else {
      ++failed;
      std::printf("[  FAILED  ] %s: %lld failed expectation(s) (%.0f ms)\n", c.name,
                  static_cast<long long>(CaseFailures()), ms);
    }
    std::fflush(stdout);
  }
  if (passed + failed == 0) {
    std::printf("no test case matched\n");
    return 1;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace embedcore_test

int main(int argc, char** argv) { return embedcore_test::RunAll(argc, argv); }
