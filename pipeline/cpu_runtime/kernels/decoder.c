/* trtpipe's CPU engine kernels (pipeline/cpu_runtime/native.py loads them; pipeline/cpu_runtime/model.py
 * Decoder calls them once per layer). All tensors are row-major and contiguous; float32 unless noted.
 *
 * decode_attention_{f32,bf16}: one query token per sequence over the slot KV cache (SlotKvCache),
 * grouped-query attention. For every (sequence i, KV head h) the `group` query heads that share KV
 * head h attend over the first lens[i] positions of slot slots[i]:
 *
 *     out[i, h, g, :] = softmax_j(scale * q[i, h, g, :] . K[slots[i], h, j, :]) @ V[slots[i], h, :lens[i], :]
 *
 *   q, out  [n, kv_heads, group, head_dim];  k, v  float32 or bfloat16 [num_slots, kv_heads, slot_len, head_dim]
 *   slots, lens  int64 [n]
 *
 *   Each (i, h) reads its keys and values once, and only up to its own length (the batched GEMM this
 *   replaces reads every slot up to the longest one): the group's scores go to a per-thread buffer,
 *   then exp and sum, then the weighted sum of the values, divided by the sum. (i, h) pairs are spread
 *   over the process's OpenMP threads (torch's libgomp when torch is loaded first). With AVX-512
 *   (head_dim a multiple of 16) intrinsics, otherwise portable loops. exp() of the (non-positive)
 *   softmax arguments is a Cephes-style polynomial, max relative error ~2 ulp; arguments below -87 give 0.
 *
 * add_rms_norm, rope_kv_write: the elementwise glue around a layer's GEMMs (see their comments).
 *
 * Every function returns 0, or: -1 a per-thread buffer could not be allocated, -2 a shape it does not
 * handle, -3 a slot / position / length outside the cache (nothing is read or written out of bounds).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_GROUP 8
#ifndef PF_ROWS
#define PF_ROWS 16
#endif

static float *scratch(int64_t n_floats) {
    static __thread float *buf = NULL;
    static __thread int64_t cap = 0;
    if (n_floats > cap) {
        free(buf);
        buf = (float *)aligned_alloc(64, (size_t)((n_floats + 15) / 16 * 16) * sizeof(float));
        cap = buf ? n_floats : 0;
    }
    return buf;
}

static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* portable path: one (sequence, KV head) item; kv_bf16 selects the element type of K and V */
static void attend_portable(const float *Q, const void *K, const void *V, int kv_bf16, int64_t len,
                            int64_t group, int64_t d, float scale, float *S, float *O) {
    float m[MAX_GROUP], sum[MAX_GROUP];
    for (int64_t g = 0; g < group; ++g) m[g] = -__builtin_inff();
    for (int64_t j = 0; j < len; ++j) {
        for (int64_t g = 0; g < group; ++g) {
            float acc = 0.0f;
            for (int64_t x = 0; x < d; ++x)
                acc += Q[g * d + x] * (kv_bf16 ? bf16_to_f32(((const uint16_t *)K)[j * d + x])
                                               : ((const float *)K)[j * d + x]);
            acc *= scale;
            S[g * len + j] = acc;
            m[g] = acc > m[g] ? acc : m[g];
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        float s = 0.0f;
        for (int64_t j = 0; j < len; ++j) { float e = exp_nonpos(S[g * len + j] - m[g]); S[g * len + j] = e; s += e; }
        sum[g] = s;
    }
    for (int64_t g = 0; g < group; ++g)
        for (int64_t x = 0; x < d; ++x) {
            float acc = 0.0f;
            for (int64_t j = 0; j < len; ++j)
                acc += S[g * len + j] * (kv_bf16 ? bf16_to_f32(((const uint16_t *)V)[j * d + x])
                                                 : ((const float *)V)[j * d + x]);
            O[g * d + x] = acc / sum[g];
        }
}

#ifdef __AVX512F__
static inline __m512 load16(const void *p, int kv_bf16, int64_t idx) {
    if (kv_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + idx))), 16));
    return _mm512_loadu_ps((const float *)p + idx);
}

static inline __m512 exp16_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* One (sequence, KV head) item. Always inlined into attend_avx512 with constant group/chunks for the
   common shapes, so the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_avx512_impl(
        const float *Q, const void *K, const void *V, int kv_bf16, int64_t len, const int64_t group,
        const int64_t chunks, float scale, float *S, float *O) {
    const int64_t d = chunks * 16, esize = kv_bf16 ? 2 : 4, row = d * esize;
    float m[MAX_GROUP], sum[MAX_GROUP];
    for (int64_t g = 0; g < group; ++g) m[g] = -__builtin_inff();
    /* scores: each key row is loaded once for the whole group */
    for (int64_t j = 0; j < len; ++j) {
        for (int64_t b = 0; b < row; b += 64) _mm_prefetch((const char *)K + (j + PF_ROWS) * row + b, _MM_HINT_T0);
        __m512 acc[MAX_GROUP];
        for (int64_t g = 0; g < group; ++g) acc[g] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) {
            __m512 kc = load16(K, kv_bf16, j * d + c * 16);
            for (int64_t g = 0; g < group; ++g)
                acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(Q + g * d + c * 16), kc, acc[g]);
        }
        for (int64_t g = 0; g < group; ++g) {
            float s = _mm512_reduce_add_ps(acc[g]) * scale;
            S[g * len + j] = s;
            m[g] = s > m[g] ? s : m[g];
        }
    }
    /* exp(s - max) and the sums */
    for (int64_t g = 0; g < group; ++g) {
        float *Sg = S + g * len;
        __m512 mg = _mm512_set1_ps(m[g]), vs = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= len; j += 16) {
            __m512 e = exp16_nonpos(_mm512_sub_ps(_mm512_loadu_ps(Sg + j), mg));
            _mm512_storeu_ps(Sg + j, e);
            vs = _mm512_add_ps(vs, e);
        }
        if (j < len) {
            __mmask16 k = (__mmask16)((1u << (len - j)) - 1u);
            __m512 e = exp16_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, Sg + j), mg));
            _mm512_mask_storeu_ps(Sg + j, k, e);
            vs = _mm512_add_ps(vs, _mm512_maskz_mov_ps(k, e));
        }
        sum[g] = _mm512_reduce_add_ps(vs);
    }
    /* weighted sum of the values: rows in order, as many 16-column chunks per pass as fit in
       registers next to the group's accumulators (all of them for group * chunks <= 24) */
    const int64_t tile = group * chunks <= 24 ? chunks : (24 / group > 0 ? 24 / group : 1);
    for (int64_t c0 = 0; c0 < chunks; c0 += tile) {
        const int64_t ct = c0 + tile <= chunks ? tile : chunks - c0;
        __m512 acc[24];
        for (int64_t a = 0; a < group * ct; ++a) acc[a] = _mm512_setzero_ps();
        for (int64_t j = 0; j < len; ++j) {
            for (int64_t b = 0; b < ct * 16 * esize; b += 64)
                _mm_prefetch((const char *)V + (j + PF_ROWS) * row + c0 * 16 * esize + b, _MM_HINT_T0);
            for (int64_t c = 0; c < ct; ++c) {
                __m512 vc = load16(V, kv_bf16, j * d + (c0 + c) * 16);
                for (int64_t g = 0; g < group; ++g)
                    acc[g * ct + c] = _mm512_fmadd_ps(_mm512_set1_ps(S[g * len + j]), vc, acc[g * ct + c]);
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            __m512 inv = _mm512_set1_ps(1.0f / sum[g]);
            for (int64_t c = 0; c < ct; ++c)
                _mm512_storeu_ps(O + g * d + (c0 + c) * 16, _mm512_mul_ps(acc[g * ct + c], inv));
        }
    }
}

static void attend_avx512(const float *Q, const void *K, const void *V, int kv_bf16, int64_t len,
                          int64_t group, int64_t d, float scale, float *S, float *O) {
#define SHAPE(G, C) if (group == G && d == 16 * C) { attend_avx512_impl(Q, K, V, kv_bf16, len, G, C, scale, S, O); return; }
    SHAPE(1, 4) SHAPE(2, 4) SHAPE(3, 4) SHAPE(4, 4) SHAPE(5, 4) SHAPE(6, 4) SHAPE(7, 4) SHAPE(8, 4)
    SHAPE(1, 8) SHAPE(2, 8) SHAPE(3, 8) SHAPE(4, 8) SHAPE(5, 8) SHAPE(6, 8) SHAPE(7, 8) SHAPE(8, 8)
#undef SHAPE
    attend_avx512_impl(Q, K, V, kv_bf16, len, group, d / 16, scale, S, O);
}
#endif

static int decode_attention(const float *q, const void *k, const void *v, int kv_bf16, const int64_t *slots,
                            const int64_t *lens, int64_t n, int64_t kv_heads, int64_t group, int64_t d,
                            int64_t num_slots, int64_t slot_len, float scale, float *out, int threads) {
    if (group > MAX_GROUP || group < 1 || d < 1) return -2;
    for (int64_t i = 0; i < n; ++i)
        if (slots[i] < 0 || slots[i] >= num_slots || lens[i] < 1 || lens[i] > slot_len) return -3;
    const size_t esize = kv_bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(dynamic, 1) reduction(|:failed)
    for (int64_t w = 0; w < n * kv_heads; ++w) {
        const int64_t i = w / kv_heads, h = w % kv_heads, len = lens[i];
        const size_t base = (size_t)((slots[i] * kv_heads + h) * slot_len * d) * esize;
        const char *K = (const char *)k + base, *V = (const char *)v + base;
        float *S = scratch(group * len);
        if (!S) { failed = 1; continue; }
#ifdef __AVX512F__
        if (d % 16 == 0) {
            attend_avx512(q + w * group * d, K, V, kv_bf16, len, group, d, scale, S, out + w * group * d);
            continue;
        }
#endif
        attend_portable(q + w * group * d, K, V, kv_bf16, len, group, d, scale, S, out + w * group * d);
    }
    return failed ? -1 : 0;
}

int decode_attention_f32(const float *q, const float *k, const float *v, const int64_t *slots, const int64_t *lens,
                         int64_t n, int64_t kv_heads, int64_t group, int64_t d, int64_t num_slots, int64_t slot_len,
                         float scale, float *out, int threads) {
    return decode_attention(q, k, v, 0, slots, lens, n, kv_heads, group, d, num_slots, slot_len, scale, out, threads);
}

int decode_attention_bf16(const float *q, const uint16_t *k, const uint16_t *v, const int64_t *slots,
                          const int64_t *lens, int64_t n, int64_t kv_heads, int64_t group, int64_t d,
                          int64_t num_slots, int64_t slot_len, float scale, float *out, int threads) {
    return decode_attention(q, k, v, 1, slots, lens, n, kv_heads, group, d, num_slots, slot_len, scale, out, threads);
}

/* 1 when this build uses the AVX-512 attention path (head_dim a multiple of 16), else 0. */
int decoder_simd(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------ the layer's glue around the GEMMs
 * Elementwise work that torch runs as several small ops per layer (each a dispatch of a few us, which
 * at one decoding sequence is a third of the step). Same arithmetic as the torch ops they replace, in
 * the same order; built with -ffp-contract=off so no multiply-add is fused where torch rounds twice. */

static inline uint16_t f32_to_bf16(float f) {
    /* round to nearest even, as torch's float -> bfloat16 conversion */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* x[T, H] float32 += delta (float32 or bfloat16, NULL: nothing added), then
 * out[T, H] = (x * 1/sqrt(mean(x^2) + eps)) * w, written as float32 or bfloat16.
 * transformers' LlamaRMSNorm in float32 (and F.rms_norm); the sum of squares in 16 lanes. */
int add_rms_norm(float *x, const void *delta, int delta_bf16, const float *w, int64_t rows, int64_t hidden,
                 float eps, void *out, int out_bf16, int threads) {
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) if (rows >= 16) schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        float *xr = x + t * hidden;
        if (delta) {
            if (delta_bf16) {
                const uint16_t *dr = (const uint16_t *)delta + t * hidden;
                for (int64_t i = 0; i < hidden; ++i) xr[i] += bf16_to_f32(dr[i]);
            } else {
                const float *dr = (const float *)delta + t * hidden;
                for (int64_t i = 0; i < hidden; ++i) xr[i] += dr[i];
            }
        }
        float lanes[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= hidden; i += 16)
            for (int l = 0; l < 16; ++l) lanes[l] += xr[i + l] * xr[i + l];
        for (; i < hidden; ++i) lanes[i % 16] += xr[i] * xr[i];
        float ss = 0.0f;
        for (int l = 0; l < 16; ++l) ss += lanes[l];
        const float r = 1.0f / __builtin_sqrtf(ss / (float)hidden + eps);
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + t * hidden;
            for (int64_t j = 0; j < hidden; ++j) o[j] = f32_to_bf16((xr[j] * r) * w[j]);
        } else {
            float *o = (float *)out + t * hidden;
            for (int64_t j = 0; j < hidden; ++j) o[j] = (xr[j] * r) * w[j];
        }
    }
    return 0;
}

/* RoPE and the KV-cache write of one step. qkv: [T, (heads + 2 kv_heads) * d] float32 or bfloat16 (the fused
 * projection's output: q heads, k heads, v heads); cos/sin: [slot_len, d] float32 tables indexed by position.
 * Writes q rotated to q_out [T, heads, d] float32, and k rotated and v as they are into the cache
 * kc/vc [num_slots, kv_heads, slot_len, d] at (slots[t], :, positions[t]): float32, or with kv_bf16 bfloat16
 * (rounded to nearest even, as torch's float -> bfloat16 conversion); cos/sin must have slot_len rows.
 * Rotation: transformers' x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1). */
int rope_kv_write(const void *qkv, int qkv_bf16, const float *cos, const float *sin, const int64_t *positions,
                  const int64_t *slots, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t num_slots,
                  int64_t slot_len, float *q_out, void *kc, void *vc, int kv_bf16, int threads) {
    const int64_t width = (heads + 2 * kv_heads) * d, half = d / 2;
    if (d % 2 || d < 2) return -2;
    for (int64_t t = 0; t < rows; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots || positions[t] < 0 || positions[t] >= slot_len) return -3;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) if (rows >= 32) schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const float *c = cos + positions[t] * d, *s = sin + positions[t] * d;
        const int64_t cache_row = slots[t] * kv_heads * slot_len + positions[t];
        float x[d], r[d];
        for (int64_t hh = 0; hh < heads + 2 * kv_heads; ++hh) {
            const int64_t off = t * width + hh * d;
            if (qkv_bf16)
                for (int64_t i = 0; i < d; ++i) x[i] = bf16_to_f32(((const uint16_t *)qkv)[off + i]);
            else
                memcpy(x, (const float *)qkv + off, (size_t)d * sizeof(float));
            const int is_v = hh >= heads + kv_heads;
            const float *src = x; /* what goes into the cache: v as it is, k rotated */
            if (!is_v) {
                float *dst = hh < heads ? q_out + (t * heads + hh) * d : r;
                for (int64_t i = 0; i < half; ++i) dst[i] = x[i] * c[i] - x[i + half] * s[i];
                for (int64_t i = half; i < d; ++i) dst[i] = x[i] * c[i] + x[i - half] * s[i];
                if (hh < heads) continue;
                src = r;
            }
            const int64_t at = (cache_row + (hh - heads - (is_v ? kv_heads : 0)) * slot_len) * d; /* its KV head */
            void *cache = is_v ? vc : kc;
            if (kv_bf16)
                for (int64_t i = 0; i < d; ++i) ((uint16_t *)cache)[at + i] = f32_to_bf16(src[i]);
            else
                memcpy((float *)cache + at, src, (size_t)d * sizeof(float));
        }
    }
    return 0;
}

/* linear_packed_{f32,bf16}: y[M, N] = x[M, K] . W^T (+ bias) for few rows (decode steps), reading the weight
 * in the blocked layout oneDNN gave it (torch.ops.mkldnn._reorder_linear_weight), so the engine keeps one copy
 * of every weight and oneDNN still runs the large-M GEMMs (prefill) on it:
 *
 *   float32:  W[o, k] at (o / 64) * K * 64 + k * 64 + o % 64                  (64 outputs per k, per block)
 *   bfloat16: W[o, k] at (o / 64) * K * 64 + (k / 2) * 128 + (o % 64) * 2 + k % 2   (k pairs interleaved, K even)
 *
 * The engine checks this layout on every weight shape before it uses these (native.Kernels.packed_layout_ok):
 * oneDNN picks its layout per shape and CPU. Per 64-output block and up to MR rows of x, 4 x MR accumulators
 * of 16 outputs; each k (each k pair in bfloat16: vdpbf16ps) loads the block's 64 weights once and
 * multiply-adds them into every row (fused multiply-add, products summed in k order per output).
 * The weight streams from memory once per call; the blocks are spread over the OpenMP threads.
 *   x, y: float32 (bfloat16 in the bf16 kernel, y rounded to nearest even); bias: NULL or [N] in x's dtype.
 * Returns -2 when N is not a multiple of 64, K of 2 (bfloat16), or the CPU lacks AVX-512 (AVX512_BF16). */
#define GEMM_NB 64
#define GEMM_MR 6
/* both linear_packed_*: below GEMM_DYNAMIC_ROWS rows (the GEMM streams its weight from memory) the N / 64 output
 * blocks are split statically, each thread one contiguous run of whole blocks (one sequential stretch of the weight
 * per core). From GEMM_DYNAMIC_ROWS rows (arithmetic-bound) the blocks are handed out one at a time (OpenMP's dynamic
 * schedule), the last (N / 64) % threads of them as two halves of 32 outputs (HALF[mr]: the kernel for mr rows of 32
 * outputs, TABLE[mr] of 64), so every thread gets the same number of outputs (o_proj and down_proj of a 576-wide
 * model are 9 blocks: 5 against 4 on 2 threads left one idle a tenth of those GEMMs), and a thread that the OS
 * preempts for another process's wakeup no longer holds the other at the barrier while blocks are left. Rows go in
 * blocks of up to GEMM_MR; an output's products are summed in the same order whichever thread and item compute it,
 * so neither split changes a bit. x, w, bias, y, M, N, K, threads from the caller; PER_OUT: weight elements per
 * output in a block's k step (1 float32, 2 bfloat16 k pairs). */
#define GEMM_DYNAMIC_ROWS 8
#define GEMM_ITEM(TABLE, HALF, PER_OUT, b, off, half)                                                             \
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_MR) {                                                                  \
        const int mr = M - m0 < GEMM_MR ? (int)(M - m0) : GEMM_MR;                                                  \
        ((half) ? HALF : TABLE)[mr](x + m0 * K, K, w + (b) * K * GEMM_NB + (PER_OUT) * (off),                       \
                                    bias ? bias + (b) * GEMM_NB + (off) : NULL, y + m0 * N + (b) * GEMM_NB + (off), N); \
    }
#define GEMM_BLOCKS(TABLE, HALF, PER_OUT)                                                                         \
    const int64_t nb_ = N / GEMM_NB, nt_ = threads > 1 ? threads : 1;                                             \
    if (M < GEMM_DYNAMIC_ROWS) {                                                                                   \
        _Pragma("omp parallel for num_threads(nt_) schedule(static)")                                              \
        for (int64_t b = 0; b < nb_; ++b) GEMM_ITEM(TABLE, HALF, PER_OUT, b, 0, 0)                                 \
    } else {                                                                                                       \
        const int64_t split_ = nb_ % nt_, whole_ = nb_ - split_;                                                   \
        _Pragma("omp parallel for num_threads(nt_) schedule(dynamic, 1)")                                          \
        for (int64_t it = 0; it < whole_ + 2 * split_; ++it) {                                                     \
            const int half = it >= whole_;                                                                         \
            GEMM_ITEM(TABLE, HALF, PER_OUT, half ? whole_ + (it - whole_) / 2 : it,                                \
                      half ? 32 * ((it - whole_) % 2) : 0, half)                                                   \
        }                                                                                                          \
    }
#ifdef __AVX512F__
/* mr rows of nj * 16 outputs (nj 4: a whole block, 2: half of one; P at the block's first weight of those outputs) */
static inline __attribute__((always_inline)) void gemm_block_f32(const float *x, int64_t K, const float *P,
                                                                 const float *bias, float *y, int64_t ldy, int mr,
                                                                 int nj) {
    __m512 acc[GEMM_MR][4];
    for (int m = 0; m < mr; ++m)
        for (int j = 0; j < nj; ++j) acc[m][j] = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const float *p = P + k * GEMM_NB;
        __m512 wv[4];
        for (int j = 0; j < nj; ++j) wv[j] = _mm512_loadu_ps(p + 16 * j);
        for (int m = 0; m < mr; ++m) {
            __m512 b = _mm512_set1_ps(x[m * K + k]);
            for (int j = 0; j < nj; ++j) acc[m][j] = _mm512_fmadd_ps(b, wv[j], acc[m][j]);
        }
    }
    for (int m = 0; m < mr; ++m)
        for (int j = 0; j < nj; ++j) _mm512_storeu_ps(y + m * ldy + 16 * j, acc[m][j]);
}
#define GEMM_F32(MR) \
    static void gemm_f32_##MR(const float *x, int64_t K, const float *P, const float *bias, float *y, int64_t ldy) { \
        gemm_block_f32(x, K, P, bias, y, ldy, MR, 4); }                                                              \
    static void gemm_f32_half_##MR(const float *x, int64_t K, const float *P, const float *bias, float *y,         \
                                   int64_t ldy) { gemm_block_f32(x, K, P, bias, y, ldy, MR, 2); }
GEMM_F32(1) GEMM_F32(2) GEMM_F32(3) GEMM_F32(4) GEMM_F32(5) GEMM_F32(6)
typedef void (*gemm_f32_fn)(const float *, int64_t, const float *, const float *, float *, int64_t);
static const gemm_f32_fn GEMM_F32_MR[GEMM_MR + 1] = {0, gemm_f32_1, gemm_f32_2, gemm_f32_3, gemm_f32_4, gemm_f32_5,
                                                      gemm_f32_6};
static const gemm_f32_fn GEMM_F32_HALF[GEMM_MR + 1] = {0, gemm_f32_half_1, gemm_f32_half_2, gemm_f32_half_3,
                                                        gemm_f32_half_4, gemm_f32_half_5, gemm_f32_half_6};
#endif

int linear_packed_f32(const float *x, const float *w, const float *bias, int64_t M, int64_t N, int64_t K, float *y,
                      int threads) {
#ifdef __AVX512F__
    if (N % GEMM_NB || M < 0 || K < 1) return -2;
    GEMM_BLOCKS(GEMM_F32_MR, GEMM_F32_HALF, 1);
    return 0;
#else
    (void)x; (void)w; (void)bias; (void)M; (void)N; (void)K; (void)y; (void)threads;
    return -2;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
static inline __attribute__((always_inline)) void gemm_block_bf16(const uint16_t *x, int64_t K, const uint16_t *P,
                                                                  const uint16_t *bias, uint16_t *y, int64_t ldy,
                                                                  int mr, int nj) {
    __m512 acc[GEMM_MR][4];
    for (int m = 0; m < mr; ++m)
        for (int j = 0; j < nj; ++j)
            acc[m][j] = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                   _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + 16 * j))), 16))
                             : _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        const uint16_t *p = P + k * GEMM_NB;
        __m512bh wv[4];
        for (int j = 0; j < nj; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(p + 32 * j);
        for (int m = 0; m < mr; ++m) {
            int32_t pair;
            memcpy(&pair, x + m * K + k, sizeof pair);
            __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < nj; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], b, wv[j]);
        }
    }
    for (int m = 0; m < mr; ++m)
        for (int j = 0; j < nj; ++j)
            _mm256_storeu_si256((__m256i *)(y + m * ldy + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[m][j]));
}
#define GEMM_BF16(MR) \
    static void gemm_bf16_##MR(const uint16_t *x, int64_t K, const uint16_t *P, const uint16_t *bias, uint16_t *y, \
                               int64_t ldy) { gemm_block_bf16(x, K, P, bias, y, ldy, MR, 4); }                       \
    static void gemm_bf16_half_##MR(const uint16_t *x, int64_t K, const uint16_t *P, const uint16_t *bias,         \
                                    uint16_t *y, int64_t ldy) { gemm_block_bf16(x, K, P, bias, y, ldy, MR, 2); }
GEMM_BF16(1) GEMM_BF16(2) GEMM_BF16(3) GEMM_BF16(4) GEMM_BF16(5) GEMM_BF16(6)
typedef void (*gemm_bf16_fn)(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, uint16_t *, int64_t);
static const gemm_bf16_fn GEMM_BF16_MR[GEMM_MR + 1] = {0, gemm_bf16_1, gemm_bf16_2, gemm_bf16_3, gemm_bf16_4,
                                                        gemm_bf16_5, gemm_bf16_6};
static const gemm_bf16_fn GEMM_BF16_HALF[GEMM_MR + 1] = {0, gemm_bf16_half_1, gemm_bf16_half_2, gemm_bf16_half_3,
                                                          gemm_bf16_half_4, gemm_bf16_half_5, gemm_bf16_half_6};
#endif

int linear_packed_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, int64_t M, int64_t N, int64_t K,
                       uint16_t *y, int threads) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (N % GEMM_NB || K % 2 || M < 0 || K < 2) return -2;
    GEMM_BLOCKS(GEMM_BF16_MR, GEMM_BF16_HALF, 2);
    return 0;
#else
    (void)x; (void)w; (void)bias; (void)M; (void)N; (void)K; (void)y; (void)threads;
    return -2;
#endif
}

/* silu_mul: out[T, inter] = silu(gu[:, :inter]) * gu[:, inter:] for the fused gate/up output gu [T, 2 * inter],
 * float32 or bfloat16 (out in the same dtype). silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) (no overflow):
 * 1 / (1 + e) for g >= 0, e / (1 + e) below; within ~2 ulp of torch's g / (1 + exp(-g)). bfloat16 rounds where
 * torch does on bfloat16 tensors: silu(g) to bfloat16, then the product to bfloat16. */
static inline float silu_f32(float g) {
    float e = exp_nonpos(g < 0.0f ? g : -g);
    return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e));
}

#ifdef __AVX512F__
/* float32 lanes rounded to the nearest bfloat16 (even on ties; NaN stays NaN), as float32 bits */
static inline __m512i round_bf16_bits(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}
#endif

int silu_mul(const void *gu, int bf16, int64_t rows, int64_t inter, void *out) {
    for (int64_t t = 0; t < rows; ++t) {
        const int64_t g0 = t * 2 * inter, u0 = g0 + inter, o0 = t * inter;
        int64_t j = 0;
#ifdef __AVX512F__
        const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
        for (; j + 16 <= inter; j += 16) {
            __m512 x = load16(gu, bf16, g0 + j), u = load16(gu, bf16, u0 + j);
            __m512 e = exp16_nonpos(_mm512_sub_ps(zero, _mm512_abs_ps(x)));
            __mmask16 pos = _mm512_cmp_ps_mask(x, zero, _CMP_GE_OQ);
            __m512 s = _mm512_mul_ps(x, _mm512_div_ps(_mm512_mask_blend_ps(pos, e, one), _mm512_add_ps(one, e)));
            if (bf16) {
                __m512i r = round_bf16_bits(_mm512_mul_ps(_mm512_castsi512_ps(round_bf16_bits(s)), u));
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + o0 + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
            } else {
                _mm512_storeu_ps((float *)out + o0 + j, _mm512_mul_ps(s, u));
            }
        }
#endif
        if (bf16) {
            const uint16_t *g = (const uint16_t *)gu;
            for (; j < inter; ++j)
                ((uint16_t *)out)[o0 + j] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu_f32(bf16_to_f32(g[g0 + j])))) *
                                                        bf16_to_f32(g[u0 + j]));
        } else {
            const float *g = (const float *)gu;
            for (; j < inter; ++j) ((float *)out)[o0 + j] = silu_f32(g[g0 + j]) * g[u0 + j];
        }
    }
    return 0;
}

/* decode_layers: every decoder layer of a step whose tokens all fit the few-row GEMM (the engine calls it for
 * decode-only steps of up to 128 sequences), the same kernels in the same order as Decoder._layers_native
 * (pipeline/cpu_runtime/model.py) without a return to Python between them:
 *
 *   h = RMSNorm(x) (ln1);  per layer: qkv = h Wqkv (+b); RoPE + K/V write; attn = decode_attention;
 *   x += attn Wo (+b), h = RMSNorm(x) (ln2); gu = h Wgu; act = silu(gate) * up; x += act Wdown, h = RMSNorm(x)
 *   (next layer's ln1; after the last layer only the add).
 *
 * w: int64 [layers, 10] addresses per layer: ln1, ln2 (float32 [hidden]), qkv weight, qkv bias, o weight, o bias,
 * gate/up weight, down weight (packed as linear_packed_* reads them, in the GEMM dtype; a bias 0 when absent),
 * K cache, V cache ([num_slots, kv_heads, slot_len, d], float32 or, with kv_bf16, bfloat16). bf16: GEMM dtype
 * bfloat16 (inputs, outputs and the SiLU product; attention's output rounded to bfloat16 before Wo), else float32.
 * x: float32 [n, hidden], updated in place. Returns 0 or the first failing kernel's code. */
int decode_layers(const int64_t *w, int64_t layers, int bf16, int kv_bf16, float *x, int64_t n, int64_t hidden,
                  int64_t heads, int64_t kv_heads, int64_t d, int64_t inter, const float *cos, const float *sin,
                  const int64_t *positions, const int64_t *slots, const int64_t *lens, int64_t num_slots,
                  int64_t slot_len, float eps, float scale, int threads) {
    const size_t es = bf16 ? 2 : 4;
    const int64_t width = (heads + 2 * kv_heads) * d, hd = heads * d;
    void *h = malloc((size_t)(n * hidden) * es), *qkv = malloc((size_t)(n * width) * es);
    void *attn_lp = bf16 ? malloc((size_t)(n * hd) * es) : NULL, *proj = malloc((size_t)(n * hidden) * es);
    void *gu = malloc((size_t)(n * 2 * inter) * es), *act = malloc((size_t)(n * inter) * es);
    float *q = (float *)malloc((size_t)(n * hd) * 4), *attn = (float *)malloc((size_t)(n * hd) * 4);
    int rc = -1;
    if (!h || !qkv || (bf16 && !attn_lp) || !proj || !gu || !act || !q || !attn) goto done;
#define LINEAR(in, W, B, N, K, out)                                                                                \
    (bf16 ? linear_packed_bf16((const uint16_t *)(in), (const uint16_t *)(W), (const uint16_t *)(B), n, N, K,     \
                               (uint16_t *)(out), threads)                                                         \
          : linear_packed_f32((const float *)(in), (const float *)(W), (const float *)(B), n, N, K, (float *)(out), \
                              threads))
#define P(i, j) ((const void *)(intptr_t)w[(i) * 10 + (j)])
    if ((rc = add_rms_norm(x, NULL, 0, (const float *)P(0, 0), n, hidden, eps, h, bf16, threads))) goto done;
    for (int64_t i = 0; i < layers; ++i) {
        if ((rc = LINEAR(h, P(i, 2), P(i, 3), width, hidden, qkv))) goto done;
        if ((rc = rope_kv_write(qkv, bf16, cos, sin, positions, slots, n, heads, kv_heads, d, num_slots, slot_len, q,
                                (void *)P(i, 8), (void *)P(i, 9), kv_bf16, threads))) goto done;
        if ((rc = decode_attention(q, P(i, 8), P(i, 9), kv_bf16, slots, lens, n, kv_heads, heads / kv_heads, d, num_slots,
                                   slot_len, scale, attn, threads))) goto done;
        const void *o_in = attn;
        if (bf16) {
            for (int64_t j = 0; j < n * hd; ++j) ((uint16_t *)attn_lp)[j] = f32_to_bf16(attn[j]);
            o_in = attn_lp;
        }
        if ((rc = LINEAR(o_in, P(i, 4), P(i, 5), hidden, hd, proj))) goto done;
        if ((rc = add_rms_norm(x, proj, bf16, (const float *)P(i, 1), n, hidden, eps, h, bf16, threads))) goto done;
        if ((rc = LINEAR(h, P(i, 6), NULL, 2 * inter, hidden, gu))) goto done;
        silu_mul(gu, bf16, n, inter, act);
        if ((rc = LINEAR(act, P(i, 7), NULL, hidden, inter, proj))) goto done;
        if (i + 1 < layers) {
            if ((rc = add_rms_norm(x, proj, bf16, (const float *)P(i + 1, 0), n, hidden, eps, h, bf16, threads)))
                goto done;
        } else if (bf16) {
            for (int64_t j = 0; j < n * hidden; ++j) x[j] += bf16_to_f32(((const uint16_t *)proj)[j]);
        } else {
            for (int64_t j = 0; j < n * hidden; ++j) x[j] += ((const float *)proj)[j];
        }
    }
#undef P
#undef LINEAR
    rc = 0;
done:
    free(h); free(qkv); free(attn_lp); free(proj); free(gu); free(act); free(q); free(attn);
    return rc;
}
