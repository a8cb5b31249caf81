// The library's table of its entry points, as the compiler reads pagewire_api.h: each one's
// name and the types of its return value and parameters. kernels/native_api.py compares it at
// load with its own reading of the same header, so the ctypes prototypes it builds cannot
// disagree with the functions they call (a reader's mistake fails the load, not the memory).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "pagewire_api.h"   // the declarations

namespace {

// A type's code: only these types cross the boundary (pagewire_api.h's format).
template <typename T>
constexpr char code() {
  if constexpr (std::is_void_v<T>) return 'v';
  else if constexpr (std::is_pointer_v<T>) return 'p';
  else if constexpr (std::is_same_v<T, int64_t>) return 'i';
  else if constexpr (std::is_same_v<T, float>) return 'f';
  else if constexpr (std::is_same_v<T, double>) return 'd';
  else static_assert(sizeof(T) == 0, "pagewire_api.h: a type outside its format");
}

template <typename F> struct Signature;
template <typename R, typename... A>
struct Signature<R(A...)> {
  static constexpr char text[] = {code<R>(), code<A>()..., '\0'};
};

struct Row {
  const char* name;
  const char* signature;
};

#define PW_API(ret, name, params) {#name, Signature<decltype(name)>::text},
constexpr Row kRows[] = {
#include "pagewire_api.h"   // again: only its PW_API lines expand, one row each
};

constexpr size_t kCount = sizeof kRows / sizeof kRows[0];

constexpr size_t length(const char* s) {
  size_t n = 0;
  while (s[n]) ++n;
  return n;
}

constexpr size_t longest_entry() {   // "name signature" and its terminating zero
  size_t most = 0;
  for (const Row& row : kRows) most = std::max(most, length(row.name) + length(row.signature) + 2);
  return most;
}

// "name signature" per row, made once (static storage: the pointers stay valid).
struct Entries {
  char text[kCount][longest_entry()];
  Entries() {
    for (size_t i = 0; i < kCount; ++i) {
      char* out = text[i];
      for (const char* p = kRows[i].name; *p; ++p) *out++ = *p;
      *out++ = ' ';
      for (const char* p = kRows[i].signature; *p; ++p) *out++ = *p;
      *out = '\0';
    }
  }
};

}  // namespace

extern "C" const char* pw_api_entry(int64_t i) {
  static const Entries entries;
  return i >= 0 && i < static_cast<int64_t>(kCount) ? entries.text[i] : nullptr;
}
