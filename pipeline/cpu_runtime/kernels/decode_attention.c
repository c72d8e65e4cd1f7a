/* Decode attention over trtpipe's slot KV cache (pipeline/cpu_runtime/model.py SlotKvCache).
 *
 * One query token per sequence, grouped-query attention: for every (sequence i, KV head h) the
 * `group` query heads that share KV head h attend over the first lens[i] positions of slot slots[i]:
 *
 *     out[i, h, g, :] = softmax_j(scale * q[i, h, g, :] . K[slots[i], h, j, :]) @ V[slots[i], h, :lens[i], :]
 *
 * Shapes (row-major, contiguous):
 *   q, out  float32 [n, kv_heads, group, head_dim]
 *   k, v    float32 or bfloat16 [num_slots, kv_heads, slot_len, head_dim]   (one layer of the cache)
 *   slots, lens  int64 [n]
 *
 * Each (i, h) reads its keys and values once, and only up to its own length (the batched GEMM this
 * replaces reads every slot up to the longest one): the group's scores go to a per-thread buffer,
 * then exp and sum, then the weighted sum of the values, divided by the sum. (i, h) pairs are spread
 * over the process's OpenMP threads (torch's libgomp when torch is loaded first).
 *
 * With AVX-512 (head_dim a multiple of 16, group <= 8) the kernel uses intrinsics; otherwise a
 * portable loop. exp() of the (non-positive) softmax arguments is a Cephes-style polynomial, max
 * relative error ~2 ulp; arguments below -87 give 0.
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

/* Returns 0; -1 when a per-thread score buffer could not be allocated (the output is then incomplete);
   -2 for a shape the kernel does not handle (group outside 1..MAX_GROUP, head_dim < 1). */
static int decode_attention(const float *q, const void *k, const void *v, int kv_bf16, const int64_t *slots,
                            const int64_t *lens, int64_t n, int64_t kv_heads, int64_t group, int64_t d,
                            int64_t slot_len, float scale, float *out, int threads) {
    if (group > MAX_GROUP || group < 1 || d < 1) return -2;
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
                         int64_t n, int64_t kv_heads, int64_t group, int64_t d, int64_t slot_len, float scale,
                         float *out, int threads) {
    return decode_attention(q, k, v, 0, slots, lens, n, kv_heads, group, d, slot_len, scale, out, threads);
}

int decode_attention_bf16(const float *q, const uint16_t *k, const uint16_t *v, const int64_t *slots,
                          const int64_t *lens, int64_t n, int64_t kv_heads, int64_t group, int64_t d,
                          int64_t slot_len, float scale, float *out, int threads) {
    return decode_attention(q, k, v, 1, slots, lens, n, kv_heads, group, d, slot_len, scale, out, threads);
}

/* 1 when this build uses the AVX-512 path (for head_dim a multiple of 16), else 0. */
int decode_attention_simd(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}
