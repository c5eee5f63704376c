// Integer-activation decode kernels (the `activations="int8"` option: llama.cpp's numerics). Each activation row is
// quantized per block of 32 to int8 (d = amax / 127, q = rint(x / d)) and meets the weights' 4-bit codes in integer
// dot products (vpmaddubsw: 32 u8 x s8 products per instruction, exact int32 sums per block), one fp32 FMA per 64
// weights applying the weight and activation scales. Reads moeq's own row-major layouts as they are
// (no repacked copy): in a 4-bit row's 32-byte chunk, 32-bit lane l holds the 8 elements 64c + 8l .. 8l + 7 (even
// elements in the low nibbles), so the activations are split once per call into their even and odd elements and
// every lane of the int32 sums belongs to one block of 32. AVX2 (every x86-64-v3 CPU). AVX512-VNNI CPUs (Zen 4/5,
// Ice Lake and later) take 128-element chunks (a 64-byte load: two of the 32-byte chunks above) through vpdpbusd,
// which sums the u8 x s8 products straight into int32: codebook values there go in as u8 shifted by 128 (the same
// per-lane correction as the plain rows' -8), so both kinds cost two vpdpbusd per row per 128 weights.
//
// Weights (i8_supported): RTN 4-bit symmetric (value = scale * (code - 8): llama.cpp's Q4_0 blocks, vLLM's int4) —
// codes as u8 against signed activations, the -8 folded into per-lane sums of the activations —, and 4-bit codebook
// grids whose values are integers in [-127, 127] (IQ4_NL: one byte shuffle per 32 codes, then llama.cpp's sign trick
// |x| * sign(v, x), which keeps every pair of products within int16); groups of 32 or multiples of 64; scales fp32,
// bf16 or int8 codes with a bf16 row factor; K % 32 == 0. 8-bit symmetric RTN (value = scale * (code - 128):
// llama.cpp's Q8_0 blocks) only on AVX512-VNNI, as linears: its codes span all 256 values, so the AVX2 rows would
// need as many instructions per weight as the int16 rows they replace, where vpdpbusd takes them as they are.
#include "moeq.h"
#include <float.h>

#if defined(__AVX2__) && defined(__FMA__)
#define MOEQ_I8 1
#endif
#if defined(MOEQ_I8) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define MOEQ_I8_512 1
#endif

int moeq_has_i8_dot(void) {  // 2: the AVX512-VNNI rows, which also take 8-bit weights
#if defined(MOEQ_I8_512)
    return 2;
#elif defined(MOEQ_I8)
    return 1;
#else
    return 0;
#endif
}

#if defined(MOEQ_I8)
#if defined(MOEQ_I8_512)
// One 128-element chunk of a quantized activation row: lo / hi its even / odd elements (the low / high nibbles of the
// weights' 64 bytes), corr = -off * (the lane's sum of q), off the weight's code offset (i8_offset), dx = the lane's
// block scale (0 past K).
#define I8_CH 128
typedef struct {
    int8_t lo[64], hi[64];
    int32_t corr[16];
    float dx[16];
} i8_chunk;
typedef __m512i i8_lut_t;
static inline int i8_offset(int cb) { return cb ? 128 : 8; }
#else
// One 64-element chunk of a quantized activation row: lo / hi its even / odd elements (the low / high nibbles of the
// weights' 32 bytes), alo / ahi their magnitudes (the codebook rows' sign trick), corr = -8 * (the lane's sum of q)
// for the plain rows, dx = the lane's block scale (0 past K).
#define I8_CH 64
typedef struct {
    int8_t lo[32], hi[32];
    uint8_t alo[32], ahi[32];
    int32_t corr[8];
    float dx[8];
} i8_chunk;
typedef __m256i i8_lut_t;
static inline int i8_offset(int cb) { return (void)cb, 8; }
#endif

static inline i64 i8_chunks(i64 K) { return (K + I8_CH - 1) / I8_CH; }

// One block of 32 activations as Q8_0: q[32] and its scale *d; returns 0 when it holds NaN/Inf. Vector form of
// d = amax / 127, q = lrintf(clamp(x * (1 / d), -127, 127)): the same fp32 products, and vcvtps2dq rounds to nearest
// even as lrintf does (no libm call per element).
static inline int i8_block(const float* xb, int* q, float* d) {
    const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(FLT_MAX);
    __m256 amax = _mm256_setzero_ps(), fin = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int k = 0; k < 32; k += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + k));
        fin = _mm256_and_ps(fin, _mm256_cmp_ps(a, big, _CMP_LE_OQ));  // false for NaN and Inf
        amax = _mm256_max_ps(amax, a);
    }
    if (_mm256_movemask_ps(fin) != 0xFF) return 0;
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    *d = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.f;
    const float id = *d > 0.f ? 1.f / *d : 0.f;
    if (!isfinite(id)) {  // 1/d overflows for subnormal d: divide instead
        for (int k = 0; k < 32; k++) {
            const float v = xb[k] / *d;
            q[k] = _mm_cvtss_si32(_mm_set_ss(v < -127.f ? -127.f : v > 127.f ? 127.f : v));
        }
        return 1;
    }
    const __m256 idv = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    for (int k = 0; k < 32; k += 8) {
        const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + k), idv), lo), hi);
        _mm256_storeu_si256((__m256i*)(q + k), _mm256_cvtps_epi32(v));
    }
    return 1;
}

int moeq_q8_block(const float* x, int* q, float* d) { return i8_block(x, q, d); }

// x [K] fp32 as i8_chunks(K) chunks; returns 0 when x holds NaN/Inf (the caller takes the default path, which
// carries them through as torch does).
static int i8_quantize_row(const float* x, i64 K, int off, i8_chunk* out) {
    memset(out, 0, (size_t)i8_chunks(K) * sizeof(i8_chunk));
    for (i64 b = 0; b < K / 32; b++) {
        int qb[32];
        float d;
        if (!i8_block(x + 32 * b, qb, &d)) return 0;
        for (int k = 0; k < 32; k++) {
            const i64 e = 32 * b + k, j = (e % I8_CH) / 2;
            const int q = qb[k];
            i8_chunk* ch = out + e / I8_CH;
            if (e & 1)
                ch->hi[j] = (int8_t)q;
            else
                ch->lo[j] = (int8_t)q;
#if !defined(MOEQ_I8_512)
            if (e & 1)
                ch->ahi[j] = (uint8_t)abs(q);
            else
                ch->alo[j] = (uint8_t)abs(q);
#endif
            ch->corr[j / 4] -= off * q;
            ch->dx[j / 4] = d;
        }
    }
    return 1;
}

#if defined(MOEQ_I8_512)
// Four rows' int32 sums of one chunk reduced into one vector by two levels of in-lane unpacks and adds: lane 4L + r
// holds row r's sum over lanes 4L..4L+3 of its vector (one conversion and FMA then serve all four rows).
static inline __attribute__((always_inline)) __m512i i8_reduce4(__m512i s0, __m512i s1, __m512i s2, __m512i s3) {
    const __m512i u01 = _mm512_add_epi32(_mm512_unpacklo_epi32(s0, s1), _mm512_unpackhi_epi32(s0, s1));
    const __m512i u23 = _mm512_add_epi32(_mm512_unpacklo_epi32(s2, s3), _mm512_unpackhi_epi32(s2, s3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(u01, u23), _mm512_unpackhi_epi64(u01, u23));
}

// The four row totals of an accumulator in i8_reduce4's lane order.
static inline void i8_sum4(__m512 acc, float* out) {
    float a[16];
    _mm512_storeu_ps(a, acc);
    for (int r = 0; r < 4; r++) out[r] = a[r] + a[4 + r] + a[8 + r] + a[12 + r];
}

// Row n of a weight (codes q, scales sc at the weight's start) against M activation rows (C chunks each): out[M].
// A 64-byte chunk holds blocks 4c .. 4c+3 (lanes 0-3, 4-7, 8-11, 12-15); codes (plain) or lut[code] = value + 128
// (cb) as u8 against the signed activations, the offset removed by the chunk's corr.
static inline __attribute__((always_inline)) void i8_row(const uint8_t* q, const void* sc, const int kind, i64 K,
                                                         i64 gs, const int cb, __m512i lut, i64 n, const i8_chunk* x,
                                                         const i64 M, const float* dx4, float* out) {
    const i64 C = i8_chunks(K), G = K / gs;
    const uint8_t* qn = q + n * (K / 2);
    const char* sn = (const char*)sc + n * G * scale_size(kind);
    const __m512i m4 = _mm512_set1_epi8(15);
    // four bf16 / fp32 / int8 block scales into lanes 4b .. 4b+3 (bf16: the high halves of the lanes)
    static const int16_t spread16[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 1, 0, 1,
                                         0, 2, 0, 2, 0, 2, 0, 2, 0, 3, 0, 3, 0, 3, 0, 3};
    const __m512i spread = _mm512_loadu_si512(spread16);
    const __m512i spread32 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    i64 g = 0, gend = gs;  // gs > 32: the group of the chunk's first element and where it ends (no division)
    for (i64 c = 0; c < C; c++) {
        const i64 left = K - I8_CH * c;  // elements in this chunk: 128, or 32 / 64 / 96 at a row's end
        const int full = left >= I8_CH;
        const __m512i w = full ? _mm512_loadu_si512(qn + 64 * c)
                               : _mm512_maskz_loadu_epi8((__mmask64)((1ULL << (left / 2)) - 1), qn + 64 * c);
        __m512 sv;
        if (gs > 32) {  // a multiple of 64: blocks 0-1 and 2-3 each within one group
            while (I8_CH * c >= gend) g++, gend += gs;
            const float s0 = load_scale(sn, kind, g);
            const float s1 = left > 64 ? load_scale(sn, kind, I8_CH * c + 64 >= gend ? g + 1 : g) : 0.f;
            sv = _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
        } else {
            const __mmask8 nb = (__mmask8)((1u << (full ? 4 : left / 32)) - 1);
            const char* sb = sn + 4 * c * scale_size(kind);
            if (kind == 1)
                sv = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(
                    0xAAAAAAAAu, spread, _mm512_castsi128_si512(_mm_maskz_loadu_epi16(nb, sb))));
            else if (kind == 0)
                sv = _mm512_permutexvar_ps(spread32, _mm512_castps128_ps512(_mm_maskz_loadu_ps(nb, sb)));
            else if (kind == 3)
                sv = _mm512_permutexvar_ps(spread32, _mm512_maskz_mov_ps(nb, e8m0_x16(_mm_maskz_loadu_epi8(nb, sb))));
            else
                sv = _mm512_permutexvar_ps(spread32, _mm512_castps128_ps512(_mm_cvtepi32_ps(
                                                         _mm_cvtepi8_epi32(_mm_maskz_loadu_epi8(nb, sb)))));
        }
        __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
        if (cb) {
            lo = _mm512_shuffle_epi8(lut, lo);
            hi = _mm512_shuffle_epi8(lut, hi);
        }
        if (M == 4 && dx4) {  // four rows: their block sums reduced into one vector first (i8_row8_x4)
            __m512i s[4];
            for (i64 m = 0; m < 4; m++) {
                const i8_chunk* xc = x + m * C + c;
                const __m512i t = _mm512_dpbusd_epi32(_mm512_loadu_si512(xc->corr), lo, _mm512_loadu_si512(xc->lo));
                s[m] = _mm512_dpbusd_epi32(t, hi, _mm512_loadu_si512(xc->hi));
            }
            const __m512i t = i8_reduce4(s[0], s[1], s[2], s[3]);
            acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(sv, _mm512_loadu_ps(dx4 + 16 * c)), acc[0]);
            continue;
        }
        for (i64 m = 0; m < M; m++) {
            const i8_chunk* xc = x + m * C + c;
            __m512i s = _mm512_loadu_si512(xc->corr);
            s = _mm512_dpbusd_epi32(s, lo, _mm512_loadu_si512(xc->lo));
            s = _mm512_dpbusd_epi32(s, hi, _mm512_loadu_si512(xc->hi));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sv, _mm512_loadu_ps(xc->dx)), acc[m]);
        }
    }
    if (M == 4 && dx4) {  // lane 4L + r: row r's sum over block L of each chunk
        i8_sum4(acc[0], out);
        return;
    }
    for (i64 m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// 8-bit rows: one 64-element chunk of a quantized activation row in element order, corr = -128 * (the lane's sum of
// q), dx = the lane's block scale (lanes 0-7 / 8-15: blocks 2c, 2c+1).
typedef struct {
    int8_t q[64];
    int32_t corr[16];
    float dx[16];
} i8_chunk8;

static inline i64 i8_chunks8(i64 K) { return (K + 63) / 64; }

static int i8_quantize_row8(const float* x, i64 K, i8_chunk8* out) {
    memset(out, 0, (size_t)i8_chunks8(K) * sizeof(i8_chunk8));
    for (i64 b = 0; b < K / 32; b++) {
        int qb[32];
        float d;
        if (!i8_block(x + 32 * b, qb, &d)) return 0;
        for (int k = 0; k < 32; k++) {
            const i64 e = 32 * b + k, j = e % 64;
            const int q = qb[k];
            i8_chunk8* ch = out + e / 64;
            ch->q[j] = (int8_t)q;
            ch->corr[j / 4] -= 128 * q;
            ch->dx[j / 4] = d;
        }
    }
    return 1;
}

static inline __attribute__((always_inline)) void i8_row8(const uint8_t* q, const void* sc, const int kind, i64 K,
                                                          i64 gs, i64 n, const i8_chunk8* x, const i64 M,
                                                          float* out) {
    const i64 C = i8_chunks8(K), G = K / gs;
    const uint8_t* qn = q + n * K;
    const char* sn = (const char*)sc + n * G * scale_size(kind);
    __m512 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    i64 g = 0, gend = gs;
    for (i64 c = 0; c < C; c++) {
        const int full = 64 * (c + 1) <= K;  // else half a chunk (K % 32 == 0)
        const __m512i w = full ? _mm512_loadu_si512(qn + 64 * c)
                               : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)(qn + 64 * c)));
        __m512 sv;
        if (gs == 32) {
            const float s0 = load_scale(sn, kind, 2 * c), s1 = full ? load_scale(sn, kind, 2 * c + 1) : 0.f;
            sv = _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
        } else {  // a multiple of 64: the chunk within one group
            while (64 * c >= gend) g++, gend += gs;
            sv = _mm512_set1_ps(load_scale(sn, kind, g));
        }
        for (i64 m = 0; m < M; m++) {
            const i8_chunk8* xc = x + m * C + c;
            const __m512i s = _mm512_dpbusd_epi32(_mm512_loadu_si512(xc->corr), w, _mm512_loadu_si512(xc->q));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sv, _mm512_loadu_ps(xc->dx)), acc[m]);
        }
    }
    for (i64 m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}

static inline void i8_row8_any(const moeq_wstack* w, const uint8_t* q, const void* sc, i64 n, const i8_chunk8* x,
                               i64 M, float* out) {
    const i64 K = w->K, gs = w->gs;
#define I8_CASE(c)                                                                                          \
    case c:                                                                                                 \
        if (w->scale_bf16 == 1) i8_row8(q, sc, 1, K, gs, n, x, c, out);                                     \
        else i8_row8(q, sc, 0, K, gs, n, x, c, out);                                                        \
        break;
    switch (M) { I8_CASE(1) I8_CASE(2) I8_CASE(3) I8_CASE(4) I8_CASE(5) I8_CASE(6) I8_CASE(7) I8_CASE(8) }
#undef I8_CASE
}

// Four activation rows of an 8-bit weight, groups of 32 (Q8_0), K % 64 == 0: a decode step of four sequences. The
// per-row form above spends a conversion, a multiply and an FMA per row per 64 weights; here the four rows' int32
// sums of a chunk are first reduced into one vector (two levels of in-lane unpacks and adds: lane 4L + r holds row
// r's sum over lanes 4L..4L+3, i.e. half a block), so one conversion and one FMA serve all four rows. The codes'
// offset (128) leaves the dot products: its term -128 sum_b d_b (dx_b sum_b q) is one dot product per weight row
// with the activations' per-block xz = dx * sum q. dx4 [C, 16]: lane 4L + r = row r's scale of block 2c + L / 2.
// 1.3x the per-row form on the 311 MB Q8_0 head (measured).
static inline __attribute__((always_inline)) void i8_row8_x4(const uint8_t* q, const void* sc, const int kind, i64 K,
                                                             i64 n, const i8_chunk8* x, const float* xz,
                                                             const float* dx4, float* out) {
    const i64 C = K / 64, G = K / 32;
    const uint8_t* qn = q + n * K;
    const char* sn = (const char*)sc + n * G * scale_size(kind);
    __m512 zt[4];
    for (int r = 0; r < 4; r++) zt[r] = _mm512_setzero_ps();
    for (i64 g = 0; g < G; g += 16) {  // G % 2 == 0; the last step may be partial
        const __mmask16 k = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
        const __m512 sv = kind ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t*)sn + g)), 16))
                               : _mm512_maskz_loadu_ps(k, (const float*)sn + g);
        for (int r = 0; r < 4; r++) zt[r] = _mm512_fmadd_ps(sv, _mm512_maskz_loadu_ps(k, xz + r * G + g), zt[r]);
    }
    // the scales of blocks 2c, 2c+1 into lanes 0-7 / 8-15 (bf16: the high halves of the lanes)
    static const int16_t spread16[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1};
    const __m512i spread = _mm512_loadu_si512(spread16), two16 = _mm512_set1_epi16(2);
    const __m512i spread32 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                  two32 = _mm512_set1_epi32(2);
    __m512 acc = _mm512_setzero_ps();
    __m512i s8 = _mm512_setzero_si512(), idx = spread;
    __m512 s16 = _mm512_setzero_ps();
    for (i64 c = 0; c < C; c++) {
        __m512 sv;
        if (kind) {
            if ((c & 3) == 0) {
                s8 = _mm512_castsi128_si512(_mm_maskz_loadu_epi16(
                    (__mmask8)(G - 2 * c >= 8 ? 0xFF : (1u << (G - 2 * c)) - 1), (const uint16_t*)sn + 2 * c));
                idx = spread;
            }
            sv = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, s8));
            idx = _mm512_add_epi16(idx, two16);
        } else {
            if ((c & 7) == 0) {
                s16 = _mm512_maskz_loadu_ps((__mmask16)(G - 2 * c >= 16 ? 0xFFFF : (1u << (G - 2 * c)) - 1),
                                            (const float*)sn + 2 * c);
                idx = spread32;
            }
            sv = _mm512_permutexvar_ps(idx, s16);
            idx = _mm512_add_epi32(idx, two32);
        }
        const __m512i w = _mm512_loadu_si512(qn + 64 * c), z = _mm512_setzero_si512();
        const __m512i s0 = _mm512_dpbusd_epi32(z, w, _mm512_loadu_si512(x[c].q));
        const __m512i s1 = _mm512_dpbusd_epi32(z, w, _mm512_loadu_si512(x[C + c].q));
        const __m512i s2 = _mm512_dpbusd_epi32(z, w, _mm512_loadu_si512(x[2 * C + c].q));
        const __m512i s3 = _mm512_dpbusd_epi32(z, w, _mm512_loadu_si512(x[3 * C + c].q));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i8_reduce4(s0, s1, s2, s3)),
                              _mm512_mul_ps(sv, _mm512_loadu_ps(dx4 + 16 * c)), acc);
    }
    i8_sum4(acc, out);
    for (int r = 0; r < 4; r++) out[r] -= 128.f * _mm512_reduce_add_ps(zt[r]);
}

// y[m, N] = x[m, K] @ W[e]^T for an 8-bit symmetric weight (fp32 or bf16 scales); 0 when outside the kernel.
static int i8_gemv8(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y) {
    if (w->values || w->scale_super || w->scale_bf16 < 0 || w->scale_bf16 > 1) return 0;
    const i64 N = w->N, K = w->K, C = i8_chunks8(K), G = K / w->gs;
    i8_chunk8* xq = (i8_chunk8*)malloc((size_t)(m * C) * sizeof(i8_chunk8));
    if (!xq) return 0;
    for (i64 r = 0; r < m; r++)
        if (!i8_quantize_row8(x + r * K, K, xq + r * C)) {
            free(xq);
            return 0;
        }
    const uint8_t* q = w->q + e * N * K;
    const void* sc = (const char*)w->scale + e * N * G * scale_size(w->scale_bf16);
    if (m == 4 && w->gs == 32 && K % 64 == 0) {  // four sequences: the reduced form above
        float* xz = (float*)malloc((size_t)(4 * G + 16 * C) * sizeof(float));
        float* dx4 = xz + 4 * G;
        if (xz) {
            for (i64 r = 0; r < 4; r++)
                for (i64 b = 0; b < G; b++) {
                    const i8_chunk8* ch = xq + r * C + b / 2;
                    int qs = 0;
                    for (int k = 0; k < 32; k++) qs += ch->q[(b % 2) * 32 + k];
                    xz[r * G + b] = ch->dx[(b % 2) * 8] * (float)qs;
                }
            for (i64 c = 0; c < C; c++)
                for (int l = 0; l < 16; l++) dx4[16 * c + l] = xq[(l % 4) * C + c].dx[(l / 8) * 8];
#pragma omp parallel for schedule(static)
            for (i64 n = 0; n < N; n++) {
                float o[4];
                if (w->scale_bf16) i8_row8_x4(q, sc, 1, K, n, xq, xz, dx4, o);
                else i8_row8_x4(q, sc, 0, K, n, xq, xz, dx4, o);
                for (i64 r = 0; r < 4; r++) y[r * N + n] = o[r];
            }
            free(xz);
            free(xq);
            return 1;
        }
    }
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++) {
        float o[8];
        i8_row8_any(w, q, sc, n, xq, m, o);
        for (i64 r = 0; r < m; r++) y[r * N + n] = o[r];
    }
    free(xq);
    return 1;
}
#else
// Row n of a weight (codes q, scales sc at the weight's start) against M activation rows (C chunks each): out[M].
// A 32-byte chunk holds blocks 2c and 2c+1 (lanes 0-3, 4-7).
static inline __attribute__((always_inline)) void i8_row(const uint8_t* q, const void* sc, const int kind, i64 K,
                                                         i64 gs, const int cb, __m256i lut, i64 n, const i8_chunk* x,
                                                         const i64 M, const float* dx4, float* out) {
    (void)dx4;  // the AVX512 rows' 4-row form only
    const i64 C = i8_chunks(K), G = K / gs;
    const uint8_t* qn = q + n * (K / 2);
    const char* sn = (const char*)sc + n * G * scale_size(kind);
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    // bf16 scales of blocks 2c, 2c+1 (a 32-bit load) into the high halves of lanes 0-3 / 4-7
    const __m256i spread = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 0, 1, -1, -1, 0, 1, -1, -1, 0, 1,
                                            -1, -1, 2, 3, -1, -1, 2, 3, -1, -1, 2, 3, -1, -1, 2, 3);
    __m256 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (i64 c = 0; c < C; c++) {
        const int full = 64 * (c + 1) <= K;  // rows with K % 64 == 32 end in half a chunk
        const __m256i w = full ? _mm256_loadu_si256((const __m256i*)(qn + 32 * c))
                               : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(qn + 32 * c)));
        __m256 sv;
        if (gs > 32) {
            sv = _mm256_set1_ps(load_scale(sn, kind, c * 64 / gs));
        } else if (kind == 1 && full) {
            int32_t two;
            memcpy(&two, sn + 4 * c, 4);
            sv = _mm256_castsi256_ps(_mm256_shuffle_epi8(_mm256_set1_epi32(two), spread));
        } else {
            const float s0 = load_scale(sn, kind, 2 * c), s1 = full ? load_scale(sn, kind, 2 * c + 1) : 0.f;
            sv = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
        }
        __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
        if (cb) {
            lo = _mm256_shuffle_epi8(lut, lo);
            hi = _mm256_shuffle_epi8(lut, hi);
        }
        for (i64 m = 0; m < M; m++) {
            const i8_chunk* xc = x + m * C + c;
            __m256i s;
            if (cb) {
                const __m256i pl = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i*)xc->alo),
                                                        _mm256_sign_epi8(lo, _mm256_loadu_si256((const __m256i*)xc->lo)));
                const __m256i ph = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i*)xc->ahi),
                                                        _mm256_sign_epi8(hi, _mm256_loadu_si256((const __m256i*)xc->hi)));
                s = _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones));
            } else {  // |sum| <= 4 * 15 * 127 per int16 lane: no saturation
                const __m256i p = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)xc->lo)),
                    _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)xc->hi)));
                s = _mm256_add_epi32(_mm256_madd_epi16(p, ones), _mm256_loadu_si256((const __m256i*)xc->corr));
            }
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(sv, _mm256_loadu_ps(xc->dx)), acc[m]);
        }
    }
    for (i64 m = 0; m < M; m++) {
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
        t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        out[m] = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
    }
}

#endif

static inline __attribute__((always_inline)) void i8_row_any(const moeq_wstack* w, const uint8_t* q, const void* sc, const uint16_t* sup, int cb,
                              i8_lut_t lut, i64 n, const i8_chunk* x, i64 M, const float* dx4, float* out) {
    const i64 K = w->K, gs = w->gs;
#define I8_KIND(c, k)                                                                  \
    if (cb) i8_row(q, sc, k, K, gs, 1, lut, n, x, c, dx4, out);                        \
    else i8_row(q, sc, k, K, gs, 0, lut, n, x, c, dx4, out);
#define I8_CASE(c)                                                                     \
    case c:                                                                            \
        if (w->scale_bf16 == 1) { I8_KIND(c, 1) }                                      \
        else if (w->scale_bf16 == 2) { I8_KIND(c, 2) }                                 \
        else if (w->scale_bf16 == 3) { I8_KIND(c, 3) }                                 \
        else { I8_KIND(c, 0) }                                                         \
        break;
    switch (M) { I8_CASE(1) I8_CASE(2) I8_CASE(3) I8_CASE(4) I8_CASE(5) I8_CASE(6) I8_CASE(7) I8_CASE(8) }
#undef I8_CASE
#undef I8_KIND
    const float f = row_super(sup, n);
    for (i64 m = 0; m < M; m++) out[m] *= f;
}

// A 4-bit codebook's values as an int8 table (repeated in each 128-bit lane) for vpshufb; returns 0 when a value is
// not an integer in [-127, 127] (the kernels then decline). *cb = 0 for the plain grid value = code - 8 (Q4_0).
static int i8_lut(const moeq_wstack* w, i8_lut_t* lut, int* cb) {
    *cb = 0;
#if defined(MOEQ_I8_512)
    *lut = _mm512_setzero_si512();
#else
    *lut = _mm256_setzero_si256();
#endif
    if (!w->values) return 1;
    int8_t t[32];
    int plain = 1;
    for (int i = 0; i < 16; i++) {
        const float v = w->values[i];
        if (!(v >= -127.f && v <= 127.f) || v != floorf(v)) return 0;
        plain &= v == (float)(i - 8);
#if defined(MOEQ_I8_512)
        t[i] = (int8_t)(uint8_t)((int)v + 128);  // the value + 128 as u8 (i8_offset)
#else
        t[i] = t[16 + i] = (int8_t)(int)v;
#endif
    }
    if (!plain) {
        *cb = 1;
#if defined(MOEQ_I8_512)
        *lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)t));
#else
        *lut = _mm256_loadu_si256((const __m256i*)t);
#endif
    }
    return 1;
}

// Whether the kernels take this weight (see the top of the file).
static int i8_supported(const moeq_wstack* w, int bits) {
    if (!w->act_i8 || w->fmt != MOEQ_FMT_RTN || w->zero || w->K % 32 || w->bits != bits || w->scale_bf16 < 0 ||
        w->scale_bf16 > 3)
        return 0;
    return w->gs == 32 || (w->gs % 64 == 0 && w->K % w->gs == 0);
}
#endif

// y[m, N] = x[m, K] @ W[e]^T with int8 activations, parallel over the rows. Returns 0 (y untouched) when the weight
// or the activations are outside the kernels' domain, or a buffer cannot be had: the caller takes its default path.
int moeq_i8_gemv(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y) {
#if defined(MOEQ_I8)
    i8_lut_t lut;
    int cb;
    if (m < 1 || m > 8) return 0;
#if defined(MOEQ_I8_512)
    if (i8_supported(w, 8)) return i8_gemv8(w, e, x, m, y);
#endif
    if (!i8_supported(w, 4) || !i8_lut(w, &lut, &cb)) return 0;
    const i64 N = w->N, K = w->K, C = i8_chunks(K), G = K / w->gs;
    i8_chunk* xq = (i8_chunk*)malloc((size_t)(m * C) * sizeof(i8_chunk));
    if (!xq) return 0;
    for (i64 r = 0; r < m; r++)
        if (!i8_quantize_row(x + r * K, K, i8_offset(cb), xq + r * C)) {
            free(xq);
            return 0;
        }
    const uint8_t* q = w->q + e * N * (K / 2);
    const void* sc = (const char*)w->scale + e * N * G * scale_size(w->scale_bf16);
    const uint16_t* sup = w->scale_super ? w->scale_super + e * N : NULL;
    float* dx4 = NULL;
#if defined(MOEQ_I8_512)
    if (m == 4 && (dx4 = (float*)malloc((size_t)(16 * C) * sizeof(float))))  // lane 4L + r: row r's block 4c + L
        for (i64 c = 0; c < C; c++)
            for (int l = 0; l < 16; l++) dx4[16 * c + l] = xq[(l % 4) * C + c].dx[(l / 4) * 4];
#endif
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++) {
        float o[8];
        i8_row_any(w, q, sc, sup, cb, lut, n, xq, m, dx4, o);
        for (i64 r = 0; r < m; r++) y[r * N + n] = o[r];
    }
    free(dx4);
    free(xq);
    return 1;
#else
    (void)w, (void)e, (void)x, (void)m, (void)y;
    return 0;
#endif
}


#if defined(MOEQ_I8)
// Row n of expert e of a 4-bit stack [E, N, K] against m activation rows.
static inline __attribute__((always_inline)) void i8_expert_row(const moeq_wstack* w, i64 e, int cb, i8_lut_t lut,
                                                                i64 n, const i8_chunk* x, i64 m, float* o) {
    const i64 N = w->N, K = w->K;
    i8_row_any(w, w->q + e * N * (K / 2), (const char*)w->scale + e * N * (K / w->gs) * scale_size(w->scale_bf16),
               w->scale_super ? w->scale_super + e * N : NULL, cb, lut, n, x, m, NULL, o);
}
#endif

// A decode step's MoE layer with int8 activations, parallel across experts (moeq_moe_forward_rtn4_bf16's structure):
// pairs grouped by expert (expert_start), at most 8 rows per expert. Returns 0 (out untouched) outside the kernels'
// domain or without memory.
int moeq_moe_forward_i8(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I,
                        const i64* pair_tok, const float* pair_w, const i64* expert_start, i64 E, float* out) {
#if defined(MOEQ_I8)
    i8_lut_t lut13, lut2;
    int cb13, cb2;
    if (!i8_supported(w13, 4) || !i8_supported(w2, 4) || !i8_lut(w13, &lut13, &cb13) || !i8_lut(w2, &lut2, &cb2) ||
        w13->K != H || w2->K != I || w13->N != 2 * I || w2->N != H)
        return 0;
    i64 A = active_experts(expert_start, E, 8);
    if (A < 0) return 0;
    const i64 I2 = 2 * I, C1 = i8_chunks(H), C2 = i8_chunks(I);
    i64 T = 0;  // tokens: each one's activations quantized once, whatever its number of experts
    for (i64 p = 0; p < expert_start[E]; p++) T = pair_tok[p] + 1 > T ? pair_tok[p] + 1 : T;
    i64* act = (i64*)malloc((size_t)(A + 1) * sizeof(i64));
    i8_chunk* tq = (i8_chunk*)malloc((size_t)(T * C1 + A * 8 * (C1 + C2) + 1) * sizeof(i8_chunk));
    const i8_chunk** xa = (const i8_chunk**)malloc((size_t)(A + 1) * sizeof(i8_chunk*));
    float* h = (float*)malloc((size_t)(A * 8 * (I2 + H) + 1) * sizeof(float));
    int ok = act && tq && xa && h;
    if (ok) {
        A = 0;
        for (i64 e = 0; e < E; e++)
            if (expert_start[e + 1] > expert_start[e]) act[A++] = e;
    }
    i8_chunk* xq = tq + T * C1;  // [A, 8, C1]: the rows of experts with more than one
    i8_chunk* aq = xq + A * 8 * C1;
    float* y = h + A * 8 * I2;
    int okx = 1, ok2 = 1;
    if (ok) {
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (i64 t = 0; t < T; t++)
                if (!i8_quantize_row(x + t * H, H, i8_offset(cb13), tq + t * C1)) {
#pragma omp atomic write
                    okx = 0;
                }
#pragma omp for schedule(static)
            for (i64 a = 0; a < A; a++) {
                const i64 p0 = expert_start[act[a]], m = expert_start[act[a] + 1] - p0;
                if (m == 1) {
                    xa[a] = tq + pair_tok[p0] * C1;
                } else {
                    xa[a] = xq + a * 8 * C1;
                    for (i64 r = 0; r < m; r++)
                        memcpy(xq + (a * 8 + r) * C1, tq + pair_tok[p0 + r] * C1, (size_t)C1 * sizeof(i8_chunk));
                }
            }
            if (okx) {
#pragma omp for schedule(static)
                for (i64 t = 0; t < A * I2; t++) {
                    const i64 a = t / I2, n = t % I2, e = act[a], m = expert_start[e + 1] - expert_start[e];
                    float o[8];
                    i8_expert_row(w13, e, cb13, lut13, n, xa[a], m, o);
                    for (i64 r = 0; r < m; r++) h[(a * 8 + r) * I2 + n] = o[r];
                }
#pragma omp for schedule(static)
                for (i64 a = 0; a < A; a++) {
                    const i64 m = expert_start[act[a] + 1] - expert_start[act[a]];
                    for (i64 r = 0; r < m; r++) {
                        float* hr = h + (a * 8 + r) * I2;
                        silu_glu_row(hr, hr + I, I, hr);
                        if (!i8_quantize_row(hr, I, i8_offset(cb2), aq + (a * 8 + r) * C2)) {
#pragma omp atomic write
                            ok2 = 0;
                        }
                    }
                }
#pragma omp for schedule(static)
                for (i64 t = 0; t < A * H; t++) {
                    const i64 a = t / H, n = t % H, e = act[a], m = expert_start[e + 1] - expert_start[e];
                    float o[8];
                    i8_expert_row(w2, e, cb2, lut2, n, aq + a * 8 * C2, m, o);
                    for (i64 r = 0; r < m; r++) y[(a * 8 + r) * H + n] = o[r];
                }
            }
        }
    }
    ok = ok && okx && ok2;
    if (ok)  // the weighted sum in the pairs' order, as the other layer kernels
        for (i64 a = 0; a < A; a++) {
            const i64 p0 = expert_start[act[a]], m = expert_start[act[a] + 1] - p0;
            for (i64 r = 0; r < m; r++) {
                const float wgt = pair_w[p0 + r];
                float* o = out + pair_tok[p0 + r] * H;
                const float* yr = y + (a * 8 + r) * H;
                for (i64 k = 0; k < H; k++) o[k] += wgt * yr[k];
            }
        }
    free(act);
    free(tq);
    free(xa);
    free(h);
    return ok;
#else
    (void)w13, (void)w2, (void)x, (void)H, (void)I, (void)pair_tok, (void)pair_w, (void)expert_start, (void)E,
        (void)out;
    return 0;
#endif
}
