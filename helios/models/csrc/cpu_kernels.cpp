// Helios CPU kernels, compiled on first use by helios/models/cpu_kernels.py (g++ -O3 -march=native
// -fopenmp against the installed torch) and registered as torch operators in the `helios` namespace.
//
// helios::q8_linear(x, codes, scales): y = x @ W^T for W[n, k] = codes[n, k] * scales[n, k / 32],
//   the exact float32 values of a ggml Q8_0 weight (an 8-bit code times a float16 scale needs at most
//   19 significant bits), computed from the 1-byte codes: a quarter of the bytes of a float32 copy,
//   read from memory once per call (blocks of weight rows shared by every tile of activation rows).
//   x and the result are float32; accumulation is float32, as a float32 matmul's is.
// helios::paged_decode(q, k_cache, v_cache, block_table, rows, lens, page_size, scale): one query
//   token per row attending over its whole history, read in place from the paged cache (no gather of
//   the history into a contiguous copy). Scores, softmax and the weighted sum are float32; histories
//   are split into chunks of kChunk positions that run in parallel and are merged with their
//   softmax statistics (flash-decoding), so one long row still uses every core.
// helios::paged_decode_int8(q, k_cache, k_scale, v_cache, v_scale, ...): paged_decode over int8 K/V
//   with one bfloat16 scale per (kv head, slot) row, dequantized on the fly (float32 math).
// helios::write_kv_int8(k, v, k_cache, k_scale, v_cache, v_scale, slot_mapping): the step's K/V rows
//   quantized into int8 caches at their slots (the row quantizer of helios.engine.attention, bit for bit).
// helios::write_paged_decode(q, k, v, k_cache, v_cache, slot_mapping, ...): the step's K/V written
//   into the caches at their slots, then paged_decode: an all-decode layer's attention in one call.
// helios::kquant_linear_grouped(x, offsets, blocks[], ggml_type, out_features): kquant_linear for groups of
//   rows with a weight each (the experts a step chose), in one parallel region.
// helios::moe_kquant_mix(x, weights, ids, gate_up[], gu_type, down[], down_type, max_rows): a mixture-of-experts
//   layer's routed experts (GGUF blocks) in one operator: grouping by expert, gate/up, SwiGLU, down and
//   the weighted sum, bit for bit helios.models.moe.expert_mix's result.
// helios::kquant_linear(x, blocks, ggml_type, out_features, float_out), helios::kquant_dequantize(blocks, ggml_type,
//   out_features, in_features): a GGUF Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 / Q8_0 weight used from its
//   blocks; each weight decoded to its exact float32 value (gguf.quants.dequantize's, bit for bit) and
//   accumulated in float32 in a fixed order (the contract: cpu_kernels.py's docstring).
// helios::add_rms_norm(h, delta, weight, eps), helios::rope_(x, cos, sin), helios::silu_mul(gu): the
//   decoder layer's residual add + RMSNorm, rotary embedding (in place) and SwiGLU activation, each
//   one operator where torch needs 3-6 (at one decode token a layer spent ~35 us in those small ops).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/div.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/BFloat16.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <immintrin.h>
#include <type_traits>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;   // Q8_0 block
#ifndef HELIOS_Q8_TILE
#define HELIOS_Q8_TILE 4
#endif
constexpr int kRowTile = HELIOS_Q8_TILE;  // activation rows sharing one dequantized weight block
#ifndef HELIOS_Q8_ROW_BYTES
#define HELIOS_Q8_ROW_BYTES 16384
#endif
constexpr int64_t kQ8RowBytes = HELIOS_Q8_ROW_BYTES;  // bytes of codes per block of weight rows (in L1)
constexpr int64_t kChunk = 256;  // history positions per attention work item
// (query head, position, head dimension) products below which decode attention runs on one thread: 4,096
// (kv head, position) pairs of the default model's heads (3 queries of 64 per kv head), where this was
// measured; a model with more work per pair (Qwen2.5-Coder-1.5B: 6 queries of 128) goes parallel sooner.
constexpr int64_t kSerialWork = 4096 * 3 * 64;

// Software prefetch of one cache row (K or V of one position and kv head). A page holds page_size
// consecutive positions and the next page is anywhere in the cache, so the hardware prefetchers lose
// the stream at every page boundary: without these, decode attention stalled on its K and V loads
// (10 GB/s of a 40 GB/s machine at 32 rows x 300 positions).
constexpr int64_t kPrefetchAhead = 16;  // positions ahead in the weighted sum of V
#ifndef HELIOS_K_AHEAD
#define HELIOS_K_AHEAD 32
#endif
constexpr int64_t kKAhead = HELIOS_K_AHEAD;  // positions ahead in the scores (K rows)
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline void store(float v, float* p) { *p = v; }
inline void store(float v, c10::BFloat16* p) { *p = c10::BFloat16(v); }  // round to nearest even

#if defined(__AVX512F__)
#ifndef HELIOS_Q8_COLS
#define HELIOS_Q8_COLS 2
#endif
#ifndef HELIOS_Q8_PF
#define HELIOS_Q8_PF 4
#endif
// (q8_tile prefetches the same block HELIOS_Q8_PF weight rows ahead at every tile size: at 1 and 2
// activation rows too, where it once did not, the 151,936 x 896 head on 2 threads of the AMX machine
// (2026-12-06) took 7.7-7.9 ms against 10.9-11.1 without it, 1 thread 15.2-16.5 against 19.3-20.3.)
constexpr int kQ8Cols = HELIOS_Q8_COLS;  // weight rows of a q8_linear register tile (with kRowTile activation rows)

// Outputs y[i * N + n + j] for activation rows i < MT and weight rows n + j, j < NT: each 32-code block
// is widened to float32 and scaled once (exact), then fused-multiply-added into per-output lane
// accumulators (two of 16 lanes); one horizontal sum per output. Each output's operations are the same
// whatever the tile. Written with intrinsics: the auto-vectorized form went through a stack array (a
// store-forwarding stall per block) and ran 4x slower.
template <int MT, int NT>
__attribute__((always_inline)) inline void q8_tile(const float* __restrict__ xp, const int8_t* __restrict__ qp,
                                                   const float* __restrict__ sp, float* __restrict__ yp, int64_t n,
                                                   int64_t K, int64_t N, int64_t blocks) {
  __m512 acc[NT][MT][2];
  _Pragma("GCC unroll 8")
  for (int j = 0; j < NT; ++j)
    _Pragma("GCC unroll 8")
    for (int i = 0; i < MT; ++i) acc[j][i][0] = acc[j][i][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 w[NT][2];
    _Pragma("GCC unroll 8")
    for (int j = 0; j < NT; ++j) {
      const __m512 sv = _mm512_set1_ps(sp[(n + j) * blocks + b]);
      const int8_t* qb = qp + (n + j) * K + b * kGroup;
      if (HELIOS_Q8_PF > 0 && (b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(qb + HELIOS_Q8_PF * K), _MM_HINT_T0);
      w[j][0] = _mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)))));
      w[j][1] = _mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16)))));
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < MT; ++i) {
      const float* xr = xp + i * K + b * kGroup;
      const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
      _Pragma("GCC unroll 8")
      for (int j = 0; j < NT; ++j) {
        acc[j][i][0] = _mm512_fmadd_ps(w[j][0], x0, acc[j][i][0]);
        acc[j][i][1] = _mm512_fmadd_ps(w[j][1], x1, acc[j][i][1]);
      }
    }
  }
  _Pragma("GCC unroll 8")
  for (int j = 0; j < NT; ++j)
    _Pragma("GCC unroll 8")
    for (int i = 0; i < MT; ++i) yp[i * N + n + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][i][0], acc[j][i][1]));
}
#endif

// Rows [0, MT) of x (row stride K) against weight rows [n0, n1): y[i * N + n] (AVX-512: in tiles of
// kQ8Cols weight rows, `q8_tile`).
template <int MT>
inline void q8_rows(const float* __restrict__ xp, const int8_t* __restrict__ qp, const float* __restrict__ sp,
                    float* __restrict__ yp, int64_t n0, int64_t n1, int64_t K, int64_t N, int64_t blocks) {
  int64_t n = n0;
#if defined(__AVX512F__)
  if constexpr (MT >= 4) {
    for (; n + kQ8Cols <= n1; n += kQ8Cols) q8_tile<MT, kQ8Cols>(xp, qp, sp, yp, n, K, N, blocks);
  }
#endif
  for (; n < n1; ++n) {
    [[maybe_unused]] const int8_t* __restrict__ qr = qp + n * K;
    [[maybe_unused]] const float* __restrict__ sr = sp + n * blocks;
#if defined(__AVX512F__)
    q8_tile<MT, 1>(xp, qp, sp, yp, n, K, N, blocks);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[MT][4];
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const __m256 sv = _mm256_set1_ps(sr[b]);
      const int8_t* qb = qr + b * kGroup;
      __m256 w[4];
      for (int j = 0; j < 4; ++j) {
        w[j] = _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * j)))));
      }
      for (int i = 0; i < MT; ++i) {
        const float* xr = xp + i * K + b * kGroup;
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j), acc[i][j]);
      }
    }
    for (int i = 0; i < MT; ++i) {
      const __m256 v = _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3]));
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      yp[i * N + n] = _mm_cvtss_f32(h);
    }
#else
    float acc[MT] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const float s = sr[b];
      for (int k = 0; k < kGroup; ++k) {
        const float w = s * static_cast<float>(qr[b * kGroup + k]);
        for (int i = 0; i < MT; ++i) acc[i] += w * xp[i * K + b * kGroup + k];
      }
    }
    for (int i = 0; i < MT; ++i) yp[i * N + n] = acc[i];
#endif
  }
}

// The last M < kRowTile rows: one tile of exactly M rows.
template <int MT>
inline void q8_tail(int64_t M, const float* xp, const int8_t* qp, const float* sp, float* yp, int64_t n0, int64_t n1,
                    int64_t K, int64_t N, int64_t blocks) {
  if constexpr (MT > 0) {
    if (M == MT) q8_rows<MT>(xp, qp, sp, yp, n0, n1, K, N, blocks);
    else q8_tail<MT - 1>(M, xp, qp, sp, yp, n0, n1, K, N, blocks);
  }
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && scales.dim() == 2, "q8_linear: 2-d operands");
  TORCH_CHECK(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kChar &&
                  scales.scalar_type() == at::kFloat,
              "q8_linear: float32 x, int8 codes, float32 scales");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scales.is_contiguous(), "q8_linear: contiguous");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(), "q8_linear: CPU");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) == K && K % kGroup == 0, "q8_linear: codes must be [N, K], K a multiple of 32");
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == K / kGroup, "q8_linear: scales must be [N, K/32]");
  at::Tensor y = at::empty({M, N}, x.options());
  const float* __restrict__ xp = x.data_ptr<float>();
  const int8_t* __restrict__ qp = codes.data_ptr<int8_t>();
  const float* __restrict__ sp = scales.data_ptr<float>();
  float* __restrict__ yp = y.data_ptr<float>();
  const int64_t blocks = K / kGroup;
  // Weight rows kQ8RowBlock at a time (read from memory once, then from L1/L2 by every tile of
  // activation rows: the codes are streamed once per call, not once per tile).
  const int64_t rblock = std::max<int64_t>(1, kQ8RowBytes / K);
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = n0; r0 < n1; r0 += rblock) {
      const int64_t r1 = std::min(n1, r0 + rblock);
      int64_t m0 = 0;
      for (; m0 + kRowTile <= M; m0 += kRowTile) q8_rows<kRowTile>(xp + m0 * K, qp, sp, yp + m0 * N, r0, r1, K, N, blocks);
      q8_tail<kRowTile - 1>(M - m0, xp + m0 * K, qp, sp, yp + m0 * N, r0, r1, K, N, blocks);
    }
  });
  return y;
}

// A float32 vector of W lanes (AVX-512, AVX2 + FMA, or one scalar lane), with loads that widen
// bfloat16 (exact: a bfloat16 is the top half of a float32).
#if defined(__AVX512F__)
using vec = __m512;
constexpr int64_t W = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vec vload(const int8_t* p) {  // int8 codes widened (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline vec vround(vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// a where x >= 0, else b (lane by lane)
inline vec vpick_nonneg(vec x, vec a, vec b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
}
inline vec vpow2i(vec n) {  // 2^n for integral n in [-126, 127]
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int64_t W = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vec vload(const int8_t* p) {  // int8 codes widened (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline float vsum(vec v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
inline vec vround(vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vpick_nonneg(vec x, vec a, vec b) {
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
inline vec vpow2i(vec n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
#else
using vec = float;
constexpr int64_t W = 1;
inline vec vzero() { return 0.f; }
inline vec vset1(float x) { return x; }
inline vec vload(const float* p) { return *p; }
inline vec vload(const c10::BFloat16* p) { return to_float(*p); }
inline vec vload(const int8_t* p) { return static_cast<float>(*p); }
inline void vstore(float* p, vec v) { *p = v; }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline vec vadd(vec a, vec b) { return a + b; }
inline vec vmul(vec a, vec b) { return a * b; }
inline vec vsub(vec a, vec b) { return a - b; }
inline vec vmax(vec a, vec b) { return std::max(a, b); }
inline vec vmin(vec a, vec b) { return std::min(a, b); }
inline vec vdiv(vec a, vec b) { return a / b; }
inline float vsum(vec v) { return v; }
inline vec vround(vec v) { return std::nearbyint(v); }
inline vec vpick_nonneg(vec x, vec a, vec b) { return x >= 0.f ? a : b; }
inline vec vpow2i(vec n) { return std::ldexp(1.f, static_cast<int>(n)); }
#endif

// e^x = e^r * 2^n for x = n ln2 + r, |r| <= ln2/2: returns e^r by its degree-6 Taylor polynomial (relative
// error below 2e-7) and n (rounded x / ln2) through ``n``.
inline vec vexp_reduced(vec x, vec& n) {
  n = vround(vmul(x, vset1(1.44269504088896341f)));
  vec r = vfma(n, vset1(-0.693145751953125f), x);  // ln2 split in two parts for an exact reduction
  r = vfma(n, vset1(-1.428606820309417232e-06f), r);
  vec p = vset1(1.f / 720.f);
  p = vfma(p, r, vset1(1.f / 120.f));
  p = vfma(p, r, vset1(1.f / 24.f));
  p = vfma(p, r, vset1(1.f / 6.f));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.f));
  p = vfma(p, r, vset1(1.f));
  return p;
}

// exp(x) for x <= 0 (softmax arguments after the max is subtracted): vexp_reduced's e^r times 2^n. Below
// -87 the result is flushed to 0 (e^-87 is under float32's normal range; such a weight is negligible
// next to the max's 1).
inline vec vexp_nonpositive(vec x) {
  vec n;
  const vec p = vexp_reduced(vmax(x, vset1(-87.f)), n);
  return vmul(p, vpow2i(n));
}

#if defined(__AVX512F__)
// vexp_nonpositive with the final scaling by 2^n as one vscalefps (the same values for x >= -87, where
// vexp_nonpositive's clamp does not act) and without the clamp: below -87 the scaling underflows
// towards 0 by itself (a subnormal or 0 instead of e^-87). x = -inf gives NaN: callers mask those lanes.
inline __m512 vexp_nonpositive_scalef(__m512 x) {
  __m512 n;
  const __m512 p = vexp_reduced(x, n);
  return _mm512_scalef_ps(p, n);
}

// Lane i of the result is op over the 16 lanes of d[i] (reduce16: the sum; reduce16_max: the maximum):
// pairs are combined within 128-bit lanes (unpack lo/hi of floats, then of float pairs), then the four
// 128-bit lanes are transposed and combined.
template <typename Op>
inline __m512 reduce16_by(const __m512* d, Op op) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = op(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]), _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w01 = op(_mm512_shuffle_f32x4(y[0], y[1], 0x44), _mm512_shuffle_f32x4(y[0], y[1], 0xEE));
  const __m512 w23 = op(_mm512_shuffle_f32x4(y[2], y[3], 0x44), _mm512_shuffle_f32x4(y[2], y[3], 0xEE));
  return op(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}
inline __m512 reduce16(const __m512* d) {
  return reduce16_by(d, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}
inline __m512 reduce16_max(const __m512* d) {
  return reduce16_by(d, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
}
#endif

// The weighted sum of V over one work item's positions for a (query group G, vectors per head NV)
// known at compile time: the G x NV accumulators stay in registers (with runtime sizes they lived
// in memory, a load-FMA-store chain per position that made this loop the kernel's bottleneck).
// out[g] = sum_j scores[g * kChunk + j] * V[position start + j], float32.
template <typename T>
using PvFn = void (*)(const T*, const int64_t*, int64_t, int64_t, int64_t, const float*, int64_t, float*);

template <typename T, int G, int NV>
void pv_fixed(const T* __restrict__ vp, const int64_t* __restrict__ sl, int64_t base, int64_t n, int64_t dh,
              const float* __restrict__ scores, int64_t row_bytes, float* __restrict__ out) {
  vec acc[G * NV];
  for (int i = 0; i < G * NV; ++i) acc[i] = vzero();
  for (int64_t j = 0; j < n; ++j) {
    const T* __restrict__ vr = vp + (base + sl[j]) * dh;
    if (j + kPrefetchAhead < n) prefetch_row(vp + (base + sl[j + kPrefetchAhead]) * dh, row_bytes);
    vec vx[NV];
    for (int e = 0; e < NV; ++e) vx[e] = vload(vr + e * W);
    for (int g = 0; g < G; ++g) {
      const vec sg = vset1(scores[g * kChunk + j]);
      for (int e = 0; e < NV; ++e) acc[g * NV + e] = vfma(sg, vx[e], acc[g * NV + e]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int e = 0; e < NV; ++e) vstore(out + g * dh + e * W, acc[g * NV + e]);
}

template <typename T, int NV>
PvFn<T> pv_for_nv(int64_t G) {
  switch (G) {
    case 1: return &pv_fixed<T, 1, NV>;
    case 2: return &pv_fixed<T, 2, NV>;
    case 3: return &pv_fixed<T, 3, NV>;
    case 4: return NV <= 4 ? &pv_fixed<T, 4, NV> : nullptr;
    case 5: return NV <= 4 ? &pv_fixed<T, 5, NV> : nullptr;
    case 6: return NV <= 4 ? &pv_fixed<T, 6, NV> : nullptr;
    default: return nullptr;
  }
}

// The specialised weighted sum for this shape, or nullptr (the generic loop) when its accumulators
// would not fit in registers.
template <typename T>
PvFn<T> pv_for(int64_t G, int64_t NV) {
  if (NV == 4) return pv_for_nv<T, 4>(G);
  if (NV == 8) return pv_for_nv<T, 8>(G);
  return nullptr;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The 16 positions' dot products of one bfloat16 query (32 PAIRS values, loaded once) with their K rows:
// dv[p] = the chain of PAIRS vdpbf16ps over the row's 32-value pieces in order (paged_decode's sums).
template <int PAIRS, typename T, typename C>
__attribute__((always_inline)) inline void qk16_bf16(const T* qr, const C* const* rows16, __m512* dv) {
  __m512bh qv[PAIRS];
  for (int c = 0; c < PAIRS; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qr + c * 32);
  for (int p = 0; p < 16; ++p) {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < PAIRS; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(rows16[p] + c * 32));
    dv[p] = a;
  }
}
#endif

// The register tile of paged_decode's weighted sum for many queries per kv head.
constexpr int64_t kPvTileQueries = 4;
constexpr int64_t kPvTileVectors = 4;

// One tile: out[g * dh + e * W] (g < GQ, e < kPvTileVectors) = sum_j scores[g * kChunk + j] *
// V[position start + j][e0 * W + e * W ..], each a chain over j in order.
template <typename T, int GQ>
void pv_tile(const T* __restrict__ vp, const int64_t* __restrict__ sl, int64_t base, int64_t n, int64_t dh, int64_t e0,
             const float* __restrict__ scores, float* __restrict__ out) {
  vec a[GQ][kPvTileVectors];
  for (int g = 0; g < GQ; ++g)
    for (int e = 0; e < kPvTileVectors; ++e) a[g][e] = vzero();
  for (int64_t j = 0; j < n; ++j) {
    const T* __restrict__ vr = vp + (base + sl[j]) * dh + e0 * W;
    vec w[GQ];
    for (int g = 0; g < GQ; ++g) w[g] = vset1(scores[g * kChunk + j]);
    for (int e = 0; e < kPvTileVectors; ++e) {
      const vec vx = vload(vr + e * W);
      for (int g = 0; g < GQ; ++g) a[g][e] = vfma(w[g], vx, a[g][e]);
    }
  }
  for (int g = 0; g < GQ; ++g)
    for (int e = 0; e < kPvTileVectors; ++e) vstore(out + g * dh + e * W, a[g][e]);
}

// T: the query's and the output's dtype; C: the caches' (T, or int8_t: codes with one bfloat16 scale per
// (kv head, slot) row in ksp / vsp, [KV, S]). An int8 K row is dequantized as it is widened (code *
// scale, exact in float32); V's scale is folded into each position's probability after the softmax
// sums (p * (s * v) = (p * s) * v up to float32 rounding).
template <typename T, typename C>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& table, const at::Tensor& rows, const at::Tensor& lens,
                       int64_t page_size, double scale, at::Tensor& out,
                       const c10::BFloat16* __restrict__ ksp = nullptr, const c10::BFloat16* __restrict__ vsp = nullptr) {
  constexpr bool kQuant = std::is_same_v<C, int8_t>;
  const int64_t D = q.size(0), H = q.size(1), dh = q.size(2);
  const int64_t KV = k_cache.size(0), S = k_cache.size(1), P = table.size(1);
  const int64_t G = H / KV, NV = dh / W;
  const T* __restrict__ qp = q.data_ptr<T>();
  const C* __restrict__ kp = reinterpret_cast<const C*>(k_cache.data_ptr());
  const C* __restrict__ vp = reinterpret_cast<const C*>(v_cache.data_ptr());
  const int64_t* __restrict__ tp = table.data_ptr<int64_t>();
  const int64_t* __restrict__ rp = rows.data_ptr<int64_t>();
  const int64_t* __restrict__ lp = lens.data_ptr<int64_t>();
  T* __restrict__ op = out.data_ptr<T>();
  int64_t max_len = 0;
  for (int64_t d = 0; d < D; ++d) {
    TORCH_CHECK(lp[d] >= 1 && lp[d] <= P * page_size, "paged_decode: length outside the block table");
    TORCH_CHECK(rp[d] >= 0 && rp[d] < table.size(0), "paged_decode: row outside the block table");
    for (int64_t pg = 0; pg < (lp[d] + page_size - 1) / page_size; ++pg) {
      const int64_t page = tp[rp[d] * P + pg];
      TORCH_CHECK(page >= 0 && (page + 1) * page_size <= S, "paged_decode: page outside the cache");
    }
    max_len = std::max(max_len, lp[d]);
  }
  const int64_t chunks = (max_len + kChunk - 1) / kChunk;
  const int64_t items = D * KV * chunks;
  // Per (item, query of the group): the chunk's max score, its sum of exponentials, and the
  // unnormalized output; merged below.
  std::vector<float> part_max(items * G), part_sum(items * G), part_acc(items * G * dh);
  const float fscale = static_cast<float>(scale);
  // Short histories are not worth a parallel region (its fork/join costs more than the work, and far
  // more when another process holds a core): below kSerialWork (query head, position, head dimension)
  // products in all, one thread.
  int64_t positions = 0;
  for (int64_t d = 0; d < D; ++d) positions += lp[d];
  const int64_t grain = positions * H * dh < kSerialWork ? items : 1;
  const int64_t row_bytes = dh * static_cast<int64_t>(sizeof(C));
  const PvFn<C> pv = pv_for<C>(G, NV);
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    std::vector<vec> qv(G * NV), acc(G * NV), dots(G);
    std::vector<float> scores(G * kChunk), kblock(16 * dh), vsc(kQuant ? kChunk : 0);
    std::vector<int64_t> slotv(kChunk);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t c = item % chunks, kv = (item / chunks) % KV, d = item / (chunks * KV);
      const int64_t len = lp[d], start = c * kChunk, end = std::min(len, start + kChunk);
      float* mx = part_max.data() + item * G;
      float* sm = part_sum.data() + item * G;
      float* out_acc = part_acc.data() + item * G * dh;
      if (start >= end) {
        for (int64_t g = 0; g < G; ++g) { mx[g] = -std::numeric_limits<float>::infinity(); sm[g] = 0.f; }
        std::fill(out_acc, out_acc + G * dh, 0.f);
        continue;
      }
      for (int64_t g = 0; g < G; ++g) {
        const T* qr = qp + (d * H + kv * G + g) * dh;
        for (int64_t e = 0; e < NV; ++e) qv[g * NV + e] = vmul(vload(qr + e * W), vset1(fscale));
      }
      const int64_t* page_row = tp + rp[d] * P;
      const int64_t n = end - start;
      {  // each position's slot, walking the pages (no division per position)
        int64_t pg = start / page_size, off = start % page_size;
        for (int64_t j = 0; j < n; ++j) {
          slotv[j] = page_row[pg] * page_size + off;
          if (++off == page_size) {
            off = 0;
            ++pg;
          }
        }
      }
      const int64_t* sl = slotv.data();
      if constexpr (kQuant) {
        for (int64_t p = 0; p < n; ++p) {
          const int64_t pos = start + p;
          vsc[p] = to_float(vsp[kv * S + sl[pos - start]]);
        }
      }
      for (int64_t p = 0; p < std::min<int64_t>(n, kKAhead); ++p) {
        const int64_t pos = start + p;
        prefetch_row(kp + (kv * S + sl[pos - start]) * dh, row_bytes);
      }
      int64_t j = 0;
#if defined(__AVX512F__)
      // Blocks of 16 positions: each query's 16 dot-product vectors are summed into one vector of 16
      // scores by a transposing reduction (reduce16), about 3 operations per score instead of the 8 of
      // a horizontal sum each; K rows are widened to float32 once per block, not once per query.
      for (; j + 16 <= n; j += 16) {
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<C, c10::BFloat16>) {
          if (dh % 32 == 0) {
            // bfloat16 K against the bfloat16 query with AVX512-BF16 dot products: each pair of
            // products is exact in float32 and accumulated in float32; the scale is applied after.
            const C* rows16[16];
            for (int64_t p = 0; p < 16; ++p) {
              const int64_t pos = start + j + p;
              const int64_t slot = kv * S + sl[pos - start];
              rows16[p] = kp + slot * dh;
              prefetch_row(vp + slot * dh, row_bytes);  // for the weighted sum below
              if (j + kKAhead + p < n) {
                const int64_t ahead = pos + kKAhead;
                prefetch_row(kp + (kv * S + sl[ahead - start]) * dh,
                             row_bytes);
              }
            }
            const int64_t pairs = dh / 32;
            for (int64_t g = 0; g < G; ++g) {
              const T* qr = qp + (d * H + kv * G + g) * dh;
              vec dv[16];
              if (pairs == 2) qk16_bf16<2>(qr, rows16, dv);  // the head sizes 64 and 128 unrolled
              else if (pairs == 4) qk16_bf16<4>(qr, rows16, dv);
              else {
                for (int64_t p = 0; p < 16; ++p) {
                  __m512 a = _mm512_setzero_ps();
                  for (int64_t c = 0; c < pairs; ++c) {
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qr + c * 32),
                                         (__m512bh)_mm512_loadu_si512(rows16[p] + c * 32));
                  }
                  dv[p] = a;
                }
              }
              _mm512_storeu_ps(scores.data() + g * kChunk + j, _mm512_mul_ps(reduce16(dv), vset1(fscale)));
            }
            continue;
          }
        }
#endif
        for (int64_t p = 0; p < 16; ++p) {
          const int64_t pos = start + j + p;
          const int64_t slot = kv * S + sl[pos - start];
          const C* __restrict__ kr = kp + slot * dh;
          prefetch_row(vp + slot * dh, row_bytes);
          if (j + kKAhead + p < n) {
            const int64_t ahead = pos + kKAhead;
            prefetch_row(kp + (kv * S + sl[ahead - start]) * dh, row_bytes);
          }
          if constexpr (kQuant) {
            const vec ks = vset1(to_float(ksp[slot]));
            for (int64_t e = 0; e < NV; ++e) vstore(kblock.data() + p * dh + e * W, vmul(vload(kr + e * W), ks));
          } else {
            for (int64_t e = 0; e < NV; ++e) vstore(kblock.data() + p * dh + e * W, vload(kr + e * W));
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          vec d[16];
          for (int64_t p = 0; p < 16; ++p) {
            vec a = vzero();
            for (int64_t e = 0; e < NV; ++e) a = vfma(qv[g * NV + e], _mm512_loadu_ps(kblock.data() + p * dh + e * W), a);
            d[p] = a;
          }
          _mm512_storeu_ps(scores.data() + g * kChunk + j, reduce16(d));
        }
      }
#endif
      for (; j < n; ++j) {
        const int64_t pos = start + j;
        const int64_t slot = kv * S + sl[pos - start];
        const C* __restrict__ kr = kp + slot * dh;
        const vec ks = vset1(kQuant ? to_float(ksp[slot]) : 1.f);
        for (int64_t g = 0; g < G; ++g) dots[g] = vzero();
        for (int64_t e = 0; e < NV; ++e) {
          const vec kx = kQuant ? vmul(vload(kr + e * W), ks) : vload(kr + e * W);
          for (int64_t g = 0; g < G; ++g) dots[g] = vfma(qv[g * NV + e], kx, dots[g]);
        }
        for (int64_t g = 0; g < G; ++g) scores[g * kChunk + j] = vsum(dots[g]);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * kChunk;
        float m = -std::numeric_limits<float>::infinity();
        {  // the maximum W lanes at a time (a scalar chain of maxima was a quarter of a short history's time)
          int64_t j = 0;
          if (n >= W) {
            vec lanes = vload(sc);
            for (j = W; j + W <= n; j += W) lanes = vmax(lanes, vload(sc + j));
            alignas(64) float part[W];
            vstore(part, lanes);
            for (int64_t l = 0; l < W; ++l) m = std::max(m, part[l]);
          }
          for (; j < n; ++j) m = std::max(m, sc[j]);
        }
        const vec mv = vset1(m);
        vec total = vzero();
        int64_t j = 0;
        for (; j + W <= n; j += W) {
          const vec ex = vexp_nonpositive(vsub(vload(sc + j), mv));
          vstore(sc + j, ex);
          total = vadd(total, ex);
        }
        float tail = vsum(total);
        for (; j < n; ++j) { sc[j] = std::exp(sc[j] - m); tail += sc[j]; }
        mx[g] = m;
        sm[g] = tail;
        if constexpr (kQuant) {
          for (int64_t j = 0; j < n; ++j) sc[j] *= vsc[j];
        }
      }
      if (pv != nullptr) {
        pv(vp, sl, kv * S, n, dh, scores.data(), row_bytes, out_acc);
        continue;
      }
      if (G * NV > kPvTileQueries * kPvTileVectors && NV % kPvTileVectors == 0) {
        // Many queries per kv head (latent attention's absorbed decode: every head shares the one
        // row; Qwen2.5's 6 or 7): G * NV accumulators would not stay in registers, so the weighted sum
        // runs in tiles of up to kPvTileQueries queries x kPvTileVectors vectors held in registers,
        // each tile over all n positions (the same sums in the same order as the loop below, so the
        // same values). Without it a group of 7 queries ran the loop below, its accumulators in
        // memory: 8 rows x 100 positions of Qwen2.5-0.5B's heads took 104 us a layer.
        for (int64_t g0 = 0; g0 < G; g0 += kPvTileQueries) {
          for (int64_t e0 = 0; e0 < NV; e0 += kPvTileVectors) {
            const float* sc = scores.data() + g0 * kChunk;
            float* dst = out_acc + g0 * dh + e0 * W;
            const int64_t base = kv * S;
            switch (std::min<int64_t>(kPvTileQueries, G - g0)) {
              case 1: pv_tile<C, 1>(vp, sl, base, n, dh, e0, sc, dst); break;
              case 2: pv_tile<C, 2>(vp, sl, base, n, dh, e0, sc, dst); break;
              case 3: pv_tile<C, 3>(vp, sl, base, n, dh, e0, sc, dst); break;
              default: pv_tile<C, 4>(vp, sl, base, n, dh, e0, sc, dst); break;
            }
          }
        }
        continue;
      }
      for (int64_t e = 0; e < G * NV; ++e) acc[e] = vzero();
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = start + j;
        const C* __restrict__ vr = vp + (kv * S + sl[pos - start]) * dh;
        if (j + kPrefetchAhead < n) {
          const int64_t ahead = pos + kPrefetchAhead;
          prefetch_row(vp + (kv * S + sl[ahead - start]) * dh, row_bytes);
        }
        for (int64_t e = 0; e < NV; ++e) {
          const vec vx = vload(vr + e * W);
          for (int64_t g = 0; g < G; ++g) acc[g * NV + e] = vfma(vset1(scores[g * kChunk + j]), vx, acc[g * NV + e]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t e = 0; e < NV; ++e) vstore(out_acc + g * dh + e * W, acc[g * NV + e]);
    }
  });
  at::parallel_for(0, D * H, grain == items ? D * H : 16, [&](int64_t j0, int64_t j1) {
    std::vector<float> o(dh);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t d = j / H, h = j % H, kv = h / G, g = h % G;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part_max[((d * KV + kv) * chunks + c) * G + g]);
      std::fill(o.begin(), o.end(), 0.f);
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t item = (d * KV + kv) * chunks + c;
        const float sm = part_sum[item * G + g];
        if (sm == 0.f) continue;
        const float w = std::exp(part_max[item * G + g] - m);
        total += sm * w;
        const float* a = part_acc.data() + (item * G + g) * dh;
        for (int64_t e = 0; e < dh; ++e) o[e] += w * a[e];
      }
      T* dst = op + (d * H + h) * dh;
      for (int64_t e = 0; e < dh; ++e) store(o[e] / total, dst + e);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& rows, const at::Tensor& lens,
                        int64_t page_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "paged_decode: q [D,H,d], caches [KV,S,d]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode: q and the caches share a dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_table.is_contiguous() && rows.is_contiguous() && lens.is_contiguous(),
              "paged_decode: contiguous operands");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && rows.scalar_type() == at::kLong &&
                  lens.scalar_type() == at::kLong, "paged_decode: int64 indices");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(2), "paged_decode: shapes");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "paged_decode: heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) % W == 0, "paged_decode: head size must be a multiple of the vector width");
  TORCH_CHECK(rows.size(0) == q.size(0) && lens.size(0) == q.size(0) && page_size > 0, "paged_decode: rows");
  at::Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  if (q.scalar_type() == at::kFloat) {
    paged_decode_impl<float, float>(q, k_cache, v_cache, block_table, rows, lens, page_size, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    paged_decode_impl<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, block_table, rows, lens, page_size, scale,
                                                     out);
  } else {
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16");
  }
  return out;
}

// paged_decode over int8 caches: codes [KV, S, d] with one bfloat16 scale per row [KV, S]
// (helios.engine.attention.quantize_rows); K/V dequantized on the fly, float32 math as paged_decode's.
at::Tensor paged_decode_int8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& k_scale,
                             const at::Tensor& v_cache, const at::Tensor& v_scale, const at::Tensor& block_table,
                             const at::Tensor& rows, const at::Tensor& lens, int64_t page_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && k_scale.dim() == 2 && v_scale.dim() == 2,
              "paged_decode_int8: q [D,H,d], caches [KV,S,d], scales [KV,S]");
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar &&
                  k_scale.scalar_type() == at::kBFloat16 && v_scale.scalar_type() == at::kBFloat16,
              "paged_decode_int8: int8 caches, bfloat16 scales");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && k_scale.is_contiguous() &&
                  v_scale.is_contiguous() && block_table.is_contiguous() && rows.is_contiguous() &&
                  lens.is_contiguous(),
              "paged_decode_int8: contiguous operands");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && rows.scalar_type() == at::kLong &&
                  lens.scalar_type() == at::kLong, "paged_decode_int8: int64 indices");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(2) &&
                  k_scale.size(0) == k_cache.size(0) && k_scale.size(1) == k_cache.size(1) &&
                  k_scale.sizes() == v_scale.sizes(), "paged_decode_int8: shapes");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "paged_decode_int8: heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) % W == 0, "paged_decode_int8: head size must be a multiple of the vector width");
  TORCH_CHECK(rows.size(0) == q.size(0) && lens.size(0) == q.size(0) && page_size > 0, "paged_decode_int8: rows");
  at::Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  const c10::BFloat16* ks = k_scale.data_ptr<c10::BFloat16>();
  const c10::BFloat16* vs = v_scale.data_ptr<c10::BFloat16>();
  if (q.scalar_type() == at::kFloat) {
    paged_decode_impl<float, int8_t>(q, k_cache, v_cache, block_table, rows, lens, page_size, scale, out, ks, vs);
  } else if (q.scalar_type() == at::kBFloat16) {
    paged_decode_impl<c10::BFloat16, int8_t>(q, k_cache, v_cache, block_table, rows, lens, page_size, scale, out, ks,
                                             vs);
  } else {
    TORCH_CHECK(false, "paged_decode_int8: a float32 or bfloat16 query");
  }
  return out;
}

bool bf16_kernels_supported();  // AVX512-BF16 built in (defined with paged_prefill)

// ---- q8_linear_bf16: the Q8_0 head for bfloat16 activations, by bfloat16 pair dot products ----------
// y = x @ W.T with W[n, k] = scale[n, k / 32] * code[n, k] (the checkpoint's Q8_0 values), x bfloat16.
// A code (an integer of magnitude <= 128) and a bfloat16 activation are both exact in bfloat16, and their
// product is exact in float32, so vdpbf16ps sums exact products in float32 over each 32-column block;
// the block's sum is then scaled once and accumulated in float32 -- the same values as q8_linear's
// float32 path (which scales each code first), in another summation order, at about twice its speed
// once several rows share each weight load. The codes are kept as bfloat16 pairs in 16-output tiles
// ([N/16, K/2, 16, 2], from `pack_q8_bf16`), twice the bytes of the int8 codes: steps of fewer rows than
// `Q8_BF16_ROWS` (models/llama.py) stay on q8_linear.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
template <int R, int T>
inline void q8bf16_tile(const uint16_t* __restrict__ x, int64_t K, const uint32_t* __restrict__ wv,
                        const float* __restrict__ st, int64_t nt0, int64_t blocks, float* __restrict__ y,
                        int64_t N) {
  const int64_t kp = K / 2;  // pairs per row
  __m512 tot[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) tot[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t p = b * 16; p < b * 16 + 16; ++p) {
      __m512bh w[T];
      for (int t = 0; t < T; ++t)
        w[t] = (__m512bh)_mm512_loadu_si512(wv + ((nt0 + t) * kp + p) * 16);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * K + 2 * p, sizeof(pair));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xb, w[t]);
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512 sv = _mm512_loadu_ps(st + ((nt0 + t) * blocks + b) * 16);
      for (int r = 0; r < R; ++r) tot[r][t] = _mm512_fmadd_ps(acc[r][t], sv, tot[r][t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t n = (nt0 + t) * 16;
    const int64_t left = std::min<int64_t>(16, N - n);
    if (left <= 0) break;
    const __mmask16 mask = left == 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * N + n, mask, tot[r][t]);
  }
}

template <int T>
inline void q8bf16_rows(const uint16_t* x, int64_t M, int64_t K, const uint32_t* wv, const float* st, int64_t nt0,
                        int64_t blocks, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) q8bf16_tile<4, T>(x + m * K, K, wv, st, nt0, blocks, y + m * N, N);
  switch (M - m) {
    case 3: q8bf16_tile<3, T>(x + m * K, K, wv, st, nt0, blocks, y + m * N, N); break;
    case 2: q8bf16_tile<2, T>(x + m * K, K, wv, st, nt0, blocks, y + m * N, N); break;
    case 1: q8bf16_tile<1, T>(x + m * K, K, wv, st, nt0, blocks, y + m * N, N); break;
    default: break;
  }
}
#endif

at::Tensor q8_linear_bf16(const at::Tensor& x, const at::Tensor& wv, const at::Tensor& st, int64_t N) {
  TORCH_CHECK(bf16_kernels_supported(), "q8_linear_bf16: built only for CPUs with AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "q8_linear_bf16: bfloat16 x [M, K]");
  TORCH_CHECK(wv.dim() == 4 && wv.scalar_type() == at::kBFloat16 && wv.is_contiguous() && wv.size(2) == 16 &&
                  wv.size(3) == 2, "q8_linear_bf16: codes [N/16, K/2, 16, 2] bfloat16");
  const int64_t M = x.size(0), K = x.size(1), tiles = wv.size(0), blocks = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && wv.size(1) * 2 == K, "q8_linear_bf16: K a multiple of 32, matching the codes");
  TORCH_CHECK(st.dim() == 3 && st.scalar_type() == at::kFloat && st.is_contiguous() && st.size(0) == tiles &&
                  st.size(1) == blocks && st.size(2) == 16, "q8_linear_bf16: scales [N/16, K/32, 16] float32");
  TORCH_CHECK(N > (tiles - 1) * 16 && N <= tiles * 16, "q8_linear_bf16: N must fill the last tile");
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(wv.data_ptr<c10::BFloat16>());
  const float* sp = st.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kT = 3;  // 16-output tiles per work item: 12 block and 12 total accumulators at 4 rows
  const int64_t items = (tiles + kT - 1) / kT;
  if (M > 0)
    at::parallel_for(0, items, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t nt0 = i * kT;
        switch (std::min(kT, tiles - nt0)) {
          case 3: q8bf16_rows<3>(xp, M, K, wp, sp, nt0, blocks, yp, N); break;
          case 2: q8bf16_rows<2>(xp, M, K, wp, sp, nt0, blocks, yp, N); break;
          default: q8bf16_rows<1>(xp, M, K, wp, sp, nt0, blocks, yp, N); break;
        }
      }
    });
#endif
  return y;
}

// ---- paged_prefill: a prefill chunk's causal attention over its context, read in place ----------------
// Query token i of the chunk (position ctx_start + i) attends to positions 0 .. ctx_start + i, whose
// K/V lie in the cache at slots[position]. Flash-attention order: a work item is one kv head and a
// tile of kQTile query tokens (their G query heads share the K/V reads); each key block of kKBlock
// positions is laid out once per item: K as (dim, dim+1) bfloat16 pairs per position for pair dot
// products (vdpbf16ps: the products of bfloat16 values are exact in float32), V widened to float32.
// Scores are float32 with an online softmax (running max and sum per query row); the weighted sum
// of V uses the float32 probabilities (rounding them to bfloat16, as bfloat16 flash attention does,
// moved the default model's near-tie first token). No gather of the history into a contiguous
// copy, no mask tensor. Built only with AVX512-BF16 (bfloat16 caches): elsewhere torch's SDPA is
// as fast as float32 code can be (it is at the FMA roofline).
constexpr int64_t kQTile = 64;
constexpr int64_t kKBlock = 64;

bool bf16_kernels_supported() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// o[r] = o[r] * corr[r] + sum_j p[r][j] * V[j] for R consecutive rows (output rows dh apart, score rows
// kKBlock apart) over the block's first `most` positions; ND float vectors per head row. Compile-time
// sizes keep the R x ND accumulators in registers and share each V load across the R rows.
template <int ND, int R>
inline void prefill_pv(float* __restrict__ o, const float* __restrict__ p, const float* __restrict__ corr,
                       const float* __restrict__ vf, int64_t most, int64_t dh) {
  __m512 a[R][ND];
  for (int r = 0; r < R; ++r) {
    const __m512 cr = _mm512_set1_ps(corr[r]);
    for (int c = 0; c < ND; ++c) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dh + c * 16), cr);
  }
  for (int64_t j = 0; j < most; ++j) {
    __m512 vv[ND];
    for (int c = 0; c < ND; ++c) {
      // Keep the V vector in a register: left to itself the compiler folds the load into each row's
      // FMA (R loads of it instead of one), and the loop became load-bound. (The barrier is on a
      // local: on the array element itself the compiler also stored each vector to the stack.)
      __m512 v = _mm512_loadu_ps(vf + j * dh + c * 16);
      __asm__("" : "+v"(v));
      vv[c] = v;
    }
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * kKBlock + j]);
      for (int c = 0; c < ND; ++c) a[r][c] = _mm512_fmadd_ps(pr, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(o + r * dh + c * 16, a[r][c]);
}

// prefill_pv over rows [0, rows) in groups of R, each group over the positions its last row attends
// to (valid[r], non-decreasing in r: rows go by query token); returns the first row not done.
template <int ND, int R>
inline int64_t prefill_pv_rows(float* o, const float* sc, const float* corr, const float* vf, int64_t rows,
                               const int64_t* valid, int64_t dh) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) prefill_pv<ND, R>(o + r * dh, sc + r * kKBlock, corr + r, vf, valid[r + R - 1], dh);
  return r;
}

// Work item w is query tile w / KV of kv head w % KV. A causal tile's cost grows with the key
// blocks it reads (and a chunk's last tile may hold a single token), so static ranges of items
// leave one thread the expensive ones: with 513 tokens (9 tiles, the last of one token) the kernel
// took 22% longer than with 512. The threads instead take items from a shared counter, the most
// expensive first (longest-processing-time order): the last item to start is among the cheapest.
// Returns the items in that order.
inline std::vector<int64_t> prefill_item_order(int64_t L, int64_t KV, int64_t G, int64_t ctx_start) {
  const int64_t items = KV * ((L + kQTile - 1) / kQTile);
  std::vector<int64_t> order(items), cost(items);
  for (int64_t w = 0; w < items; ++w) {
    const int64_t t0 = (w / KV) * kQTile, t1 = std::min(L, t0 + kQTile);
    const int64_t blocks = (ctx_start + t1 + kKBlock - 1) / kKBlock;
    cost[w] = blocks * ((t1 - t0) * G + kKBlock / 2);  // rows' work + laying out each block's K and V
    order[w] = w;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  return order;
}

void paged_prefill_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* slots, int64_t L,
                        int64_t H, int64_t KV, int64_t S, int64_t dh, int64_t ctx_start, float scale, uint16_t* out) {
  const int64_t G = H / KV;
  const int64_t dp = dh / 2;    // dim pairs
  const int64_t nd = dh / 16;   // float vectors per row of the head dim
  constexpr int64_t NV = kKBlock / 16;
  const std::vector<int64_t> order = prefill_item_order(L, KV, G, ctx_start);
  const int64_t items = static_cast<int64_t>(order.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    const int64_t M = kQTile * G;
    std::vector<uint32_t> kt(dp * kKBlock);
    std::vector<float> vf(kKBlock * dh), o(M * dh), sc(M * kKBlock), mx(M), sm(M), corr(M);
    std::vector<int64_t> vd(M);  // per row: the positions of the current key block it attends to
    std::vector<const uint32_t*> qrow(M);
    for (int64_t k = next.fetch_add(1); k < items; k = next.fetch_add(1)) {
      const int64_t w = order[k];
      const int64_t tile = w / KV;
      const int64_t kh = w % KV, t0 = tile * kQTile, t1 = std::min(L, t0 + kQTile);
      const int64_t rows = (t1 - t0) * G;  // row r: token t0 + r / G, head kh * G + r % G
      for (int64_t r = 0; r < rows; ++r) {
        qrow[r] = reinterpret_cast<const uint32_t*>(q + ((t0 + r / G) * H + kh * G + r % G) * dh);
        mx[r] = -std::numeric_limits<float>::infinity();
        sm[r] = 0.f;
      }
      std::fill(o.begin(), o.begin() + rows * dh, 0.f);
      const int64_t end = ctx_start + t1;  // positions this tile sees at most
      for (int64_t p0 = 0; p0 < end; p0 += kKBlock) {
        const int64_t n = std::min(kKBlock, end - p0);
        for (int64_t j = 0; j < kKBlock; ++j) {
          if (j < n) {
            const int64_t slot = slots[p0 + j];
            const uint32_t* kr = reinterpret_cast<const uint32_t*>(kc + (kh * S + slot) * dh);
            for (int64_t e = 0; e < dp; ++e) kt[e * kKBlock + j] = kr[e];
          } else {
            for (int64_t e = 0; e < dp; ++e) kt[e * kKBlock + j] = 0;
          }
        }
        for (int64_t j = 0; j < n; ++j) {
          const c10::BFloat16* vr = reinterpret_cast<const c10::BFloat16*>(vc + (kh * S + slots[p0 + j]) * dh);
          for (int64_t c = 0; c < nd; ++c) _mm512_storeu_ps(vf.data() + j * dh + c * 16, vload(vr + c * 16));
        }
        const __m512 vscale = _mm512_set1_ps(scale);
        // Four query rows per pass: 16 independent accumulator chains, enough to keep the pair dot
        // products at their throughput rather than their latency (two rows gave 8 chains).
        constexpr int64_t kQK = 4;
        for (int64_t r = 0; r < rows; r += kQK) {
          __m512 a[kQK][NV];
          const uint32_t* qr[kQK];
          for (int64_t i = 0; i < kQK; ++i) {
            qr[i] = qrow[std::min(r + i, rows - 1)];  // past the last row: recompute it, not stored
            for (int64_t c = 0; c < NV; ++c) a[i][c] = _mm512_setzero_ps();
          }
          for (int64_t e = 0; e < dp; ++e) {
            const uint32_t* kr = kt.data() + e * kKBlock;
            __m512bh kv[NV];
            for (int64_t c = 0; c < NV; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kr + c * 16);
            for (int64_t i = 0; i < kQK; ++i) {
              const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[i][e]));
              for (int64_t c = 0; c < NV; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], b, kv[c]);
            }
          }
          for (int64_t i = 0; i < kQK && r + i < rows; ++i)
            for (int64_t c = 0; c < NV; ++c)
              _mm512_storeu_ps(sc.data() + (r + i) * kKBlock + c * 16, _mm512_mul_ps(a[i][c], vscale));
        }
        // Online softmax per row: probabilities in place of the scores (0 past the row's last
        // position), the row's correction of its earlier sum.
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = sc.data() + r * kKBlock;
          const int64_t last = ctx_start + t0 + r / G;  // the last position row r attends to
          const int64_t valid = std::min(n, std::max<int64_t>(last - p0 + 1, 0));
          vd[r] = valid;
          if (valid == 0) {
            corr[r] = 1.f;
            std::fill(sr, sr + kKBlock, 0.f);
            continue;
          }
          for (int64_t j = valid; j < kKBlock; ++j) sr[j] = -std::numeric_limits<float>::infinity();
          __m512 bmv = _mm512_loadu_ps(sr);
          for (int64_t c = 1; c < NV; ++c) bmv = _mm512_max_ps(bmv, _mm512_loadu_ps(sr + c * 16));
          const float m_new = std::max(mx[r], _mm512_reduce_max_ps(bmv));
          corr[r] = std::exp(mx[r] - m_new);
          __m512 tot = _mm512_setzero_ps();
          for (int64_t c = 0; c < NV; ++c) {
            __m512 pv = vexp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + c * 16), _mm512_set1_ps(m_new)));
            const int64_t left = valid - c * 16;  // lanes of this vector the row attends to
            if (left < 16) pv = _mm512_maskz_mov_ps(left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1), pv);
            tot = _mm512_add_ps(tot, pv);
            _mm512_storeu_ps(sr + c * 16, pv);
          }
          sm[r] = sm[r] * corr[r] + _mm512_reduce_add_ps(tot);
          mx[r] = m_new;
        }
        // Weighted sum of V, several rows at a time sharing each V load, accumulators in registers;
        // in the diagonal block a group stops at its last row's last position.
        int64_t r = 0;
        const int64_t* vp = vd.data();
        switch (nd) {
          case 2: r = prefill_pv_rows<2, 4>(o.data(), sc.data(), corr.data(), vf.data(), rows, vp, dh); break;
          case 4: r = prefill_pv_rows<4, 4>(o.data(), sc.data(), corr.data(), vf.data(), rows, vp, dh); break;
          case 6: r = prefill_pv_rows<6, 2>(o.data(), sc.data(), corr.data(), vf.data(), rows, vp, dh); break;
          default: r = prefill_pv_rows<8, 2>(o.data(), sc.data(), corr.data(), vf.data(), rows, vp, dh); break;
        }
        for (; r < rows; ++r) {
          switch (nd) {
            case 2: prefill_pv<2, 1>(o.data() + r * dh, sc.data() + r * kKBlock, corr.data() + r, vf.data(), vd[r], dh); break;
            case 4: prefill_pv<4, 1>(o.data() + r * dh, sc.data() + r * kKBlock, corr.data() + r, vf.data(), vd[r], dh); break;
            case 6: prefill_pv<6, 1>(o.data() + r * dh, sc.data() + r * kKBlock, corr.data() + r, vf.data(), vd[r], dh); break;
            default: prefill_pv<8, 1>(o.data() + r * dh, sc.data() + r * kKBlock, corr.data() + r, vf.data(), vd[r], dh); break;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        c10::BFloat16* dst = reinterpret_cast<c10::BFloat16*>(out) + ((t0 + r / G) * H + kh * G + r % G) * dh;
        const float inv = 1.f / sm[r];
        for (int64_t e = 0; e < dh; ++e) store(o[r * dh + e] * inv, dst + e);
      }
    }
  });
}
#endif

// ---- paged_prefill on AMX tiles ----------------------------------------------------------------------
// The same work items, key blocks, online softmax and results' contract as paged_prefill_bf16, with both
// products on the tile unit: S = Q K^T as TDPBF16PS over the block's K laid out as dim pairs (the kt
// layout above is the B operand as it stands), and O += P V with the probabilities split into two
// bfloat16 terms, P = hi + lo (hi = bf16(p), lo = bf16(p - hi): about 17 significant bits of p where a
// single bfloat16 keeps 8, which moved the default model's near-tie first token), each multiplied with V
// laid out as position pairs. Products of bfloat16 values are exact in float32 and every sum is float32,
// as on the AVX512-BF16 path; the sums go in another order, so the two paths differ by float32
// roundings (tests/unit/test_cpu_kernels.py compares both with float64). Tiles need the process's
// permission for the tile data state (Linux's arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)); where it is
// refused (some virtual machines advertise AMX and refuse it) the AVX512-BF16 path runs.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HELIOS_AMX 1

bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtiledata) != 0) return false;
    unsigned long long permitted = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &permitted) != 0) return false;
    return (permitted & (1ull << kXtiledata)) != 0;
  }();
  return ok;
}

struct alignas(64) AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile register 16 rows of 64 bytes: C 16 x 16 float32, A 16 x 32 bfloat16, B 16 pairs x 16.
inline void amx_configure() {
  AmxConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// dst[c * stride + i] = src[i][c] for a 16 x 16 block of 32-bit values (src[i]: 16 values of row i): pairs
// of rows interleaved (32-bit, then 64-bit unpacks), then the 128-bit lanes gathered across rows.
inline void amx_transpose16(const uint32_t* const* src, uint32_t* dst, int64_t stride) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    const __m512i a = _mm512_loadu_si512(src[2 * i]), b = _mm512_loadu_si512(src[2 * i + 1]);
    t[2 * i] = _mm512_unpacklo_epi32(a, b);
    t[2 * i + 1] = _mm512_unpackhi_epi32(a, b);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c], lane L: rows 4g .. 4g + 3 of column c + 4L
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    _mm512_storeu_si512(dst + c * stride, _mm512_shuffle_i32x4(v0, w0, 0x88));
    _mm512_storeu_si512(dst + (c + 8) * stride, _mm512_shuffle_i32x4(v0, w0, 0xDD));
    _mm512_storeu_si512(dst + (c + 4) * stride, _mm512_shuffle_i32x4(v1, w1, 0x88));
    _mm512_storeu_si512(dst + (c + 12) * stride, _mm512_shuffle_i32x4(v1, w1, 0xDD));
  }
}

// Interleave two rows of n bfloat16 (positions j and j + 1) into n pairs: out[2e] = a[e], out[2e+1] = b[e].
inline void amx_pair_rows(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t n) {
  alignas(64) static constexpr uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
  for (int64_t e = 0; e < n; e += 32) {
    const __m512i va = _mm512_loadu_si512(a + e), vb = _mm512_loadu_si512(b + e);
    _mm512_storeu_si512(out + 2 * e, _mm512_permutex2var_epi16(va, il, vb));
    _mm512_storeu_si512(out + 2 * e + 32, _mm512_permutex2var_epi16(va, ih, vb));
  }
}

// O tiles [c0, c0 + cnt) of one 16-row block += lo V, then += hi V, over a key block (two k-steps of 32
// positions). Consecutive tile products go to different accumulators, so they overlap in the unit.
template <int CNT>
inline void amx_pv(float* o, const uint16_t* ph, const uint16_t* pl, const uint16_t* vt, int64_t dh, int64_t c0) {
  const int64_t os = dh * 4, ps = kKBlock * 2, vs = dh * 4;
  if constexpr (CNT > 0) _tile_loadd(0, o + 16 * c0, os);
  if constexpr (CNT > 1) _tile_loadd(1, o + 16 * (c0 + 1), os);
  if constexpr (CNT > 2) _tile_loadd(2, o + 16 * (c0 + 2), os);
  if constexpr (CNT > 3) _tile_loadd(3, o + 16 * (c0 + 3), os);
  for (int64_t pass = 0; pass < 2; ++pass) {
    for (int64_t s = 0; s < kKBlock / 32; ++s) {
      _tile_loadd(4, (pass == 0 ? pl : ph) + 32 * s, ps);
      const uint16_t* vb = vt + 32 * s * dh + 32 * c0;  // rows: position pairs 16s .., columns: dims 16 c0 ..
      if constexpr (CNT > 0) { _tile_loadd(5, vb, vs); _tile_dpbf16ps(0, 4, 5); }
      if constexpr (CNT > 1) { _tile_loadd(6, vb + 32, vs); _tile_dpbf16ps(1, 4, 6); }
      if constexpr (CNT > 2) { _tile_loadd(7, vb + 64, vs); _tile_dpbf16ps(2, 4, 7); }
      if constexpr (CNT > 3) { _tile_loadd(5, vb + 96, vs); _tile_dpbf16ps(3, 4, 5); }
    }
  }
  if constexpr (CNT > 0) _tile_stored(0, o + 16 * c0, os);
  if constexpr (CNT > 1) _tile_stored(1, o + 16 * (c0 + 1), os);
  if constexpr (CNT > 2) _tile_stored(2, o + 16 * (c0 + 2), os);
  if constexpr (CNT > 3) _tile_stored(3, o + 16 * (c0 + 3), os);
}

void paged_prefill_amx(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* slots, int64_t L,
                       int64_t H, int64_t KV, int64_t S, int64_t dh, int64_t ctx_start, float scale, uint16_t* out) {
  static_assert(kKBlock == 64, "a key block is four 16-column tiles and two 32-position k-steps");
  const int64_t G = H / KV;
  const int64_t dp = dh / 2, nd = dh / 16, ksteps = dh / 32;
  constexpr int64_t NV = kKBlock / 16;
  const std::vector<int64_t> order = prefill_item_order(L, KV, G, ctx_start);  // paged_prefill_bf16's items
  const int64_t items = static_cast<int64_t>(order.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    amx_configure();
    const int64_t M = kQTile * G, Mp = (M + 15) / 16 * 16;
    std::vector<uint16_t> qb(Mp * dh), ph(Mp * kKBlock), pl(Mp * kKBlock), vt(kKBlock * dh);
    std::vector<uint32_t> kt(dp * kKBlock);
    std::vector<float> o(Mp * dh), sc(Mp * kKBlock), mx(Mp), sm(Mp);
    const std::vector<uint16_t> zero_row(dh, 0);
    for (int64_t k = next.fetch_add(1); k < items; k = next.fetch_add(1)) {
      const int64_t w = order[k];
      const int64_t kh = w % KV, t0 = (w / KV) * kQTile, t1 = std::min(L, t0 + kQTile);
      const int64_t rows = (t1 - t0) * G, rp = (rows + 15) / 16 * 16;
      for (int64_t r = 0; r < rows; ++r)  // row r: token t0 + r / G, head kh * G + r % G
        std::memcpy(qb.data() + r * dh, q + ((t0 + r / G) * H + kh * G + r % G) * dh, dh * 2);
      std::fill(mx.begin(), mx.begin() + rp, -std::numeric_limits<float>::infinity());
      std::fill(sm.begin(), sm.begin() + rp, 0.f);
      std::fill(qb.begin() + rows * dh, qb.begin() + rp * dh, 0);  // padding rows (their probabilities are 0)
      std::fill(o.begin(), o.begin() + rp * dh, 0.f);
      const int64_t end = ctx_start + t1;
      for (int64_t p0 = 0; p0 < end; p0 += kKBlock) {
        const int64_t n = std::min(kKBlock, end - p0);
        // K as dim pairs (B of Q K^T), V as position pairs (B of P V); zeros past the block's end.
        for (int64_t j0 = 0; j0 < kKBlock; j0 += 16) {
          const uint32_t* src[16];
          for (int64_t i = 0; i < 16; ++i)
            src[i] = j0 + i < n ? reinterpret_cast<const uint32_t*>(kc + (kh * S + slots[p0 + j0 + i]) * dh)
                                : reinterpret_cast<const uint32_t*>(zero_row.data());
          for (int64_t e0 = 0; e0 < dp; e0 += 16) {
            amx_transpose16(src, kt.data() + e0 * kKBlock + j0, kKBlock);
            for (int64_t i = 0; i < 16; ++i) src[i] += 16;
          }
        }
        for (int64_t j = 0; j < kKBlock; j += 2) {
          const uint16_t* a = j < n ? vc + (kh * S + slots[p0 + j]) * dh : zero_row.data();
          const uint16_t* b = j + 1 < n ? vc + (kh * S + slots[p0 + j + 1]) * dh : zero_row.data();
          amx_pair_rows(a, b, vt.data() + j * dh, dh);
        }
        // Scores of every 16-row block: four 16-position column tiles, ksteps dim steps of 32.
        for (int64_t rb = 0; rb < rp; rb += 16) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t s = 0; s < ksteps; ++s) {
            const uint32_t* kb = kt.data() + 16 * s * kKBlock;
            _tile_loadd(4, qb.data() + rb * dh + 32 * s, dh * 2);
            _tile_loadd(5, kb, kKBlock * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, kb + 16, kKBlock * 4);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, kb + 32, kKBlock * 4);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, kb + 48, kKBlock * 4);
            _tile_dpbf16ps(3, 4, 5);
          }
          float* sb = sc.data() + rb * kKBlock;
          _tile_stored(0, sb, kKBlock * 4);
          _tile_stored(1, sb + 16, kKBlock * 4);
          _tile_stored(2, sb + 32, kKBlock * 4);
          _tile_stored(3, sb + 48, kKBlock * 4);
        }
        // Online softmax, 16 rows at a time (the rows' maxima, corrections and sums as vectors: one
        // transposed reduction each instead of a horizontal one per row); the probabilities written as
        // hi + lo, and each row's output scaled by its correction. The maximum is taken over the raw
        // scores (scale > 0) and the scale applied with the subtraction, (s * scale) - m in one FMA.
        const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        const __m512i himask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
        for (int64_t rb = 0; rb < rp; rb += 16) {
          __mmask16 keep[16][NV];
          __m512 bm[16], tot[16];
          for (int64_t i = 0; i < 16; ++i) {
            const int64_t r = rb + i;
            const int64_t last = ctx_start + t0 + r / G;  // the last position row r attends to
            const int64_t valid = r < rows ? std::min(n, std::max<int64_t>(last - p0 + 1, 0)) : 0;
            const float* sr = sc.data() + r * kKBlock;
            bm[i] = ninf;
            for (int64_t c = 0; c < NV; ++c) {  // lanes past the row's last position take no part
              const int64_t left = valid - c * 16;
              keep[i][c] = left >= 16 ? static_cast<__mmask16>(0xffff)
                           : left <= 0 ? static_cast<__mmask16>(0)
                                       : static_cast<__mmask16>((1u << left) - 1);
              bm[i] = _mm512_mask_max_ps(bm[i], keep[i][c], bm[i], _mm512_loadu_ps(sr + c * 16));
            }
          }
          const __m512 m_old = _mm512_loadu_ps(mx.data() + rb);
          const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(reduce16_max(bm), vscale));
          // exp(m_old - m_new); 1 for rows that have seen no position yet (both -inf)
          const __mmask16 seen = _mm512_cmp_ps_mask(m_new, ninf, _CMP_NEQ_OQ);
          const __m512 corr = _mm512_mask_blend_ps(seen, _mm512_set1_ps(1.f), vexp_nonpositive(_mm512_sub_ps(m_old, m_new)));
          for (int64_t i = 0; i < 16; ++i) {
            const int64_t r = rb + i;
            const float* sr = sc.data() + r * kKBlock;
            uint16_t* hr = ph.data() + r * kKBlock;
            uint16_t* lr = pl.data() + r * kKBlock;
            const __m512 mv = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(i)), m_new);
            tot[i] = _mm512_setzero_ps();
            for (int64_t c = 0; c < NV; ++c) {
              const __m512 pv = _mm512_maskz_mov_ps(
                  keep[i][c], vexp_nonpositive_scalef(_mm512_fmsub_ps(_mm512_loadu_ps(sr + c * 16), vscale, mv)));
              tot[i] = _mm512_add_ps(tot[i], pv);
              // hi: p with its low 16 bits cleared (a bfloat16 value, exact); lo: the rest, rounded
              const __m512 hif = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(pv), himask));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(hr + c * 16), (__m256i)_mm512_cvtneps_pbh(hif));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(lr + c * 16),
                                  (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(pv, hif)));
            }
          }
          _mm512_storeu_ps(sm.data() + rb, _mm512_fmadd_ps(_mm512_loadu_ps(sm.data() + rb), corr, reduce16(tot)));
          _mm512_storeu_ps(mx.data() + rb, m_new);
          const __mmask16 scaled = _mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.f), _CMP_NEQ_OQ);
          if (scaled) {
            alignas(64) float cf[16];
            _mm512_store_ps(cf, corr);
            for (int64_t i = 0; i < 16; ++i) {
              if (!((scaled >> i) & 1)) continue;
              const __m512 cv = _mm512_set1_ps(cf[i]);
              float* orow = o.data() + (rb + i) * dh;
              for (int64_t c = 0; c < nd; ++c) _mm512_storeu_ps(orow + c * 16, _mm512_mul_ps(_mm512_loadu_ps(orow + c * 16), cv));
            }
          }
        }
        for (int64_t rb = 0; rb < rp; rb += 16) {
          float* ob = o.data() + rb * dh;
          const uint16_t* hb = ph.data() + rb * kKBlock;
          const uint16_t* lb = pl.data() + rb * kKBlock;
          for (int64_t c0 = 0; c0 < nd; c0 += 4) {
            switch (std::min<int64_t>(4, nd - c0)) {
              case 4: amx_pv<4>(ob, hb, lb, vt.data(), dh, c0); break;
              case 3: amx_pv<3>(ob, hb, lb, vt.data(), dh, c0); break;
              case 2: amx_pv<2>(ob, hb, lb, vt.data(), dh, c0); break;
              default: amx_pv<1>(ob, hb, lb, vt.data(), dh, c0); break;
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        c10::BFloat16* dst = reinterpret_cast<c10::BFloat16*>(out) + ((t0 + r / G) * H + kh * G + r % G) * dh;
        const float inv = 1.f / sm[r];
        for (int64_t e = 0; e < dh; ++e) store(o[r * dh + e] * inv, dst + e);
      }
    }
    _tile_release();
  });
}
#else
bool amx_permitted() { return false; }
#endif

// 1: paged_prefill runs on AMX tiles where they are built and permitted; 0: the AVX512-BF16 path.
std::atomic<int> prefill_amx_mode{1};

bool prefill_amx_active() {
#ifdef HELIOS_AMX
  return prefill_amx_mode.load() != 0 && amx_permitted();
#else
  return false;
#endif
}

// Turns the AMX prefill path on or off; returns whether paged_prefill now runs on tiles.
bool set_prefill_amx(bool on) {
  prefill_amx_mode.store(on ? 1 : 0);
  return prefill_amx_active();
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slots, int64_t ctx_start, double scale) {
  TORCH_CHECK(bf16_kernels_supported(), "paged_prefill: built only for CPUs with AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "paged_prefill: q [L,H,d], caches [KV,S,d]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "paged_prefill: bfloat16 q and caches");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous(),
              "paged_prefill: contiguous operands");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "paged_prefill: int64 slots");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(2), "paged_prefill: shapes");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "paged_prefill: heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) % 32 == 0 && q.size(2) <= 128, "paged_prefill: head size a multiple of 32, at most 128");
  TORCH_CHECK(ctx_start >= 0 && slots.size(0) >= ctx_start + q.size(0), "paged_prefill: a slot per position");
  const int64_t S = k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < ctx_start + q.size(0); ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < S, "paged_prefill: a slot outside the cache");
  at::Tensor out = at::empty_like(q);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (q.size(0) > 0)
#ifdef HELIOS_AMX
    (prefill_amx_active() ? paged_prefill_amx : paged_prefill_bf16)(
#else
    paged_prefill_bf16(
#endif
                       reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>()),
                       reinterpret_cast<const uint16_t*>(k_cache.data_ptr<c10::BFloat16>()),
                       reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>()), sp, q.size(0), q.size(1),
                       k_cache.size(0), S, q.size(2), ctx_start, static_cast<float>(scale),
                       reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()));
#endif
  return out;
}

// ---- The decoder layer's elementwise operations, one operator each instead of 3-6 torch ops ----
// Math is float32; a bfloat16 result is rounded once (to nearest even). Rows are independent, so
// large batches (prefill) split rows across threads and small ones (decode) run on the caller's.
constexpr int64_t kRowGrain = 32;

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// 1 / sqrt(mean(s^2) + eps) of a row of D floats (the squares summed in vector lanes, then the lanes and
// the tail): the norms' one order.
inline float row_rstd(const float* s, int64_t D, float eps) {
  vec acc = vzero();
  int64_t i = 0;
  for (; i + W <= D; i += W) {
    const vec v = vload(s + i);
    acc = vfma(v, v, acc);
  }
  float ss = vsum(acc);
  for (; i < D; ++i) ss += s[i] * s[i];
  return 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
}

// y = s * rstd * w, each rounded to the dtype: the norms' one product.
template <typename T>
inline void scale_row(const float* s, float rstd, const float* w, int64_t D, T* y) {
  for (int64_t j = 0; j < D; ++j) store(s[j] * rstd * w[j], y + j);
}

// add_rms_norm: s = h + delta (rounded to the dtype, as torch's add is), y = s * rsqrt(mean(s^2) + eps) * w.
template <typename T>
void add_rms_norm_impl(const T* h, const T* delta, const float* w, T* sum_out, T* y, int64_t N, int64_t D,
                       float eps) {
  at::parallel_for(0, N, kRowGrain, [&](int64_t r0, int64_t r1) {
    std::vector<float> s(D);
    for (int64_t r = r0; r < r1; ++r) {
      const T* hr = h + r * D;
      if (delta != nullptr) {
        const T* dr = delta + r * D;
        T* so = sum_out + r * D;
        for (int64_t i = 0; i < D; ++i) {
          store(to_float(hr[i]) + to_float(dr[i]), so + i);
          s[i] = to_float(so[i]);
        }
      } else {
        load_row(hr, s.data(), D);
      }
      scale_row(s.data(), row_rstd(s.data(), D, eps), w, D, y + r * D);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const std::optional<at::Tensor>& delta,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "add_rms_norm: h is a contiguous [N, D]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == h.size(1),
              "add_rms_norm: a float32 weight of D values");
  const bool has_delta = delta.has_value() && delta->defined();
  if (has_delta)
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->scalar_type() == h.scalar_type() && delta->is_contiguous(),
                "add_rms_norm: delta matches h");
  at::Tensor sum = has_delta ? at::empty_like(h) : h;
  at::Tensor y = at::empty_like(h);
  const int64_t N = h.size(0), D = h.size(1);
  if (N == 0) return {sum, y};
  if (h.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(h.data_ptr<float>(), has_delta ? delta->data_ptr<float>() : nullptr,
                             weight.data_ptr<float>(), sum.data_ptr<float>(), y.data_ptr<float>(), N, D,
                             static_cast<float>(eps));
  } else if (h.scalar_type() == at::kBFloat16) {
    add_rms_norm_impl<c10::BFloat16>(h.data_ptr<c10::BFloat16>(),
                                     has_delta ? delta->data_ptr<c10::BFloat16>() : nullptr,
                                     weight.data_ptr<float>(), sum.data_ptr<c10::BFloat16>(),
                                     y.data_ptr<c10::BFloat16>(), N, D, static_cast<float>(eps));
  } else {
    TORCH_CHECK(false, "add_rms_norm: float32 or bfloat16");
  }
  return {sum, y};
}

// rope_: rotate-half RoPE in place on x [T, M, d] (rows may be strided, the last dim contiguous) with
// tables cos/sin [T, d] (sin sign-folded: x' = x * cos + roll(x, d/2) * sin).
template <typename T, typename C>
void rope_impl(T* x, const C* cos, const C* sin, int64_t Tn, int64_t M, int64_t d, int64_t st, int64_t sm,
               const float* norm, float eps) {
  const int64_t half = d / 2;
  at::parallel_for(0, Tn, kRowGrain, [&](int64_t t0, int64_t t1) {
    std::vector<float> v(d), c(d), sn(d);
    for (int64_t t = t0; t < t1; ++t) {
      load_row(cos + t * d, c.data(), d);
      load_row(sin + t * d, sn.data(), d);
      for (int64_t m = 0; m < M; ++m) {
        T* row = x + t * st + m * sm;
        load_row(row, v.data(), d);
        if (norm != nullptr) {  // the row normalized first, rounded to the dtype (qk_norm_rope_)
          scale_row(v.data(), row_rstd(v.data(), d, eps), norm + m * d, d, row);
          load_row(row, v.data(), d);
        }
        for (int64_t j = 0; j < d; ++j) {
          const float rolled = j < half ? v[j + half] : v[j - half];
          store(v[j] * c[j] + rolled * sn[j], row + j);
        }
      }
    }
  });
}

// rope_ and qk_norm_rope_ (``norm`` null: no norm): checks, then rope_impl for x's dtype and the tables'.
at::Tensor rope_dispatch(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const float* norm, float eps,
                         const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, name, ": x is [T, M, d], last dim contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
                  sin.numel() == cos.numel() && cos.scalar_type() == sin.scalar_type(),
              name, ": contiguous tables of T x d values");
  const int64_t Tn = x.size(0), M = x.size(1), d = x.size(2), st = x.stride(0), sm = x.stride(1);
  if (x.numel() == 0) return x;
  const bool f32_tables = cos.scalar_type() == at::kFloat;
  TORCH_CHECK(f32_tables || cos.scalar_type() == x.scalar_type(), name, ": tables are float32 or x's dtype");
  if (x.scalar_type() == at::kFloat) {
    rope_impl<float, float>(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), Tn, M, d, st, sm,
                            norm, eps);
  } else if (x.scalar_type() == at::kBFloat16 && f32_tables) {
    rope_impl<c10::BFloat16, float>(x.data_ptr<c10::BFloat16>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                    Tn, M, d, st, sm, norm, eps);
  } else if (x.scalar_type() == at::kBFloat16) {
    rope_impl<c10::BFloat16, c10::BFloat16>(x.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(),
                                            sin.data_ptr<c10::BFloat16>(), Tn, M, d, st, sm, norm, eps);
  } else {
    TORCH_CHECK(false, name, ": float32 or bfloat16");
  }
  return x;
}

at::Tensor rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_dispatch(x, cos, sin, nullptr, 0.f, "rope_");
}

// qk_norm_rope_: the per-head q/k RMSNorm, then rope_, in place on x [T, M, d] (rows may be strided, the
// last dim contiguous): row m of token t becomes rope(n) for n = x[t, m] * rstd * w[m] rounded to x's
// dtype (w [M, d] float32; rstd and the product add_rms_norm's), the values rms_norm's result then
// rope_ would give.
at::Tensor qk_norm_rope_(at::Tensor x, const at::Tensor& weight, double eps, const at::Tensor& cos,
                         const at::Tensor& sin) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && x.dim() == 3 &&
                  weight.numel() == x.size(1) * x.size(2),
              "qk_norm_rope_: a contiguous float32 weight [M, d]");
  return rope_dispatch(x, cos, sin, weight.data_ptr<float>(), static_cast<float>(eps), "qk_norm_rope_");
}

// silu_mul: y = silu(g) * u for gu = [g | u] ([N, 2I] -> [N, I]). silu(g) = g * t / (t + u') with
// t = exp(min(g, 0)) and u' = exp(min(-g, 0)): the logistic function without overflow on either side.
// The work is split into items of rows by column spans (whole rows from kRowGrain rows on; a decode step's
// few rows by spans of kSiluSpan columns, a multiple of the vector width, so every element takes the same
// vector or scalar path as in a whole row): the same values at any number of threads.
constexpr int64_t kSiluSpan = 1024;
constexpr int64_t kSiluSerial = 16384;  // elements below which one thread does it all (the fork costs more)
template <typename T>
void silu_mul_impl(const T* gu, T* y, int64_t N, int64_t I) {
  const int64_t span = N >= kRowGrain ? I : std::min(I, kSiluSpan), spans = (I + span - 1) / span;
  const int64_t items = N * spans;
  const int64_t grain = N * I < kSiluSerial ? items : (N >= kRowGrain ? kRowGrain : 1);
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> g(span), u(span), o(span);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t r = item / spans, c0 = (item % spans) * span, n = std::min(span, I - c0);
      load_row(gu + r * 2 * I + c0, g.data(), n);
      load_row(gu + r * 2 * I + I + c0, u.data(), n);
      int64_t i = 0;
      for (; i + W <= n; i += W) {
        // sigmoid(g) = t / (t + e) with t = exp(min(g, 0)) and e = exp(min(-g, 0)): one of the two is
        // exp(0) = 1 exactly and the other is x = exp(-|g|), so one exp gives both (never overflows).
        const vec gv = vload(g.data() + i);
        const vec x = vexp_nonpositive(vmin(gv, vsub(vzero(), gv)));
        const vec one = vset1(1.f);
        const vec t = vpick_nonneg(gv, one, x);
        vstore(o.data() + i, vmul(vdiv(vmul(gv, t), vadd(one, x)), vload(u.data() + i)));
      }
      for (; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
      T* yr = y + r * I + c0;
      for (int64_t j = 0; j < n; ++j) store(o[j], yr + j);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "silu_mul: a contiguous [N, 2I]");
  const int64_t N = gu.size(0), I = gu.size(1) / 2;
  at::Tensor y = at::empty({N, I}, gu.options());
  if (N == 0) return y;
  if (gu.scalar_type() == at::kFloat) {
    silu_mul_impl<float>(gu.data_ptr<float>(), y.data_ptr<float>(), N, I);
  } else if (gu.scalar_type() == at::kBFloat16) {
    silu_mul_impl<c10::BFloat16>(gu.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), N, I);
  } else {
    TORCH_CHECK(false, "silu_mul: float32 or bfloat16");
  }
  return y;
}

// cache[:, slots[t]] = x[t] for x [T, kv_heads, d] (any strides between tokens and heads, the head
// dimension contiguous) and a contiguous cache [kv_heads, S, d] of the same dtype: row copies (at one
// decode token index_copy_'s dispatch cost more than the copy). Other layouts take index_copy_.
void write_slots(const at::Tensor& x, at::Tensor& cache, const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 3 && cache.dim() == 3 && x.size(1) == cache.size(0) && x.size(2) == cache.size(2) &&
                  slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kLong,
              "write_kv: k/v [T, kv_heads, d], caches [kv_heads, S, d], one int64 slot per token");
  if (x.scalar_type() != cache.scalar_type() || x.stride(2) != 1 || !cache.is_contiguous() || !slots.is_contiguous()) {
    cache.index_copy_(1, slots, x.transpose(0, 1).to(cache.scalar_type()));
    return;
  }
  const int64_t T = x.size(0), KV = x.size(1), dh = x.size(2), S = cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "write_kv: a slot outside the cache");
  const int64_t bytes = dh * static_cast<int64_t>(x.element_size());
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  const int64_t st = x.stride(0) * x.element_size(), sh = x.stride(1) * x.element_size();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < KV; ++h) std::memcpy(dst + ((h * S + sp[t]) * bytes), src + t * st + h * sh, bytes);
}

// Symmetric int8 codes of x[t, h, :] (float32 or bfloat16, the head dimension contiguous) at
// codes[h, slots[t], :] with their bfloat16 scale at scales[h, slots[t]]: the arithmetic of
// helios.engine.attention.quantize_rows, to the bit (scale = max|x| / 127 in float32, rounded to the
// nearest bfloat16 and up by one step if that fell below; code = round-half-even(x / scale) in float32,
// clamped to -127..127; a zero row: scale 0, codes 0).
template <typename T>
void write_rows_int8(const at::Tensor& x, at::Tensor& codes, at::Tensor& scales, const int64_t* sp) {
  const int64_t T_ = x.size(0), KV = x.size(1), dh = x.size(2), S = codes.size(1);
  const T* src = x.data_ptr<T>();
  int8_t* dst = codes.data_ptr<int8_t>();
  c10::BFloat16* sc = scales.data_ptr<c10::BFloat16>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t h = 0; h < KV; ++h) {
      const T* row = src + t * st + h * sh;
      float amax = 0.f;
      for (int64_t e = 0; e < dh; ++e) amax = std::max(amax, std::fabs(to_float(row[e])));
      const float want = amax / 127.f;
      c10::BFloat16 scale(want);  // to nearest even
      if (to_float(scale) < want) scale.x = static_cast<uint16_t>(scale.x + 1);
      const float sf = to_float(scale);
      const float div = sf > 0.f ? sf : 1.f;
      int8_t* out = dst + (h * S + sp[t]) * dh;
      for (int64_t e = 0; e < dh; ++e) {
        const float q = std::nearbyint(to_float(row[e]) / div);
        out[e] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
      }
      sc[h * S + sp[t]] = scale;
    }
  }
}

void write_slots_int8(const at::Tensor& x, at::Tensor& codes, at::Tensor& scales, const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 3 && codes.dim() == 3 && scales.dim() == 2 && x.size(1) == codes.size(0) &&
                  x.size(2) == codes.size(2) && scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
                  slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kLong,
              "write_kv_int8: k/v [T, kv_heads, d], codes [kv_heads, S, d], scales [kv_heads, S], one int64 slot "
              "per token");
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kBFloat16 && codes.is_contiguous() &&
                  scales.is_contiguous() && slots.is_contiguous(),
              "write_kv_int8: contiguous int8 codes and bfloat16 scales");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < codes.size(1), "write_kv_int8: a slot outside the cache");
  const at::Tensor rows = x.stride(2) == 1 ? x : x.contiguous();
  if (x.scalar_type() == at::kFloat) {
    write_rows_int8<float>(rows, codes, scales, sp);
  } else if (x.scalar_type() == at::kBFloat16) {
    write_rows_int8<c10::BFloat16>(rows, codes, scales, sp);
  } else {
    TORCH_CHECK(false, "write_kv_int8: float32 or bfloat16 rows");
  }
}

void write_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& k_scale,
                   at::Tensor& v_cache, at::Tensor& v_scale, const at::Tensor& slot_mapping) {
  write_slots_int8(k, k_cache, k_scale, slot_mapping);
  write_slots_int8(v, v_cache, v_scale, slot_mapping);
}

// K/V of this step's tokens into the caches at their slots (any step; `write_paged_decode` does it for
// an all-decode one).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  write_slots(k, k_cache, slot_mapping);
  write_slots(v, v_cache, slot_mapping);
}

// K/V of this step's tokens into the cache at their slots, then decode attention over it: an
// all-decode step's attention for one layer (`PagedAttention`, and `decode_layer` below).
at::Tensor write_paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                              at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_table,
                              const at::Tensor& rows, const at::Tensor& lens, int64_t page_size, double scale) {
  write_kv(k, v, k_cache, v_cache, slot_mapping);
  return paged_decode(q.contiguous(), k_cache, v_cache, block_table, rows, lens, page_size, scale);
}

// write_paged_decode for int8 caches: the rows quantized at their slots, then paged_decode_int8.
at::Tensor write_paged_decode_int8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                                   at::Tensor& k_scale, at::Tensor& v_cache, at::Tensor& v_scale,
                                   const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                   const at::Tensor& rows, const at::Tensor& lens, int64_t page_size, double scale) {
  write_kv_int8(k, v, k_cache, k_scale, v_cache, v_scale, slot_mapping);
  return paged_decode_int8(q.contiguous(), k_cache, k_scale, v_cache, v_scale, block_table, rows, lens, page_size,
                           scale);
}

// ---- decode layers: the decoder layers of an all-decode step as one operator ------------------------------
// What `_DecoderLayer.forward` does with the fused kernels, the layer's projections and an all-decode
// step's paged attention, for a run of consecutive layers in one operator: the same operators in the
// same order (so the same results), without the ~20 Python-level calls per layer, which at one decode
// row cost about as much as the layer's attention, nor a dispatch per layer. No q/k/v bias, no q/k
// norm (those models keep the Python path). The projections are torch's int4 weight-only matmul or
// oneDNN's prepacked linear (the weights `quant.pack_onednn` packed), as `quant` would run them.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& sz) {
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16).contiguous(), packed, group, sz);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// quant.dense_matmul with a oneDNN-packed weight: x converted to the weight's dtype and back.
at::Tensor onednn_mm(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const bool convert = x.scalar_type() != packed.scalar_type();
  torch::jit::Stack stack;
  stack.emplace_back((convert ? x.to(packed.scalar_type()) : x).contiguous());
  stack.emplace_back(packed);
  stack.emplace_back(c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  op.callBoxed(&stack);
  at::Tensor y = stack.back().toTensor();
  return convert ? y.to(x.scalar_type()) : y;
}

// One decoder layer of an all-decode step: mm(i, x) projection i (0 qkv, 1 o) of x; ffn(x) the
// feed-forward of the post-attention rows; `qkv_bias` / `qk_norm` (per head) where the layer has them.
// Returns (stream, feed-forward output). `decode_layers` and `KqDecodePlan` run their layers through it.
template <typename MM, typename FFN>
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const MM& mm, const FFN& ffn, const at::Tensor& h, const std::optional<at::Tensor>& delta,
    const at::Tensor& input_norm, const at::Tensor& post_norm, const at::Tensor* qkv_bias, const at::Tensor* qk_norm,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor* k_scale,
    at::Tensor* v_scale, const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& rows,
    const at::Tensor& lens, int64_t page_size, double scale, double eps, int64_t heads, int64_t kv_heads) {
  const int64_t T = h.size(0), dh = k_cache.size(2);
  auto [stream, x] = add_rms_norm(h, delta, input_norm, eps);
  at::Tensor qkv = mm(0, x);
  if (qkv_bias != nullptr) qkv = at::add(qkv, *qkv_bias);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dh, "decode layer: qkv width");
  at::Tensor qk = qkv.narrow(1, 0, (heads + kv_heads) * dh).view({T, heads + kv_heads, dh});
  qk = qk_norm != nullptr ? qk_norm_rope_(qk, *qk_norm, eps, cos, sin) : rope_(qk, cos, sin);
  at::Tensor v = qkv.narrow(1, (heads + kv_heads) * dh, kv_heads * dh).view({T, kv_heads, dh});
  at::Tensor attn = k_scale != nullptr
      ? write_paged_decode_int8(qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads), v, k_cache, *k_scale, v_cache,
                                *v_scale, slot_mapping, block_table, rows, lens, page_size, scale)
      : write_paged_decode(qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads), v, k_cache, v_cache, slot_mapping,
                           block_table, rows, lens, page_size, scale);
  at::Tensor o = mm(1, attn.reshape({T, heads * dh}));
  auto [stream2, x2] = add_rms_norm(stream, o, post_norm, eps);
  return {stream2, ffn(x2)};
}

// Consecutive decoder layers of an all-decode step, each as `decode_layer`, in one operator (one
// dispatch instead of one per layer). `group` > 0: every layer's projections are int4 with that group
// size, `weights` holding (packed, scales_and_zeros) of qkv, o, gate/up and down per layer; `group`
// == 0: they are oneDNN-packed, four weights per layer. `k_scales`/`v_scales`: empty for float caches,
// else one per layer (int8 caches). Returns the last layer's (stream, MLP output).
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& h, const std::optional<at::Tensor>& delta, at::TensorList input_norms,
    at::TensorList post_norms, at::TensorList weights, int64_t group, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList k_caches, at::TensorList v_caches, at::TensorList k_scales, at::TensorList v_scales,
    const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& rows, const at::Tensor& lens,
    int64_t page_size, double scale, double eps, int64_t heads, int64_t kv_heads) {
  const int64_t L = static_cast<int64_t>(input_norms.size());
  const int64_t per = group > 0 ? 8 : 4;
  TORCH_CHECK(L > 0 && static_cast<int64_t>(post_norms.size()) == L && static_cast<int64_t>(k_caches.size()) == L &&
                  static_cast<int64_t>(v_caches.size()) == L && static_cast<int64_t>(weights.size()) == L * per,
              "decode_layers: per layer two norms, a K and a V cache, and ", per, " weights");
  const bool quantized = !k_scales.empty();
  TORCH_CHECK((!quantized || static_cast<int64_t>(k_scales.size()) == L) && k_scales.size() == v_scales.size(),
              "decode_layers: no K/V scales, or a K and a V scale tensor per layer");
  at::Tensor stream = h;
  std::optional<at::Tensor> d = delta;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = &weights[l * per];
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    at::Tensor k_scale = quantized ? k_scales[l] : at::Tensor(), v_scale = quantized ? v_scales[l] : at::Tensor();
    at::Tensor* ks = quantized ? &k_scale : nullptr;
    at::Tensor* vs = quantized ? &v_scale : nullptr;
    std::tuple<at::Tensor, at::Tensor> out;
    if (group > 0) {
      auto mm = [&](int i, const at::Tensor& x) { return int4_mm(x, w[2 * i], group, w[2 * i + 1]); };
      auto mlp = [&](const at::Tensor& x) { return mm(3, silu_mul(mm(2, x))); };
      out = decode_layer(mm, mlp, stream, d, input_norms[l], post_norms[l], nullptr, nullptr, cos, sin, k_cache,
                         v_cache, ks, vs, slot_mapping, block_table, rows, lens, page_size, scale, eps, heads, kv_heads);
    } else {
      auto mm = [&](int i, const at::Tensor& x) { return onednn_mm(x, w[i]); };
      auto mlp = [&](const at::Tensor& x) { return mm(3, silu_mul(mm(2, x))); };
      out = decode_layer(mm, mlp, stream, d, input_norms[l], post_norms[l], nullptr, nullptr, cos, sin, k_cache,
                         v_cache, ks, vs, slot_mapping, block_table, rows, lens, page_size, scale, eps, heads, kv_heads);
    }
    stream = std::get<0>(out);
    d = std::get<1>(out);
  }
  return {stream, *d};
}


// ---- k-quant blocks: GGUF Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 and Q8_0 weights used in their file form ----------
// A weight [N, K] is its GGUF bytes: N rows of K / per blocks of `bytes` bytes each. Every block is read
// as sub-blocks of 32 weights; sub-block c's weight l is w = a * code (+ b), with a per 16 weights and b
// per 32, exactly as gguf.quants.dequantize computes it in float32: a and b are exact products of a
// float16 scale and a small integer (at most 18 significant bits), a * code is exact too (at most 24
// bits), so each weight has at most one rounding (the "+ b" of Q5_1, Q4_K, Q5_K), and an FMA gives the
// same bits as numpy's multiply-then-add. kquant_dequantize writes those values; kquant_linear decodes
// them in registers and accumulates x * w in float32 (see `KqAcc` for the summation order).
constexpr int kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

template <int T> struct KqTraits;
template <> struct KqTraits<kQ5_0> { static constexpr int64_t per = 32, bytes = 22; static constexpr bool affine = false, lanes = true; };
template <> struct KqTraits<kQ5_1> { static constexpr int64_t per = 32, bytes = 24; static constexpr bool affine = true, lanes = false; };
template <> struct KqTraits<kQ8_0> { static constexpr int64_t per = 32, bytes = 34; static constexpr bool affine = false, lanes = false; };
template <> struct KqTraits<kQ4_K> { static constexpr int64_t per = 256, bytes = 144; static constexpr bool affine = true, lanes = true; };
template <> struct KqTraits<kQ5_K> { static constexpr int64_t per = 256, bytes = 176; static constexpr bool affine = true, lanes = false; };
template <> struct KqTraits<kQ6_K> { static constexpr int64_t per = 256, bytes = 210; static constexpr bool affine = false, lanes = false; };

// The lane order of a type's matmul: lane L (0..31) of a sub-block's accumulator takes weight
// kq_lane_weight(type, L) of the sub-block, and the activations are permuted to match once per call.
// Q4_K: weight 4 (L % 8) + L / 8, so that the sub-block's 32 bytes as dwords, shifted right by
// 8 (L / 8), hold lane L's code in their low bits. Q5_0: lanes 0-15 the low nibbles of its 16 code
// bytes, 16-31 the high ones, each half as Q4_K's over 4 dwords: weight 16 (L / 16) + 4 (L % 4) +
// (L % 16) / 4. The other types: weight L.
constexpr int kq_lane_weight(int64_t type, int L) {
  return type == kQ4_K ? 4 * (L % 8) + L / 8 : type == kQ5_0 ? 16 * (L / 16) + 4 * (L % 4) + (L % 16) / 4 : L;
}

inline std::pair<int64_t, int64_t> kq_layout(int64_t type) {
  switch (type) {
    case kQ5_0: return {KqTraits<kQ5_0>::per, KqTraits<kQ5_0>::bytes};
    case kQ5_1: return {KqTraits<kQ5_1>::per, KqTraits<kQ5_1>::bytes};
    case kQ8_0: return {KqTraits<kQ8_0>::per, KqTraits<kQ8_0>::bytes};
    case kQ4_K: return {KqTraits<kQ4_K>::per, KqTraits<kQ4_K>::bytes};
    case kQ5_K: return {KqTraits<kQ5_K>::per, KqTraits<kQ5_K>::bytes};
    case kQ6_K: return {KqTraits<kQ6_K>::per, KqTraits<kQ6_K>::bytes};
    default: TORCH_CHECK(false, "kquant: ggml type ", type, " is not one of Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), "
                         "Q5_K (13), Q6_K (14)");
  }
}

// IEEE half -> float, exact (subnormals included).
inline float half_bits_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;  // mant * 2^-24, exact
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// A float16 field, widened (exact; F16C's conversion where the build has it).
inline float half_to_float(const uint8_t* p) {
#if defined(__F16C__)
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
#else
  return half_bits_to_float(p);
#endif
}

// A block's scales: a[c] for sub-block c's 32 weights (Q6_K: a[s] for weights 16 s .. 16 s + 15) and
// b[c] (the types without an offset leave it unset).
struct KqHeader {
  alignas(32) float a[16];
  alignas(32) float b[8];
};

template <int T>
inline void kq_header(const uint8_t* blk, KqHeader& h) {
  if constexpr (T == kQ8_0 || T == kQ5_0) {
    h.a[0] = half_to_float(blk);
  } else if constexpr (T == kQ5_1) {
    h.a[0] = half_to_float(blk);
    h.b[0] = half_to_float(blk + 2);
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
#if defined(__AVX2__)
    // the 6-bit scales and mins unpacked to bytes with word operations (as ggml does), kept in
    // registers (assembled in memory, the 8-byte loads of 4-byte stores missed store forwarding)
    uint32_t u0, u1, u2;
    std::memcpy(&u0, blk + 4, 4);
    std::memcpy(&u1, blk + 8, 4);
    std::memcpy(&u2, blk + 12, 4);
    constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    const uint64_t scales = (u0 & k1) | static_cast<uint64_t>((u2 & k2) | (((u0 >> 6) & k3) << 4)) << 32;
    const uint64_t mins = (u1 & k1) | static_cast<uint64_t>(((u2 >> 4) & k2) | (((u1 >> 6) & k3) << 4)) << 32;
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(scales))));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(mins))));
    _mm256_store_ps(h.a, _mm256_mul_ps(_mm256_set1_ps(d), sc));       // exact
    _mm256_store_ps(h.b, _mm256_mul_ps(_mm256_set1_ps(-dmin), m));    // exact: -(dmin m); w = a q - dmin m
#else
    const uint8_t* s = blk + 4;
    for (int j = 0; j < 8; ++j) {
      const int sc = j < 4 ? (s[j] & 63) : ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
      const int m = j < 4 ? (s[j + 4] & 63) : ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
      h.a[j] = d * static_cast<float>(sc);        // exact
      h.b[j] = -(dmin * static_cast<float>(m));  // exact; w = a q - dmin m
    }
#endif
  } else {  // Q6_K
    const float d = half_to_float(blk + 208);
#if defined(__AVX2__)
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    const __m256 dv = _mm256_set1_ps(d);
    _mm256_store_ps(h.a, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));  // exact
    _mm256_store_ps(h.a + 8, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
#else
    for (int j = 0; j < 16; ++j) h.a[j] = d * static_cast<float>(static_cast<int8_t>(blk[192 + j]));  // exact
#endif
  }
}

// The 32 codes of sub-block c as int8 (the signed types with their offset applied: Q5_0 q - 16, Q6_K q - 32).
template <int T>
inline void kq_codes_scalar(const uint8_t* blk, int c, int8_t* q) {
  for (int l = 0; l < 32; ++l) {
    int v;
    if constexpr (T == kQ8_0) {
      v = static_cast<int8_t>(blk[2 + l]);
    } else if constexpr (T == kQ5_0 || T == kQ5_1) {
      const uint8_t* qh = blk + (T == kQ5_0 ? 2 : 4);
      const uint8_t* qs = qh + 4;
      const uint32_t hbits = static_cast<uint32_t>(qh[0]) | (static_cast<uint32_t>(qh[1]) << 8) |
                             (static_cast<uint32_t>(qh[2]) << 16) | (static_cast<uint32_t>(qh[3]) << 24);
      const int lo = l < 16 ? (qs[l] & 0xF) : (qs[l - 16] >> 4);
      v = lo | static_cast<int>(((hbits >> l) & 1u) << 4);
      if (T == kQ5_0) v -= 16;
    } else if constexpr (T == kQ4_K) {
      v = (blk[16 + 32 * (c / 2) + l] >> (4 * (c % 2))) & 0xF;
    } else if constexpr (T == kQ5_K) {
      v = ((blk[48 + 32 * (c / 2) + l] >> (4 * (c % 2))) & 0xF) | (((blk[16 + l] >> c) & 1) << 4);
    } else {  // Q6_K
      const int half = c / 4, k = c % 4;
      const int lo = (blk[half * 64 + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0xF;
      const int hi = (blk[128 + half * 32 + l] >> (2 * k)) & 3;
      v = (lo | (hi << 4)) - 32;
    }
    q[l] = static_cast<int8_t>(v);
  }
}

#if defined(__AVX2__)
// bit j of the 32 bits at p -> 0xFF / 0x00 in byte j (ggml's bytes_from_bits_32)
inline __m256i kq_bytes_from_bits(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf),
                                        _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

template <int T>
inline __m256i kq_codes(const uint8_t* blk, int c) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  if constexpr (T == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    const uint8_t* qh = blk + (T == kQ5_0 ? 2 : 4);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 4));
    const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), nib);
    const __m256i v = _mm256_or_si256(lo, _mm256_and_si256(kq_bytes_from_bits(qh), _mm256_set1_epi8(0x10)));
    return T == kQ5_0 ? _mm256_sub_epi8(v, _mm256_set1_epi8(16)) : v;
  } else if constexpr (T == kQ4_K) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * (c / 2)));
    return _mm256_and_si256(c % 2 ? _mm256_srli_epi16(q, 4) : q, nib);
  } else if constexpr (T == kQ5_K) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 48 + 32 * (c / 2)));
    const __m256i lo = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(q, 4) : q, nib);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, c), _mm256_set1_epi8(1)), 4);
    return _mm256_or_si256(lo, hi);
  } else {  // Q6_K
    const int half = c / 4, k = c % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + half * 64 + 32 * (k % 2)));
    const __m256i lo = _mm256_and_si256(k / 2 ? _mm256_srli_epi16(ql, 4) : ql, nib);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + half * 32));
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), _mm256_set1_epi8(3)), 4);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
  }
}
#endif

// 32 float32 lanes (weights or one output's partial sums): 2 x 16 (AVX-512), 4 x 8 (AVX2), 32 scalars.
#if defined(__AVX512F__)
struct Kq32 { __m512 v[2]; };
#elif defined(__AVX2__) && defined(__FMA__)
struct Kq32 { __m256 v[4]; };
#else
struct Kq32 { float v[32]; };
#endif

template <int T>
inline Kq32 kq_weights(const uint8_t* blk, int c, const KqHeader& h) {
  constexpr bool affine = KqTraits<T>::affine;
  const float a0 = T == kQ6_K ? h.a[2 * c] : h.a[c], a1 = T == kQ6_K ? h.a[2 * c + 1] : a0;
  const float b = affine ? h.b[c] : 0.f;
  Kq32 w;
#if defined(__AVX512F__)
  const __m256i q = kq_codes<T>(blk, c);
  const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
  const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
  if constexpr (affine) {
    w.v[0] = _mm512_fmadd_ps(_mm512_set1_ps(a0), q0, _mm512_set1_ps(b));
    w.v[1] = _mm512_fmadd_ps(_mm512_set1_ps(a1), q1, _mm512_set1_ps(b));
  } else {
    w.v[0] = _mm512_mul_ps(_mm512_set1_ps(a0), q0);
    w.v[1] = _mm512_mul_ps(_mm512_set1_ps(a1), q1);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256i q = kq_codes<T>(blk, c);
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int j = 0; j < 4; ++j) {
    const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[j]));
    const __m256 a = _mm256_set1_ps(j < 2 ? a0 : a1);
    w.v[j] = affine ? _mm256_fmadd_ps(a, qf, _mm256_set1_ps(b)) : _mm256_mul_ps(a, qf);
  }
#else
  int8_t q[32];
  kq_codes_scalar<T>(blk, c, q);
  for (int l = 0; l < 32; ++l) {
    const float a = l < 16 ? a0 : a1;
    w.v[l] = affine ? a * static_cast<float>(q[l]) + b : a * static_cast<float>(q[l]);  // a * q is exact
  }
#endif
  return w;
}

// Q5_0 in lane order: lane L's 4 low bits from its code byte (the 16 bytes as 4 dwords, shifted right
// by 8 ((L % 16) / 4), + 4 for lanes 16-31), its fifth bit bit l of qh (l = its weight); w = d (q - 16),
// kq_weights' bits (AVX-512: the 32 values d (q - 16) looked up by the 5-bit code).
inline Kq32 kq_q5_0_lanes(const uint8_t* blk, float d) {
  Kq32 w;
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  const uint8_t* qs = blk + 6;
#if defined(__AVX512F__)
  const __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m512i bits = _mm512_set1_epi32(static_cast<int>(qh));
  // lane i of half h: shift 8 (i / 4) + 4 h of the code dword; the weight's bit of qh rotated to bit 4
  const __m512i sh0 = _mm512_set_epi32(24, 24, 24, 24, 16, 16, 16, 16, 8, 8, 8, 8, 0, 0, 0, 0);
  const __m512i sh1 = _mm512_add_epi32(sh0, _mm512_set1_epi32(4));
  const __m512i rot0 = _mm512_set_epi32(11, 7, 3, 31, 10, 6, 2, 30, 9, 5, 1, 29, 8, 4, 0, 28);
  const __m512i rot1 = _mm512_add_epi32(rot0, _mm512_set1_epi32(16));
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  const __m512i i0 = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(raw, sh0), _mm512_rorv_epi32(bits, rot0), low4, 0xE4);
  const __m512i i1 = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(raw, sh1), _mm512_rorv_epi32(bits, rot1), low4, 0xE4);
  const __m512 dv = _mm512_set1_ps(d);
  const __m512 t0 = _mm512_mul_ps(dv, _mm512_set_ps(-1, -2, -3, -4, -5, -6, -7, -8, -9, -10, -11, -12, -13, -14, -15, -16));
  const __m512 t1 = _mm512_mul_ps(dv, _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  w.v[0] = _mm512_permutex2var_ps(t0, i0, t1);
  w.v[1] = _mm512_permutex2var_ps(t0, i1, t1);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m256i bits = _mm256_set1_epi32(static_cast<int>(qh));
  const __m256 dv = _mm256_set1_ps(d);
  for (int j = 0; j < 4; ++j) {
    alignas(32) int32_t sh[8], at[8];
    for (int i = 0; i < 8; ++i) {
      const int L = 8 * j + i;
      sh[i] = 8 * ((L % 16) / 4) + 4 * (L / 16);
      at[i] = kq_lane_weight(kQ5_0, L);
    }
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(raw, _mm256_load_si256(reinterpret_cast<const __m256i*>(sh))),
                                        _mm256_set1_epi32(0x0F));
    const __m256i hi = _mm256_slli_epi32(
        _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_load_si256(reinterpret_cast<const __m256i*>(at))),
                         _mm256_set1_epi32(1)), 4);
    const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, hi), _mm256_set1_epi32(16));
    w.v[j] = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(q));
  }
#else
  for (int L = 0; L < 32; ++L) {
    const int l = kq_lane_weight(kQ5_0, L);
    const int lo = (qs[l % 16] >> (4 * (l / 16))) & 0xF;
    w.v[L] = d * static_cast<float>((lo | static_cast<int>(((qh >> l) & 1u) << 4)) - 16);
  }
#endif
  return w;
}

// kq_weights for the matmul: the same 32 values, in the lane order of the type (`kq_lane_weight` for
// the types with `lanes`). Q4_K: the sub-block's 32 bytes as 8 dwords; shifted right by 8 j (+ 4 for
// an odd sub-block) their low four bits are the codes of lanes 8 j .. 8 j + 7 (weights 4 i + j);
// AVX-512 looks each code up in the sub-block's 16 values a q + b (vpermps reads the index's low four
// bits), AVX2 masks and converts it. Either way w = fma(a, q, b), kq_weights' bits.
template <int T>
inline Kq32 kq_lane_weights(const uint8_t* blk, int c, const KqHeader& h) {
  if constexpr (!KqTraits<T>::lanes) {
    return kq_weights<T>(blk, c, h);
  } else if constexpr (T == kQ5_0) {
    return kq_q5_0_lanes(blk, h.a[0]);
  } else {
    static_assert(T == kQ4_K, "a type with lanes has its own decode");
    const uint8_t* q = blk + 16 + 32 * (c / 2);
    const int s = 4 * (c % 2);
    const float a = h.a[c], b = h.b[c];
    Kq32 w;
#if defined(__AVX512F__)
    const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    const __m512i sh = _mm512_set1_epi32(s);
    const __m512i base0 = _mm512_set_epi32(8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i base1 = _mm512_set_epi32(24, 24, 24, 24, 24, 24, 24, 24, 16, 16, 16, 16, 16, 16, 16, 16);
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(a), iota, _mm512_set1_ps(b));
    w.v[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(raw, _mm512_add_epi32(base0, sh)), table);
    w.v[1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(raw, _mm512_add_epi32(base1, sh)), table);
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i nib = _mm256_set1_epi32(0xF);
    for (int j = 0; j < 4; ++j) {
      const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(raw, _mm256_set1_epi32(8 * j + s)), nib);
      w.v[j] = _mm256_fmadd_ps(_mm256_set1_ps(a), _mm256_cvtepi32_ps(code), _mm256_set1_ps(b));
    }
#else
    for (int L = 0; L < 32; ++L) w.v[L] = a * static_cast<float>((q[kq_lane_weight(kQ4_K, L)] >> s) & 0xF) + b;
#endif
    return w;
  }
}

inline void kq_zero(Kq32& acc) {
#if defined(__AVX512F__)
  acc.v[0] = acc.v[1] = _mm512_setzero_ps();
#elif defined(__AVX2__) && defined(__FMA__)
  for (auto& v : acc.v) v = _mm256_setzero_ps();
#else
  for (auto& v : acc.v) v = 0.f;
#endif
}

inline void kq_store(const Kq32& w, float* out) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(out, w.v[0]);
  _mm512_storeu_ps(out + 16, w.v[1]);
#elif defined(__AVX2__) && defined(__FMA__)
  for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + 8 * j, w.v[j]);
#else
  for (int l = 0; l < 32; ++l) out[l] = w.v[l];
#endif
}

// KqAcc: lane l (0..31) of an output's accumulator takes x[k] * w[k] for the k of lane l (k = 32 s + the
// weight kq_lane_weight gives for lane l, over the sub-blocks s; k = l (mod 32) for the types without
// `lanes`), in increasing k, each by a fused multiply-add (one rounding per step; the scalar build, without FMA,
// rounds the product too). The 32 lanes are then summed by a fixed tree: p[l] + p[l + 16], then + 8,
// + 4, + 2, + 1 (lane 0 holds the result). AVX-512 and AVX2 builds give the same bits.
inline void kq_fmav(Kq32& acc, const Kq32& w, const Kq32& x) {
#if defined(__AVX512F__)
  acc.v[0] = _mm512_fmadd_ps(w.v[0], x.v[0], acc.v[0]);
  acc.v[1] = _mm512_fmadd_ps(w.v[1], x.v[1], acc.v[1]);
#elif defined(__AVX2__) && defined(__FMA__)
  for (int j = 0; j < 4; ++j) acc.v[j] = _mm256_fmadd_ps(w.v[j], x.v[j], acc.v[j]);
#else
  for (int l = 0; l < 32; ++l) {
#if defined(__FMA__)
    acc.v[l] = std::fma(w.v[l], x.v[l], acc.v[l]);
#else
    acc.v[l] = acc.v[l] + w.v[l] * x.v[l];
#endif
  }
#endif
}

#if defined(__AVX2__)
// The sum of 8 lanes by the fixed tree: l + 4, + 2, + 1.
inline float kq_tree8(__m256 r) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));  // + 4
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                          // + 2
  s = _mm_add_ss(s, _mm_movehdup_ps(s));                                           // + 1
  return _mm_cvtss_f32(s);
}
#endif
#if defined(__AVX512F__)
// The sum of 16 lanes by the fixed tree: l + 8, then kq_tree8.
inline float kq_tree16(__m512 q) {
  return kq_tree8(_mm256_add_ps(_mm512_castps512_ps256(q), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(q), 1))));
}
#endif

inline float kq_sum(const Kq32& acc) {
#if defined(__AVX512F__)
  return kq_tree16(_mm512_add_ps(acc.v[0], acc.v[1]));  // l + 16, then the tree
#elif defined(__AVX2__) && defined(__FMA__)
  return kq_tree8(_mm256_add_ps(_mm256_add_ps(acc.v[0], acc.v[2]), _mm256_add_ps(acc.v[1], acc.v[3])));  // + 16, + 8
#else
  float p[32];
  for (int l = 0; l < 32; ++l) p[l] = acc.v[l];
  for (int width = 16; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) p[l] = p[l] + p[l + width];
  return p[0];
#endif
}

#ifndef HELIOS_KQ_TILE
#define HELIOS_KQ_TILE 5
#endif
#ifndef HELIOS_KQ_COLS
#define HELIOS_KQ_COLS 2
#endif
// A register tile is MT activation rows x NT weight rows: each of the NT weight sub-blocks is decoded
// once per tile and each 32 activations loaded once, for MT x NT outputs' accumulators (AVX-512: 5 x 2
// tiles, 20 of the 32 zmm registers; AVX2: 2 x 1, 8 of the 16 ymm). Five rows, not four: a speculative
// verification of 4 drafts is 5 rows, which a 4-row tile ran as a tile and a 1-row pass, decoding the
// weights twice (2026-12-02, Q4_K 8960 x 1536, 1 thread: 5 rows 1.58-1.76 ms as 4 + 1, 1.15-1.41 ms
// as one tile; 4 rows 0.92-1.02 ms either way).
#if defined(__AVX512F__)
constexpr int kKqTile = HELIOS_KQ_TILE;  // activation rows of a tile
constexpr int kKqCols = HELIOS_KQ_COLS;  // weight rows of a tile
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kKqTile = 2;
constexpr int kKqCols = 1;
#else
constexpr int kKqTile = 4;
constexpr int kKqCols = 1;
#endif
#ifndef HELIOS_KQ_PANEL
#define HELIOS_KQ_PANEL 16384
#endif
// Steps of kKqTile + 1 .. kKqWideTile rows run as one tile of that many rows against single weight
// rows (AVX-512: 8 x 1 is 16 accumulators), each weight decoded once for all of them instead of once
// per tile (8 rows as 5 + 3 decoded every weight twice).
#if defined(__AVX512F__)
constexpr int kKqWideTile = 8;
#else
constexpr int kKqWideTile = kKqTile;
#endif
constexpr int64_t kKqPanel = HELIOS_KQ_PANEL;  // bytes of a tile's activations (one column chunk) kept in L1
#ifndef HELIOS_KQ_GROUP
#define HELIOS_KQ_GROUP 786432
#endif
constexpr int64_t kKqGroupBytes = HELIOS_KQ_GROUP;  // bytes of activations (rows x K) a group keeps in L2
#ifndef HELIOS_KQ_ROWS
#define HELIOS_KQ_ROWS 16
#endif
#ifndef HELIOS_KQ_PF
#define HELIOS_KQ_PF 4
#endif
// weight rows ahead that every tile prefetches (one weight row too: without it a decode GEMV of one
// row read from memory ran at 3.5 GB/s, with it 8.9; Q5_0 4864 x 896, 1 thread, scripts/bench_kernels.py)
constexpr int64_t kKqAhead = HELIOS_KQ_PF;
constexpr int64_t kKqRowBlock = HELIOS_KQ_ROWS;  // weight rows read from memory once for all tiles of rows

inline void kq_load(Kq32& acc, const float* p) {
#if defined(__AVX512F__)
  acc.v[0] = _mm512_loadu_ps(p);
  acc.v[1] = _mm512_loadu_ps(p + 16);
#elif defined(__AVX2__) && defined(__FMA__)
  for (int j = 0; j < 4; ++j) acc.v[j] = _mm256_loadu_ps(p + 8 * j);
#else
  for (int l = 0; l < 32; ++l) acc.v[l] = p[l];
#endif
}

// The headers of block b of weight rows 0 .. NT - 1 (w at row 0, row stride rb), prefetching the same
// block `ahead` rows further on (none at 0).
template <int T, int NT>
__attribute__((always_inline)) inline void kq_headers_ahead(const uint8_t* w, int64_t rb, int64_t b, int64_t ahead,
                                                            KqHeader (&h)[NT]) {
  constexpr int64_t bytes = KqTraits<T>::bytes;
  _Pragma("GCC unroll 8")
  for (int j = 0; j < NT; ++j) {
    if (ahead > 0) {
      const char* next = reinterpret_cast<const char*>(w + (j + ahead) * rb + b * bytes);
      for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
    }
    kq_header<T>(w + j * rb + b * bytes, h[j]);
  }
}

// kq_headers_ahead kKqAhead rows on (the float32 path's compile-time distance).
template <int T, int NT>
__attribute__((always_inline)) inline void kq_headers(const uint8_t* w, int64_t rb, int64_t b, KqHeader (&h)[NT]) {
  kq_headers_ahead<T>(w, rb, b, kKqAhead, h);
}

// One register tile over blocks [b0, b1): acc[j][i] += x row i . weight row j, where x (row stride K)
// starts at the tile's first row and w (row stride rb bytes) at its first weight row.
template <int T, int MT, int NT>
__attribute__((always_inline)) inline void kq_micro(const float* __restrict__ x, const uint8_t* __restrict__ w, int64_t rb, int64_t K, int64_t b0,
                     int64_t b1, Kq32 (&acc)[NT][MT]) {
  constexpr int64_t per = KqTraits<T>::per, bytes = KqTraits<T>::bytes;
  constexpr int subs = static_cast<int>(per / 32);
  KqHeader h[NT];
  for (int64_t b = b0; b < b1; ++b) {
    kq_headers<T>(w, rb, b, h);
    for (int c = 0; c < subs; ++c) {
      Kq32 wv[NT];
      _Pragma("GCC unroll 8")
      for (int j = 0; j < NT; ++j) wv[j] = kq_lane_weights<T>(w + j * rb + b * bytes, c, h[j]);
      const float* xb = x + b * per + 32 * c;
      _Pragma("GCC unroll 8")
      for (int i = 0; i < MT; ++i) {
        Kq32 xv;
        kq_load(xv, xb + i * K);
        _Pragma("GCC unroll 8")
        for (int j = 0; j < NT; ++j) kq_fmav(acc[j][i], wv[j], xv);
      }
    }
  }
}

// Outputs y[i * N + n + j] (i < MT, j < NT) over column blocks [b0, b1) of nb: started from zero at
// b0 = 0 or else from their parked lane sums (pk + j * ps + 32 i), summed at b1 = nb or else parked.
template <int T, int MT, int NT>
inline void kq_out(const float* x, const uint8_t* wp, float* y, int64_t n, int64_t K, int64_t N, int64_t b0,
                   int64_t b1, int64_t nb, float* pk, int64_t ps) {
  const int64_t rb = nb * KqTraits<T>::bytes;
  Kq32 acc[NT][MT];
  _Pragma("GCC unroll 8")
  for (int j = 0; j < NT; ++j)
    _Pragma("GCC unroll 8")
    for (int i = 0; i < MT; ++i) {
      if (b0 == 0) kq_zero(acc[j][i]); else kq_load(acc[j][i], pk + j * ps + 32 * i);
    }
  kq_micro<T, MT, NT>(x, wp + n * rb, rb, K, b0, b1, acc);
  _Pragma("GCC unroll 8")
  for (int j = 0; j < NT; ++j)
    _Pragma("GCC unroll 8")
    for (int i = 0; i < MT; ++i) {
      if (b1 == nb) y[i * N + n + j] = kq_sum(acc[j][i]); else kq_store(acc[j][i], pk + j * ps + 32 * i);
    }
}

// Rows [0, MT) of x against weight rows [r0, r1), column blocks [b0, b1): tiles of kKqCols weight rows,
// then single rows. The parked lane sums of weight row n are at pk + (n - r0) * ps.
template <int T, int MT>
inline void kq_rows(const float* x, const uint8_t* wp, float* y, int64_t r0, int64_t r1, int64_t K, int64_t N,
                    int64_t b0, int64_t b1, int64_t nb, float* pk, int64_t ps) {
  // Single weight rows for 1-3 activation rows (faster there), except Q6_K and Q4_K, whose decode
  // gains from two weight rows in flight even for one activation row (8960 x 1536 ... 1536 x 8960,
  // 1 thread: Q6_K 1 row 0.83 ms against 1.53 ms; Q4_K 8960 x 1536 1.02-1.09 ms against 1.26 ms).
  constexpr int NT = MT > kKqTile ? 1 : MT >= 4 || T == kQ6_K || T == kQ4_K ? kKqCols : 1;
  int64_t n = r0;
  for (; n + NT <= r1; n += NT) kq_out<T, MT, NT>(x, wp, y, n, K, N, b0, b1, nb, pk + (n - r0) * ps, ps);
  if constexpr (NT > 1) {
    for (; n < r1; ++n) kq_out<T, MT, 1>(x, wp, y, n, K, N, b0, b1, nb, pk + (n - r0) * ps, ps);
  }
}

// The last M < kKqTile rows: one tile of exactly M rows.
template <int T, int MT>
inline void kq_tail(int64_t M, const float* x, const uint8_t* wp, float* y, int64_t r0, int64_t r1, int64_t K,
                    int64_t N, int64_t b0, int64_t b1, int64_t nb, float* pk, int64_t ps) {
  if constexpr (MT > 0) {
    if (M == MT) kq_rows<T, MT>(x, wp, y, r0, r1, K, N, b0, b1, nb, pk, ps);
    else kq_tail<T, MT - 1>(M, x, wp, y, r0, r1, K, N, b0, b1, nb, pk, ps);
  }
}

// Each thread takes a range of output rows, kKqRowBlock weight rows at a time: the block is read from
// memory once and then stays in L1/L2 while every tile of activation rows passes over it (activation
// rows in groups whose x stays in L2: more rows than that, a group at a time). Long rows of several
// tiles are taken in column chunks of `bpc` blocks so that a tile's chunk of x stays in L1 across the
// block's weight rows; between chunks each output's 32 lane sums are parked (exactly: the summation
// order is the one the `KqAcc` comment states, whatever the tiling and chunking).
template <int T>
void kq_linear_range(const float* xp, const uint8_t* wp, float* yp, int64_t M, int64_t K, int64_t N, int64_t n0,
                     int64_t n1) {
  constexpr int64_t per = KqTraits<T>::per;
  const int64_t nb = K / per;
  const int64_t bpc = M <= kKqTile || kKqTile * K * 4 <= kKqPanel ? nb
                                                                   : std::max<int64_t>(1, kKqPanel / (4 * kKqTile * per));
  const int64_t group = std::max<int64_t>(kKqTile, kKqGroupBytes / (4 * K) / kKqTile * kKqTile);
  const int64_t ps = std::min(M, group) * 32;  // parked floats per weight row
  std::vector<float> park(bpc < nb ? static_cast<size_t>(kKqRowBlock * ps) : 0);
  for (int64_t g0 = 0; g0 < M; g0 += group) {
    const int64_t g1 = std::min(M, g0 + group);
    for (int64_t r0 = n0; r0 < n1; r0 += kKqRowBlock) {
      const int64_t r1 = std::min(n1, r0 + kKqRowBlock);
      for (int64_t b0 = 0; b0 < nb; b0 += bpc) {
        const int64_t b1 = std::min(nb, b0 + bpc);
        int64_t m0 = g0;
        if (g1 - g0 > kKqTile && g1 - g0 <= kKqWideTile) {  // one tile of single weight rows
          kq_tail<T, kKqWideTile>(g1 - g0, xp + g0 * K, wp, yp + g0 * N, r0, r1, K, N, b0, b1, nb, park.data(), ps);
          continue;
        }
        for (; m0 + kKqTile <= g1; m0 += kKqTile)
          kq_rows<T, kKqTile>(xp + m0 * K, wp, yp + m0 * N, r0, r1, K, N, b0, b1, nb, park.data() + (m0 - g0) * 32, ps);
        kq_tail<T, kKqTile - 1>(g1 - m0, xp + m0 * K, wp, yp + m0 * N, r0, r1, K, N, b0, b1, nb,
                                park.data() + (m0 - g0) * 32, ps);
      }
    }
  }
}

inline int64_t kq_grain(int64_t K) { return std::max<int64_t>(kKqRowBlock, 32768 / K); }

template <int T>
void kq_linear_impl(const float* xp, const uint8_t* wp, float* yp, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N, kq_grain(K), [&](int64_t n0, int64_t n1) { kq_linear_range<T>(xp, wp, yp, M, K, N, n0, n1); });
}

// Groups of activation rows, each against its own weight (one expert's): rows [off[g], off[g + 1]) of x
// times W_g^T into the same rows of y. One parallel region over (group, weight-row range) units, so the
// experts a step chose run as one operator; every output is kq_linear_range's, the same bits as
// kquant_linear on the group alone.
// range(g, n0, n1) for every nonempty group g and weight-row range [n0, n1) of kq_grain(K) rows, in one
// parallel region.
template <typename F>
void kq_for_units(const std::vector<int64_t>& off, int64_t K, int64_t N, F&& range) {
  const int64_t grain = kq_grain(K);
  std::vector<std::array<int64_t, 3>> units;  // (group, n0, n1)
  for (size_t g = 0; g + 1 < off.size(); ++g) {
    if (off[g + 1] == off[g]) continue;
    for (int64_t n0 = 0; n0 < N; n0 += grain) units.push_back({static_cast<int64_t>(g), n0, std::min(N, n0 + grain)});
  }
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) range(units[u][0], units[u][1], units[u][2]);
  });
}

template <int T>
void kq_grouped_impl(const float* xp, const std::vector<const uint8_t*>& wps, const std::vector<int64_t>& off,
                     float* yp, int64_t K, int64_t N) {
  kq_for_units(off, K, N, [&](int64_t g, int64_t n0, int64_t n1) {
    kq_linear_range<T>(xp + off[g] * K, wps[g], yp + off[g] * N, off[g + 1] - off[g], K, N, n0, n1);
  });
}

// ---- Q6_K times bfloat16 activations by pair dot products (kqb_*) ---------------------------------------
// Where the build has AVX512-BF16 (and AVX512-BW), bfloat16 x against Q6_K blocks runs without widening x
// or decoding the weights to float32: each sub-block's 32 codes q - 32 (integers in -32..31, exact in
// bfloat16) are looked up as bfloat16 words, multiplied with x's 32 values in pairs, and each 16-weight
// group's scale a (d times its 8-bit scale, exact) is applied once to those pair sums:
// y = sum_c sum_i a_c(i) S_c,i (w = a (q - 32), gguf's value, exactly). The order (the contract;
// `kquant_linear`'s docstring), with subnormal inputs and results flushed to zero (vdpbf16ps's rule;
// MXCSR DAZ/FTZ for the rest):
//   - S_c,i (lane i = 0..15 of sub-block c) = fl(x_{2i+1} q_{2i+1} + x_{2i} q_{2i}) (both products exact);
//   - A_i = fma(S_c,i, a_c(i), A_i) over the sub-blocks in order (a_c(i): the scale of lane i's weights);
//   - y = A_0 + ... + A_15 by the tree that pairs lane l with l + 8, then + 4, + 2, + 1.
// One activation row computes S with vdpbf16ps; more rows compute the same S as fma(x odd, q odd, x even
// * q even) on float32 lanes (vdpbf16ps issues at half the rate of an FMA on the machines measured, and
// each row would pay it): the same bits at any number of rows, tiles and threads. On the machine of
// 2026-12-05 (1 thread, 1,536 x 8,960 from memory) this took Q6_K from 93-99 to 69-73 ps a weight at one
// row and 102 to 81 at two, even at 3-5 rows; Q4_K, whose float32 decode is one table lookup, gained only
// at one row (66 -> 52) and lost 10-20% at 2-7 rows (a row costs three operations a sub-block here
// against two), so the other types keep the float32 path (`kq_linear_impl`), as do float32 x and builds
// without AVX512-BF16.
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HELIOS_KQB 1
std::atomic<bool> g_kqb_on{true};
// Whether rows past the first compute S with vdpbf16ps too (one per row and sub-block, against the float32
// lanes' multiply and FMA): for Q6_K the same values (S is rounded once either way), so the choice is
// speed alone; Q4_K, Q5_K and Q5_0 take the pair dot path only so. On by default on AMD, whose Zen 4 / Zen 5
// cores issue vdpbf16ps at an FMA's rate (2026-12-06, a Zen 5 VM, 2 threads, ps a weight at 1 / 5 / 6
// rows: Q6_K 1,536 x 8,960 16.0 / 33.8 / 67.8 -> 16.0 / 26.1 / 29.0; Q4_K 17,920 x 1,536 on the float32
// path 17.2 / 33.1 / 48.8, by pair dot products 11.4 / 24.7 / 28.5); off on Intel, where it issues at
// half that rate (and Q4_K's pair form lost 10-20% at 2-7 rows, the float32 lanes computing S).
std::atomic<bool> g_kqb_dp_rows{[] {
  __builtin_cpu_init();  // a static initializer may run before libgcc's own (GCC's note on __builtin_cpu_is)
  return __builtin_cpu_is("amd") != 0;
}()};

// bfloat16 words of the integers i - 32 (lo) and i (hi), i = 0..31: the 64-entry table of q - 32.
struct KqbTabs {
  alignas(64) uint16_t lo[32], hi[32], mid[32];  // mid: i - 16 (Q5_0's codes)
  alignas(64) uint16_t nib[32];  // i mod 16: a byte's low nibble looked up without masking its high one
  alignas(64) uint16_t sh[32];  // 0 for words 0-15, 4 for 16-31: the low then the high nibbles (kqb_dot2's pairs)
};
inline uint16_t kqb_bf16_of_int(int v) {
  const float f = static_cast<float>(v);  // a small integer: exact in bfloat16
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>(b >> 16);
}
inline const KqbTabs& kqb_tabs() {
  static const KqbTabs tabs = [] {
    KqbTabs t{};
    for (int i = 0; i < 32; ++i) {
      t.lo[i] = kqb_bf16_of_int(i - 32);
      t.hi[i] = kqb_bf16_of_int(i);
      t.mid[i] = kqb_bf16_of_int(i - 16);
      t.nib[i] = kqb_bf16_of_int(i % 16);
      t.sh[i] = i < 16 ? 0 : 4;
    }
    return t;
  }();
  return tabs;
}

// The 4 sub-blocks of half g (0, 1) of a Q6_K block as bfloat16 words q - 32, weights in order:
// sub-block k's codes are the low (k < 2) or high nibbles of ql[64 g + 32 (k % 2) + l] and bits 2k, 2k + 1
// of qh[32 g + l], moved to bits 4-5 of a 6-bit index into the 64-word table.
__attribute__((always_inline)) inline void kqb_codes(const uint8_t* blk, int g, __m512i* out, __m512i tlo, __m512i thi) {
  const __m512i lo4 = _mm512_set1_epi16(0x000F);
  const uint8_t* ql = blk + 64 * g;
  const __m512i z0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql)));
  const __m512i z1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32)));
  const __m512i zh = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * g)));
  // ternary logic 0xE4: bits of the first operand where the mask (0x000F) is set, else of the second
  out[0] = _mm512_permutex2var_epi16(tlo, _mm512_ternarylogic_epi32(z0, _mm512_slli_epi16(zh, 4), lo4, 0xE4), thi);
  out[1] = _mm512_permutex2var_epi16(tlo, _mm512_ternarylogic_epi32(z1, _mm512_slli_epi16(zh, 2), lo4, 0xE4), thi);
  out[2] = _mm512_permutex2var_epi16(tlo, _mm512_ternarylogic_epi32(_mm512_srli_epi16(z0, 4), zh, lo4, 0xE4), thi);
  out[3] = _mm512_permutex2var_epi16(tlo, _mm512_ternarylogic_epi32(_mm512_srli_epi16(z1, 4), _mm512_srli_epi16(zh, 2),
                                                                   lo4, 0xE4), thi);
}

// Subnormal inputs and results flushed to zero (MXCSR DAZ and FTZ) while a thread runs kqb_range, as
// vdpbf16ps treats them, so that its pair sums and the float32 lanes' give the same bits.
struct KqbFlush {
  unsigned saved;
  KqbFlush() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~KqbFlush() { _mm_setcsr(saved); }
};

// bfloat16 rows x [M, K] widened to float32 with each 32 columns' even-indexed values first, then the odd
// ones (the operand of the float32 lanes, for M > 1 where the rows do not take vdpbf16ps); empty otherwise.
at::Tensor kqb_widened(const at::Tensor& xb) {
  const int64_t M = xb.size(0), K = xb.size(1);
  const bool lanes = M > 1 && !g_kqb_dp_rows.load(std::memory_order_relaxed);
  at::Tensor xf = at::empty({lanes ? M : 0, K}, xb.options().dtype(at::kFloat));
  if (lanes) {
    const auto* x = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
    float* out = xf.data_ptr<float>();
    for (int64_t i = 0; i < M * K / 32; ++i) {
      const __m512i v = _mm512_loadu_si512(x + 32 * i);
      _mm512_storeu_si512(out + 32 * i, _mm512_slli_epi32(v, 16));
      _mm512_storeu_si512(out + 32 * i + 16, _mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
  }
  return xf;
}

#ifndef HELIOS_KQB_COLS
#define HELIOS_KQB_COLS 2
#endif
constexpr int kKqbTile = 8;  // activation rows of a tile at most
constexpr int kKqbCols = HELIOS_KQB_COLS;  // weight rows of a tile for tiles of up to 5 activation rows

#ifndef HELIOS_KQB_PF_BYTES
#define HELIOS_KQB_PF_BYTES 16384
#endif
#ifndef HELIOS_KQB_PF_ROWS
#define HELIOS_KQB_PF_ROWS 2
#endif
// The weight rows ahead that the pair dot paths prefetch at up to HELIOS_KQB_PF_ROWS activation rows:
// about HELIOS_KQB_PF_BYTES of them, 4 to 32 rows (more rows keep kKqAhead). Their decode is cheap enough
// that one row waits on memory: 2026-12-06, a Zen 5 VM, 2 threads, from memory, Q4_K 17,920 x 1,536 at
// one row 14.6-14.9 -> 11.3-11.7 ps a weight; the 1.5B's one-row step 27.2-27.5 -> 23.9 ms (4 rows ahead,
// 3.5 KB, against 16 KB; 8-24 KB alike; at 5 rows 16 KB lost 2%).
inline int64_t kqb_ahead(int64_t rb) {
  return std::min<int64_t>(32, std::max<int64_t>(4, HELIOS_KQB_PF_BYTES / rb));
}

// 32 bfloat16 words as vdpbf16ps's operand, loaded in its own vector mode (through an __m512i the compiler
// copied some rows' operands through the stack)
typedef short kqb_bh_u __attribute__((vector_size(64), may_alias, aligned(2)));
__attribute__((always_inline)) inline __m512bh kqb_load_bh(const uint16_t* p) {
  return *reinterpret_cast<const kqb_bh_u*>(p);
}

// A zero accumulator for a product's first vdpbf16ps, by the zeroing idiom (no execution unit): from
// _mm512_setzero_ps the compiler copied one zero register per product, a vector move each (Q4_K 17,920 x
// 1,536 at 7 / 8 rows: 38.1 / 35.3 -> 28.1 / 33.9 ps a weight, with kqb_load_bh).
__attribute__((always_inline)) inline __m512 kqb_zero_ps() {
  __m512 z;
  asm volatile("vpxord %0, %0, %0" : "=v"(z));
  return z;
}

// acc[j][i] += sc[j] * (the pair sums of codes[j] and x's row i: 32 columns, rows K apart), by vdpbf16ps.
template <int NT, int MT>
__attribute__((always_inline)) inline void kqb_dot(__m512 (&acc)[NT][MT], const __m512i (&codes)[NT],
                                                   const __m512 (&sc)[NT], const uint16_t* x, int64_t K) {
  _Pragma("GCC unroll 8")
  for (int i = 0; i < MT; ++i) {
    const __m512bh xv = kqb_load_bh(x + i * K);
    _Pragma("GCC unroll 8")
    for (int j = 0; j < NT; ++j)
      acc[j][i] = _mm512_fmadd_ps(_mm512_dpbf16_ps(kqb_zero_ps(), (__m512bh)codes[j], xv), sc[j], acc[j][i]);
  }
}

// acc[j][i] += sc[j] * (ca[j]'s pair sums with x's row i at x, then cb[j]'s with x + 32, summed by a second
// vdpbf16ps): two sub-blocks a product, lanes 0-7 of one and 8-15 of the other (sc[j] their two scales), in
// the operand order of kqb_paired's rows. One FMA a row for 64 weights where kqb_dot takes two.
template <int NT, int MT>
__attribute__((always_inline)) inline void kqb_dot2(__m512 (&acc)[NT][MT], const __m512i (&ca)[NT],
                                                    const __m512i (&cb)[NT], const __m512 (&sc)[NT],
                                                    const uint16_t* x, int64_t K) {
  _Pragma("GCC unroll 8")
  for (int i = 0; i < MT; ++i) {
    const __m512bh xa = kqb_load_bh(x + i * K), xb = kqb_load_bh(x + i * K + 32);
    _Pragma("GCC unroll 8")
    for (int j = 0; j < NT; ++j)
      acc[j][i] = _mm512_fmadd_ps(
          _mm512_dpbf16_ps(_mm512_dpbf16_ps(kqb_zero_ps(), (__m512bh)ca[j], xa), (__m512bh)cb[j], xb), sc[j],
          acc[j][i]);
  }
}

// The scales of sub-blocks c (lanes 0-7) and c + 1 (lanes 8-15) from a header's a[].
__attribute__((always_inline)) inline __m512 kqb_pair_scales(const float* a, int c) {
  return _mm512_insertf32x8(_mm512_set1_ps(a[c]), _mm256_set1_ps(a[c + 1]), 1);
}

// A tile's MT x NT accumulators set to zero, and summed into y[i * N + n + j] (kq_tree16).
template <int NT, int MT>
__attribute__((always_inline)) inline void kqb_zero(__m512 (&acc)[NT][MT]) {
  _Pragma("GCC unroll 8")
  for (int j = 0; j < NT; ++j)
    _Pragma("GCC unroll 8")
    for (int i = 0; i < MT; ++i) acc[j][i] = _mm512_setzero_ps();
}

template <int NT, int MT>
__attribute__((always_inline)) inline void kqb_store(__m512 (&acc)[NT][MT], float* __restrict__ y, int64_t n,
                                                     int64_t N) {
  _Pragma("GCC unroll 8")
  for (int j = 0; j < NT; ++j)
    _Pragma("GCC unroll 8")
    for (int i = 0; i < MT; ++i) y[i * N + n + j] = kq_tree16(acc[j][i]);
}

// Outputs y[i * N + n + j] for activation rows i < MT (x and xf row stride K) and weight rows n + j, j < NT
// (w at weight row n).
template <int MT, int NT, bool DP>
void kqb_out(const uint16_t* __restrict__ x, const float* __restrict__ xf, const uint8_t* __restrict__ w,
             float* __restrict__ y, int64_t n, int64_t K, int64_t N, const KqbTabs& tb) {
  constexpr int64_t per = KqTraits<kQ6_K>::per, bytes = KqTraits<kQ6_K>::bytes;
  const int64_t nb = K / per, rb = nb * bytes;
  const __m512i tlo = _mm512_load_si512(tb.lo), thi = _mm512_load_si512(tb.hi);
  __m512 acc[NT][MT];
  kqb_zero(acc);
  KqHeader h[NT];
  const int64_t ahead = MT <= HELIOS_KQB_PF_ROWS ? kqb_ahead(rb) : kKqAhead;
  for (int64_t b = 0; b < nb; ++b) {
    kq_headers_ahead<kQ6_K>(w, rb, b, ahead, h);
    // the scales stay in memory (loaded below), where the compiler would otherwise extract them from
    // registers with shuffle-port operations (in this kernel's first, all-types form the barrier took Q4_K
    // from 66 to 52 ps a weight)
    asm volatile("" : : "r"(h) : "memory");
    _Pragma("GCC unroll 2")
    for (int g = 0; g < 2; ++g) {
      __m512i codes[NT][4];
      _Pragma("GCC unroll 8")
      for (int j = 0; j < NT; ++j) kqb_codes(w + j * rb + b * bytes, g, codes[j], tlo, thi);
      _Pragma("GCC unroll 4")
      for (int s = 0; s < 4; ++s) {
        const int c = 4 * g + s;
        // lanes 0-7 (weights 0-15) take the scale of group 2c, lanes 8-15 that of 2c + 1
        const __m512i pick = _mm512_set_epi32(2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                                              2 * c + 1, 2 * c + 1, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c);
        __m512 sc[NT];
        _Pragma("GCC unroll 8")
        for (int j = 0; j < NT; ++j) sc[j] = _mm512_permutexvar_ps(pick, _mm512_load_ps(h[j].a));
        if constexpr (MT == 1 || DP) {
          __m512i cs[NT];
          _Pragma("GCC unroll 8")
          for (int j = 0; j < NT; ++j) cs[j] = codes[j][s];
          kqb_dot(acc, cs, sc, x + b * per + 32 * c, K);
        } else {
          __m512 qe[NT], qo[NT];
          _Pragma("GCC unroll 8")
          for (int j = 0; j < NT; ++j) {
            qe[j] = _mm512_castsi512_ps(_mm512_slli_epi32(codes[j][s], 16));
            qo[j] = _mm512_castsi512_ps(_mm512_and_si512(codes[j][s], _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
          }
          _Pragma("GCC unroll 8")
          for (int i = 0; i < MT; ++i) {
            const float* xp = xf + i * K + b * per + 32 * c;
            const __m512 xe = _mm512_loadu_ps(xp), xo = _mm512_loadu_ps(xp + 16);
            _Pragma("GCC unroll 8")
            for (int j = 0; j < NT; ++j) {
              const __m512 d = _mm512_fmadd_ps(xo, qo[j], _mm512_mul_ps(xe, qe[j]));
              acc[j][i] = _mm512_fmadd_ps(d, sc[j], acc[j][i]);
            }
          }
        }
      }
    }
  }
  kqb_store(acc, y, n, N);
}

#ifndef HELIOS_KQB_DP_COLS_ROWS
#define HELIOS_KQB_DP_COLS_ROWS 8
#endif
// Q4_K and Q5_K by pair dot products (where kqb_dp_rows: every row by vdpbf16ps). Sub-block c's weights are
// a_c q + b_c (q = 0..15, Q5_K's 0..31 with its fifth bit; a_c = d sc_c and b_c = -dmin m_c exact), so
// y = sum_c a_c (q_c . x_c) + b_c X_c
// with X_c the sub-block's sum of x (kqb_xsums). Sub-blocks 2g and 2g + 1 (one 32-byte group of codes) take
// one product (kqb_dot2): lanes 0-7 the first's weights, 8-15 the second's, Z_i = the pair sums of their
// weights 0-15 then, accumulated by a second vdpbf16ps, of 16-31 (x reordered to match, kqb_paired); lane i
// of the accumulator takes A_i = fma(Z_i, a(i), A_i) over the block's four groups in order, then lanes 0-7
// A_i = fma(b_i, X_i, A_i) with the block's eight mins and sums; then kq_tree16. The codes are looked up as
// bfloat16 words (q is exact in bfloat16): a row costs three operations for 64 weights (two vdpbf16ps and
// the scales' FMA) against the float32 path's four (2026-12-06, a Zen 5 VM, 2 threads, Q4_K 17,920 x
// 1,536, ps a weight at 5 / 8 / 12 rows: one sub-block a product 25.7 / 39.1 / 62.0, two 22.5 / 35.3 / 54.0).
template <int T, int MT, int NT>
void kqb4_out(const uint16_t* __restrict__ x, const float* __restrict__ xs, const uint8_t* __restrict__ w,
              float* __restrict__ y, int64_t n, int64_t K, int64_t N, const KqbTabs& tb) {
  static_assert(T == kQ4_K || T == kQ5_K, "Q4_K or Q5_K");
  constexpr int64_t per = KqTraits<T>::per, bytes = KqTraits<T>::bytes;
  constexpr int64_t qs = T == kQ4_K ? 16 : 48;  // the codes' low four bits; Q5_K's fifth bits at 16
  const int64_t nb = K / per, rb = nb * bytes, ns = K / 32;
  const __m512i tab = _mm512_load_si512(T == kQ4_K ? tb.nib : tb.hi), sh = _mm512_load_si512(tb.sh);
  const __m512i lo4 = _mm512_set1_epi16(0x000F);
  const __m512i b4 = _mm512_set1_epi16(16);
  __m512 acc[NT][MT];
  kqb_zero(acc);
  KqHeader h[NT];
  const int64_t ahead = MT <= HELIOS_KQB_PF_ROWS ? kqb_ahead(rb) : kKqAhead;
  for (int64_t b = 0; b < nb; ++b) {
    kq_headers_ahead<T>(w, rb, b, ahead, h);
    asm volatile("" : : "r"(h) : "memory");  // the scales stay in memory (kqb_out's note)
    // Q5_K: the fifth bits as words, qh[l mod 16] (ha) and qh[16 + l mod 16] (hb) at word l (bit c: sub-block c's)
    __m512i ha[NT], hb[NT];
    if constexpr (T == kQ5_K) {
      _Pragma("GCC unroll 8")
      for (int j = 0; j < NT; ++j) {
        const uint8_t* qh = w + j * rb + b * bytes + 16;
        ha[j] = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh))));
        hb[j] = _mm512_cvtepu8_epi16(
            _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 16))));
      }
    }
    // sub-blocks 2 g and 2 g + 1 share 32 bytes (low nibbles the first's weights, high the second's):
    // ca = both nibbles of bytes 0-15 (weights 0-15 of each), cb = of bytes 16-31
    const auto group = [&](int g) __attribute__((always_inline)) {
      __m512i ca[NT], cb[NT];
      __m512 sc[NT];
      _Pragma("GCC unroll 8")
      for (int j = 0; j < NT; ++j) {
        const uint8_t* q = w + j * rb + b * bytes + qs + 32 * g;
        __m512i ia = _mm512_srlv_epi16(
            _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), sh);
        __m512i ib = _mm512_srlv_epi16(
            _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))),
            sh);
        if constexpr (T == kQ5_K) {  // the nibble, + 16 where the fifth bit is set
          const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(1 << (2 * g))),
                                                  _mm256_set1_epi16(static_cast<int16_t>(2 << (2 * g))), 1);
          ia = _mm512_and_si512(ia, lo4);
          ib = _mm512_and_si512(ib, lo4);
          ia = _mm512_mask_add_epi16(ia, _mm512_test_epi16_mask(ha[j], bits), ia, b4);
          ib = _mm512_mask_add_epi16(ib, _mm512_test_epi16_mask(hb[j], bits), ib, b4);
        }
        ca[j] = _mm512_permutexvar_epi16(ia, tab);  // Q4_K: nib ignores the high nibble left in words 0-15
        cb[j] = _mm512_permutexvar_epi16(ib, tab);
        sc[j] = kqb_pair_scales(h[j].a, 2 * g);
      }
      kqb_dot2(acc, ca, cb, sc, x + b * per + 64 * g, K);
    };
    if constexpr (MT > 5) {
      // a rolled loop: unrolled, the compiler hoists the four groups' codes and spills (8 rows: 39.8 against
      // 35.7 ps a weight; at 5 rows the unrolled loop's 22.2 against 23.7)
      _Pragma("GCC unroll 1")
      for (int g = 0; g < 4; ++g) group(g);
    } else {
      _Pragma("GCC unroll 4")
      for (int g = 0; g < 4; ++g) group(g);
    }
    __m512 mv[NT];
    _Pragma("GCC unroll 8")
    for (int j = 0; j < NT; ++j) mv[j] = _mm512_castps256_ps512(_mm256_load_ps(h[j].b));
    _Pragma("GCC unroll 8")
    for (int i = 0; i < MT; ++i) {
      const __m512 xv = _mm512_castps256_ps512(_mm256_loadu_ps(xs + i * ns + b * 8));
      _Pragma("GCC unroll 8")
      for (int j = 0; j < NT; ++j) acc[j][i] = _mm512_mask3_fmadd_ps(mv[j], xv, acc[j][i], 0x00FF);
    }
  }
  kqb_store(acc, y, n, N);
}

// Q5_0 by pair dot products (where kqb_dp_rows): the block's 32 codes q - 16 (5 bits: the nibbles of its
// 16 bytes, low ones first, and the bits of qh) looked up as bfloat16 words; blocks b, b + 1 take one
// product as kqb4_out's sub-block pairs (kqb_dot2: lanes 0-7 block b's, 8-15 block b + 1's, weights 0-15
// then 16-31), lane i A_i = fma(Z_i, d(i), A_i) over the pairs in order, an odd last block alone (kqb_dot,
// its 32 columns of x as they are), then kq_tree16. A row costs three operations for 64 weights against
// the float32 path's four (4,864 x 896 at 5 / 8 rows: 30.1 / 41.2 -> 26.4 / 39.6 ps a weight).
template <int MT, int NT>
void kqb5_out(const uint16_t* __restrict__ x, const uint8_t* __restrict__ w, float* __restrict__ y, int64_t n,
              int64_t K, int64_t N, const KqbTabs& tb) {
  constexpr int64_t bytes = KqTraits<kQ5_0>::bytes;
  const int64_t nb = K / 32, rb = nb * bytes;
  const __m512i tmid = _mm512_load_si512(tb.mid);
  const __m512i lo4 = _mm512_set1_epi16(0x000F);
  const __m512i b4 = _mm512_set1_epi16(16);
  __m512 acc[NT][MT];
  kqb_zero(acc);
  const int64_t ahead = MT <= HELIOS_KQB_PF_ROWS ? kqb_ahead(rb) : kKqAhead;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {  // blocks b, b + 1: ca their weights 0-15 (low nibbles), cb 16-31 (high)
    __m512i ca[NT], cb[NT];
    __m512 sc[NT];
    _Pragma("GCC unroll 8")
    for (int j = 0; j < NT; ++j) {
      const uint8_t* blk = w + j * rb + b * bytes;
      if (b % 4 == 0) {  // 88 bytes of blocks a time: two lines ahead cover them
        _mm_prefetch(reinterpret_cast<const char*>(blk + ahead * rb), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(blk + ahead * rb + 64), _MM_HINT_T0);
      }
      const __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(blk + bytes + 6),
                                                                  reinterpret_cast<const __m128i*>(blk + 6)));
      uint32_t h0, h1;
      std::memcpy(&h0, blk + 2, 4);
      std::memcpy(&h1, blk + bytes + 2, 4);
      __m512i qa = _mm512_and_si512(z, lo4), qb = _mm512_srli_epi16(z, 4);
      qa = _mm512_mask_add_epi16(qa, static_cast<__mmask32>((h0 & 0xFFFFu) | (h1 << 16)), qa, b4);  // the fifth bits
      qb = _mm512_mask_add_epi16(qb, static_cast<__mmask32>((h0 >> 16) | (h1 & 0xFFFF0000u)), qb, b4);
      ca[j] = _mm512_permutexvar_epi16(qa, tmid);
      cb[j] = _mm512_permutexvar_epi16(qb, tmid);
      sc[j] = _mm512_insertf32x8(_mm512_set1_ps(half_to_float(blk)), _mm256_set1_ps(half_to_float(blk + bytes)), 1);
    }
    kqb_dot2(acc, ca, cb, sc, x + 32 * b, K);
  }
  if (b < nb) {  // an odd last block: its 32 columns of x as they are (kqb_paired)
    __m512i codes[NT];
    __m512 sc[NT];
    _Pragma("GCC unroll 8")
    for (int j = 0; j < NT; ++j) {
      const uint8_t* blk = w + j * rb + b * bytes;
      const __m256i z = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6)));
      __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(z, _mm256_set1_epi16(0x000F))),
                                     _mm256_srli_epi16(z, 4), 1);
      uint32_t qh;
      std::memcpy(&qh, blk + 2, 4);
      q = _mm512_mask_add_epi16(q, static_cast<__mmask32>(qh), q, b4);
      codes[j] = _mm512_permutexvar_epi16(q, tmid);
      sc[j] = _mm512_set1_ps(half_to_float(blk));
    }
    kqb_dot(acc, codes, sc, x + 32 * b, K);
  }
  kqb_store(acc, y, n, N);
}

// The pair dot kernels as one form for kqb_rows: Kern::out<MT, NT>(x, xf, w, y, n, K, N, tb) for a tile of
// MT activation rows and NT weight rows (xf: Q6_K's widened rows or null, the K-quants' sub-block sums),
// two weight rows in flight up to Kern::wide activation rows: with vdpbf16ps rows (DP) a row needs no
// registers for widened x.
template <bool DP>
struct KqbQ6 {
  static constexpr int T = kQ6_K, wide = DP ? HELIOS_KQB_DP_COLS_ROWS : 5;
  template <int MT, int NT>
  static void out(const uint16_t* x, const float* xf, const uint8_t* w, float* y, int64_t n, int64_t K, int64_t N,
                  const KqbTabs& tb) {
    kqb_out<MT, NT, DP>(x, xf, w, y, n, K, N, tb);
  }
};
template <int Q>
struct KqbK {  // Q4_K, Q5_K
  static constexpr int T = Q, wide = HELIOS_KQB_DP_COLS_ROWS;
  template <int MT, int NT>
  static void out(const uint16_t* x, const float* xf, const uint8_t* w, float* y, int64_t n, int64_t K, int64_t N,
                  const KqbTabs& tb) {
    kqb4_out<Q, MT, NT>(x, xf, w, y, n, K, N, tb);
  }
};
struct KqbQ5 {  // Q5_0
  static constexpr int T = kQ5_0, wide = HELIOS_KQB_DP_COLS_ROWS;
  template <int MT, int NT>
  static void out(const uint16_t* x, const float*, const uint8_t* w, float* y, int64_t n, int64_t K, int64_t N,
                  const KqbTabs& tb) {
    kqb5_out<MT, NT>(x, w, y, n, K, N, tb);
  }
};

// Rows [0, MT) against weight rows [n0, n1).
template <class Kern, int MT>
void kqb_rows(const uint16_t* x, const float* xf, const uint8_t* wp, float* y, int64_t n0, int64_t n1, int64_t K,
              int64_t N, const KqbTabs& tb) {
  constexpr int NT = MT <= Kern::wide ? kKqbCols : 1;
  const int64_t rb = K / KqTraits<Kern::T>::per * KqTraits<Kern::T>::bytes;
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) Kern::template out<MT, NT>(x, xf, wp + n * rb, y, n, K, N, tb);
  if constexpr (NT > 1) {
    for (; n < n1; ++n) Kern::template out<MT, 1>(x, xf, wp + n * rb, y, n, K, N, tb);
  }
}

// The last M <= MT activation rows: one tile of exactly M rows.
template <class Kern, int MT>
void kqb_tail(int64_t M, const uint16_t* x, const float* xf, const uint8_t* wp, float* y, int64_t n0, int64_t n1,
              int64_t K, int64_t N, const KqbTabs& tb) {
  if constexpr (MT > 0) {
    if (M == MT) kqb_rows<Kern, MT>(x, xf, wp, y, n0, n1, K, N, tb);
    else kqb_tail<Kern, MT - 1>(M, x, xf, wp, y, n0, n1, K, N, tb);
  }
}

// bfloat16 rows x [M, K] with each 64 columns reordered as 0-15, 32-47, 16-31, 48-63 (a last 32 as they are):
// the operands of kqb_dot2, whose products pair weights 0-15 of two sub-blocks (or Q5_0 blocks), then 16-31.
at::Tensor kqb_paired(const at::Tensor& xb) {
  const int64_t M = xb.size(0), K = xb.size(1);
  at::Tensor out = at::empty({M, K}, xb.options());
  const auto* x = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < M; ++r) {
    const uint16_t* xr = x + r * K;
    uint16_t* orow = o + r * K;
    int64_t c = 0;
    for (; c + 64 <= K; c += 64) {
      const __m512i v0 = _mm512_loadu_si512(xr + c), v1 = _mm512_loadu_si512(xr + c + 32);
      _mm512_storeu_si512(orow + c, _mm512_shuffle_i64x2(v0, v1, 0x44));
      _mm512_storeu_si512(orow + c + 32, _mm512_shuffle_i64x2(v0, v1, 0xEE));
    }
    if (c < K) std::memcpy(orow + c, xr + c, static_cast<size_t>(K - c) * 2);
  }
  return out;
}

// The sums X_c of each row's sub-blocks of 32 bfloat16 values (Q4_K's and Q5_K's mins multiply them), [M, K / 32]
// float32 in a fixed order: the even-indexed values' lanes plus the odd ones', then _mm512_reduce_add_ps.
at::Tensor kqb_xsums(const at::Tensor& xb) {
  const int64_t M = xb.size(0), K = xb.size(1);
  at::Tensor xs = at::empty({M, K / 32}, xb.options().dtype(at::kFloat));
  const auto* x = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  float* out = xs.data_ptr<float>();
  for (int64_t i = 0; i < M * K / 32; ++i) {
    const __m512i v = _mm512_loadu_si512(x + 32 * i);
    const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    out[i] = _mm512_reduce_add_ps(_mm512_add_ps(e, o));
  }
  return xs;
}

// Every activation row against weight rows [n0, n1), kKqRowBlock weight rows at a time (tiles of up to
// kKqbTile activation rows each pass over them while they are in cache). Q6_K: xf the widened rows (or
// null: every row by vdpbf16ps); Q4_K, Q5_K: xf the rows' sub-block sums (kqb_xsums); Q5_0: none.
void kqb_range(int64_t type, const uint16_t* x, const float* xf, const uint8_t* wp, float* y, int64_t M, int64_t K,
               int64_t N, int64_t n0, int64_t n1) {
  const KqbFlush flush;
  const KqbTabs& tb = kqb_tabs();
  const int64_t xfs = type == kQ4_K || type == kQ5_K ? K / 32 : K;  // xf's row stride
  for (int64_t r0 = n0; r0 < n1; r0 += kKqRowBlock) {
    const int64_t r1 = std::min(n1, r0 + kKqRowBlock);
    for (int64_t m0 = 0; m0 < M; m0 += kKqbTile) {
      const int64_t mt = std::min<int64_t>(kKqbTile, M - m0);
      const uint16_t* xm = x + m0 * K;
      const float* xfm = xf == nullptr ? nullptr : xf + m0 * xfs;
      float* ym = y + m0 * N;
      if (type == kQ4_K) kqb_tail<KqbK<kQ4_K>, kKqbTile>(mt, xm, xfm, wp, ym, r0, r1, K, N, tb);
      else if (type == kQ5_K) kqb_tail<KqbK<kQ5_K>, kKqbTile>(mt, xm, xfm, wp, ym, r0, r1, K, N, tb);
      else if (type == kQ5_0) kqb_tail<KqbQ5, kKqbTile>(mt, xm, nullptr, wp, ym, r0, r1, K, N, tb);
      else if (xf == nullptr) kqb_tail<KqbQ6<true>, kKqbTile>(mt, xm, nullptr, wp, ym, r0, r1, K, N, tb);  // vdpbf16ps rows
      else kqb_tail<KqbQ6<false>, kKqbTile>(mt, xm, xfm, wp, ym, r0, r1, K, N, tb);
    }
  }
}

// kq_for_units with kqb_range (one group: kq_linear_impl's split): x [R, K] bfloat16 against Q6_K, Q4_K,
// Q5_K or Q5_0 blocks, groups [off[g], off[g + 1]) against wps[g].
void kqb_grouped(int64_t type, const at::Tensor& xb, const std::vector<const uint8_t*>& wps,
                 const std::vector<int64_t>& off, float* y, int64_t K, int64_t N) {
  const bool affine = type == kQ4_K || type == kQ5_K;
  const at::Tensor xp = affine || type == kQ5_0 ? kqb_paired(xb) : xb;  // kqb_dot2's operand order
  const auto* x = reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>());
  const at::Tensor xf = affine ? kqb_xsums(xb) : type == kQ5_0 ? at::Tensor() : kqb_widened(xb);
  const float* xfp = xf.defined() && xf.numel() > 0 ? xf.data_ptr<float>() : nullptr;
  const int64_t xfs = affine ? K / 32 : K;
  kq_for_units(off, K, N, [&](int64_t g, int64_t n0, int64_t n1) {
    kqb_range(type, x + off[g] * K, xfp == nullptr ? nullptr : xfp + off[g] * xfs, wps[g], y + off[g] * N,
              off[g + 1] - off[g], K, N, n0, n1);
  });
}
#endif  // AVX512-BF16

// Whether bfloat16 x against `type` takes the pair dot path.
inline bool kqb_applies(const at::Tensor& x, int64_t type) {
#if defined(HELIOS_KQB)
  return x.scalar_type() == at::kBFloat16 && g_kqb_on.load(std::memory_order_relaxed) &&
         (type == kQ6_K ||
          ((type == kQ4_K || type == kQ5_K || type == kQ5_0) && g_kqb_dp_rows.load(std::memory_order_relaxed)));
#else
  (void)x;
  (void)type;
  return false;
#endif
}

// Whether a bfloat16 step of `rows` rows against `type` takes the pair dot path (the exact weights) where the
// tiles' rows would take kquant_linear_tiles: where every row takes vdpbf16ps, the pair dot path's types up to
// one tile of kKqbTile rows, where it leads (2026-12-06, a Zen 5 VM, 2 threads, ps a weight at 8 rows, pair
// dot against tiles: Q4_K 17,920 x 1,536 33.3 / 35.7, Q6_K 1,536 x 8,960 38.2 / 42.4, Q5_0 4,864 x 896
// 37.9 / 56.2; at 12 rows Q4_K 52.0 / 43.8).
bool kquant_pair_before_tiles(int64_t rows, int64_t type) {
#if defined(HELIOS_KQB)
  return rows <= kKqbTile && g_kqb_on.load(std::memory_order_relaxed) &&
         g_kqb_dp_rows.load(std::memory_order_relaxed) &&
         (type == kQ4_K || type == kQ5_K || type == kQ5_0 || type == kQ6_K);
#else
  (void)rows;
  (void)type;
  return false;
#endif
}

bool kquant_bf16_dot_supported() {
#if defined(HELIOS_KQB)
  return true;
#else
  return false;
#endif
}

// The pair dot path's switches where the build has it: 0 the path itself (off: the float32 path serves
// bfloat16 x too), 1 kqb_dp_rows (rows past the first by vdpbf16ps; Q4_K, Q5_K and Q5_0 on the path).
bool kqb_switch(int which, const bool* set) {
#if defined(HELIOS_KQB)
  std::atomic<bool>& flag = which == 0 ? g_kqb_on : g_kqb_dp_rows;
  if (set != nullptr) flag.store(*set);
  return flag.load();
#else
  (void)which;
  (void)set;
  return false;
#endif
}

bool kquant_bf16_dot_rows() { return kqb_switch(1, nullptr); }
bool set_kquant_bf16_dot_rows(bool on) { return kqb_switch(1, &on); }
bool set_kquant_bf16_dot(bool on) { return kqb_switch(0, &on); }

// 32 weights as bfloat16, each float32 value rounded to nearest even (torch's `.to(torch.bfloat16)`
// of a finite float; every dequantized weight is finite).
inline void kq_store_bf16(const Kq32& w, at::BFloat16* out) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(w.v[0]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), (__m256i)_mm512_cvtneps_pbh(w.v[1]));
#else
  alignas(64) float f[32];
  kq_store(w, f);
  for (int l = 0; l < 32; ++l) {
    uint32_t bits;
    std::memcpy(&bits, &f[l], 4);
    const uint16_t r = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    std::memcpy(&out[l], &r, 2);
  }
#endif
}

// W's values into `out` [N, K]: float32 (exact) or bfloat16 (each exact value rounded once).
template <int T, typename Out>
void kq_dequantize_impl(const uint8_t* wp, Out* out, int64_t N, int64_t K) {
  constexpr int64_t per = KqTraits<T>::per, bytes = KqTraits<T>::bytes;
  constexpr int subs = static_cast<int>(per / 32);
  const int64_t nb = K / per;
  at::parallel_for(0, N * nb, std::max<int64_t>(1, 65536 / per), [&](int64_t b0, int64_t b1) {
    KqHeader h;
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = wp + b * bytes;
      kq_header<T>(blk, h);
      for (int c = 0; c < subs; ++c) {
        if constexpr (std::is_same_v<Out, float>) kq_store(kq_weights<T>(blk, c, h), out + b * per + 32 * c);
        else kq_store_bf16(kq_weights<T>(blk, c, h), out + b * per + 32 * c);
      }
    }
  });
}

// Dispatch on the ggml type: f.template operator()<T>() for T one of the six.
template <typename F>
void kq_dispatch(int64_t type, F&& f) {
  switch (type) {
    case kQ5_0: f(std::integral_constant<int, kQ5_0>{}); break;
    case kQ5_1: f(std::integral_constant<int, kQ5_1>{}); break;
    case kQ8_0: f(std::integral_constant<int, kQ8_0>{}); break;
    case kQ4_K: f(std::integral_constant<int, kQ4_K>{}); break;
    case kQ5_K: f(std::integral_constant<int, kQ5_K>{}); break;
    case kQ6_K: f(std::integral_constant<int, kQ6_K>{}); break;
    default: kq_layout(type);  // raises
  }
}

void kq_check_blocks(const at::Tensor& blocks, int64_t type, int64_t N, int64_t K, const char* what) {
  const auto [per, bytes] = kq_layout(type);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.device().is_cpu(),
              what, ": blocks are a contiguous uint8 CPU tensor");
  TORCH_CHECK(N >= 0 && K > 0 && K % per == 0, what, ": in_features must be a positive multiple of ", per);
  TORCH_CHECK(blocks.numel() == N * (K / per) * bytes, what, ": ", blocks.numel(), " bytes of blocks, expected ",
              N * (K / per) * bytes, " for a [", N, ", ", K, "] weight");
}

// y = x @ W^T for x [M, K] (float32 or bfloat16, widened exactly) and W [N, K] in GGUF blocks of `type`;
// the result in x's dtype (bfloat16: the float32 sum rounded to nearest even).
// x [M, K] as float32 in the lane order of `type` (each 32 columns permuted by kq_lane_weight for
// the types with `lanes`).
at::Tensor kq_activations(const at::Tensor& x, int64_t type) {
  at::Tensor xf = x.to(at::kFloat).contiguous();
  if (type != kQ4_K && type != kQ5_0) return xf;
  const int64_t M = xf.size(0), K = xf.size(1);
  int order[32];
  for (int L = 0; L < 32; ++L) order[L] = kq_lane_weight(type, L);
  at::Tensor xl = at::empty({M, K}, xf.options());
  const float* src = xf.data_ptr<float>();
  float* dst = xl.data_ptr<float>();
  for (int64_t i = 0; i < M * K; i += 32)
    for (int L = 0; L < 32; ++L) dst[i + L] = src[i + order[L]];
  return xl;
}

at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t N, bool float_out) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "kquant_linear: x is a 2-d float32 or bfloat16 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  kq_check_blocks(blocks, type, N, K, "kquant_linear");
#if defined(HELIOS_KQB)
  if (kqb_applies(x, type)) {
    const at::Tensor xb = x.contiguous();
    at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
    if (M > 0 && N > 0) kqb_grouped(type, xb, {blocks.data_ptr<uint8_t>()}, {0, M}, y.data_ptr<float>(), K, N);
    return float_out ? y : y.to(at::kBFloat16);
  }
#endif
  const at::Tensor xf = kq_activations(x, type);
  at::Tensor y = at::empty({M, N}, xf.options());
  if (M > 0 && N > 0) {
    const float* xp = xf.data_ptr<float>();
    const uint8_t* wp = blocks.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    kq_dispatch(type, [&](auto t) { kq_linear_impl<decltype(t)::value>(xp, wp, yp, M, K, N); });
  }
  return x.scalar_type() == at::kFloat || float_out ? y : y.to(x.scalar_type());
}

// kquant_linear for groups of rows with a weight each: x [R, K] (rows of group g: [offsets[g],
// offsets[g + 1])), blocks[g] group g's [N, K] weight in GGUF blocks of `type` -> y [R, N] in x's dtype.
at::Tensor kquant_linear_grouped(const at::Tensor& x, at::IntArrayRef offsets, at::TensorList blocks, int64_t type,
                                 int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "kquant_linear_grouped: x is a 2-d float32 or bfloat16 CPU tensor");
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(offsets.size() == blocks.size() + 1, "kquant_linear_grouped: one more offset than weights");
  std::vector<int64_t> off(offsets.begin(), offsets.end());
  TORCH_CHECK(off.front() == 0 && off.back() == R, "kquant_linear_grouped: offsets run from 0 to the rows of x");
  std::vector<const uint8_t*> wps;
  for (size_t g = 0; g < blocks.size(); ++g) {
    TORCH_CHECK(off[g] <= off[g + 1], "kquant_linear_grouped: offsets do not decrease");
    kq_check_blocks(blocks[g], type, N, K, "kquant_linear_grouped");
    wps.push_back(blocks[g].data_ptr<uint8_t>());
  }
#if defined(HELIOS_KQB)
  if (kqb_applies(x, type)) {
    const at::Tensor xb = x.contiguous();
    at::Tensor y = at::empty({R, N}, x.options().dtype(at::kFloat));
    if (R > 0 && N > 0) kqb_grouped(type, xb, wps, off, y.data_ptr<float>(), K, N);
    return y.to(at::kBFloat16);
  }
#endif
  const at::Tensor xf = kq_activations(x, type);
  at::Tensor y = at::empty({R, N}, xf.options());
  if (R > 0 && N > 0) {
    const float* xp = xf.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    kq_dispatch(type, [&](auto t) { kq_grouped_impl<decltype(t)::value>(xp, wps, off, yp, K, N); });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// ---- Mixture-of-experts: the routed experts of one layer in one operator -------------------------------
//
// helios::moe_kquant_mix(x, weights, ids, gate_up[], gu_type, down[], down_type, max_rows): helios.models.moe's
// expert_mix for experts held as GGUF blocks (every expert's gate/up one [2I, H] weight of gu_type, its
// down one [H, I] weight of down_type), bit for bit, without the Python between its steps:
//   1. the (token, slot) pairs sorted by expert, stably (a counting sort: torch.argsort(stable=True)'s
//      order), each pair's token row gathered and widened to float32 in gu_type's lane order
//      (kq_activations of x.index_select's rows: the same values);
//   2. gate/up: kq_grouped_impl over the experts' row groups (kquant_linear_grouped's outputs), in x's dtype;
//   3. at::silu(gate) * up over the same views as moe.swiglu (the same ATen operators, so the same bits);
//   4. down: kq_grouped_impl again, in x's dtype;
//   5. each row times its routing weight with at::mul (the same type promotion: a float32 weight makes a
//      float32 product), rounded to x's dtype, then added into its token's output row in the sorted pair
//      order, each addition rounded to x's dtype: what index_add_ over the pairs does from zeros (a
//      token's rows are added one after another in the order the index lists them).
// An expert with more than max_rows rows (>= 0) raises: its module would have dequantized it for the call.
at::Tensor moe_kquant_mix(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                          at::TensorList gate_up, int64_t gu_type, at::TensorList down, int64_t down_type,
                          int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_kquant_mix: x is a 2-d float32 or bfloat16 CPU tensor");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong,
              "moe_kquant_mix: ids are int64 [tokens, top_k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && (weights.scalar_type() == at::kFloat ||
                                                 weights.scalar_type() == x.scalar_type()),
              "moe_kquant_mix: weights [tokens, top_k], float32 or x's dtype");
  const int64_t E = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(E > 0 && static_cast<int64_t>(down.size()) == E, "moe_kquant_mix: one gate/up and one down per expert");
  const int64_t T = x.size(0), k = ids.size(1), H = x.size(1), R = T * k;
  const int64_t I2 = gate_up[0].size(0), I = I2 / 2;
  TORCH_CHECK(I2 % 2 == 0 && I > 0, "moe_kquant_mix: gate/up rows are gate then up, as many of each");
  at::Tensor out = at::zeros_like(x, at::MemoryFormat::Contiguous);
  if (R == 0) return out;
  // 1. the stable sort by expert
  const at::Tensor idc = ids.contiguous();
  const int64_t* idp = idc.data_ptr<int64_t>();
  std::vector<int64_t> off(static_cast<size_t>(E) + 1, 0);
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(idp[i] >= 0 && idp[i] < E, "moe_kquant_mix: an expert id outside 0..", E - 1);
    ++off[idp[i] + 1];
  }
  std::vector<const uint8_t*> gps(static_cast<size_t>(E), nullptr), dps(static_cast<size_t>(E), nullptr);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = off[e + 1];
    TORCH_CHECK(max_rows < 0 || n <= max_rows, "moe_kquant_mix: an expert has more rows than max_rows");
    off[e + 1] += off[e];
    if (n == 0) continue;  // its blocks are not read
    kq_check_blocks(gate_up[e], gu_type, I2, H, "moe_kquant_mix (gate/up)");
    kq_check_blocks(down[e], down_type, H, I, "moe_kquant_mix (down)");
    gps[e] = gate_up[e].data_ptr<uint8_t>();
    dps[e] = down[e].data_ptr<uint8_t>();
  }
  std::vector<int64_t> order(static_cast<size_t>(R));
  {
    std::vector<int64_t> next(off.begin(), off.end() - 1);
    for (int64_t i = 0; i < R; ++i) order[next[idp[i]]++] = i;
  }
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor xc = x.contiguous();
  at::Tensor gu = at::empty({R, I2}, x.options().dtype(at::kFloat));
#if defined(HELIOS_KQB)
  // bfloat16 rows against Q6_K (or Q4_K, Q5_K, Q5_0 where kqb_dp_rows): the rows gathered as they are, then
  // kqb_grouped (kquant_linear_grouped's path for them)
  if (kqb_applies(x, gu_type)) {
    at::Tensor rows = at::empty({R, H}, x.options());
    const at::BFloat16* src = xc.data_ptr<at::BFloat16>();
    at::BFloat16* dst = rows.data_ptr<at::BFloat16>();
    for (int64_t p = 0; p < R; ++p) std::memcpy(dst + p * H, src + (order[p] / k) * H, H * sizeof(at::BFloat16));
    kqb_grouped(gu_type, rows, gps, off, gu.data_ptr<float>(), H, I2);
  } else
#endif
  {
    // 2. gate/up over the gathered rows, float32 in gu_type's lane order
    at::Tensor rows = at::empty({R, H}, x.options().dtype(at::kFloat));
    int perm[32];
    const bool lanes = gu_type == kQ4_K || gu_type == kQ5_0;
    for (int L = 0; L < 32; ++L) perm[L] = lanes ? kq_lane_weight(gu_type, L) : L;
    float* rp = rows.data_ptr<float>();
    for (int64_t p = 0; p < R; ++p) {
      const int64_t t = order[p] / k;
      float* dst = rp + p * H;
      if (bf16) {
        const at::BFloat16* src = xc.data_ptr<at::BFloat16>() + t * H;
        for (int64_t c = 0; c < H; c += 32)
          for (int L = 0; L < 32; ++L) dst[c + L] = static_cast<float>(src[c + perm[L]]);
      } else {
        const float* src = xc.data_ptr<float>() + t * H;
        for (int64_t c = 0; c < H; c += 32)
          for (int L = 0; L < 32; ++L) dst[c + L] = src[c + perm[L]];
      }
    }
    const float* xp = rows.data_ptr<float>();
    float* yp = gu.data_ptr<float>();
    kq_dispatch(gu_type, [&](auto t) { kq_grouped_impl<decltype(t)::value>(xp, gps, off, yp, H, I2); });
  }
  if (bf16) gu = gu.to(at::kBFloat16);
  // 3. SwiGLU, 4. down
  const at::Tensor act = at::mul(at::silu(gu.narrow(1, 0, I)), gu.narrow(1, I, I));
  at::Tensor mixed = at::empty({R, H}, x.options().dtype(at::kFloat));
#if defined(HELIOS_KQB)
  if (kqb_applies(act, down_type)) {
    const at::Tensor ac = act.contiguous();
    kqb_grouped(down_type, ac, dps, off, mixed.data_ptr<float>(), I, H);
  } else
#endif
  {
    const at::Tensor hf = kq_activations(act, down_type);
    const float* xp = hf.data_ptr<float>();
    float* yp = mixed.data_ptr<float>();
    kq_dispatch(down_type, [&](auto t) { kq_grouped_impl<decltype(t)::value>(xp, dps, off, yp, I, H); });
  }
  if (bf16) mixed = mixed.to(at::kBFloat16);
  // 5. weighted, then summed per token in pair order
  at::Tensor w = at::empty({R, 1}, weights.options());
  {
    const at::Tensor wc = weights.contiguous();
    const auto n = static_cast<size_t>(weights.element_size());
    const auto* src = static_cast<const char*>(wc.data_ptr());
    auto* dst = static_cast<char*>(w.data_ptr());
    for (int64_t p = 0; p < R; ++p) std::memcpy(dst + p * n, src + order[p] * n, n);
  }
  const at::Tensor scaled = at::mul(mixed, w).to(x.scalar_type()).contiguous();
  if (bf16) {
    const at::BFloat16* sp = scaled.data_ptr<at::BFloat16>();
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    for (int64_t p = 0; p < R; ++p) {
      at::BFloat16* o = op + (order[p] / k) * H;
      const at::BFloat16* s = sp + p * H;
      for (int64_t c = 0; c < H; ++c) o[c] = static_cast<at::BFloat16>(static_cast<float>(o[c]) + static_cast<float>(s[c]));
    }
  } else {
    const float* sp = scaled.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t p = 0; p < R; ++p) {  // a few thousand additions a row: not worth a parallel region
      float* o = op + (order[p] / k) * H;
      const float* s = sp + p * H;
      for (int64_t c = 0; c < H; ++c) o[c] = o[c] + s[c];
    }
  }
  return out;
}
// ---- end of the mixture-of-experts operator ------------------------------------------------------------

// W [N, K] in GGUF blocks of `type` -> float32, equal to gguf.quants.dequantize bit for bit; with
// `bf16`, those values rounded to bfloat16 (the same bits as `.to(torch.bfloat16)` of the float32
// result, without writing and reading it).
at::Tensor kquant_dequantize(const at::Tensor& blocks, int64_t type, int64_t N, int64_t K, bool bf16) {
  kq_check_blocks(blocks, type, N, K, "kquant_dequantize");
  at::Tensor out = at::empty({N, K}, at::TensorOptions().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  if (N > 0) {
    const uint8_t* wp = blocks.data_ptr<uint8_t>();
    if (bf16) {
      at::BFloat16* op = out.data_ptr<at::BFloat16>();
      kq_dispatch(type, [&](auto t) { kq_dequantize_impl<decltype(t)::value>(wp, op, N, K); });
    } else {
      float* op = out.data_ptr<float>();
      kq_dispatch(type, [&](auto t) { kq_dequantize_impl<decltype(t)::value>(wp, op, N, K); });
    }
  }
  return out;
}

// ---- K-quant matmul on AMX tiles (kquant_linear_tiles) ----
// y = x W^T for bfloat16 x [M, K] and W [N, K] in GGUF blocks of any of the six types (or q8_linear's
// codes and scales), on the AMX tile unit. Each thread takes units of 32 weight rows and decodes them to
// bfloat16: each weight is kquant_dequantize's exact float32 value rounded to nearest even, the bits
// `kquant_dequantize(..., bf16)` writes (so this is the dequantize-then-bfloat16-GEMM of
// `KQuantLinear.unpack_above` without writing the dense weight to memory). Up to 32 activation rows
// (kq_amx_unit) a unit is decoded one 32-column chunk at a time into L1 and multiplied at once; more
// rows (kq_decode_rows, kq_amx_tiles) decode the unit's whole rows into an L2 scratch that every pair of
// row tiles passes over. The decoded weights are the A operand (16 weight rows x 32 columns a tile); x
// is laid out once per call as column pairs (the B operand: 16 pairs x 16 activation rows a tile, zero
// rows past M); 32 weight rows x 32 activation rows take four float32 accumulator tiles. Products of bfloat16 values are exact in float32; every sum is float32 (the
// tile unit's order: the pair's two products, then the pairs in k order; denormal inputs and results
// are flushed to zero, as TDPBF16PS does). The result is rounded once to bfloat16.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HELIOS_KQ_TILES 1
constexpr int64_t kKqUnitRows = 32;  // weight rows a thread decodes at a time (two A tiles)
// q8_linear's layout as a tile source: int8 codes [N, K] and float32 scales [N, K / 32] (w = scale * code)
constexpr int kQ8Codes = 108;
template <> struct KqTraits<kQ8Codes> { static constexpr int64_t per = 32, bytes = 32; static constexpr bool affine = false, lanes = false; };

// The calling thread's scratch of at least n elements (kept between calls: a fresh allocation of this
// size is a fresh mapping, whose page faults cost more than a small projection's whole product).
template <typename E>
E* kq_scratch(int64_t n) {
  thread_local std::vector<E> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.assign(static_cast<size_t>(n), E{});
  return buf.data();
}

// Sub-block c's 32 weights as bfloat16 (kq_store_bf16 of kq_weights: each exact value rounded to
// nearest even). The types with at most 32 codes look each code up in a table of the sub-block's
// rounded values (one word permute for 32 weights); Q8_0 (256 codes) converts each weight; Q6_K goes
// a block at a time (kq_q6k_bf16_block).
template <int T>
inline void kq_bf16_32(const uint8_t* blk, int c, const KqHeader& h, at::BFloat16* out) {
  static_assert(T != kQ6_K, "Q6_K is decoded by kq_q6k_bf16_half");
  if constexpr (T == kQ8Codes) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
    const __m512 a = _mm512_set1_ps(h.a[0]);
    const __m512 w0 = _mm512_mul_ps(a, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
    const __m512 w1 = _mm512_mul_ps(a, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
  } else if constexpr (T == kQ8_0) {
    const Kq32 w = kq_weights<T>(blk, c, h);
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(w.v[1], w.v[0]));
  } else {
    __m256i codes = kq_codes<T>(blk, c);
    if constexpr (T == kQ5_0) codes = _mm256_add_epi8(codes, _mm256_set1_epi8(16));  // back to 0 .. 31
    const __m512i idx = _mm512_cvtepu8_epi16(codes);
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 a = _mm512_set1_ps(h.a[T == kQ5_0 || T == kQ5_1 ? 0 : c]);
    __m512i table;
    if constexpr (T == kQ4_K) {
      table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(a, iota, _mm512_set1_ps(h.b[c]))));
    } else {
      const __m512 q0 = T == kQ5_0 ? _mm512_sub_ps(iota, _mm512_set1_ps(16.f)) : iota;
      const __m512 q1 = _mm512_add_ps(q0, _mm512_set1_ps(16.f));
      __m512 v0, v1;
      if constexpr (T == kQ5_0) {
        v0 = _mm512_mul_ps(a, q0);
        v1 = _mm512_mul_ps(a, q1);
      } else {
        const __m512 b = _mm512_set1_ps(h.b[T == kQ5_1 ? 0 : c]);
        v0 = _mm512_fmadd_ps(a, q0, b);
        v1 = _mm512_fmadd_ps(a, q1, b);
      }
      table = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
    }
    _mm512_storeu_si512(out, _mm512_permutexvar_epi16(idx, table));
  }
}

// Half `half` of a Q6_K block (128 weights, sub-blocks c = 4 half + k) as bfloat16, sub-block c at
// out + k cs, h the block's header: kq_bf16_32's values (a_s (q - 32) exact in float32, rounded to
// nearest even). With AVX512-VBMI the half's codes (64 bytes of low nibbles, 32 of high bit pairs) are
// assembled 64 to a register (the high pairs moved to bits 4-5 by one variable word shift per 256-bit
// half), and each 16 spread to float32 lanes by one byte permute into the float 2^23 + q (its low
// byte), less 2^23 + 32 (exact: q - 32, +0 at 32 as the int8 conversion gives); without it,
// kq_weights' conversion.
inline void kq_q6k_bf16_half(const uint8_t* blk, int half, const KqHeader& h, at::BFloat16* out, int64_t cs) {
#if defined(__AVX512VBMI__)
  const __m512i nib = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  // sub-blocks k = 0, 1 take bit pairs 0-1, 2-3 (to bits 4-5: left by 4, by 2); k = 2, 3 take 4-5,
  // 6-7 (right by 0, by 2); a word shift keeps each byte's own bits at 4-5
  const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i magic = _mm512_set1_epi32(0x4B000000);  // 2^23: q in the low mantissa byte
  const __m512 bias = _mm512_set1_ps(8388640.f);        // 2^23 + 32
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i L = _mm512_loadu_si512(blk + 64 * half);
  const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * half)));
  const __m512i codes[2] = {
      _mm512_or_si512(_mm512_and_si512(L, nib), _mm512_and_si512(_mm512_sllv_epi16(H, left), top)),
      _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), nib), _mm512_and_si512(_mm512_srlv_epi16(H, right), top))};
  for (int k = 0; k < 4; ++k) {  // sub-block k's codes: bytes 32 (k % 2) .. + 31 of codes[k / 2]
    const int c = 4 * half + k;
    __m512 w[2];
    for (int g = 0; g < 2; ++g) {
      // byte 4 j of lane j <- code byte 32 (k % 2) + 16 g + j; the other bytes keep 2^23's
      const __m512i sel = _mm512_add_epi32(lane, _mm512_set1_epi32(32 * (k % 2) + 16 * g));
      const __m512 f = _mm512_castsi512_ps(_mm512_mask_permutexvar_epi8(magic, 0x1111111111111111ULL, sel, codes[k / 2]));
      w[g] = _mm512_mul_ps(_mm512_set1_ps(h.a[2 * c + g]), _mm512_sub_ps(f, bias));
    }
    _mm512_storeu_si512(out + k * cs, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
  }
#else
  for (int k = 0; k < 4; ++k) {
    const Kq32 w = kq_weights<kQ6_K>(blk, 4 * half + k, h);
    _mm512_storeu_si512(out + k * cs, (__m512i)_mm512_cvtne2ps_pbh(w.v[1], w.v[0]));
  }
#endif
}

// Q4_K sub-blocks c (even) and c + 1 as bfloat16 in weight order, to out and out + 32: kq_bf16_32's
// values from their shared 32 code bytes widened to words once; each sub-block's 16 values a q + b
// rounded to nearest even into both halves of a 32-word table, so that a word's whole code byte indexes
// the low nibble's value (vpermw reads 5 bits: the high nibble's low bit picks a copy) and the byte
// shifted right by 4 the high one's.
inline void kq_q4k_bf16_pair_words(const uint8_t* blk, int c, const KqHeader& h, uint16_t* out) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 16 * c)));
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 v0 = _mm512_fmadd_ps(_mm512_set1_ps(h.a[c]), iota, _mm512_set1_ps(h.b[c]));
  const __m512 v1 = _mm512_fmadd_ps(_mm512_set1_ps(h.a[c + 1]), iota, _mm512_set1_ps(h.b[c + 1]));
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(w, (__m512i)_mm512_cvtne2ps_pbh(v0, v0)));
  _mm512_storeu_si512(out + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), (__m512i)_mm512_cvtne2ps_pbh(v1, v1)));
}

// Weight rows [0, rows) (row stride rb bytes; q8 codes: their scales su, K / 32 a row) as bfloat16 into
// the scratch s [rows, K] (each exact value rounded to nearest even, in weight order), then zero rows up
// to `upto`. `next` (or null): the bytes at the same offsets from it are prefetched as these are read
// (the thread's next rows arrive while these decode and multiply).
template <int T>
inline void kq_decode_rows(const uint8_t* wp, int64_t rb, int64_t rows, int64_t K, uint16_t* s, const float* su,
                           const uint8_t* next, int64_t upto) {
  constexpr int64_t per = KqTraits<T>::per, bytes = KqTraits<T>::bytes;
  constexpr int subs = static_cast<int>(per / 32);
  const int64_t nb = K / per, ahead = next == nullptr ? 0 : next - wp;
  for (int64_t r = 0; r < rows; ++r) {
    KqHeader h;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wp + r * rb + b * bytes;
      if (ahead != 0)
        for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + ahead + l), _MM_HINT_T0);
      uint16_t* out = s + r * K + b * per;
      if constexpr (T == kQ8Codes) h.a[0] = su[r * nb + b];
      else kq_header<T>(blk, h);
      if constexpr (T == kQ4_K) {
        for (int cc = 0; cc < subs; cc += 2) kq_q4k_bf16_pair_words(blk, cc, h, out + 32 * cc);
      } else if constexpr (T == kQ6_K) {
        for (int half = 0; half < 2; ++half)
          kq_q6k_bf16_half(blk, half, h, reinterpret_cast<at::BFloat16*>(out + 128 * half), 32);
      } else {
        for (int cc = 0; cc < subs; ++cc) kq_bf16_32<T>(blk, cc, h, reinterpret_cast<at::BFloat16*>(out + 32 * cc));
      }
    }
  }
  if (upto > rows) std::memset(static_cast<void*>(s + rows * K), 0, (upto - rows) * K * 2);
}
#endif

#ifdef HELIOS_AMX
// Tile products over `chunks` column chunks of 32: A tiles 0, 1 (weight rows 0-15, 16-31 of the scratch,
// row stride ss elements), B from xb (chunk stride xs 32-bit words). TWO: two row tiles (B tiles 2, 3
// into accumulators 4, 5 and 6, 7); else one, with even chunks into 4, 5 and odd ones into 6, 7 (two
// dependency chains where one would wait on the tile unit's latency).
template <bool TWO>
inline void kq_amx_tiles(const uint16_t* w, int64_t ss, const uint32_t* xb, int64_t xs, int64_t chunks) {
  const int64_t stride = ss * 2;
  int64_t k = 0;
  for (; k + 1 < chunks || (TWO && k < chunks); k += TWO ? 1 : 2) {
    _tile_loadd(0, w + k * 32, stride);
    _tile_loadd(1, w + 16 * ss + k * 32, stride);
    _tile_loadd(2, xb + k * xs, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 1, 2);
    if constexpr (TWO) {
      _tile_loadd(3, xb + k * xs + 256, 64);
      _tile_dpbf16ps(6, 0, 3);
      _tile_dpbf16ps(7, 1, 3);
    } else {
      _tile_loadd(0, w + k * 32 + 32, stride);
      _tile_loadd(1, w + 16 * ss + k * 32 + 32, stride);
      _tile_loadd(3, xb + (k + 1) * xs, 64);
      _tile_dpbf16ps(6, 0, 3);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  if (!TWO && k < chunks) {
    _tile_loadd(0, w + k * 32, stride);
    _tile_loadd(1, w + 16 * ss + k * 32, stride);
    _tile_loadd(2, xb + k * xs, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 1, 2);
  }
}

// The accumulators out: row tiles mt (and mt + 1 when two) of y (bfloat16 [M, N]), weight rows n0 ..
// n0 + rows. One row tile: the even and odd chains added first.
template <typename Out>
inline void kq_amx_out(bool two, int64_t mt, int64_t M, int64_t N, int64_t n0, int64_t rows, Out* yp) {
  alignas(64) float c[4][256];
  _tile_stored(4, c[0], 64);
  _tile_stored(5, c[1], 64);
  _tile_stored(6, c[2], 64);
  _tile_stored(7, c[3], 64);
  if (!two)
    for (int a = 0; a < 2; ++a)
      for (int64_t e = 0; e < 256; e += 16)
        _mm512_store_ps(c[a] + e, _mm512_add_ps(_mm512_load_ps(c[a] + e), _mm512_load_ps(c[2 + a] + e)));
  // c[2 b + a][i * 16 + j]: weight row n0 + 16 a + i, activation row 16 (mt + b) + j
  for (int b = 0; b < (two ? 2 : 1); ++b)
    for (int64_t j = 0; j < 16 && 16 * (mt + b) + j < M; ++j) {
      Out* out = yp + (16 * (mt + b) + j) * N + n0;
      for (int a = 0; a < 2; ++a)
        for (int64_t i = 0; i < 16 && 16 * a + i < rows; ++i) store(c[2 * b + a][i * 16 + j], out + 16 * a + i);
    }
}

// Every pair of activation row tiles (MT of them, x packed at xpack, chunk stride xs) over one unit's
// decoded weight rows (w, row stride ss elements, `chunks` column chunks of 32), each pair's
// accumulators written out to y.
template <typename Out>
inline void kq_amx_passes(const uint16_t* w, int64_t ss, const uint32_t* xpack, int64_t xs, int64_t chunks, int64_t MT,
                          int64_t M, int64_t N, int64_t n0, int64_t rows, Out* yp) {
  for (int64_t mt = 0; mt < MT; mt += 2) {
    const bool two = mt + 1 < MT;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    if (two) kq_amx_tiles<true>(w, ss, xpack + mt * 256, xs, chunks);
    else kq_amx_tiles<false>(w, ss, xpack + mt * 256, xs, chunks);
    kq_amx_out(two, mt, M, N, n0, rows, yp);
  }
}

// Q4_K sub-blocks c (even) and c + 1 as bfloat16 at once: they share their 32 code bytes (low and high
// nibbles), widened once; kq_bf16_32's values.
inline void kq_q4k_bf16_pair(const uint8_t* blk, int c, const KqHeader& h, at::BFloat16* out0, at::BFloat16* out1) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 16 * c)));
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i t0 = _mm512_castsi256_si512(
      (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_set1_ps(h.a[c]), iota, _mm512_set1_ps(h.b[c]))));
  const __m512i t1 = _mm512_castsi256_si512(
      (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_set1_ps(h.a[c + 1]), iota, _mm512_set1_ps(h.b[c + 1]))));
  _mm512_storeu_si512(out0, _mm512_permutexvar_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x0F)), t0));
  _mm512_storeu_si512(out1, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), t1));
}

// One 32-column chunk ch of 32 decoded weight rows (a: A0 then A1, 64 bytes a row) against x's B tiles:
// TWO row tiles into accumulators 4-7; one row tile with even chunks into 4, 5 and odd ones into 6, 7
// (two dependency chains where one would wait on the tile unit's latency).
template <bool TWO>
inline void kq_amx_chunk(const uint16_t* a, const uint32_t* xb, int64_t xs, int64_t ch) {
  _tile_loadd(0, a, 64);
  _tile_loadd(1, a + 512, 64);
  if constexpr (TWO) {
    _tile_loadd(2, xb + ch * xs, 64);
    _tile_loadd(3, xb + ch * xs + 256, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 1, 2);
    _tile_dpbf16ps(6, 0, 3);
    _tile_dpbf16ps(7, 1, 3);
  } else if (ch & 1) {
    _tile_loadd(3, xb + ch * xs, 64);
    _tile_dpbf16ps(6, 0, 3);
    _tile_dpbf16ps(7, 1, 3);
  } else {
    _tile_loadd(2, xb + ch * xs, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 1, 2);
  }
}

// One unit of 32 weight rows (rows of them real, from wu, row stride rb) against one or two row tiles
// of x (TWO), into accumulators 4-7: each 32-column chunk of the 32 rows decoded into one of two 2 KB
// buffers (`buf`, tile layout: A0 then A1, 64 bytes a row) and multiplied at once, so the tile unit
// works on one chunk while the vector units decode the next. Headers of the 256-weight types are read
// once per block column for all 32 rows; `next` (the thread's next unit, or null) is prefetched a few
// lines per chunk.
template <int T, bool TWO>
inline void kq_amx_unit(const uint8_t* wu, int64_t rb, int64_t rows, int64_t K, const uint32_t* xb, int64_t xs,
                        uint16_t* buf, const uint8_t* next, const float* su) {
  constexpr int64_t per = KqTraits<T>::per, bytes = KqTraits<T>::bytes;
  constexpr int subs = static_cast<int>(per / 32);
  const int64_t nb = K / per, chunks = K / 32, lines = next != nullptr ? (kKqUnitRows * rb + 63) / 64 : 0;
  KqHeader h[kKqUnitRows];
  if (rows < kKqUnitRows)
    for (int p = 0; p < 2; ++p) std::memset(static_cast<void*>(buf + p * 1024 + rows * 32), 0, (kKqUnitRows - rows) * 64);
  int64_t ch = 0;
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (per == 256)
      for (int64_t r = 0; r < rows; ++r) kq_header<T>(wu + r * rb + b * bytes, h[r]);
    for (int cc = 0; cc < subs; ++cc, ++ch) {
      // the thread's next unit, in order, a share per chunk (the weights are read column-wise across
      // 32 rows here, which the hardware prefetchers follow poorly; a few lines at a time, so the
      // prefetches do not queue for fill buffers)
      for (int64_t l = ch * lines / chunks; l < (ch + 1) * lines / chunks; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(next + 64 * l), _MM_HINT_T0);
      uint16_t* a = buf + (ch & 1) * 1024;
      at::BFloat16* ab = reinterpret_cast<at::BFloat16*>(a);
      if constexpr (T == kQ4_K) {  // the pair at the even chunk, into both buffers (the odd one's chunk is ch + 1)
        if ((cc & 1) == 0)
          for (int64_t r = 0; r < rows; ++r)
            kq_q4k_bf16_pair(wu + r * rb + b * bytes, cc, h[r], ab + r * 32, ab + 1024 + r * 32);
      } else for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* blk = wu + r * rb + b * bytes;
        if constexpr (T == kQ8Codes) {
          h[0].a[0] = su[r * nb + b];
          kq_bf16_32<T>(blk, 0, h[0], ab + r * 32);
        } else if constexpr (per == 32) {
          kq_header<T>(blk, h[0]);
          kq_bf16_32<T>(blk, 0, h[0], ab + r * 32);
        } else {
          kq_bf16_32<T>(blk, cc, h[r], ab + r * 32);
        }
      }
      kq_amx_chunk<TWO>(a, xb, xs, ch);
    }
  }
}

// kq_amx_unit for Q6_K, half a block (4 chunks) at a time: the 32 rows' halves into one of two sets of
// 4 chunk buffers (`buf`, 8 x 2 KB), the previous half's 4 chunks multiplied in between the rows (the
// tile unit works while the vector units decode; tile registers are not renamed, so a run of tile
// products after the decode would stall it); `next` prefetched a share per row and half.
template <bool TWO>
inline void kq_amx_unit_q6k(const uint8_t* wu, int64_t rb, int64_t rows, int64_t K, const uint32_t* xb, int64_t xs,
                            uint16_t* buf, const uint8_t* next) {
  constexpr int64_t bytes = KqTraits<kQ6_K>::bytes;
  const int64_t nb = K / 256, lines = next != nullptr ? (kKqUnitRows * rb + 63) / 64 : 0;
  KqHeader h[kKqUnitRows];
  if (rows < kKqUnitRows)
    for (int p = 0; p < 8; ++p) std::memset(static_cast<void*>(buf + p * 1024 + rows * 32), 0, (kKqUnitRows - rows) * 64);
  const int64_t steps = 2 * nb * rows;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t r = 0; r < rows; ++r) kq_header<kQ6_K>(wu + r * rb + b * bytes, h[r]);
    for (int half = 0; half < 2; ++half) {
      const int64_t hb = 2 * b + half;  // chunks 4 hb .. 4 hb + 3, in buffers 4 (hb % 2) ..
      at::BFloat16* set = reinterpret_cast<at::BFloat16*>(buf) + (hb & 1) * 4096;
      int64_t done = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t st = hb * rows + r;
        for (int64_t l = st * lines / steps; l < (st + 1) * lines / steps; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(next + 64 * l), _MM_HINT_T0);
        kq_q6k_bf16_half(wu + r * rb + b * bytes, half, h[r], set + r * 32, 1024);
        for (; hb > 0 && done < (r + 1) * 4 / rows; ++done) {  // the previous half's chunks
          const int64_t ch = 4 * (hb - 1) + done;
          kq_amx_chunk<TWO>(buf + (ch & 7) * 1024, xb, xs, ch);
        }
      }
    }
  }
  for (int64_t j = 0; j < 4; ++j) {  // the last half's chunks (hb = 2 nb - 1 is odd: buffers 4-7)
    const int64_t ch = 4 * (2 * nb - 1) + j;
    kq_amx_chunk<TWO>(buf + (ch & 7) * 1024, xb, xs, ch);
  }
}

// Units of 32 weight rows split over the threads. One or two row tiles (M <= 32): kq_amx_unit, chunk by
// chunk in L1, the accumulators kept in the tiles across the row. More rows: the unit's whole rows
// decoded once into an L2 scratch (kq_decode_rows), then each pair of row tiles passes over it.
template <int T, typename Out>
void kq_amx_impl(const uint32_t* xpack, int64_t MT, const uint8_t* wp, Out* yp, int64_t M, int64_t K, int64_t N,
                 const float* sp = nullptr) {
  constexpr int64_t per = KqTraits<T>::per, bytes = KqTraits<T>::bytes;
  const int64_t rb = K / per * bytes, kc = K / 32;
  const int64_t units = (N + kKqUnitRows - 1) / kKqUnitRows;
  const int64_t xs = MT * 256;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    amx_configure();
    if (MT <= 2) {
      uint16_t* buf = kq_scratch<uint16_t>((T == kQ6_K ? 8 : 2) * 1024);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t n0 = u * kKqUnitRows, rows = std::min(kKqUnitRows, N - n0);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        const uint8_t* next = u + 1 < u1 ? wp + (n0 + kKqUnitRows) * rb : nullptr;
        const float* su = sp == nullptr ? nullptr : sp + n0 * (K / 32);
        if constexpr (T == kQ6_K) {
          if (MT == 2) kq_amx_unit_q6k<true>(wp + n0 * rb, rb, rows, K, xpack, xs, buf, next);
          else kq_amx_unit_q6k<false>(wp + n0 * rb, rb, rows, K, xpack, xs, buf, next);
        } else if (MT == 2) {
          kq_amx_unit<T, true>(wp + n0 * rb, rb, rows, K, xpack, xs, buf, next, su);
        } else {
          kq_amx_unit<T, false>(wp + n0 * rb, rb, rows, K, xpack, xs, buf, next, su);
        }
        kq_amx_out(MT == 2, 0, M, N, n0, rows, yp);
      }
    } else {
      at::BFloat16* w = kq_scratch<at::BFloat16>(kKqUnitRows * K);
      const uint16_t* w16 = reinterpret_cast<const uint16_t*>(w);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t n0 = u * kKqUnitRows, rows = std::min(kKqUnitRows, N - n0);
        kq_decode_rows<T>(wp + n0 * rb, rb, rows, K, reinterpret_cast<uint16_t*>(w),
                          sp == nullptr ? nullptr : sp + n0 * (K / 32), nullptr, kKqUnitRows);
        kq_amx_passes(w16, K, xpack, xs, kc, MT, M, N, n0, rows, yp);
      }
    }
    _tile_release();
  });
}
#endif

// ---- The same products with AVX512-BF16 dot products (kquant_linear_tiles where the tiles are absent) ----
// Where the CPU has AVX512-BF16 but no AMX tiles (AMD Zen 4 and 5; an Intel machine that refuses the
// tile state), kquant_linear_tiles and q8_linear_tiles's rounded mode run the same products with
// VDPBF16PS: each thread takes units of 32 weight rows, 8 rows at a time where their bfloat16 rows fit in 32
// KB, else 4 (kq_dp_group_rows): those rows decoded to bfloat16 into a scratch by kq_decode_rows (the tiles'
// weights: each exact value rounded to nearest even; the group two ahead prefetched), then each block of
// up to 3 (6) activation rows passes over them: 24 accumulators of 16 float32 lanes, lane j the chain over the
// 32-column chunks of the products of columns 2 j and 2 j + 1 (VDPBF16PS adds the pair's two products
// to the lane in turn), then the 16 lanes summed by kq_tree16. Products of bfloat16 values are exact in
// float32 and every sum is float32: the tiles' contract in another order of sums (the two backends
// differ by float32 roundings); each output's order depends on nothing but K, so a row gets the same
// bits whatever rows share its step and however many threads run it. On AMD Zen 5 (2 threads,
// 2026-12-06, scripts/bench_kquant_tiles.py) Q4_K 17,920 x 1,536 took 35.6 ps a weight at 8 rows and 101
// at 32 against the exact kernel's 60.1 and 249 (docs/benchmarks.md, "The tiles path on AVX512-BF16").
#ifdef HELIOS_KQ_TILES
// Weight rows decoded into the scratch at a time: 8 where their bfloat16 rows fit in 32 KB of L1 (the
// activation rows then pass over twice the weights per load: Q4_K 17,920 x 1,536 at 16 / 32 / 64 rows 51-53 /
// 87 / 158-160 ps a weight against 55 / 96-99 / 173-177 with 4, 2026-12-06, Zen 5, 2 threads), else 4 (Q6_K
// 1,536 x 8,960: 4 rows 57-59 / 109-113 against 66-68 / 118 with 8).
inline int kq_dp_group_rows(int64_t K) { return 8 * K * 2 <= 32 * 1024 ? 8 : 4; }
// Weight rows w (G of them, row stride K, zero past the real ones) times activation rows x (MB of them,
// row stride K) over all K columns (a multiple of 32): part[m * G + n] = the dot product of x row m and
// weight row n, lane chains then a fixed tree.
template <int G, int MB>
inline void kq_dp_block(const uint16_t* w, const uint16_t* x, int64_t K, float* part) {
  __m512 acc[G][MB];
  for (int n = 0; n < G; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = kqb_load_bh(x + m * K + k);
    for (int n = 0; n < G; ++n) {
      const __m512bh wv = kqb_load_bh(w + n * K + k);
      for (int m = 0; m < MB; ++m) acc[n][m] = _mm512_dpbf16_ps(acc[n][m], wv, xv[m]);
    }
  }
  for (int n = 0; n < G; ++n)
    for (int m = 0; m < MB; ++m) part[m * G + n] = kq_tree16(acc[n][m]);
}

// kq_dp_block for a block of mb <= MB activation rows (the instance of exactly mb rows).
template <int G, int MB>
inline void kq_dp_block_of(int64_t mb, const uint16_t* w, const uint16_t* x, int64_t K, float* part) {
  if constexpr (MB > 1) {
    if (mb < MB) return kq_dp_block_of<G, MB - 1>(mb, w, x, K, part);
  }
  kq_dp_block<G, MB>(w, x, K, part);
}

// One group's decoded weight rows (w: G rows, row stride K) times every activation row of x (bfloat16
// [M, K], in blocks of up to 24 / G rows, as even as they go) into y's columns n0 .. n0 + rows (rows <= G).
template <int G, typename Out>
void kq_dp_group(const uint16_t* w, const uint16_t* x, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t rows,
                 Out* yp) {
  constexpr int64_t most = 24 / G;
  const int64_t blocks = (M + most - 1) / most;
  for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
    const int64_t mb = (M - m0) / (blocks - b);
    const uint16_t* xb = x + m0 * K;
    alignas(64) float part[24];
    kq_dp_block_of<G, most>(mb, w, xb, K, part);
    for (int64_t m = 0; m < mb; ++m)
      for (int64_t r = 0; r < rows; ++r) store(part[m * G + r], yp + (m0 + m) * N + n0 + r);
    m0 += mb;
  }
}

template <int T, int G, typename Out>
void kq_dp_units(const at::Tensor& xc, const uint8_t* wp, Out* yp, int64_t M, int64_t K, int64_t N, const float* sp) {
  constexpr int64_t per = KqTraits<T>::per, bytes = KqTraits<T>::bytes;
  const int64_t rb = K / per * bytes;
  const int64_t units = (N + kKqUnitRows - 1) / kKqUnitRows;
  const uint16_t* x = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    uint16_t* w = kq_scratch<uint16_t>(G * K);
    const int64_t end = std::min(N, u1 * kKqUnitRows);
    for (int64_t n0 = u0 * kKqUnitRows; n0 < end; n0 += G) {
      const int64_t rows = std::min<int64_t>(G, end - n0);
      const uint8_t* next = n0 + 2 * G < end ? wp + (n0 + 2 * G) * rb : nullptr;
      kq_decode_rows<T>(wp + n0 * rb, rb, rows, K, w, sp == nullptr ? nullptr : sp + n0 * (K / 32), next, G);
      kq_dp_group<G>(w, x, M, K, N, n0, rows, yp);
    }
  });
}

template <int T, typename Out>
void kq_dp_impl(const at::Tensor& xc, const uint8_t* wp, Out* yp, int64_t M, int64_t K, int64_t N,
                const float* sp = nullptr) {
  if (kq_dp_group_rows(K) == 8) kq_dp_units<T, 8>(xc, wp, yp, M, K, N, sp);
  else kq_dp_units<T, 4>(xc, wp, yp, M, K, N, sp);
}
#endif

// 0: kquant_linear_tiles and q8_linear_tiles take the AMX tiles where permitted, else the AVX512-BF16 dot
// products; 1: the dot products even where tiles are permitted (tests compare both backends there).
std::atomic<int> kq_tiles_mode{0};

// The backend kquant_linear_tiles runs on now: 2 the AMX tiles, 1 AVX512-BF16 dot products, 0 none.
int64_t kquant_tiles_backend() {
#ifdef HELIOS_AMX
  if (kq_tiles_mode.load() == 0 && amx_permitted()) return 2;
#endif
#ifdef HELIOS_KQ_TILES
  return 1;
#else
  return 0;
#endif
}

// Forces the AVX512-BF16 dot products (`dp`) or restores the default choice; returns the backend now.
int64_t set_kquant_tiles_dp(bool dp) {
  kq_tiles_mode.store(dp ? 1 : 0);
  return kquant_tiles_backend();
}

// Whether kquant_linear_tiles and q8_linear_tiles can run here (on either backend).
bool kquant_tiles_supported() { return kquant_tiles_backend() != 0; }

#ifdef HELIOS_AMX
// x [M, K] (bfloat16, contiguous) as the B operand: for column chunk k and row tile t, tile (k MT + t) of
// 16 pairs x 16 rows (32-bit pairs), zero rows past M; in the calling thread's scratch.
const uint32_t* kq_amx_pack_x(const at::Tensor& xc, int64_t MT) {
  const int64_t M = xc.size(0), K = xc.size(1), kc = K / 32;
  uint32_t* xpack = kq_scratch<uint32_t>(kc * MT * 256);
  const uint32_t* xs = reinterpret_cast<const uint32_t*>(xc.data_ptr<c10::BFloat16>());
  static const std::array<uint32_t, 16> zero_row{};
  for (int64_t t = 0; t < MT; ++t) {
    const uint32_t* src[16];
    for (int64_t i = 0; i < 16; ++i) src[i] = 16 * t + i < M ? xs + (16 * t + i) * (K / 2) : zero_row.data();
    for (int64_t k = 0; k < kc; ++k) {
      amx_transpose16(src, xpack + (k * MT + t) * 256, 16);
      for (int64_t i = 0; i < 16; ++i)
        if (16 * t + i < M) src[i] += 16;
    }
  }
  return xpack;
}
#endif

// kquant_linear on AMX tiles for bfloat16 x [M, K]: [M, N] in bfloat16, or float32 with `float_out`
// (the contract at the head of this section; needs kquant_tiles_supported()).
at::Tensor kquant_linear_tiles(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t N, bool float_out) {
  TORCH_CHECK(kquant_tiles_supported(), "kquant_linear_tiles: built only for CPUs with AMX or AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              "kquant_linear_tiles: x is a 2-d bfloat16 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  kq_check_blocks(blocks, type, N, K, "kquant_linear_tiles");
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0 || N == 0) return y;
#ifdef HELIOS_KQ_TILES
  if (kquant_tiles_backend() == 1) {
    const at::Tensor xc = x.contiguous();
    const uint8_t* wp = blocks.data_ptr<uint8_t>();
    if (float_out) {
      float* yp = y.data_ptr<float>();
      kq_dispatch(type, [&](auto t) { kq_dp_impl<decltype(t)::value>(xc, wp, yp, M, K, N); });
    } else {
      c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
      kq_dispatch(type, [&](auto t) { kq_dp_impl<decltype(t)::value>(xc, wp, yp, M, K, N); });
    }
    return y;
  }
#endif
#ifdef HELIOS_AMX
  const int64_t MT = (M + 15) / 16;
  const uint32_t* xpack = kq_amx_pack_x(x.contiguous(), MT);
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  if (float_out) {
    float* yp = y.data_ptr<float>();
    kq_dispatch(type, [&](auto t) { kq_amx_impl<decltype(t)::value>(xpack, MT, wp, yp, M, K, N); });
  } else {
    c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
    kq_dispatch(type, [&](auto t) { kq_amx_impl<decltype(t)::value>(xpack, MT, wp, yp, M, K, N); });
  }
#endif
  return y;
}

// ---- q8_linear_tiles(exact): a Q8_0 output projection on the AMX tiles with its exact weights ----------------
// q8_linear_tiles rounds each weight scale * code to bfloat16 (k-quant models' choice); an output
// projection whose logits must not be rounded (the default model's near tie) keeps the exact weights:
// each w = scale * code is split into three bfloat16 terms, w = hi + mid + lo, hi = bf16(w), mid =
// bf16(w - hi), lo = bf16(w - hi - mid). With a float16 scale (a GGUF Q8_0 block's) w has at most 18
// significant bits, each rounding to nearest leaves at most 8 fewer, so lo is exact and the three add
// up to w exactly; each term times a bfloat16 activation is exact in float32 and the tile unit sums
// them in float32 (its order: a pair's two products, then the pairs in k order; the three terms of
// a block are three chunks in a row). A float32 scale of more bits (a float head quantized by Helios)
// loses at most 2^-24 of w. Per 32 weight rows the rows are split into a [32, 3K] bfloat16 scratch
// (block b's terms at columns 96 b .. 96 b + 95), then every pair of activation row tiles passes over
// it with x's chunks each given three times.
#ifdef HELIOS_AMX
inline __m512 kq_bf16_widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// The blocks of one weight row (codes q, scales a, kc blocks of 32) into hi, mid and lo (block b's 32
// bfloat16 words each at out + 96 b, + 32, + 64): two blocks at a time, whose chains interleave.
inline void kq_q8_split3_row(const int8_t* q, const float* a, int64_t kc, uint16_t* out) {
  for (int64_t b = 0; b < kc; b += 2) {
    const int n = b + 1 < kc ? 2 : 1;
    __m512 r[2][2];
    for (int i = 0; i < n; ++i) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * (b + i)));
      const __m512 av = _mm512_set1_ps(a[b + i]);
      r[i][0] = _mm512_mul_ps(av, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c))));
      r[i][1] = _mm512_mul_ps(av, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1))));
    }
    for (int t = 0; t < 3; ++t)
      for (int i = 0; i < n; ++i) {
        const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(r[i][1], r[i][0]);
        _mm512_storeu_si512(out + 96 * (b + i) + 32 * t, h);
        if (t < 2) {
          r[i][0] = _mm512_sub_ps(r[i][0], kq_bf16_widen(_mm512_castsi512_si256(h)));
          r[i][1] = _mm512_sub_ps(r[i][1], kq_bf16_widen(_mm512_extracti64x4_epi64(h, 1)));
        }
      }
  }
}
// q8_linear_tiles with `exact`: the split terms' products (the contract above).
void q8_amx_exact(const at::Tensor& x, const int8_t* qp, const float* sp, float* yp, int64_t M, int64_t K, int64_t N) {
  const int64_t MT = (M + 15) / 16, kc = K / 32, xs = MT * 256, K3 = 3 * K;
  const uint32_t* xpack = kq_amx_pack_x(x.contiguous(), MT);
  at::Tensor x3 = at::empty({3 * kc * xs}, x.options().dtype(at::kInt));
  uint32_t* xp3 = reinterpret_cast<uint32_t*>(x3.data_ptr<int32_t>());
  for (int64_t k = 0; k < kc; ++k)
    for (int t = 0; t < 3; ++t) std::memcpy(xp3 + (3 * k + t) * xs, xpack + k * xs, xs * sizeof(uint32_t));
  const int64_t units = (N + kKqUnitRows - 1) / kKqUnitRows;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    amx_configure();
    uint16_t* w = reinterpret_cast<uint16_t*>(kq_scratch<at::BFloat16>(kKqUnitRows * K3));
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n0 = u * kKqUnitRows, rows = std::min(kKqUnitRows, N - n0);
      for (int64_t r = 0; r < rows; ++r) kq_q8_split3_row(qp + (n0 + r) * K, sp + (n0 + r) * kc, kc, w + r * K3);
      std::memset(static_cast<void*>(w + rows * K3), 0, (kKqUnitRows - rows) * K3 * 2);
      kq_amx_passes(w, K3, xp3, xs, 3 * kc, MT, M, N, n0, rows, yp);
    }
  });
}
#endif

// q8_linear on AMX tiles for bfloat16 x [M, K] and q8_linear's codes [N, K] / scales [N, K / 32]:
// float32 [M, N], each weight scale * code rounded to bfloat16 (kquant_linear_tiles's contract), or with
// `exact` split into three bfloat16 terms (q8_amx_exact).
at::Tensor q8_linear_tiles(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, bool exact) {
  TORCH_CHECK(kquant_tiles_supported(), "q8_linear_tiles: built only for CPUs with AMX or AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              "q8_linear_tiles: x is a 2-d bfloat16 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.size(1) == K &&
                  K % 32 == 0, "q8_linear_tiles: codes are contiguous int8 [N, K], K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / 32),
              "q8_linear_tiles: scales are contiguous float32 [N, K / 32]");
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  TORCH_CHECK(!exact || kquant_tiles_backend() == 2, "q8_linear_tiles: the exact mode runs on AMX tiles only");
#ifdef HELIOS_KQ_TILES
  if (kquant_tiles_backend() == 1) {
    kq_dp_impl<kQ8Codes>(x.contiguous(), reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>()),
                         y.data_ptr<float>(), M, K, N, scales.data_ptr<float>());
    return y;
  }
#endif
#ifdef HELIOS_AMX
  if (exact) {
    q8_amx_exact(x, codes.data_ptr<int8_t>(), scales.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
    return y;
  }
  const int64_t MT = (M + 15) / 16;
  const uint32_t* xpack = kq_amx_pack_x(x.contiguous(), MT);
  kq_amx_impl<kQ8Codes>(xpack, MT, reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>()), y.data_ptr<float>(), M,
                        K, N, scales.data_ptr<float>());
#endif
  return y;
}

// One gated delta rule update per (token, head), in place on the token's state slot (Gated DeltaNet
// decode, `helios.models.gated_delta`): S <- exp(g) S; delta = beta (v - S^T k); S <- S + k delta^T;
// out = S^T q. q, k [N, H, dk], v [N, H, dv], g, beta [N, H], state [slots, H, dk, dv], all float32
// and contiguous; slots [N] int64; fresh [N] uint8 (1: the slot starts from zeros). Two passes over
// each state: decay with the prediction, then the write with the output.
at::Tensor gated_delta_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots,
                            const at::Tensor& fresh) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1) && g.dim() == 2 && g.size(0) == q.size(0) && g.size(1) == q.size(1) &&
                  beta.sizes() == g.sizes() && state.dim() == 4 && state.size(1) == q.size(1) &&
                  state.size(2) == q.size(2) && state.size(3) == v.size(2) && slots.dim() == 1 &&
                  slots.size(0) == q.size(0) && fresh.sizes() == slots.sizes(),
              "gated_delta_step: q, k [N, H, dk], v [N, H, dv], g, beta [N, H], state [S, H, dk, dv], slots [N]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &g, &beta, &state}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "gated_delta_step: contiguous float32");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && fresh.scalar_type() == at::kByte &&
                  fresh.is_contiguous(), "gated_delta_step: int64 slots, uint8 fresh");
  const int64_t N = q.size(0), H = q.size(1), dk = q.size(2), dv = v.size(2), S = state.size(0);
  at::Tensor out = at::empty({N, H, dv}, v.options());
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(sp[n] >= 0 && sp[n] < S, "gated_delta_step: a slot outside the state");
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  const uint8_t* fp = fresh.data_ptr<uint8_t>();
  float* stp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(dv));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / H, h = i % H;
      float* st = stp + (sp[n] * H + h) * dk * dv;
      const float* qi = qp + i * dk;
      const float* ki = kp + i * dk;
      const float* vi = vp + i * dv;
      float* oi = op + i * dv;
      if (fp[n]) std::fill(st, st + dk * dv, 0.0f);
      const float decay = std::exp(gp[i]), b = bp[i];
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t a = 0; a < dk; ++a) {
        float* row = st + a * dv;
        const float ka = ki[a];
        for (int64_t j = 0; j < dv; ++j) {
          row[j] *= decay;
          acc[j] += row[j] * ka;
        }
      }
      for (int64_t j = 0; j < dv; ++j) acc[j] = (vi[j] - acc[j]) * b;  // delta
      std::fill(oi, oi + dv, 0.0f);
      for (int64_t a = 0; a < dk; ++a) {
        float* row = st + a * dv;
        const float ka = ki[a], qa = qi[a];
        for (int64_t j = 0; j < dv; ++j) {
          row[j] += ka * acc[j];
          oi[j] += row[j] * qa;
        }
      }
    }
  });
  return out;
}


// ---- k-quant decode layers: the layers of a k-quant decoder in one call ---------------------------------
// What a llama-family layer (`llama._DecoderLayer.forward`) or an MoE layer (`MoELayer.forward`) does
// with the fused kernels for an all-decode step, layer after layer, without the Python between its
// operators (20-30 calls a layer, which at a few decode rows cost about as much as the layer's
// attention): the same operators in the same order, so the same bits. Held as a `KqDecodePlan` (a torch
// custom class built once from the layers' weights, so a step passes no per-expert lists). Per layer:
// two RMSNorm weights, an optional q/k/v bias and per-head q/k norm, k-quant q/k/v and o projections
// (each one or more row segments of GGUF blocks, as `KQuantLinear` holds them), full rotary RoPE, and
// either a SwiGLU MLP of k-quant gate/up and down projections or a router with routed experts as GGUF
// blocks (`BlockExperts`; no shared experts). Routing: softmax top-k (`moe.route`'s operators: softmax
// in float32, topk, the optional renormalisation, the weights cast to the logits' dtype); the router
// weight is passed per step (the layer's float32 copy for bfloat16 activations: `MoELayer._router_logits`'s
// product).
struct KqProjection {
  std::vector<at::Tensor> blocks;
  std::vector<int64_t> types, outs;
};

// KQuantLinear.forward's kernel paths: each segment through kquant_linear (or, with `tiles`, through
// kquant_linear_tiles: the tiles' bfloat16 steps of TILE_ROWS rows, but for the segments that
// kquant_pair_before_tiles keeps on the pair dot path), joined along the columns.
at::Tensor kq_project(const KqProjection& p, const at::Tensor& x, bool tiles) {
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < p.blocks.size(); ++i)
    outs.push_back(tiles && !kquant_pair_before_tiles(x.size(0), p.types[i])
                       ? kquant_linear_tiles(x, p.blocks[i], p.types[i], p.outs[i], false)
                       : kquant_linear(x, p.blocks[i], p.types[i], p.outs[i], false));
  return outs.size() == 1 ? outs[0] : at::cat(outs, 1);
}

struct KqDecodeLayer {
  at::Tensor input_norm, post_norm;
  std::optional<at::Tensor> qkv_bias, qk_norm;
  KqProjection qkv, o, gate_up, down;  // gate_up / down: the MLP (empty in an MoE layer)
  std::vector<at::Tensor> experts_gate_up, experts_down;
  int64_t gu_type = 0, down_type = 0, max_rows = -1;
};

struct KqDecodePlan : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim, top_k;
  bool norm_topk, router_fp32;
  double eps;
  std::vector<KqDecodeLayer> layers;

  KqDecodePlan(int64_t heads_, int64_t kv_heads_, int64_t head_dim_, double eps_, int64_t top_k_, bool norm_topk_,
               bool router_fp32_)
      : heads(heads_), kv_heads(kv_heads_), head_dim(head_dim_), top_k(top_k_), norm_topk(norm_topk_),
        router_fp32(router_fp32_), eps(eps_) {}

  // One more layer. `segments`: how many of `blocks` / `types` / `outs` the qkv, o, gate/up and down
  // projections take, in that order (0 and 0 for the last two in an MoE layer, whose experts are given
  // instead); `max_rows`: the most rows an expert may get (-1: no limit).
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::optional<at::Tensor> qkv_bias,
                 std::optional<at::Tensor> qk_norm, std::vector<at::Tensor> blocks, std::vector<int64_t> types,
                 std::vector<int64_t> outs, std::vector<int64_t> segments, std::vector<at::Tensor> experts_gate_up,
                 std::vector<at::Tensor> experts_down, int64_t gu_type, int64_t down_type, int64_t max_rows) {
    TORCH_CHECK(blocks.size() == types.size() && blocks.size() == outs.size() && segments.size() == 4 &&
                    segments[0] > 0 && segments[1] > 0 &&
                    segments[0] + segments[1] + segments[2] + segments[3] == static_cast<int64_t>(blocks.size()),
                "KqDecodePlan.add_layer: a type and a width per block tensor, counted by four segment counts");
    const bool moe = !experts_gate_up.empty();
    TORCH_CHECK(experts_gate_up.size() == experts_down.size() && (moe ? segments[2] == 0 && segments[3] == 0
                                                                      : segments[2] > 0 && segments[3] > 0),
                "KqDecodePlan.add_layer: a gate/up and a down projection, or a gate/up and a down weight per expert");
    TORCH_CHECK(!moe || top_k > 0, "KqDecodePlan.add_layer: an MoE layer in a plan without top_k");
    for (const auto& b : blocks) TORCH_CHECK(b.scalar_type() == at::kByte, "KqDecodePlan.add_layer: uint8 blocks");
    KqDecodeLayer w;
    w.input_norm = std::move(input_norm);
    w.post_norm = std::move(post_norm);
    w.qkv_bias = std::move(qkv_bias);
    w.qk_norm = std::move(qk_norm);
    KqProjection* parts[4] = {&w.qkv, &w.o, &w.gate_up, &w.down};
    size_t at = 0;
    for (int i = 0; i < 4; ++i)
      for (int64_t j = 0; j < segments[i]; ++j, ++at) {
        parts[i]->blocks.push_back(blocks[at]);
        parts[i]->types.push_back(types[at]);
        parts[i]->outs.push_back(outs[at]);
      }
    w.experts_gate_up = std::move(experts_gate_up);
    w.experts_down = std::move(experts_down);
    w.gu_type = gu_type;
    w.down_type = down_type;
    w.max_rows = max_rows;
    layers.push_back(std::move(w));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // The feed-forward of layer w on x: the MLP, or the routed experts (MoELayer.feed_forward's fused path).
  at::Tensor feed_forward(const KqDecodeLayer& w, const at::Tensor& x, const at::Tensor& router, bool tiles) const {
    if (w.experts_gate_up.empty()) return kq_project(w.down, silu_mul(kq_project(w.gate_up, x, tiles)), tiles);
    at::Tensor logits;
    if (router_fp32) {
      logits = at::linear(x.to(at::kFloat), router);
    } else if (router.scalar_type() != x.scalar_type()) {  // bfloat16 rows, the weight's float32 copy
      logits = at::linear(x.to(at::kFloat), router).to(x.scalar_type());
    } else {
      logits = at::linear(x, router);
    }
    const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
    auto [top, ids] = at::topk(probs, top_k, -1);
    if (norm_topk) top = at::div(top, at::sum(top, {-1}, true));
    return moe_kquant_mix(x, top.to(logits.scalar_type()), ids, w.experts_gate_up, w.gu_type, w.experts_down,
                          w.down_type, w.max_rows);
  }

  // Every layer of an all-decode step on the embeddings h: [stream, feed-forward output] of the last.
  // `routers[l]`: layer l's router weight as the step multiplies it (any tensor in an MLP layer); the
  // caches and the step's paged-attention arguments as `decode_layers` takes them; `tiles`: the
  // projections on the tiles.
  std::vector<at::Tensor> run(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> routers,
                              std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                              std::vector<at::Tensor> k_scales, std::vector<at::Tensor> v_scales,
                              at::Tensor slot_mapping, at::Tensor block_table, at::Tensor rows, at::Tensor lens,
                              int64_t page_size, double scale, bool tiles) const {
    const int64_t L = num_layers();
    TORCH_CHECK(L > 0 && static_cast<int64_t>(routers.size()) == L && static_cast<int64_t>(k_caches.size()) == L &&
                    static_cast<int64_t>(v_caches.size()) == L,
                "KqDecodePlan.run: a router, a K and a V cache per layer");
    const bool quantized = !k_scales.empty();
    TORCH_CHECK((!quantized || static_cast<int64_t>(k_scales.size()) == L) && k_scales.size() == v_scales.size(),
                "KqDecodePlan.run: no K/V scales, or a K and a V scale tensor per layer");
    TORCH_CHECK(h.dim() == 2, "KqDecodePlan.run: h is [T, hidden]");
    at::Tensor stream = h;
    std::optional<at::Tensor> d;
    for (int64_t l = 0; l < L; ++l) {
      const KqDecodeLayer& w = layers[l];
      TORCH_CHECK(k_caches[l].size(2) == head_dim, "KqDecodePlan.run: the caches' head size");
      at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
      at::Tensor k_scale = quantized ? k_scales[l] : at::Tensor(), v_scale = quantized ? v_scales[l] : at::Tensor();
      auto mm = [&](int i, const at::Tensor& x) { return kq_project(i == 0 ? w.qkv : w.o, x, tiles); };
      auto ffn = [&](const at::Tensor& x) { return feed_forward(w, x, routers[l], tiles); };
      auto out = decode_layer(mm, ffn, stream, d, w.input_norm, w.post_norm, w.qkv_bias ? &*w.qkv_bias : nullptr,
                              w.qk_norm ? &*w.qk_norm : nullptr, cos, sin, k_cache, v_cache,
                              quantized ? &k_scale : nullptr, quantized ? &v_scale : nullptr, slot_mapping,
                              block_table, rows, lens, page_size, scale, eps, heads, kv_heads);
      stream = std::get<0>(out);
      d = std::get<1>(out);
    }
    return {stream, *d};
  }
};
// ---- end of the k-quant decode layers --------------------------------------------------------------------
}  // namespace

TORCH_LIBRARY(helios, m) {
  m.def("q8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("q8_linear_bf16(Tensor x, Tensor codes, Tensor scales, int n) -> Tensor");
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor rows, "
        "Tensor lens, int page_size, float scale) -> Tensor");
  m.def("paged_decode_int8(Tensor q, Tensor k_cache, Tensor k_scale, Tensor v_cache, Tensor v_scale, "
        "Tensor block_table, Tensor rows, Tensor lens, int page_size, float scale) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor? delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)");
  m.def("qk_norm_rope_(Tensor(a!) x, Tensor weight, float eps, Tensor cos, Tensor sin) -> Tensor(a!)");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, int ctx_start, float scale) -> Tensor");
  m.def("bf16_kernels_supported() -> bool");
  m.def("set_prefill_amx(bool on) -> bool");
  m.def("amx_permitted() -> bool");
  m.def("decode_layers(Tensor h, Tensor? delta, Tensor[] input_norms, Tensor[] post_norms, Tensor[] weights, "
        "int group, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor(c!)[] k_scales, "
        "Tensor(d!)[] v_scales, Tensor slot_mapping, Tensor block_table, Tensor rows, Tensor lens, int page_size, "
        "float scale, float eps, int heads, int kv_heads) -> (Tensor, Tensor)");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("write_kv_int8(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) k_scale, Tensor(c!) v_cache, "
        "Tensor(d!) v_scale, Tensor slot_mapping) -> ()");
  m.def("write_paged_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, Tensor block_table, Tensor rows, Tensor lens, int page_size, float scale) -> Tensor");
  m.def("write_paged_decode_int8(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) k_scale, "
        "Tensor(c!) v_cache, Tensor(d!) v_scale, Tensor slot_mapping, Tensor block_table, Tensor rows, Tensor lens, "
        "int page_size, float scale) -> Tensor");
  m.def("kquant_linear(Tensor x, Tensor blocks, int ggml_type, int out_features, bool float_out=False) -> Tensor");
  m.def("kquant_dequantize(Tensor blocks, int ggml_type, int out_features, int in_features, bool bf16=False) -> Tensor");
  m.def("kquant_linear_grouped(Tensor x, int[] offsets, Tensor[] blocks, int ggml_type, int out_features) -> Tensor");
  m.def("kquant_linear_tiles(Tensor x, Tensor blocks, int ggml_type, int out_features, bool float_out=False) -> Tensor");
  m.def("kquant_tiles_supported() -> bool");
  m.def("kquant_tiles_backend() -> int");
  m.def("set_kquant_tiles_dp(bool dp) -> int");
  m.def("kquant_bf16_dot_supported() -> bool");
  m.def("set_kquant_bf16_dot(bool on) -> bool");
  m.def("kquant_bf16_dot_rows() -> bool");
  m.def("kquant_pair_before_tiles(int rows, int ggml_type) -> bool");
  m.def("set_kquant_bf16_dot_rows(bool on) -> bool");
  m.def("q8_linear_tiles(Tensor x, Tensor codes, Tensor scales, bool exact=False) -> Tensor");
  m.def("moe_kquant_mix(Tensor x, Tensor weights, Tensor ids, Tensor[] gate_up, int gu_type, Tensor[] down, "
        "int down_type, int max_rows) -> Tensor");
  m.def("gated_delta_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor slots, "
        "Tensor fresh) -> Tensor");
  m.class_<KqDecodePlan>("KqDecodePlan")
      .def(torch::init<int64_t, int64_t, int64_t, double, int64_t, bool, bool>())
      .def("add_layer", &KqDecodePlan::add_layer)
      .def("run", &KqDecodePlan::run);
}

TORCH_LIBRARY_FRAGMENT(helios, m) {
  m.impl("bf16_kernels_supported", &bf16_kernels_supported);
  m.impl("set_prefill_amx", &set_prefill_amx);
  m.impl("amx_permitted", &amx_permitted);
  m.impl("kquant_tiles_supported", &kquant_tiles_supported);
  m.impl("kquant_tiles_backend", &kquant_tiles_backend);
  m.impl("set_kquant_tiles_dp", &set_kquant_tiles_dp);
  m.impl("kquant_bf16_dot_supported", &kquant_bf16_dot_supported);
  m.impl("set_kquant_bf16_dot", &set_kquant_bf16_dot);
  m.impl("kquant_bf16_dot_rows", &kquant_bf16_dot_rows);
  m.impl("kquant_pair_before_tiles", &kquant_pair_before_tiles);
  m.impl("set_kquant_bf16_dot_rows", &set_kquant_bf16_dot_rows);
}

TORCH_LIBRARY_IMPL(helios, CPU, m) {
  m.impl("q8_linear", TORCH_FN(q8_linear));
  m.impl("q8_linear_bf16", TORCH_FN(q8_linear_bf16));
  m.impl("paged_decode", TORCH_FN(paged_decode));
  m.impl("paged_decode_int8", TORCH_FN(paged_decode_int8));
  m.impl("add_rms_norm", TORCH_FN(add_rms_norm));
  m.impl("rope_", TORCH_FN(rope_));
  m.impl("qk_norm_rope_", TORCH_FN(qk_norm_rope_));
  m.impl("silu_mul", TORCH_FN(silu_mul));
  m.impl("paged_prefill", TORCH_FN(paged_prefill));
  m.impl("write_paged_decode", TORCH_FN(write_paged_decode));
  m.impl("write_paged_decode_int8", TORCH_FN(write_paged_decode_int8));
  m.impl("write_kv", TORCH_FN(write_kv));
  m.impl("write_kv_int8", TORCH_FN(write_kv_int8));
  m.impl("decode_layers", TORCH_FN(decode_layers));
  m.impl("kquant_linear", TORCH_FN(kquant_linear));
  m.impl("kquant_dequantize", TORCH_FN(kquant_dequantize));
  m.impl("kquant_linear_grouped", TORCH_FN(kquant_linear_grouped));
  m.impl("kquant_linear_tiles", TORCH_FN(kquant_linear_tiles));
  m.impl("q8_linear_tiles", TORCH_FN(q8_linear_tiles));
  m.impl("moe_kquant_mix", TORCH_FN(moe_kquant_mix));
  m.impl("gated_delta_step", TORCH_FN(gated_delta_step));
}

// The oneDNN-packed weights are MkldnnCPU tensors, and the dispatcher picks that key for the call.
TORCH_LIBRARY_IMPL(helios, MkldnnCPU, m) {
  m.impl("decode_layers", TORCH_FN(decode_layers));
}
