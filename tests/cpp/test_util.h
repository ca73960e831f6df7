// A tiny test harness for the C++ unit tests, so they need no framework.
//
//   EMBEDCORE_TEST(TableLookupSum) { ... EMBEDCORE_EXPECT_EQ(a, b); ... }
//
// Each test file registers its cases with EMBEDCORE_TEST and links
// test_main.cc, which runs every case (or those whose name contains argv[1]),
// prints one line per case and a closing "N passed, N failed" line, and exits
// non-zero when any expectation failed. An expectation that fails records the
// failure and lets the case go on; an exception that escapes a case fails it.
// After kMaxReportedPerCase failures a case stops printing (but keeps
// counting), so an exhaustive loop cannot flood the log.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace embedcore_test {

struct Case {
  const char* name;
  void (*fn)();
};

inline std::vector<Case>& Registry() {
  static std::vector<Case> cases;
  return cases;
}

/// Failures of the case that is running.
inline int64_t& CaseFailures() {
  static int64_t n = 0;
  return n;
}

constexpr int64_t kMaxReportedPerCase = 20;

struct Registrar {
  Registrar(const char* name, void (*fn)()) { Registry().push_back({name, fn}); }
};

/// Records one failed expectation at file:line with a message.
inline void Fail(const char* file, int line, const std::string& message) {
  const int64_t n = ++CaseFailures();
  if (n <= kMaxReportedPerCase) {
    std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, message.c_str());
  } else if (n == kMaxReportedPerCase + 1) {
    std::fprintf(stderr, "%s:%d: (more failures in this case are counted, not printed)\n", file, line);
  }
}

// Printing of values in messages: floats with all their digits and bits.
template <typename T>
std::string Show(const T& v) {
  std::ostringstream os;
  if constexpr (std::is_same_v<T, float>) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof(u));
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.9g (0x%08x)", double(v), u);
    os << buf;
  } else if constexpr (std::is_same_v<T, double>) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.17g", v);
    os << buf;
  } else if constexpr (std::is_same_v<T, bool>) {
    os << (v ? "true" : "false");
  } else if constexpr (std::is_enum_v<T>) {
    os << int64_t(v);
  } else if constexpr (std::is_integral_v<T> && sizeof(T) == 1) {
    os << int(v);
  } else {
    os << v;
  }
  return os.str();
}

/// Bits of a float, for exact comparisons that also hold for -0.0 and NaN.
inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

/// True when `a` and `b` are within `rel` of each other relative to the
/// larger magnitude, or within `abs` absolutely.
inline bool Near(double a, double b, double rel, double abs = 0.0) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (a == b) return true;
  const double diff = std::fabs(a - b);
  return diff <= abs || diff <= rel * std::fmax(std::fabs(a), std::fabs(b));
}

int RunAll(int argc, char** argv);

}  // namespace embedcore_test

#define EMBEDCORE_TEST(name)                                                      \
  static void embedcore_test_##name();                                             \
  static const ::embedcore_test::Registrar embedcore_registrar_##name(#name,      \
                                                                      &embedcore_test_##name); \
  static void embedcore_test_##name()

#define EMBEDCORE_EXPECT(cond)                                              \
  do {                                                                      \
    if (!(cond)) ::embedcore_test::Fail(__FILE__, __LINE__, "expected " #cond); \
  } while (0)

/// EMBEDCORE_EXPECT with a message built from `<<` pieces after it.
#define EMBEDCORE_EXPECT_MSG(cond, msg)                                              \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::ostringstream embedcore_os_;                                              \
      embedcore_os_ << "expected " #cond ": " << msg;                                \
      ::embedcore_test::Fail(__FILE__, __LINE__, embedcore_os_.str());               \
    }                                                                                \
  } while (0)

#define EMBEDCORE_EXPECT_OP_(a, b, op)                                                          \
  do {                                                                                          \
    const auto& embedcore_a_ = (a);                                                             \
    const auto& embedcore_b_ = (b);                                                             \
    if (!(embedcore_a_ op embedcore_b_))                                                        \
      ::embedcore_test::Fail(__FILE__, __LINE__,                                                \
                             std::string("expected " #a " " #op " " #b ", got ") +              \
                                 ::embedcore_test::Show(embedcore_a_) + " vs " +                \
                                 ::embedcore_test::Show(embedcore_b_));                         \
  } while (0)

#define EMBEDCORE_EXPECT_EQ(a, b) EMBEDCORE_EXPECT_OP_(a, b, ==)
#define EMBEDCORE_EXPECT_NE(a, b) EMBEDCORE_EXPECT_OP_(a, b, !=)
#define EMBEDCORE_EXPECT_LT(a, b) EMBEDCORE_EXPECT_OP_(a, b, <)
#define EMBEDCORE_EXPECT_LE(a, b) EMBEDCORE_EXPECT_OP_(a, b, <=)
#define EMBEDCORE_EXPECT_GE(a, b) EMBEDCORE_EXPECT_OP_(a, b, >=)

/// Bit-exact equality of two floats (so -0.0 != 0.0 and NaN == the same NaN).
#define EMBEDCORE_EXPECT_BITS_EQ(a, b)                                                         \
  do {                                                                                         \
    const float embedcore_a_ = (a);                                                            \
    const float embedcore_b_ = (b);                                                            \
    if (::embedcore_test::Bits(embedcore_a_) != ::embedcore_test::Bits(embedcore_b_))          \
      ::embedcore_test::Fail(__FILE__, __LINE__,                                               \
                             std::string("expected the bits of " #a " == " #b ", got ") +      \
                                 ::embedcore_test::Show(embedcore_a_) + " vs " +               \
                                 ::embedcore_test::Show(embedcore_b_));                        \
  } while (0)

#define EMBEDCORE_EXPECT_NEAR(a, b, rel, abs)                                                   \
  do {                                                                                         \
    const double embedcore_a_ = double(a);                                                     \
    const double embedcore_b_ = double(b);                                                     \
    if (!::embedcore_test::Near(embedcore_a_, embedcore_b_, rel, abs))                         \
      ::embedcore_test::Fail(__FILE__, __LINE__,                                               \
                             std::string("expected " #a " near " #b ", got ") +                \
                                 ::embedcore_test::Show(embedcore_a_) + " vs " +               \
                                 ::embedcore_test::Show(embedcore_b_));                        \
  } while (0)

/// `stmt` throws `Type` (or a subclass); the message must contain `substring`
/// (pass "" to accept any message).
#define EMBEDCORE_EXPECT_THROWS(stmt, Type, substring)                                         \
  do {                                                                                         \
    bool embedcore_caught_ = false;                                                            \
    try {                                                                                      \
      stmt;                                                                                    \
    } catch (const Type& embedcore_e_) {                                                       \
      embedcore_caught_ = true;                                                                \
      if (std::string(embedcore_e_.what()).find(substring) == std::string::npos)               \
        ::embedcore_test::Fail(__FILE__, __LINE__,                                             \
                               std::string(#stmt " threw " #Type " without \"") + (substring) + \
                                   "\" in its message: " + embedcore_e_.what());               \
    } catch (const std::exception& embedcore_e_) {                                             \
      embedcore_caught_ = true;                                                                \
      ::embedcore_test::Fail(__FILE__, __LINE__,                                               \
                             std::string(#stmt " threw another exception than " #Type ": ") +  \
                                 embedcore_e_.what());                                         \
    }                                                                                          \
    if (!embedcore_caught_)                                                                    \
      ::embedcore_test::Fail(__FILE__, __LINE__, #stmt " did not throw " #Type);               \
  } while (0)

#define EMBEDCORE_EXPECT_NO_THROW(stmt)                                                        \
  do {                                                                                         \
    try {                                                                                      \
      stmt;                                                                                    \
    } catch (const std::exception& embedcore_e_) {                                             \
      ::embedcore_test::Fail(__FILE__, __LINE__, std::string(#stmt " threw: ") + embedcore_e_.what()); \
    }                                                                                          \
  } while (0)
