// Candidate int4 matrix-vector kernels for issue 49, measured by research/experiments/projection_bandwidth.py
// (`--kinds ...,int4_cpp,int4_vnni`), registered with the dispatcher like int8_gemv.cpp. Not part
// of the library: the tiled kernel that won is structkv/ops/csrc/tiled_linear.cpp.
//
// The weight layout is the benchmark's `Int4Rows`: codes (N, K/2) uint8, per group of 32 columns
// 16 bytes, byte j holding column j (low nibble) and j + 16 (high); scale and minimum (N, K/32)
// bf16, w = code * scale + min.
//
// int4_gemv:  each group's 32 codes widened to float in registers (two 16-lane vectors), w = code
//             * scale + min by one FMA, then FMA'd with x: the float product of the stored weight.
// int4_vnni:  x quantized per group of 32 (symmetric int8, a float scale per group, llama.cpp's
//             q8 activations); per two groups one VPDPBUSD of 64 unsigned codes by 64 signed x
//             values, the minimum's share from each group's precomputed sum of x.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <omp.h>

#include "over_outputs.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

constexpr int64_t kGroup = 32;

inline float bf16_float(const at::BFloat16 *p) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t *>(p)[0]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline __m512 bf16_broadcast(const at::BFloat16 *p) { return _mm512_set1_ps(bf16_float(p)); }  // to 16 lanes

void float_rows(const float *x, const uint8_t *codes, const at::BFloat16 *scale, const at::BFloat16 *lo, float *y,
                int64_t K, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t *w = codes + n * (K / 2);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
      __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i *>(w + g * 16));
      __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
      __m512 s = bf16_broadcast(scale + n * G + g), m = bf16_broadcast(lo + n * G + g);
      __m512 wl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)), s, m);
      __m512 wh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)), s, m);
      acc0 = _mm512_fmadd_ps(wl, _mm512_loadu_ps(x + g * kGroup), acc0);
      acc1 = _mm512_fmadd_ps(wh, _mm512_loadu_ps(x + g * kGroup + 16), acc1);
    }
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
}

void vnni_rows(const int8_t *xq, const float *xs, const float *xsum, const uint8_t *codes,
               const at::BFloat16 *scale, const at::BFloat16 *lo, float *y, int64_t K, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;  // even: two groups per step
  const __m256i mask = _mm256_set1_epi8(0x0F);
  // dpbusd sums 4 products per int32 lane: lanes 0-7 hold group 2i, lanes 8-15 group 2i + 1
  const __mmask16 first = 0x00FF;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t *w = codes + n * (K / 2);
    const at::BFloat16 *sn = scale + n * G, *ln = lo + n * G;
    __m512 acc = _mm512_setzero_ps();
    float mins = 0.f;
    for (int64_t g = 0; g < G; g += 2) {
      __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w + g * 16));  // two groups
      __m256i low = _mm256_and_si256(bytes, mask), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
      // columns in x's order: [g low 16 | g high 16 | g+1 low 16 | g+1 high 16]
      __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(low, high, 0x20)),
                                     _mm256_permute2x128_si256(low, high, 0x31), 1);
      __m512i xv = _mm512_loadu_si512(xq + g * kGroup);
      __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xv));
      float f0 = bf16_float(sn + g) * xs[g], f1 = bf16_float(sn + g + 1) * xs[g + 1];
      acc = _mm512_fmadd_ps(dot, _mm512_mask_blend_ps(first, _mm512_set1_ps(f1), _mm512_set1_ps(f0)), acc);
      mins += bf16_float(ln + g) * xsum[g] + bf16_float(ln + g + 1) * xsum[g + 1];
    }
    y[n] = _mm512_reduce_add_ps(acc) + mins;
  }
}

void check(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale, int64_t groups_multiple) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "int4_gemv: x (1, K)");
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) * 2 == x.size(1), "int4_gemv: codes (N, K/2)");
  TORCH_CHECK(x.size(1) % (kGroup * groups_multiple) == 0, "int4_gemv: K must be a multiple of ",
              kGroup * groups_multiple);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "int4_gemv: contiguous uint8 codes");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.is_contiguous(), "int4_gemv: contiguous bf16 tables");
}

at::Tensor int4_gemv(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale, const at::Tensor &lo) {
  check(x, codes, scale, 1);
  auto xf = x.to(at::kFloat).contiguous();
  const int64_t K = xf.size(1), N = codes.size(0);
  auto y = at::empty({1, N}, xf.options());
  over_outputs(N, [&](int64_t n0, int64_t n1) {
    float_rows(xf.data_ptr<float>(), codes.data_ptr<uint8_t>(), scale.data_ptr<at::BFloat16>(),
               lo.data_ptr<at::BFloat16>(), y.data_ptr<float>(), K, n0, n1);
  });
  return y;
}

struct Quantized {  // x as int8 per group of 32 (|x| / 127), with each group's scale and sum as quantized
  at::Tensor q, scale, sum;
};

Quantized quantize(const at::Tensor &xf) {
  const int64_t K = xf.size(1), G = K / kGroup;
  auto xq = at::empty({K}, xf.options().dtype(at::kChar));
  auto xs = at::empty({G}, xf.options()), xsum = at::empty({G}, xf.options());
  const float *xp = xf.data_ptr<float>();
  int8_t *qp = xq.data_ptr<int8_t>();
  for (int64_t g = 0; g < G; g++) {  // one scale per group: |x| / 127; the group's sum of x as quantized
    float amax = 0.f;
    for (int64_t j = 0; j < kGroup; j++) amax = std::max(amax, std::fabs(xp[g * kGroup + j]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    int32_t total = 0;
    for (int64_t j = 0; j < kGroup; j++) {
      qp[g * kGroup + j] = static_cast<int8_t>(std::nearbyint(xp[g * kGroup + j] / s));
      total += qp[g * kGroup + j];
    }
    xs.data_ptr<float>()[g] = s;
    xsum.data_ptr<float>()[g] = s * total;
  }
  return {xq, xs, xsum};
}

at::Tensor int4_vnni(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale, const at::Tensor &lo) {
  check(x, codes, scale, 2);
  auto xf = x.to(at::kFloat).contiguous();
  const int64_t K = xf.size(1), N = codes.size(0);
  auto xq = quantize(xf);
  auto y = at::empty({1, N}, xf.options());
  over_outputs(N, [&](int64_t n0, int64_t n1) {
    vnni_rows(xq.q.data_ptr<int8_t>(), xq.scale.data_ptr<float>(), xq.sum.data_ptr<float>(), codes.data_ptr<uint8_t>(),
              scale.data_ptr<at::BFloat16>(), lo.data_ptr<at::BFloat16>(), y.data_ptr<float>(), K, n0, n1);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(structkv_bench4, m) {
  m.def("int4_gemv(Tensor x, Tensor codes, Tensor scale, Tensor lo) -> Tensor");
  m.def("int4_vnni(Tensor x, Tensor codes, Tensor scale, Tensor lo) -> Tensor");
}

TORCH_LIBRARY_IMPL(structkv_bench4, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_vnni", &int4_vnni);
}
