// FP8 e4m3 weights with one fp32 scale per (bn x bk) tile (DeepSeek's block-scaled layout, kept as stored): the
// small-batch GEMV. An e4m3 byte becomes an fp16 with the same bits shifted (sign << 8, the rest << 7): exactly the
// e4m3 value times 2^-8, subnormals included, so F16C / AVX512 converts 8 or 16 weights per instruction and the
// 2^8 goes into the tile's scale. Products and sums in fp32, each tile's partial sum times its scale.
#include "moeq.h"

#define FP8_ROWS 8  // rows of x per pass over a weight row (the row is re-read from L1)
// The 64-wide rows prefetch FP8_PF bytes ahead: a 16384 x 4096 weight from memory at 1 / 2 / 4 rows 13.4 / 12.3 /
// 7.3 -> 27.4 / 23.4 / 15.8 Gweights/s (1024: 26.5 / 22.1 / 15.4; 4096: 30.6 / 22.1 / 15.9 but 7.6 at 8 rows against
// 9.1; Intel SPR, 2 threads). An expert-parallel FP8 layer kernel (one fork per stack, as the 4-bit one) measured no
// faster than this per-expert path with the prefetch (Qwen3-30B-A3B experts, 4 / 8 rows 6.9 / 11.8 vs 6.7 / 10.9 ms).
#define FP8_PF 2048

// y[M, N] = x[M, K] @ dequant(W)^T, W = q [N, K] e4m3 bytes with scale s [ceil(N/bn), ceil(K/bk)].
void moeq_fp8_gemv(const float* x, i64 M, const uint8_t* q, const float* s, i64 N, i64 K, i64 bn, i64 bk, float* y) {
    float lut[256];
    for (int c = 0; c < 256; c++) lut[c] = e4m3_value(c);
    const i64 TK = (K + bk - 1) / bk;
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++) {
        const uint8_t* qq = q + n * K;
        const float* ss = s + (n / bn) * TK;
        for (i64 m0 = 0; m0 < M; m0 += FP8_ROWS) {
            const i64 mc = M - m0 < FP8_ROWS ? M - m0 : FP8_ROWS;
            const float* xm = x + m0 * K;
            float out[FP8_ROWS] = {0};
            for (i64 t = 0; t < TK; t++) {
                const i64 k0 = t * bk, k1 = k0 + bk < K ? k0 + bk : K;
                float part[FP8_ROWS] = {0};
                i64 k = k0;
#if defined(__AVX512F__)
                __m512 v[FP8_ROWS];
                for (i64 m = 0; m < mc; m++) v[m] = _mm512_setzero_ps();
                const __m256i sign = _mm256_set1_epi16(0x80), rest = _mm256_set1_epi16(0x7F);
                for (; k + 16 <= k1; k += 16) {
                    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(qq + k)));
                    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, sign), 8),
                                                      _mm256_slli_epi16(_mm256_and_si256(b, rest), 7));
                    const __m512 w = _mm512_cvtph_ps(h);
                    for (i64 m = 0; m < mc; m++) v[m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xm + m * K + k), v[m]);
                }
                for (i64 m = 0; m < mc; m++) part[m] = _mm512_reduce_add_ps(v[m]) * 256.0f;
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
                __m256 v[FP8_ROWS];
                for (i64 m = 0; m < mc; m++) v[m] = _mm256_setzero_ps();
                const __m128i sign = _mm_set1_epi16(0x80), rest = _mm_set1_epi16(0x7F);
                for (; k + 8 <= k1; k += 8) {
                    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(qq + k)));
                    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, sign), 8),
                                                   _mm_slli_epi16(_mm_and_si128(b, rest), 7));
                    const __m256 w = _mm256_cvtph_ps(h);
                    for (i64 m = 0; m < mc; m++) v[m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xm + m * K + k), v[m]);
                }
                for (i64 m = 0; m < mc; m++) {
                    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v[m]), _mm256_extractf128_ps(v[m], 1));
                    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
                    r = _mm_add_ss(r, _mm_movehdup_ps(r));
                    part[m] = _mm_cvtss_f32(r) * 256.0f;
                }
#endif
                for (i64 m = 0; m < mc; m++) {
                    float a = 0.f;
                    for (i64 j = k; j < k1; j++) a += lut[qq[j]] * xm[m * K + j];
                    out[m] += (part[m] + a) * ss[t];
                }
            }
            for (i64 m = 0; m < mc; m++) y[(m0 + m) * N + n] = out[m];
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// 32 e4m3 bytes as 32 bf16 words, exactly: normals by moving the bits (exponent + 120), the 8 subnormals (m * 2^-9,
// exponent bits 0) from a table, the sign last.
static inline __m512i e4m3_bf16x32(const uint8_t* p, __m512i sub) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
    __m512i t = _mm512_add_epi16(_mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x7F)), 4),
                                 _mm512_set1_epi16(120 << 7));
    const __mmask32 normal = _mm512_test_epi16_mask(b, _mm512_set1_epi16(0x78));
    t = _mm512_mask_blend_epi16(normal, _mm512_permutexvar_epi16(b, sub), t);  // index b & 31 = m where e == 0
    return _mm512_ternarylogic_epi32(t, _mm512_slli_epi16(b, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// 64 e4m3 bytes as 64 bf16 words by two byte-table lookups (the high and low byte of each magnitude's bf16, 128
// entries each: vpermi2b ignores the sign bit), the sign put back, then interleaved within 128-bit lanes: *a holds
// weights {0-7, 16-23, 32-39, 48-55} of the chunk, *b the others (x is permuted the same way: fp8_x_perm64).
static inline void e4m3_bf16x64(const uint8_t* p, const __m512i* hi, const __m512i* lo, __m512i* a, __m512i* b) {
    const __m512i q = _mm512_loadu_si512(p);
    const __m512i h = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi[0], q, hi[1]), q,
                                                _mm512_set1_epi8((char)0x80), 0xF8);
    const __m512i l = _mm512_permutex2var_epi8(lo[0], q, lo[1]);
    *a = _mm512_unpacklo_epi8(l, h);
    *b = _mm512_unpackhi_epi8(l, h);
}

static void fp8_x_perm64(const uint16_t* x, i64 K, uint16_t* out) {
    for (i64 c = 0; c < K; c += 64)
        for (int j = 0; j < 32; j++) {
            out[c + j] = x[c + (j / 8) * 16 + j % 8];
            out[c + 32 + j] = x[c + (j / 8) * 16 + 8 + j % 8];
        }
}

// One weight row against mc rows of permuted x (mc a constant where inlined: accumulators stay in registers).
static inline __attribute__((always_inline)) void fp8_row64(const uint8_t* qq, const float* ss, const uint16_t* xm,
                                                            i64 K, i64 bk, i64 TK, const __m512i* hi,
                                                            const __m512i* lo, const int mc, i64 N, float* yo) {
    __m512 acc[FP8_ROWS], v[FP8_ROWS];
    for (int m = 0; m < mc; m++) acc[m] = _mm512_setzero_ps();
    for (i64 t = 0; t < TK; t++) {
        const i64 k0 = t * bk, k1 = k0 + bk < K ? k0 + bk : K;
        for (int m = 0; m < mc; m++) v[m] = _mm512_setzero_ps();
        for (i64 k = k0; k < k1; k += 64) {
            __m512i a, b;
            _mm_prefetch((const char*)(qq + k + FP8_PF), _MM_HINT_T0);  // rows are contiguous: past the end is the next
            e4m3_bf16x64(qq + k, hi, lo, &a, &b);
            for (int m = 0; m < mc; m++) {
                v[m] = _mm512_dpbf16_ps(v[m], (__m512bh)a, (__m512bh)_mm512_loadu_si512(xm + m * K + k));
                v[m] = _mm512_dpbf16_ps(v[m], (__m512bh)b, (__m512bh)_mm512_loadu_si512(xm + m * K + k + 32));
            }
        }
        const __m512 sc = _mm512_set1_ps(ss[t]);
        for (int m = 0; m < mc; m++) acc[m] = _mm512_fmadd_ps(v[m], sc, acc[m]);
    }
    for (int m = 0; m < mc; m++) yo[m * N] = _mm512_reduce_add_ps(acc[m]);
}

static int fp8_gemv_bf16_64(const uint16_t* xb, i64 M, const uint8_t* q, const float* s, i64 N, i64 K, i64 bn,
                            i64 bk, float* y) {
    uint8_t th[128], tl[128];
    for (int i = 0; i < 128; i++) {  // the bf16 bits of every e4m3 magnitude (exact: 3 significant bits)
        const float v = e4m3_value(i);
        uint32_t u;
        memcpy(&u, &v, 4);
        th[i] = (uint8_t)(u >> 24), tl[i] = (uint8_t)(u >> 16);
    }
    const __m512i hi[2] = {_mm512_loadu_si512(th), _mm512_loadu_si512(th + 64)};
    const __m512i lo[2] = {_mm512_loadu_si512(tl), _mm512_loadu_si512(tl + 64)};
    uint16_t* xp = (uint16_t*)malloc((size_t)(M * K) * sizeof(uint16_t));
    if (!xp) return 0;
    for (i64 r = 0; r < M; r++) fp8_x_perm64(xb + r * K, K, xp + r * K);
    const i64 TK = (K + bk - 1) / bk;
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++) {
        const uint8_t* qq = q + n * K;
        const float* ss = s + (n / bn) * TK;
        for (i64 m0 = 0; m0 < M; m0 += FP8_ROWS) {
            const uint16_t* xm = xp + m0 * K;
            float* yo = y + m0 * N + n;
            switch (M - m0 < FP8_ROWS ? M - m0 : FP8_ROWS) {
#define FP8_CASE(c) \
    case c: fp8_row64(qq, ss, xm, K, bk, TK, hi, lo, c, N, yo); break;
                FP8_CASE(1) FP8_CASE(2) FP8_CASE(3) FP8_CASE(4) FP8_CASE(5) FP8_CASE(6) FP8_CASE(7) FP8_CASE(8)
#undef FP8_CASE
            }
        }
    }
    free(xp);
    return 1;
}
#endif

// y[M, N] = x[M, K] @ dequant(W)^T with x as bf16 (a bf16 model's activations, exact): the weights converted to bf16
// (exact: every e4m3 value is a bf16) and multiplied by AVX512-BF16 pair dot products, 32 weights per instruction.
// Returns 0 (nothing written) without AVX512-BF16 or where K or the tile width bk is not a multiple of 32.
int moeq_fp8_gemv_bf16(const uint16_t* xb, i64 M, const uint8_t* q, const float* s, i64 N, i64 K, i64 bn, i64 bk,
                       float* y) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (K % 32 || bk % 32 || M <= 0) return 0;
#if defined(__AVX512VBMI__)
    if (K % 64 == 0 && bk % 64 == 0) return fp8_gemv_bf16_64(xb, M, q, s, N, K, bn, bk, y);  // 64 per two lookups
#endif
    uint16_t tab[32] = {0};
    for (int m = 0; m < 8; m++) {
        const float v = ldexpf((float)m, -9);
        uint32_t u;
        memcpy(&u, &v, 4);
        tab[m] = (uint16_t)(u >> 16);  // exact: 3 significant bits
    }
    const __m512i sub = _mm512_loadu_si512(tab);
    const i64 TK = (K + bk - 1) / bk;
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++) {
        const uint8_t* qq = q + n * K;
        const float* ss = s + (n / bn) * TK;
        for (i64 m0 = 0; m0 < M; m0 += FP8_ROWS) {
            const i64 mc = M - m0 < FP8_ROWS ? M - m0 : FP8_ROWS;
            const uint16_t* xm = xb + m0 * K;
            __m512 acc[FP8_ROWS];
            for (i64 m = 0; m < mc; m++) acc[m] = _mm512_setzero_ps();
            for (i64 t = 0; t < TK; t++) {
                const i64 k0 = t * bk, k1 = k0 + bk < K ? k0 + bk : K;
                __m512 v[FP8_ROWS];
                for (i64 m = 0; m < mc; m++) v[m] = _mm512_setzero_ps();
                for (i64 k = k0; k < k1; k += 32) {
                    const __m512bh w = (__m512bh)e4m3_bf16x32(qq + k, sub);
                    for (i64 m = 0; m < mc; m++)
                        v[m] = _mm512_dpbf16_ps(v[m], w, (__m512bh)_mm512_loadu_si512(xm + m * K + k));
                }
                const __m512 sc = _mm512_set1_ps(ss[t]);
                for (i64 m = 0; m < mc; m++) acc[m] = _mm512_fmadd_ps(v[m], sc, acc[m]);
            }
            for (i64 m = 0; m < mc; m++) y[(m0 + m) * N + n] = _mm512_reduce_add_ps(acc[m]);
        }
    }
    return 1;
#else
    (void)xb, (void)M, (void)q, (void)s, (void)N, (void)K, (void)bn, (void)bk, (void)y;
    return 0;
#endif
}
