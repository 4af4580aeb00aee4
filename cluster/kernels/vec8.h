// 8-float vectors (one AVX2 register, half an AVX-512 one) for the row kernels: rms_norm.cpp and
// paged_attention.cpp. GCC vector extensions, compiled for the machine's instruction set.
#pragma once

#include <cstring>

namespace specserve_vec {
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(vec8));
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof(vec8)); }

// The 8 lanes summed in lane order.
inline float hsum(vec8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}
}  // namespace specserve_vec
