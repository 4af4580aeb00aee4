// Attention of a few query rows per sequence (decode, verification) over the paged KV cache, on CPU.
// Each query row reads its sequence's keys and values straight from the flat cache through the
// sequence's slot list, sees the first `keys` of them (causal: its own position and before) and
// nothing else. The torch path gathered every sequence's K and V into padded tensors and ran
// scaled_dot_product_attention with a boolean mask: ~165 us per layer for one row over 300 keys on
// a 2-core machine (a decode step spent ~9% of its time there), twice that with a mask (verification).
//
// A query row's result depends only on its own query, keys and values: not on the other rows of
// the call (decode and verification agree bit for bit). Scores, softmax and the weighted sum are
// float32; the query heads sharing a KV head (grouped-query attention) are scored together so each
// key is read once per KV head, the weighted sum keeps a head's 64 columns in registers, and the
// rows of keys and values a few slots ahead are prefetched (the cache is cold at every step).
// Work is split over (query row, KV head).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vec8.h"

namespace {
using specserve_vec::hsum;
using specserve_vec::load8;
using specserve_vec::store8;
using specserve_vec::vec8;

// e^x for x <= 0 (softmax scores less their maximum), 8 at a time: x = n ln2 + r with |r| <= ln2 / 2,
// e^r by a degree-6 polynomial (the Cephes expf coefficients), 2^n put into the exponent bits.
// Within 2 ulp of expf; below -87 (e^x < 2^-125, nothing next to the maximum's 1) it is 0.
inline vec8 exp8(vec8 x) {
  typedef int32_t ivec8 __attribute__((vector_size(8 * sizeof(int32_t))));
  const auto lo = x < -87.0f;  // all-ones lanes where x underflows
  x = x < -87.0f ? vec8{} - 87.0f : x;
  const vec8 shifter = vec8{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const vec8 n = (x * 1.44269504088896341f + shifter) - shifter;
  const vec8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  vec8 p = vec8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vec8 y = p * (r * r) + r + 1.0f;
  const ivec8 bits = (__builtin_convertvector(n, ivec8) + 127) << 23;
  vec8 scale;
  std::memcpy(&scale, &bits, sizeof(vec8));
  const vec8 out = y * scale;
  return lo ? vec8{} : out;
}

// The cache is cold at every step (a forward streams ~0.5 GB of weights between two visits of a
// layer) and a sequence's slots are only block-contiguous: its rows are fetched ahead by hand.
constexpr int64_t PREFETCH_KEYS = 8;
inline void prefetch_row(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 3);
}

inline float dot(const float* a, const float* b, int64_t D) {  // D % 8 == 0
  vec8 s0 = vec8{}, s1 = vec8{};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    s0 += load8(a + d) * load8(b + d);
    s1 += load8(a + d + 8) * load8(b + d + 8);
  }
  if (d < D) s0 += load8(a + d) * load8(b + d);
  return hsum(s0 + s1);
}

// One query row, the `rep` query heads of KV head `kh`: out[h * D ...] for h in [kh * rep, (kh + 1) * rep).
void row_kv_head(const float* q, const float* kc, const float* vc, const int64_t* slots, int64_t keys,
                 int64_t H, int64_t Hkv, int64_t D, int64_t kh, float scale, float* out, std::vector<float>& s) {
  const int64_t rep = H / Hkv;
  s.resize(static_cast<size_t>(rep * keys));
  for (int64_t j = 0; j < keys; ++j) {
    const float* k = kc + (slots[j] * Hkv + kh) * D;
    if (j + PREFETCH_KEYS < keys) prefetch_row(kc + (slots[j + PREFETCH_KEYS] * Hkv + kh) * D, D);
    for (int64_t r = 0; r < rep; ++r) s[r * keys + j] = dot(q + (kh * rep + r) * D, k, D) * scale;
  }
  for (int64_t r = 0; r < rep; ++r) {
    float* sr = s.data() + r * keys;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < keys; ++j) m = std::max(m, sr[j]);
    vec8 sum8 = vec8{};
    int64_t j = 0;
    for (; j + 8 <= keys; j += 8) {
      const vec8 e = exp8(load8(sr + j) - m);
      store8(sr + j, e);
      sum8 += e;
    }
    if (j < keys) {  // the last, partial 8: padded with -inf's e^x = 0
      float tail[8];
      for (int i = 0; i < 8; ++i) tail[i] = j + i < keys ? sr[j + i] - m : -1000.0f;
      vec8 e = exp8(load8(tail));
      store8(tail, e);
      for (int i = 0; j + i < keys; ++i) sr[j + i] = tail[i];
      sum8 += e;
    }
    const float total = hsum(sum8);
    const float inv = 1.0f / total;
    for (int64_t j = 0; j < keys; ++j) sr[j] *= inv;
  }
  // the weighted sum of the values, 64 columns of one head at a time in registers
  for (int64_t r = 0; r < rep; ++r) {
    const float* pr = s.data() + r * keys;
    float* o = out + (kh * rep + r) * D;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int64_t nv = std::min<int64_t>(8, (D - d0) / 8);
      vec8 acc[8] = {};
      for (int64_t j = 0; j < keys; ++j) {
        const float* v = vc + (slots[j] * Hkv + kh) * D + d0;
        if (r == 0 && j + PREFETCH_KEYS < keys) prefetch_row(vc + (slots[j + PREFETCH_KEYS] * Hkv + kh) * D + d0, D - d0);
        const float p = pr[j];
        for (int64_t i = 0; i < 8; ++i)
          if (i < nv) acc[i] += p * load8(v + 8 * i);
      }
      for (int64_t i = 0; i < nv; ++i) store8(o + d0 + 8 * i, acc[i]);
    }
  }
}

// q [T, H, D]; kc, vc [S, Hkv, D]; slots [G, L]; rows, seq, keys [N]: query row rows[n] of sequence
// seq[n] sees keys slots[seq[n], :keys[n]]. Returns [N, H * D].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slots,
                           const at::Tensor& rows, const at::Tensor& seq, const at::Tensor& keys, double scale) {
  auto is_f32 = [](const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous(); };
  auto is_i64 = [](const at::Tensor& t) { return t.scalar_type() == at::kLong && t.device().is_cpu() && t.is_contiguous(); };
  TORCH_CHECK(q.dim() == 3 && is_f32(q), "paged_attention: q must be contiguous float32 [T, H, D], got ", q.sizes());
  TORCH_CHECK(kc.dim() == 3 && vc.sizes() == kc.sizes() && is_f32(kc) && is_f32(vc),
              "paged_attention: the caches must be contiguous float32 [S, Hkv, D] of one shape");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), S = kc.size(0), Hkv = kc.size(1);
  TORCH_CHECK(kc.size(2) == D && D % 8 == 0 && Hkv > 0 && H % Hkv == 0,
              "paged_attention: head size ", D, " (a multiple of 8) and ", H, " query heads over ", Hkv, " KV heads");
  TORCH_CHECK(slots.dim() == 2 && is_i64(slots) && rows.dim() == 1 && is_i64(rows) && seq.sizes() == rows.sizes() &&
                  is_i64(seq) && keys.sizes() == rows.sizes() && is_i64(keys),
              "paged_attention: slots [G, L] and rows, seq, keys [N] must be contiguous int64");
  const int64_t N = rows.size(0), G = slots.size(0), L = slots.size(1);
  const int64_t *rp = rows.data_ptr<int64_t>(), *sp = seq.data_ptr<int64_t>(), *kp = keys.data_ptr<int64_t>();
  const int64_t* slp = slots.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {  // an index out of range would read outside the cache
    TORCH_CHECK(rp[n] >= 0 && rp[n] < T && sp[n] >= 0 && sp[n] < G && kp[n] >= 1 && kp[n] <= L,
                "paged_attention: query ", n, " (row ", rp[n], ", sequence ", sp[n], ", keys ", kp[n], ") out of range");
    const int64_t* sl = slp + sp[n] * L;
    for (int64_t j = 0; j < kp[n]; ++j)
      TORCH_CHECK(sl[j] >= 0 && sl[j] < S, "paged_attention: slot ", sl[j], " outside the cache of ", S);
  }
  auto out = at::empty({N, H * D}, q.options());
  const float *qp = q.data_ptr<float>(), *kcp = kc.data_ptr<float>(), *vcp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, N * Hkv, 1, [&](int64_t b, int64_t e) {
    std::vector<float> s;
    for (int64_t w = b; w < e; ++w) {
      const int64_t n = w / Hkv, kh = w % Hkv;
      row_kv_head(qp + rp[n] * H * D, kcp, vcp, slp + sp[n] * L, kp[n], H, Hkv, D, kh, sc, op + n * H * D, s);
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor rows, Tensor seq, "
        "Tensor keys, float scale) -> Tensor", &paged_attention);
}
