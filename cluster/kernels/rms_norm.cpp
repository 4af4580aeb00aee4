// RMSNorm of float32 rows on CPU: y = x * (1 / sqrt(mean(x^2) + eps)) * w over the last dimension.
// torch's fused rms_norm dispatches half a dozen tensor ops per call, ~60 us for one 576-float row
// on a 2-core machine; a decode step calls it twice per layer, so it cost ~7% of the step. Here a
// row is one pass of 8-float vectors (two accumulators), rows in parallel only when there are many.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>

#include "vec8.h"

namespace {
using specserve_vec::hsum;
using specserve_vec::load8;
using specserve_vec::vec8;

void norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  vec8 a = vec8{}, b = vec8{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const vec8 u = load8(x + i), v = load8(x + i + 8);
    a += u * u;
    b += v * v;
  }
  float ss = hsum(a + b);
  for (; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) y[j] = (x[j] * inv) * w[j];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1,
              "specserve rms_norm wants contiguous float32 CPU rows, got ", x.sizes(), " ", x.scalar_type());
  const int64_t n = x.size(-1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1 && w.size(0) == n,
              "specserve rms_norm weight must be float32 [", n, "], got ", w.sizes(), " ", w.scalar_type());
  auto y = at::empty_like(x);
  const int64_t rows = n ? x.numel() / n : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));  // few rows: no thread hand-off
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) norm_row(xp + r * n, wp, yp + r * n, n, e);
  });
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
}
