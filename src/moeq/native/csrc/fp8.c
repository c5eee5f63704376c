// FP8 e4m3 weights with one fp32 scale per (bn x bk) tile (DeepSeek's block-scaled layout, kept as stored): the
// small-batch GEMV. An e4m3 byte becomes an fp16 with the same bits shifted (sign << 8, the rest << 7): exactly the
// e4m3 value times 2^-8, subnormals included, so F16C / AVX512 converts 8 or 16 weights per instruction and the
// 2^8 goes into the tile's scale. Products and sums in fp32, each tile's partial sum times its scale.
#include "moeq.h"

static void e4m3_table(float* lut) {  // the exact values (0x7F/0xFF NaN: refused before any kernel runs)
    for (int c = 0; c < 256; c++) {
        const int e = (c >> 3) & 15, m = c & 7;
        const float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        lut[c] = (c & 128) ? -v : v;
    }
}

#define FP8_ROWS 8  // rows of x per pass over a weight row (the row is re-read from L1)

// y[M, N] = x[M, K] @ dequant(W)^T, W = q [N, K] e4m3 bytes with scale s [ceil(N/bn), ceil(K/bk)].
void moeq_fp8_gemv(const float* x, i64 M, const uint8_t* q, const float* s, i64 N, i64 K, i64 bn, i64 bk, float* y) {
    float lut[256];
    e4m3_table(lut);
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
