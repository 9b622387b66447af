// Candidate int8 matrix-vector kernels for issue 49, measured by research/experiments/projection_bandwidth.py
// (`--kinds ...,int8_cpp,int8_vnni`): registered with the dispatcher (TORCH_LIBRARY), so a call
// costs what an aten op costs, not a Python or ctypes call. Not part of the library until one wins.
//
// int8_gemv:  y (M, N) = x (M, K) float32 @ (codes (N, K) int8 * scales (N,))^T; each code is
//             widened to float in registers and multiplied by every row of x (AVX-512: 16 codes a
//             step), so the codes are read once for all M rows.
// int8_vnni:  the same with x quantized per block of 64 values (symmetric int8, a float scale per
//             block, as llama.cpp's q8_0 activations): 64 products a VPDPBUSD instruction, |x| as
//             the unsigned operand and the code's sign flipped where x < 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <omp.h>

#include "over_outputs.h"

#include <algorithm>
#include <cmath>

namespace {

constexpr int kMaxRows = 8;
constexpr int64_t kBlock = 64;

void float_rows(const float *x, const int8_t *codes, const float *scale, float *y, int64_t M, int64_t N,
                int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n++) {
    const int8_t *w = codes + n * K;
    __m512 acc[kMaxRows];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      __m512 wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(w + k))));
      for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(wf, _mm512_loadu_ps(x + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; m++) y[m * N + n] = _mm512_reduce_add_ps(acc[m]) * scale[n];
  }
}

void vnni_rows(const int8_t *xq, const float *xs, const int8_t *codes, const float *scale, float *y, int64_t M,
               int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t blocks = K / kBlock;
  for (int64_t n = n0; n < n1; n++) {
    const int8_t *w = codes + n * K;
    for (int m = 0; m < M; m++) {
      const int8_t *xm = xq + m * K;
      const float *sm = xs + m * blocks;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; b++) {
        __m512i xv = _mm512_loadu_si512(xm + b * kBlock);
        __m512i wv = _mm512_loadu_si512(w + b * kBlock);
        __mmask64 negative = _mm512_movepi8_mask(xv);
        __m512i signed_w = _mm512_mask_sub_epi8(wv, negative, _mm512_setzero_si512(), wv);
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(xv), signed_w);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(sm[b]), acc);
      }
      y[m * N + n] = _mm512_reduce_add_ps(acc) * scale[n];
    }
  }
}

void check(const at::Tensor &x, const at::Tensor &codes, int64_t multiple) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1), "int8_gemv: x (M, K), codes (N, K)");
  TORCH_CHECK(x.size(0) <= kMaxRows, "int8_gemv: at most ", kMaxRows, " rows");
  TORCH_CHECK(x.size(1) % multiple == 0, "int8_gemv: K must be a multiple of ", multiple);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous(), "int8_gemv: contiguous int8 codes");
}

at::Tensor int8_gemv(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scales) {
  check(x, codes, 16);
  auto xf = x.to(at::kFloat).contiguous();
  auto s = scales.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = codes.size(0);
  auto y = at::empty({M, N}, xf.options());
  over_outputs(N, [&](int64_t n0, int64_t n1) {
    float_rows(xf.data_ptr<float>(), codes.data_ptr<int8_t>(), s.data_ptr<float>(), y.data_ptr<float>(), M, N, K,
               n0, n1);
  });
  return y;
}

at::Tensor int8_vnni(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scales) {
  check(x, codes, kBlock);
  auto xf = x.to(at::kFloat).contiguous();
  auto s = scales.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = codes.size(0), blocks = K / kBlock;
  auto xq = at::empty({M, K}, xf.options().dtype(at::kChar));
  auto xs = at::empty({M, blocks}, xf.options());
  const float *xp = xf.data_ptr<float>();
  int8_t *qp = xq.data_ptr<int8_t>();
  float *sp = xs.data_ptr<float>();
  for (int64_t i = 0; i < M * blocks; i++) {  // one scale per block of 64: |x| / 127
    float amax = 0.f;
    for (int64_t j = 0; j < kBlock; j++) amax = std::max(amax, std::fabs(xp[i * kBlock + j]));
    float scale = amax > 0.f ? amax / 127.f : 1.f;
    sp[i] = scale;
    for (int64_t j = 0; j < kBlock; j++) qp[i * kBlock + j] = static_cast<int8_t>(std::nearbyint(xp[i * kBlock + j] / scale));
  }
  auto y = at::empty({M, N}, xf.options());
  over_outputs(N, [&](int64_t n0, int64_t n1) {
    vnni_rows(qp, sp, codes.data_ptr<int8_t>(), s.data_ptr<float>(), y.data_ptr<float>(), M, N, K, n0, n1);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(structkv_bench, m) {
  m.def("int8_gemv(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("int8_vnni(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(structkv_bench, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
  m.impl("int8_vnni", &int8_vnni);
}
