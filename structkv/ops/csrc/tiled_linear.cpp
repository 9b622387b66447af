// structkv::int4_tiled_linear, structkv::int8_tiled_linear: x (M, K) times a 4- or 8-bit weight
// (N, K) stored in tiles of 16 output rows -> (M, N) float32. Built at first use by
// structkv/ops/tiled_linear.py (which defines the ops' schemas and fakes), loaded with
// torch.ops.load_library, called through the dispatcher.
//
// int4 layout (`pack_int4` in tiled_linear.py): codes (N/16, K/8, 64) uint8: per tile and step of 8 input
// columns, byte 4i + j holds row i's column j in its low nibble and column 4 + j in its high one;
// scale and minimum (N/16, K/32, 16) float16 per tile, group of 32 columns and row: w = code *
// scale + min (GGUF's Q4_1). One load of 64 bytes is 16 rows x 8 columns, so the products are
// vectorised across output rows: no horizontal sum per row or group.
// int8 layout (`pack_int8`): codes (N/16, K/4, 64) int8, byte 4i + j of a step = row i's column j;
// one bf16 scale per row (N,), w = code * scale: the per-row int8 weights of `weights="int8"`.
//
// Few rows (decode, a serving batch's step): x is quantized per group of 32 columns to int8
// (symmetric, scale max|x| / 127: llama.cpp's q8 activations), a group's 32 products per row are
// integers (VPDPBUSD on AVX-512 VNNI; VPMADDUBSW + VPMADDWD on AVX2; plain C elsewhere), and
// out += isum * scale * xs + min * sum(xs * xq) (int8: out += isum * xs per group, times the row's
// scale at the end; VPDPBUSD on the codes offset by 128, or VPSIGNB + VPMADDUBSW). Many rows (a
// prompt, M >= dense_rows) unpack the weight (a block of rows at a time) and run GEMMs on the
// unquantized x: bf16 where the CPU multiplies bf16 natively (AVX512_BF16, AMX), else float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/EmptyTensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // the vector paths; elsewhere (ARM) the portable one builds
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32, kRows = 16, kStep = 8;  // columns a group, rows a tile, columns a step
#ifndef STRUCTKV_THREAD_BYTES
#define STRUCTKV_THREAD_BYTES (64 * 1024)
#endif

// Tiles a thread takes at least: a product over fewer weight bytes runs on one thread, since a
// fork and join costs more than it saves on a small projection.
inline int64_t grain(int64_t tile_bytes, int64_t rows) {
  return std::max<int64_t>(1, STRUCTKV_THREAD_BYTES / (tile_bytes * rows));
}

struct Quantized {  // one row of x: int8 codes (K); per group the scale, the sum of x as quantized
  const int8_t *q;    // and (int8 weights on AVX-512) the codes' integer sum
  const float *scale, *sum;
  const int32_t *qsum;
};

// One group of 32 values of x: its int8 codes, scale max|x| / 127 (1 for a zero group) and the
// codes' integer sum. The vector paths compute the scalar one's numbers (a division, rounding to
// nearest even, as std::nearbyint); why vectors: a decode step quantizes x once per product, ~120
// times a token, and the scalar loop cost ~2 us at K = 576.
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline int32_t quantize_group(const float *x, int8_t *q, float *scale) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  const __m512 sv = _mm512_set1_ps(s);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_div_ps(a, sv)), qb = _mm512_cvtps_epi32(_mm512_div_ps(b, sv));
  _mm_storeu_si128(reinterpret_cast<__m128i *>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i *>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *scale = s;
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}
#elif defined(__AVX2__)
inline int32_t quantize_group(const float *x, int8_t *q, float *scale) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));  // the largest of 8 lanes, in every lane
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1));
  const float amax = _mm256_cvtss_f32(m), s = amax > 0.f ? amax / 127.f : 1.f;
  const __m256 sv = _mm256_set1_ps(s);
  __m256i c[4], total = _mm256_setzero_si256();
  for (int i = 0; i < 4; i++) {
    c[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], sv));
    total = _mm256_add_epi32(total, c[i]);
  }
  // packs work within 128-bit halves: dwords (0, 4, 1, 5, 2, 6, 3, 7) put the 32 codes in order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  *scale = s;
  return _mm_cvtsi128_si32(t);
}
#else
inline int32_t quantize_group(const float *x, int8_t *q, float *scale) {
  float amax = 0.f;
  for (int64_t j = 0; j < kGroup; j++) amax = std::max(amax, std::fabs(x[j]));
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  int32_t total = 0;
  for (int64_t j = 0; j < kGroup; j++) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] / s));
    total += q[j];
  }
  *scale = s;
  return total;
}
#endif

// Every row of x (M, K) quantized per group of 32: codes (M, K) int8; per group (M, G) the scale,
// the sum of x as quantized and the codes' integer sum. Held in the calling thread's scratch
// (reused call after call: no allocation a product; the kernel's threads only read it).
struct Rows {
  const int8_t *q;
  const float *scale, *sum;
  const int32_t *qsum;
  int64_t K, G;
  Quantized row(int64_t r) const { return {q + r * K, scale + r * G, sum + r * G, qsum + r * G}; }
};

Rows quantize(const at::Tensor &x) {
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> tables;  // scale (M, G) then sum (M, G)
  thread_local std::vector<int32_t> totals;
  // x as it comes when it is float32 already, and the outputs from empty_cpu: neither goes through the
  // dispatcher, ~0.3 us of a product's ~2.3 us fixed cost (a warm pass over SmolLM2's int4
  // projections 3.16 -> 3.06 ms, none measurable after a flush; research/experiments/tiled_variants.py, 52b7eae).
  const at::Tensor xf = x.scalar_type() == at::kFloat && x.is_contiguous() ? x : x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), G = K / kGroup;
  codes.resize(M * K);
  tables.resize(2 * M * G);
  totals.resize(M * G);
  const float *xp = xf.data_ptr<float>();
  float *scale = tables.data(), *sum = scale + M * G;
  for (int64_t i = 0; i < M * G; i++) {  // group i of row i / G: x, codes, scale, sums in (M, G) order
    totals[i] = quantize_group(xp + i * kGroup, codes.data() + i * kGroup, scale + i);
    sum[i] = scale[i] * static_cast<float>(totals[i]);
  }
  return {codes.data(), scale, sum, totals.data(), K, G};
}

#if defined(__x86_64__) || defined(__i386__)
// The int4 kernels ask for the next tile's line at the same offset (one tile = K/8 x 64 bytes ahead:
// 4.6-12 KB at K 576-1536) while they work on this one. Why: a decode step runs ~120 short products
// back to back, each a fresh stream the hardware prefetcher ramps up on again, and an int4 line takes
// twice int8's arithmetic, so fewer of its loads are in flight. Measured (research/experiments/tiled_variants.py,
// SmolLM2's shapes, weights on huge pages, builds alternated): a pass 2.85 -> 2.52 ms on 2 threads,
// 4.45 -> 3.52 ms on one; the AVX2 build 3.12 -> 2.52 ms. Not in the int8 kernels: there it cost 10 %
// (a one-off harness of the same kind).
// Past a product's last tile the hint reads nothing it needs (a prefetch never faults).
inline void ahead(const uint8_t *p) { _mm_prefetch(reinterpret_cast<const char *>(p), _MM_HINT_T0); }
#endif

inline int32_t load4(const int8_t *p) {  // 4 int8 x values as one 32-bit lane (broadcast below)
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
constexpr const char *kIsa = "avx512_vnni";

// One tile's 16 outputs for one row: per group, 4 steps of one 64-byte load and two VPDPBUSD
// (16 rows x 4 columns of unsigned codes by 4 broadcast int8 x values each).
void tile(const Quantized &x, const uint8_t *w, const c10::Half *sc, const c10::Half *mn, int64_t G, float *y) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 out = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t o = 0; o < 4; o++) {
      ahead(w + (4 * g + o) * 64 + G * 256);
      const __m512i bytes = _mm512_loadu_si512(w + (4 * g + o) * 64);
      const int8_t *xq = x.q + g * kGroup + o * kStep;
      acc = _mm512_dpbusd_epi32(acc, _mm512_and_si512(bytes, mask), _mm512_set1_epi32(load4(xq)));
      acc = _mm512_dpbusd_epi32(acc, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask),
                                _mm512_set1_epi32(load4(xq + 4)));
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(sc + g * kRows)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(mn + g * kRows)));
    out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(s, _mm512_set1_ps(x.scale[g])), out);
    out = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum[g]), out);
  }
  _mm512_storeu_ps(y, out);
}

// int8: VPDPBUSD takes unsigned codes, so the stored signed codes are read with their top bit
// flipped (code + 128) and 128 * sum(xq) of the group taken off again.
void tile8(const Quantized &x, const int8_t *w, int64_t G, float *y) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 out = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t o = 0; o < 8; o++) {
      const __m512i bytes = _mm512_xor_si512(_mm512_loadu_si512(w + (8 * g + o) * 64), flip);
      acc = _mm512_dpbusd_epi32(acc, bytes, _mm512_set1_epi32(load4(x.q + g * kGroup + 4 * o)));
    }
    acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * x.qsum[g]));
    out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(x.scale[g]), out);
  }
  _mm512_storeu_ps(y, out);
}

#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr const char *kIsa = "avx2";

// The same per half tile (8 rows, 32 bytes a step): VPMADDUBSW gives each row two int16 sums of
// two products; a group's 8 of them stay within int16 (8 x 2 x 15 x 127 = 30480), and one
// VPMADDWD by ones folds each row's pair into its int32 sum.
void tile(const Quantized &x, const uint8_t *w, const c10::Half *sc, const c10::Half *mn, int64_t G, float *y) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 out[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < G; g++) {
    __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t o = 0; o < 4; o++) {
      ahead(w + (4 * g + o) * 64 + G * 256);
      const int8_t *xq = x.q + g * kGroup + o * kStep;
      const __m256i xa = _mm256_set1_epi32(load4(xq)), xb = _mm256_set1_epi32(load4(xq + 4));
      for (int h = 0; h < 2; h++) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w + (4 * g + o) * 64 + 32 * h));
        const __m256i low = _mm256_and_si256(bytes, mask);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
        acc[h] = _mm256_add_epi16(acc[h], _mm256_add_epi16(_mm256_maddubs_epi16(low, xa),
                                                           _mm256_maddubs_epi16(high, xb)));
      }
    }
    const __m256 xs = _mm256_set1_ps(x.scale[g]), xsum = _mm256_set1_ps(x.sum[g]);
    for (int h = 0; h < 2; h++) {
      const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[h], ones));
      const c10::Half *s = sc + g * kRows + 8 * h, *m = mn + g * kRows + 8 * h;
      const __m256 sf = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s)));
      const __m256 mf = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(m)));
      out[h] = _mm256_fmadd_ps(isum, _mm256_mul_ps(sf, xs), out[h]);
      out[h] = _mm256_fmadd_ps(mf, xsum, out[h]);
    }
  }
  _mm256_storeu_ps(y, out[0]);
  _mm256_storeu_ps(y + 8, out[1]);
}

// int8 per half tile: VPSIGNB moves each code's sign onto x, VPMADDUBSW multiplies |code| by it
// (two products a lane, at most 2 x 127 x 127: no int16 overflow), VPMADDWD folds them to int32.
void tile8(const Quantized &x, const int8_t *w, int64_t G, float *y) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 out[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < G; g++) {
    __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t o = 0; o < 8; o++) {
      const __m256i xv = _mm256_set1_epi32(load4(x.q + g * kGroup + 4 * o));
      for (int h = 0; h < 2; h++) {
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w + (8 * g + o) * 64 + 32 * h));
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(xv, c));
        acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(p, ones));
      }
    }
    const __m256 xs = _mm256_set1_ps(x.scale[g]);
    for (int h = 0; h < 2; h++) out[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[h]), xs, out[h]);
  }
  _mm256_storeu_ps(y, out[0]);
  _mm256_storeu_ps(y + 8, out[1]);
}

#else
constexpr const char *kIsa = "portable";

void tile(const Quantized &x, const uint8_t *w, const c10::Half *sc, const c10::Half *mn, int64_t G, float *y) {
  for (int64_t i = 0; i < kRows; i++) {
    float out = 0.f;
    for (int64_t g = 0; g < G; g++) {
      int32_t isum = 0;
      for (int64_t o = 0; o < 4; o++) {
        const uint8_t *b = w + (4 * g + o) * 64 + 4 * i;
        const int8_t *xq = x.q + g * kGroup + o * kStep;
        for (int64_t j = 0; j < 4; j++) isum += (b[j] & 15) * xq[j] + (b[j] >> 4) * xq[4 + j];
      }
      out = std::fma(static_cast<float>(isum), static_cast<float>(sc[g * kRows + i]) * x.scale[g], out);
      out = std::fma(static_cast<float>(mn[g * kRows + i]), x.sum[g], out);
    }
    y[i] = out;
  }
}
void tile8(const Quantized &x, const int8_t *w, int64_t G, float *y) {
  for (int64_t i = 0; i < kRows; i++) {
    float out = 0.f;
    for (int64_t g = 0; g < G; g++) {
      int32_t isum = 0;
      for (int64_t o = 0; o < 8; o++)
        for (int64_t j = 0; j < 4; j++) isum += w[(8 * g + o) * 64 + 4 * i + j] * x.q[g * kGroup + 4 * o + j];
      out = std::fma(static_cast<float>(isum), x.scale[g], out);
    }
    y[i] = out;
  }
}
#endif

#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
constexpr at::ScalarType kGemm = at::kBFloat16;  // native bf16 products: half the bytes of float32
#else
constexpr at::ScalarType kGemm = at::kFloat;  // no bf16 arithmetic: a bf16 GEMM ran 7x slower than float32 (AVX2)
#endif
constexpr int64_t kDenseTiles = 256;  // a prompt's weight unpacked 4096 rows at a time (the LM head: 262K rows)

// A prompt's product (M >= dense_rows): the weight unpacked a block of tiles at a time and one GEMM
// per block on the unquantized x, so at most kDenseTiles x 16 x K unpacked values live at once.
template <typename Weight>
at::Tensor dense(const at::Tensor &x, int64_t tiles, Weight weight) {
  auto xg = x.to(kGemm);
  if (tiles <= kDenseTiles)  // one block: the GEMM's own output (a copy into a fresh y cost 20 ms at 1024 x 1536)
    return at::linear(xg, weight(0, tiles)).to(at::kFloat);
  auto y = at::empty({x.size(0), tiles * kRows}, x.options().dtype(at::kFloat));
  for (int64_t b0 = 0; b0 < tiles; b0 += kDenseTiles) {
    const int64_t nb = std::min(kDenseTiles, tiles - b0);
    y.narrow(1, b0 * kRows, nb * kRows).copy_(at::linear(xg, weight(b0, nb)));
  }
  return y;
}

void check(const at::Tensor &codes, const at::Tensor &scale, const at::Tensor &lo) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 64 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "int4_tiled_linear: codes must be contiguous uint8 (N/16, K/8, 64), got ", codes.sizes());
  const int64_t tiles = codes.size(0), G = codes.size(1) * kStep / kGroup;
  TORCH_CHECK(codes.size(1) % 4 == 0, "int4_tiled_linear: K must be a multiple of 32, got ", codes.size(1) * kStep);
  for (const at::Tensor *t : {&scale, &lo}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == tiles &&
                t->size(1) == G && t->size(2) == kRows,
                "int4_tiled_linear: tables must be contiguous float16 (N/16, K/32, 16) = (", tiles, ", ", G, ", 16), got ",
                t->sizes());
  }
}

// The (N, K) float32 weight the codes stand for (a prompt's GEMM; `dequantize` in tests).
at::Tensor int4_tiled_weight(const at::Tensor &codes, const at::Tensor &scale, const at::Tensor &lo) {
  check(codes, scale, lo);
  const int64_t tiles = codes.size(0), K = codes.size(1) * kStep, G = K / kGroup;
  auto w = at::empty({tiles * kRows, K}, codes.options().dtype(at::kFloat));
  const uint8_t *cp = codes.data_ptr<uint8_t>();
  const c10::Half *sp = scale.data_ptr<c10::Half>(), *mp = lo.data_ptr<c10::Half>();
  float *wp = w.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++)
      for (int64_t o = 0; o < K / kStep; o++)
        for (int64_t i = 0; i < kRows; i++) {
          const uint8_t *byte = cp + (b * (K / kStep) + o) * 64 + 4 * i;
          const int64_t t = (b * G + o / 4) * kRows + i;
          const float s = static_cast<float>(sp[t]), m = static_cast<float>(mp[t]);
          float *row = wp + (b * kRows + i) * K + o * kStep;
          for (int64_t j = 0; j < 4; j++) {
            row[j] = static_cast<float>(byte[j] & 15) * s + m;
            row[4 + j] = static_cast<float>(byte[j] >> 4) * s + m;
          }
        }
  });
  return w;
}

at::Tensor int4_tiled_linear(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale,
                             const at::Tensor &lo, int64_t dense_rows) {
  check(codes, scale, lo);
  const int64_t tiles = codes.size(0), K = codes.size(1) * kStep, G = K / kGroup;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "int4_tiled_linear: x must be (M, ", K, "), got ", x.sizes());
  const int64_t M = x.size(0);
  if (M >= dense_rows)  // a prompt: unpacked once, GEMMs (faster there than M integer row passes)
    return dense(x, tiles, [&](int64_t b0, int64_t nb) {
      return int4_tiled_weight(codes.narrow(0, b0, nb), scale.narrow(0, b0, nb), lo.narrow(0, b0, nb)).to(kGemm);
    });
  const Rows rows = quantize(x);
  auto y = at::detail::empty_cpu({M, tiles * kRows}, at::kFloat, false, std::nullopt);
  const uint8_t *cp = codes.data_ptr<uint8_t>();
  const c10::Half *sp = scale.data_ptr<c10::Half>(), *mp = lo.data_ptr<c10::Half>();
  float *yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, grain(kRows * K / 2, M), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++)  // a tile's weights stay in L1 while every row reads them
      for (int64_t r = 0; r < M; r++)
        tile(rows.row(r), cp + b * (K / kStep) * 64, sp + b * G * kRows, mp + b * G * kRows, G,
             yp + r * tiles * kRows + b * kRows);
  });
  return y;
}

void check8(const at::Tensor &codes, const at::Tensor &scales) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 64 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "int8_tiled: codes must be contiguous int8 (N/16, K/4, 64), got ", codes.sizes());
  TORCH_CHECK((codes.size(1) * 4) % kGroup == 0, "int8_tiled: K must be a multiple of 32, got ", codes.size(1) * 4);
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.dim() == 1 &&
                  scales.size(0) == codes.size(0) * kRows,
              "int8_tiled: scales must be contiguous bfloat16 (N,) = (", codes.size(0) * kRows, ",), got ",
              scales.sizes());
}

// The (N, K) weight in `dtype`: float32 for `int8_tiled_weight` and a prompt's float32 GEMM; bf16
// for a bf16 one (codes exact in bf16, the product rounded once, as the packed path's).
at::Tensor int8_weight(const at::Tensor &codes, const at::Tensor &scales, at::ScalarType dtype) {
  const int64_t tiles = codes.size(0), S = codes.size(1);
  auto rows = codes.view({tiles, S, kRows, 4}).permute({0, 2, 1, 3}).reshape({tiles * kRows, S * 4});  // (N, K)
  return rows.to(dtype) * scales.to(dtype).unsqueeze(1);
}

at::Tensor int8_tiled_weight(const at::Tensor &codes, const at::Tensor &scales) {
  check8(codes, scales);
  return int8_weight(codes, scales, at::kFloat);
}

at::Tensor int8_tiled_linear(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scales,
                             int64_t dense_rows) {
  check8(codes, scales);
  const int64_t tiles = codes.size(0), K = codes.size(1) * 4, G = K / kGroup;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "int8_tiled_linear: x must be (M, ", K, "), got ", x.sizes());
  const int64_t M = x.size(0);
  if (M >= dense_rows)
    return dense(x, tiles, [&](int64_t b0, int64_t nb) {
      return int8_weight(codes.narrow(0, b0, nb), scales.narrow(0, b0 * kRows, nb * kRows), kGemm);
    });
  const Rows rows = quantize(x);
  auto y = at::detail::empty_cpu({M, tiles * kRows}, at::kFloat, false, std::nullopt);
  const int8_t *cp = codes.data_ptr<int8_t>();
  const at::BFloat16 *sp = scales.data_ptr<at::BFloat16>();
  float *yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, grain(kRows * K, M), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++)
      for (int64_t r = 0; r < M; r++) {
        float *out = yp + r * tiles * kRows + b * kRows;
        tile8(rows.row(r), cp + b * (K / 4) * 64, G, out);
        for (int64_t i = 0; i < kRows; i++) out[i] *= static_cast<float>(sp[b * kRows + i]);
      }
  });
  return y;
}

}  // namespace

extern "C" const char *structkv_tiled_linear_isa() { return kIsa; }  // which path this build compiled

TORCH_LIBRARY_IMPL(structkv, CPU, m) {
  m.impl("int4_tiled_linear", &int4_tiled_linear);
  m.impl("int4_tiled_weight", &int4_tiled_weight);
  m.impl("int8_tiled_linear", &int8_tiled_linear);
  m.impl("int8_tiled_weight", &int8_tiled_weight);
}
