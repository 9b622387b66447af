/* One query token per row over a KV cache, on CPU: the decode attention of structkv.ops.cpu_decode.
 *
 * Why a kernel of our own: a single-token step attends G query rows (the query heads of one KV
 * head) over T keys. PyTorch's CPU flash attention pays a fixed cost per call and per block that
 * dominates at G = 1-4 (measured: SmolLM2-135M at 1K, 79 us per layer with a warm cache for
 * ~0.8 MB of keys and values), so decode ran far below the memory bandwidth. Here every key and
 * value row is read once, for all G rows, in one pass with an online softmax; the key range of
 * every (row, KV head) is cut into `splits` parts run in parallel, merged by their log-sum-exps.
 *
 * Entries are float32, bfloat16, int8 (one bfloat16 scale per row) or int4 (two codes per byte,
 * dimension j low and j + D/2 high; per group of dimensions a bfloat16 scale and a float32
 * minimum), the layouts of structkv.ops.kv_quant. Plain C, no PyTorch headers: the library
 * compiles it inside the C++ op of decode_attention_op.cpp; research/experiments/attention_kernel_ab.py builds
 * it alone as C to time two revisions. OpenMP from the process's own runtime (PyTorch's libgomp).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#define L 16       /* floats per vector (GCC vector extensions): one AVX-512 register */
#else
#define L 8        /* one AVX2 register (a 16-float vector spilled there: 2-3x slower, measured) */
#endif
#define BLOCK (2 * L)  /* keys per online-softmax block: two vectors of scores */
#define MAX_G 16   /* query rows per KV head */
#define MAX_D 512  /* head dimension; a multiple of 16 (of L on every path) */
#define MAX_ACC 16  /* value accumulators (vectors) held in registers */

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_INT8 = 2, KIND_INT4 = 3 };

typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));

typedef struct {            /* one of k / v: its planes and their strides (elements) */
    const void *codes;      /* (B, H, T, last): float, bf16, int8 or packed uint8 */
    const uint16_t *scale;  /* (B, H, T, groups) bf16, quantized kinds only */
    const float *minimum;   /* (B, H, T, groups) float32, int4 only */
    int64_t cs[3], ss[3], ms[3];
} Plane;

/* Which slots the query rows see: a byte mask (B, Hm, T), or the slots' original positions (B, Hkv,
 * T; -1 empty) against each row's query position `at` (B), within `window` positions when > 0.
 * Why positions: building the mask took a separate pass a layer (an inductor loop over every slot
 * of the cache, ~15 us at 1K slots, 55 us at 4K: more than SmolLM2's whole attention at 1K); here
 * the check rides on the key loop. Row (b, h) starts at b * sb + h * sh; `heads` rows a batch row. */
typedef struct {
    const uint8_t *mask;
    const int64_t *pos, *at;
    int64_t sb, sh, heads, window;
} Sight;

typedef struct {  /* one (row, KV head)'s view of Sight */
    const uint8_t *mask;
    const int64_t *pos;
    int64_t at, window;
} Seen;

static inline Seen seen_by(const Sight *s, int64_t b, int64_t h) {
    Seen r = {s->mask ? s->mask + b * s->sb + h * s->sh : NULL, s->pos ? s->pos + b * s->sb + h * s->sh : NULL,
              s->at ? s->at[b] : 0, s->window};
    return r;
}

static inline int sees(const Seen *s, int64_t t) {
    if (s->mask) return s->mask[t];
    int64_t p = s->pos[t];
    return p >= 0 && p <= s->at && (s->window <= 0 || s->at - p < s->window);
}

static inline vf load(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store(float *p, vf x) { memcpy(p, &x, sizeof x); }

static inline vf splat(float x) { return (vf){0} + x; }

static inline float hsum(vf x) {
    float s = 0.0f;
    for (int i = 0; i < L; i++) s += x[i];
    return s;
}

/* AVX-512: lane j of the result is the sum of the lanes of t[j] (16 dot products' partial sums ->
 * their 16 values in one vector). A tree of 15 shuffle-and-add steps where each step halves the lanes
 * every key holds: ~3 operations a key instead of a 16-lane horizontal sum each. */
#define HALVES(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))
#define LEVEL(a, b, lo, hi) (HALVES(a, b, lo) + HALVES(a, b, hi))
#define W16_LO 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define W16_HI 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define W8_LO 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define W8_HI 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define W4_LO 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define W4_HI 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define W2_LO 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define W2_HI 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#ifdef __AVX512F__
static inline vf sum16(const vf *t) {
    vf u[8], w[4], x[2];
    for (int i = 0; i < 8; i++) u[i] = LEVEL(t[2 * i], t[2 * i + 1], W16_LO, W16_HI);
    for (int i = 0; i < 4; i++) w[i] = LEVEL(u[2 * i], u[2 * i + 1], W8_LO, W8_HI);
    for (int i = 0; i < 2; i++) x[i] = LEVEL(w[2 * i], w[2 * i + 1], W4_LO, W4_HI);
    return LEVEL(x[0], x[1], W2_LO, W2_HI);
}
#endif

static inline float hmax(vf x) {
    float s = x[0];
    for (int i = 1; i < L; i++) s = x[i] > s ? x[i] : s;
    return s;
}

static inline float bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* e^x for x <= 0 (0 below -87), lane by lane: 2^n * p(r), |r| <= ln2 / 2, degree-6 Taylor
 * (relative error < 2e-7). */
static inline vf exp_nonpositive(vf x) {
    vi under = x < splat(-87.0f);
    vf y = (vf)(((vi)x & ~under) | ((vi)splat(-87.0f) & under));  /* also -inf: the conversion stays defined */
    vi n = __builtin_convertvector(y * 1.44269504f - 0.5f, vi);   /* y <= 0: truncation rounds to nearest */
    vf nf = __builtin_convertvector(n, vf);
    vf r = y - nf * 0.693145752f - nf * 1.42860677e-6f;
    vf p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f +
           r * (0.00833333377f + r * 0.00138888892f)))));
    vf e = p * (vf)((n + 127) << 23);
    return (vf)((vi)e & ~under);
}

static inline float exp1(float x) { return exp_nonpositive(splat(x))[0]; }

/* Row t of a plane as D floats: a pointer into the cache (float32) or `tmp` filled. */
static inline const float *row(const Plane *pl, int kind, int64_t b, int64_t h, int64_t t, int D, int groups,
                               float *tmp) {
    int64_t at = b * pl->cs[0] + h * pl->cs[1] + t * pl->cs[2];
    if (kind == KIND_F32) return (const float *)pl->codes + at;
    if (kind == KIND_BF16) {
        const uint16_t *c = (const uint16_t *)pl->codes + at;
        for (int d = 0; d < D; d++) tmp[d] = bf16(c[d]);
        return tmp;
    }
    const uint16_t *s = pl->scale + b * pl->ss[0] + h * pl->ss[1] + t * pl->ss[2];
    if (kind == KIND_INT8) {
        const int8_t *c = (const int8_t *)pl->codes + at;
        float sc = bf16(s[0]);
        for (int d = 0; d < D; d++) tmp[d] = (float)c[d] * sc;
        return tmp;
    }
    const uint8_t *c = (const uint8_t *)pl->codes + at;
    const float *mn = pl->minimum + b * pl->ms[0] + h * pl->ms[1] + t * pl->ms[2];
    int half = D / 2, group = D / groups;
    for (int d = 0; d < half; d++) {
        tmp[d] = (float)(c[d] & 15);
        tmp[d + half] = (float)(c[d] >> 4);
    }
    for (int g = 0; g < groups; g++) {
        float sc = bf16(s[g]), lo = mn[g];
        for (int d = g * group; d < (g + 1) * group; d++) tmp[d] = tmp[d] * sc + lo;
    }
    return tmp;
}

static const float ZERO_ROW[MAX_D] = {0};  /* what a masked key reads: no branch in the loops, no stale value */

/* q . row as C vectors' partial sums (two chains, so the multiply-adds overlap). */
static inline __attribute__((always_inline)) vf dot(const vf *qv, const float *row, const int C) {
    vf t0 = splat(0.0f), t1 = splat(0.0f);
    for (int c = 0; c + 1 < C; c += 2) {
        t0 += qv[c] * load(row + c * L);
        t1 += qv[c + 1] * load(row + (c + 1) * L);
    }
    if (C % 2) t0 += qv[C - 1] * load(row + (C - 1) * L);
    return t0 + t1;
}

/* Scores of one query row over L keys: lane j = q . rows[j] (q pre-scaled, C vectors). */
static inline __attribute__((always_inline)) vf scores(const vf *qv, const float *const *rows, const int C) {
#ifdef __AVX512F__
    vf t[L];
    for (int j = 0; j < L; j++) t[j] = dot(qv, rows[j], C);
    return sum16(t);
#else
    vf out;  /* without AVX-512 (L = 8): each key's sum reduced on its own, no 8-vector transpose */
    for (int j = 0; j < L; j++) out[j] = hsum(dot(qv, rows[j], C));
    return out;
#endif
}

/* acc[g] += sum_j p[g][j] v_j for the rows g0 .. g0 + n_g of a block: every value row is loaded
 * once for the n_g query rows, whose n_g * C accumulators stay in registers (independent chains,
 * so the multiply-adds are not serialised on one accumulator's latency). */
static inline __attribute__((always_inline)) void values(float (*p)[BLOCK], const float *const *rows, int n, int g0,
                                                         int n_g, const int C, float *acc, const int D) {
    vf a[MAX_ACC > MAX_D / L ? MAX_ACC : MAX_D / L];  /* one row of a wide head holds C = D / L > MAX_ACC */
    for (int g = 0; g < n_g; g++)
        for (int c = 0; c < C; c++) a[g * C + c] = load(acc + (g0 + g) * D + c * L);
    if (n_g == 1) {  /* one row (wide heads): its C accumulators are the independent chains */
        for (int j = 0; j < n; j++) {
            vf w = splat(p[g0][j]);
            for (int c = 0; c < C; c++) a[c] += w * load(rows[j] + c * L);
        }
        for (int c = 0; c < C; c++) store(acc + g0 * D + c * L, a[c]);
        return;
    }
    for (int j = 0; j < n; j++) {
        vf r[MAX_D / L];
        for (int c = 0; c < C; c++) r[c] = load(rows[j] + c * L);
        for (int g = 0; g < n_g; g++) {
            vf w = splat(p[g0 + g][j]);
            for (int c = 0; c < C; c++) a[g * C + c] += w * r[c];
        }
    }
    for (int g = 0; g < n_g; g++)
        for (int c = 0; c < C; c++) store(acc + (g0 + g) * D + c * L, a[g * C + c]);
}

/* Keys [t0, t1) of (b, h): acc (G, D) = sum_t e^(s_t - m) v_t, with m (G) the running max and
 * l (G) the sum of the weights. Blocks of keys: their rows are found (float32) or dequantized
 * once (a masked or absent key points at ZERO_ROW and gets a score of -inf), then each query row
 * scores the block with its q in registers, and the values are added for several rows at once.
 * Inlined with D a constant (attend_range_d), so the loops over D unroll. */
static inline __attribute__((always_inline)) void attend_range(
        const float *q, const Plane *k, const Plane *v, int kind, const Seen *view, int64_t b, int64_t h,
        int64_t t0, int64_t t1, int G, const int D, int groups, float scale, float *acc, float *m, float *l) {
    const int C = D / L, per = C > MAX_ACC ? 1 : MAX_ACC / C;  /* query rows per pass over a block's values */
    float s[MAX_G][BLOCK], buf[BLOCK * MAX_D];
    const float *rows[BLOCK];
    vi hidden[BLOCK / L];
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int d = 0; d < D; d++) acc[g * D + d] = 0.0f;
    }
    for (int64_t tb = t0; tb < t1; tb += BLOCK) {
        int n = (int)(t1 - tb < BLOCK ? t1 - tb : BLOCK), seen = 0;
        for (int j = 0; j < BLOCK; j++) {
            int on = j < n && sees(view, tb + j);
            rows[j] = on ? row(k, kind, b, h, tb + j, D, groups, buf + j * D) : ZERO_ROW;
            hidden[j / L][j % L] = on ? 0 : -1;
            seen |= on;
        }
        if (!seen) continue;
        for (int g = 0; g < G; g++) {
            vf qv[MAX_D / L], top;
            for (int c = 0; c < C; c++) qv[c] = load(q + g * D + c * L) * scale;
            vf lo = scores(qv, rows, C), hi = scores(qv, rows + L, C);
            lo = (vf)(((vi)lo & ~hidden[0]) | ((vi)splat(-INFINITY) & hidden[0]));
            hi = (vf)(((vi)hi & ~hidden[1]) | ((vi)splat(-INFINITY) & hidden[1]));
            vi gt = lo > hi;
            top = (vf)(((vi)lo & gt) | ((vi)hi & ~gt));
            float mx = hmax(top);
            mx = mx > m[g] ? mx : m[g];
            lo = exp_nonpositive(lo - mx);
            hi = exp_nonpositive(hi - mx);
            store(s[g], lo);
            store(s[g] + L, hi);
            float keep = exp1(m[g] - mx);  /* m = -inf: keep = 0 */
            for (int c = 0; c < C; c++) store(acc + g * D + c * L, load(acc + g * D + c * L) * keep);
            l[g] = l[g] * keep + hsum(lo + hi);
            m[g] = mx;
        }
        for (int j = 0; j < n; j++)
            if (rows[j] != ZERO_ROW) rows[j] = row(v, kind, b, h, tb + j, D, groups, buf + j * D);
        for (int g0 = 0; g0 < G; g0 += per)
            values(s, rows, n, g0, G - g0 < per ? G - g0 : per, C, acc, D);
    }
}

/* attend_range with the common head sizes as constants (their loops unroll and the vectors stay
 * in registers). */
static void attend_range_d(const float *q, const Plane *k, const Plane *v, int kind, const Seen *view, int64_t b,
                           int64_t h, int64_t t0, int64_t t1, int G, int D, int groups, float scale, float *acc,
                           float *m, float *l) {
    switch (D) {
    case 64: attend_range(q, k, v, kind, view, b, h, t0, t1, G, 64, groups, scale, acc, m, l); break;
    case 128: attend_range(q, k, v, kind, view, b, h, t0, t1, G, 128, groups, scale, acc, m, l); break;
    case 256: attend_range(q, k, v, kind, view, b, h, t0, t1, G, 256, groups, scale, acc, m, l); break;
    default: attend_range(q, k, v, kind, view, b, h, t0, t1, G, D, groups, scale, acc, m, l);
    }
}

/* The slots [lo, hi) where any row or head sees a key (a cache's unused or evicted slots are
 * hidden; splitting only the visible range keeps the threads' shares equal). */
static void visible_range(const Sight *sight, int64_t B, int64_t T, int64_t *lo, int64_t *hi) {
    *lo = T;
    *hi = 0;
    for (int64_t r = 0; r < B * sight->heads; r++) {
        Seen m = seen_by(sight, r / sight->heads, r % sight->heads);
        int64_t a = 0, b = T;
        while (a < T && !sees(&m, a)) a++;
        while (b > a && !sees(&m, b - 1)) b--;
        if (a < b) {
            *lo = a < *lo ? a : *lo;
            *hi = b > *hi ? b : *hi;
        }
    }
}

/* Key ranges per (row, KV head) over `visible` slots: enough tasks for every thread twice over,
 * never ranges under 128 keys (their setup would cost more than they read), at most `max_splits`
 * (the work buffer's room). Chosen here, from the range the mask shows, not from the capacity. */
static int key_ranges(int64_t heads, int64_t visible, int threads, int max_splits) {
    int splits = 1;
    while (splits * 2 <= max_splits && heads * splits < 2 * threads && visible / (2 * splits) >= 128) splits *= 2;
    return splits;
}

/* q (B, Hkv, G, D) float32 contiguous; sight: a mask (B, Hm, T) of bytes 0/1, Hm 1 or Hkv (sh 0 where
 * broadcast), or positions (B, Hkv, T), T contiguous; out (B, Hkv, G, D) float32; work: splits * B * Hkv *
 * G * (D + 2) floats for splits = max_splits. Returns 0, or -1 for shapes past the fixed limits (the caller checks them). */
static int decode_attention(int kind, const float *q, Plane k, Plane v, Sight sight, float *out, float *work, int B,
                            int Hkv, int G,
                            int64_t T, int D, int groups, float scale, int max_splits, int threads) {
    if (G > MAX_G || D > MAX_D || D % 16 || max_splits < 1) return -1;  /* D % 16: cpu_decode.VECTOR on every path */
    int64_t lo, hi;
    visible_range(&sight, B, T, &lo, &hi);
    int splits = key_ranges(B * Hkv, hi > lo ? hi - lo : 0, threads, max_splits);
    int64_t tasks = (int64_t)B * Hkv * splits, per = hi > lo ? (hi - lo + splits - 1) / splits : 0;
    float *accs = work, *ms = work + tasks * G * D, *ls = ms + tasks * G;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < tasks; i++) {
        int64_t bh = i / splits, part = i % splits, b = bh / Hkv, h = bh % Hkv;
        int64_t t0 = lo + part * per, t1 = t0 + per < hi ? t0 + per : hi;
        Seen view = seen_by(&sight, b, h);  /* sh is 0 for a mask shared by the KV heads */
        attend_range_d(q + bh * G * D, &k, &v, kind, &view, b, h, t0, t1 > t0 ? t1 : t0,
                       G, D, groups, scale, accs + i * G * D, ms + i * G, ls + i * G);
    }
    for (int64_t bh = 0; bh < (int64_t)B * Hkv; bh++) {
        for (int g = 0; g < G; g++) {
            float top = -INFINITY, total = 0.0f, *o = out + (bh * G + g) * D;
            for (int p = 0; p < splits; p++) top = ms[(bh * splits + p) * G + g] > top ? ms[(bh * splits + p) * G + g] : top;
            for (int d = 0; d < D; d++) o[d] = 0.0f;
            if (top == -INFINITY) continue;  /* nothing visible: zeros, as SDPA's CPU flash kernel gives */
            for (int p = 0; p < splits; p++) {
                int64_t at = (bh * splits + p) * G + g;
                float w = exp1(ms[at] - top);
                total += w * ls[at];
                for (int d = 0; d < D; d++) o[d] += w * accs[at * D + d];
            }
            for (int d = 0; d < D; d++) o[d] /= total;
        }
    }
    return 0;
}

static Plane plane(const int64_t *a) {
    Plane p = {(const void *)a[0], (const uint16_t *)a[1], (const float *)a[2],
               {a[3], a[4], a[5]}, {a[6], a[7], a[8]}, {a[9], a[10], a[11]}};
    return p;
}

/* The C entry point of a standalone build (research/experiments/attention_kernel_ab.py calls it through
 * ctypes; the library's op calls decode_attention directly), its integers and pointers in one
 * array: kind, q, out, work, mask, mask_sb, mask_sh, mask_heads,
 * B, Hkv, G, T, D, groups, max_splits, threads, then k's and v's planes, 12 each: codes, scale,
 * minimum pointers and their three strides (B, H, T) each. */
int structkv_decode_attention(const int64_t *a, float scale) {
    Sight mask = {(const uint8_t *)a[4], NULL, NULL, a[5], a[6], a[7], 0};
    return decode_attention((int)a[0], (const float *)a[1], plane(a + 16), plane(a + 28), mask, (float *)a[2],
                            (float *)a[3], (int)a[8], (int)a[9], (int)a[10], a[11], (int)a[12], (int)a[13], scale,
                            (int)a[14], (int)a[15]);
}
