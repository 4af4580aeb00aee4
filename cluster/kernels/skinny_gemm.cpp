// Skinny GEMM for CPU inference: y[M, N] = x[M, K] @ W[K, N] (+ add[M, N]) with M small (decode is
// 1 row per sequence, verification K+1 rows). MKL's sgemm packs W on every call, which doubles the
// memory traffic at small M; here W is packed once at load into column tiles [T, K, 64] that are
// streamed exactly once per call whatever M is. A tile is processed a few rows at a time (all
// accumulators in vector registers) so that, once in L2, it serves every row.
//
// The vector width and the register blocking follow the instruction set the kernel is compiled
// for (-march=native): with AVX-512 (32 zmm registers) 16-float vectors, 6 rows x the whole
// 64-column tile; otherwise (AVX2: 16 ymm registers) 8-float vectors, 6 rows x the whole tile for
// few rows and 6 rows x 16 columns for many. Few rows are bound by streaming the weights: 6 rows'
// 48 accumulators do not fit 16 registers, but keeping the extra ones in L1 costs less than a
// second pass over the tile — 2 rows at a time, verifying 3-6 tokens cost 1.35-1.64 decode
// forwards' worth of GEMM on a 2-core AMD EPYC, 6 at a time 1.12-1.22 (narrower column groups,
// 16-32 columns, streamed the tile in strides and were 1.5x slower even at 1 row). Many rows are
// bound by the multiply-adds, where spills cost and the tile is in L2 anyway: 6 x 16 (12
// accumulators, 2 weight vectors) stays in registers with the most multiply-adds per load —
// 0.71-0.82x the time of the 3 x 32 used before at 24-256 rows, 0.92x at 16, 1.0-1.1x at 9-12.
// Generic 16-float vectors on AVX2 spill every accumulator: measured 2x slower than torch.matmul
// at 1 row and 16x at 160 rows.
//
// Every output element is summed over k = 0..K-1 in the same order whatever M is, so a row's
// result does not depend on how many other rows share the call (decode and verification agree
// bit for bit).
//
// Weights whose values are bfloat16 (an EAGLE head is stored so) can be packed as bfloat16 tiles:
// half the bytes streamed, each widened to float32 exactly (a 16-bit shift) before the same
// multiply-adds in the same order — the result equals the float32 kernel's bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace {
constexpr int NB = 64;            // output columns per tile
#if defined(__AVX512F__)
constexpr int VL = 16;            // floats per vector
constexpr int MR_FEW = 6, GV_FEW = 4;   // rows per register block, vectors per column group (few rows)
constexpr int MR_MANY = 6, GV_MANY = 4; // the same for many rows
#else
constexpr int VL = 8;
constexpr int MR_FEW = 6, GV_FEW = 8;
constexpr int MR_MANY = 6, GV_MANY = 2;
#endif
constexpr int NV = NB / VL;       // vectors per tile row
constexpr int FEW_ROWS = 8;       // calls of at most this many rows use the FEW blocking
constexpr int PREFETCH_ROWS = 16; // tile rows ahead (4 KiB) for the software prefetch
constexpr int PREFETCH_LOCALITY = 1;  // into L2/L3, not L1 (measured best of 0..3)
typedef float vec __attribute__((vector_size(VL * sizeof(float))));
typedef uint16_t hvec __attribute__((vector_size(VL * sizeof(uint16_t))));
typedef uint32_t uvec __attribute__((vector_size(VL * sizeof(uint32_t))));

// VL weights at p as float32: a float32 tile as is, a bfloat16 one widened exactly.
inline vec load_w(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}
inline vec load_w(const at::BFloat16* p) {
  hvec h;
  std::memcpy(&h, p, sizeof(hvec));
  const uvec u = __builtin_convertvector(h, uvec) << 16;
  vec v;
  std::memcpy(&v, &u, sizeof(vec));
  return v;
}

// R rows of one tile, G vectors (G * VL columns) at a time.
template <int R, int G, typename W>
inline void block(const float* x, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy,
                  int ncols, const float* add, int64_t ldadd) {
  static_assert(NV % G == 0, "column groups must tile the tile");
  for (int c0 = 0; c0 < ncols; c0 += G * VL) {
    vec acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < G; ++j) {
        if (add != nullptr && ncols == NB) std::memcpy(&acc[r][j], add + r * ldadd + c0 + j * VL, sizeof(vec));
        else acc[r][j] = vec{};
      }
    for (int64_t k = 0; k < K; ++k) {
      const W* wk = w + k * NB + c0;
      for (int j = 0; j < G; ++j) __builtin_prefetch(wk + PREFETCH_ROWS * NB + j * VL, 0, PREFETCH_LOCALITY);
      vec wv[G];
      for (int j = 0; j < G; ++j) wv[j] = load_w(wk + j * VL);
      for (int r = 0; r < R; ++r) {
        const float xs = x[r * ldx + k];
        for (int j = 0; j < G; ++j) acc[r][j] += xs * wv[j];
      }
    }
    for (int r = 0; r < R; ++r) {
      if (ncols == NB) {
        for (int j = 0; j < G; ++j) std::memcpy(y + r * ldy + c0 + j * VL, &acc[r][j], sizeof(vec));
      } else {  // last, partial tile: the add (if any) was not folded into the accumulators
        float tmp[G * VL];
        for (int j = 0; j < G; ++j) std::memcpy(tmp + j * VL, &acc[r][j], sizeof(vec));
        const int n = std::min(G * VL, ncols - c0);
        for (int c = 0; c < n; ++c) y[r * ldy + c0 + c] = add ? add[r * ldadd + c0 + c] + tmp[c] : tmp[c];
      }
    }
  }
}

// One row over two full tiles at once: two independent streams per core keep more cache misses in
// flight, which is what a single row (batch-1 decode) is bound by. Same k order as block<1, G>.
template <typename W>
inline void one_row_two_tiles(const float* x, const W* wa, const W* wb, int64_t K, float* ya, float* yb,
                              const float* adda, const float* addb) {
  constexpr int G = GV_FEW;
  for (int c0 = 0; c0 < NB; c0 += G * VL) {
    vec a[G], b[G];
    for (int j = 0; j < G; ++j) {
      if (adda) { std::memcpy(&a[j], adda + c0 + j * VL, sizeof(vec)); std::memcpy(&b[j], addb + c0 + j * VL, sizeof(vec)); }
      else { a[j] = vec{}; b[j] = vec{}; }
    }
    for (int64_t k = 0; k < K; ++k) {
      const W* pa = wa + k * NB + c0;
      const W* pb = wb + k * NB + c0;
      for (int j = 0; j < G; ++j) {
        __builtin_prefetch(pa + PREFETCH_ROWS * NB + j * VL, 0, PREFETCH_LOCALITY);
        __builtin_prefetch(pb + PREFETCH_ROWS * NB + j * VL, 0, PREFETCH_LOCALITY);
      }
      const float xs = x[k];
      for (int j = 0; j < G; ++j) a[j] += xs * load_w(pa + j * VL);
      for (int j = 0; j < G; ++j) b[j] += xs * load_w(pb + j * VL);
    }
    for (int j = 0; j < G; ++j) {
      std::memcpy(ya + c0 + j * VL, &a[j], sizeof(vec));
      std::memcpy(yb + c0 + j * VL, &b[j], sizeof(vec));
    }
  }
}

template <int MR, int G, typename W>
void tile_rows(const float* x, int64_t ldx, int64_t M, const W* w, int64_t K, float* y, int64_t ldy,
               int ncols, const float* add, int64_t ldadd) {
  static_assert(MR <= 6, "the remainder switch below covers up to 5 rows");
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    block<MR, G>(x + m * ldx, ldx, w, K, y + m * ldy, ldy, ncols, add ? add + m * ldadd : nullptr, ldadd);
  x += m * ldx;
  y += m * ldy;
  if (add) add += m * ldadd;
  switch (M - m) {
    case 0: break;
    case 1: block<1, G>(x, ldx, w, K, y, ldy, ncols, add, ldadd); break;
    case 2: block<2, G>(x, ldx, w, K, y, ldy, ncols, add, ldadd); break;
    case 3: block<3, G>(x, ldx, w, K, y, ldy, ncols, add, ldadd); break;
    case 4: block<4, G>(x, ldx, w, K, y, ldy, ncols, add, ldadd); break;
    case 5: block<5, G>(x, ldx, w, K, y, ldy, ncols, add, ldadd); break;
  }
}

// [K, N] float32 or bfloat16 -> [ceil(N / 64), K, 64] of the same type, zero-padded columns.
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) && w.device().is_cpu(),
              "skinny_pack wants a 2-D float32 or bfloat16 CPU tensor [in, out], got ", w.sizes(), " ", w.scalar_type());
  const int64_t K = w.size(0), N = w.size(1), T = (N + NB - 1) / NB;
  auto padded = at::zeros({K, T * NB}, w.options());
  padded.narrow(1, 0, N).copy_(w);
  return padded.view({K, T, NB}).permute({1, 0, 2}).contiguous();
}

template <typename W>
void run(const float* xp, int64_t ldx, int64_t M, const W* wp, int64_t K, int64_t T, int64_t N, float* yp,
         const float* addp, int64_t ldadd) {
  if (M == 1 && N % NB == 0) {  // batch-1 decode: pair tile t with tile t + half in each thread's range
    at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
      const int64_t half = (end - begin) / 2;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t ta = begin + i, tb = begin + half + i;
        one_row_two_tiles(xp, wp + ta * K * NB, wp + tb * K * NB, K, yp + ta * NB, yp + tb * NB,
                          addp ? addp + ta * NB : nullptr, addp ? addp + tb * NB : nullptr);
      }
      if ((end - begin) % 2) {
        const int64_t t = end - 1;
        tile_rows<MR_FEW, GV_FEW>(xp, ldx, M, wp + t * K * NB, K, yp + t * NB, N, NB, addp ? addp + t * NB : nullptr,
                                  ldadd);
      }
    });
    return;
  }
  const bool few = M <= FEW_ROWS;
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int ncols = static_cast<int>(std::min<int64_t>(NB, N - t * NB));
      const W* wt = wp + t * K * NB;
      const float* addt = addp ? addp + t * NB : nullptr;
      if (few) tile_rows<MR_FEW, GV_FEW>(xp, ldx, M, wt, K, yp + t * NB, N, ncols, addt, ldadd);
      else tile_rows<MR_MANY, GV_MANY>(xp, ldx, M, wt, K, yp + t * NB, N, ncols, addt, ldadd);
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& add) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              "skinny_linear wants x as float32 CPU rows [M, K] with unit column stride, got ", x.sizes(), " ",
              x.strides(), " ", x.scalar_type());
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NB && packed.is_contiguous() &&
                  (packed.scalar_type() == at::kFloat || bf16),
              "skinny_linear wants a packed weight [T, K, 64] from skinny_pack");
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " columns, the packed weight has ", packed.size(1), " rows");
  TORCH_CHECK(N > (T - 1) * NB && N <= T * NB, "n_out ", N, " does not match ", T, " tiles of ", NB);
  const float* addp = nullptr;
  int64_t ldadd = 0;
  if (add.has_value()) {
    TORCH_CHECK(add->dim() == 2 && add->size(0) == M && add->size(1) == N && add->scalar_type() == at::kFloat &&
                    add->stride(1) == 1,
                "skinny_linear add must be float32 [", M, ", ", N, "] with unit column stride, got ", add->sizes());
    addp = add->data_ptr<float>();
    ldadd = add->stride(0);  // 0 for a broadcast bias
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  if (bf16)
    run(x.data_ptr<float>(), x.stride(0), M, packed.data_ptr<at::BFloat16>(), K, T, N, y.data_ptr<float>(), addp, ldadd);
  else
    run(x.data_ptr<float>(), x.stride(0), M, packed.data_ptr<float>(), K, T, N, y.data_ptr<float>(), addp, ldadd);
  return y;
}
// Floats per vector this build uses (16 with AVX-512, else 8): tests check it matches the CPU.
int64_t vector_width() { return VL; }
}  // namespace

TORCH_LIBRARY(specserve, m) {
  m.def("skinny_vector_width() -> int", &vector_width);
  m.def("skinny_pack(Tensor w) -> Tensor", &pack);
  m.def("skinny_linear(Tensor x, Tensor packed, int n_out, Tensor? add=None) -> Tensor", &linear);
}
