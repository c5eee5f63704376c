// bf12: a bf16 weight held losslessly in 12 bits per weight, for the kept bf16 linears that dominate a decode step's
// bytes (a 151936 x 2048 lm_head is 622 MB of a Qwen3-30B-A3B-shaped token's ~750). Every weight comes back bit for
// bit, so a gemv computes the same products as on the bf16 weight (fp32 sums, in another order), from 3/4 of the bytes.
//
// A bf16 value is two bytes: hi = sign << 7 | exponent >> 1, lo = (exponent & 1) << 7 | mantissa. lo is kept as is.
// Of hi, a row's weights use few values: per row, base = max(0, max(hi & 0x7f) - 7), and a weight whose
// e = hi & 0x7f lies in base+1 .. base+7 keeps the nibble sign << 3 | (e - base) (with base == 0, e 0..7 directly);
// nibble code 0 means hi = sign << 7 (zeros; with base == 0 also e == 0). Any other weight (|w| below the row's max
// by more than ~2^13, and subnormals: 0.03% of a trained or random head) is stored as a signed zero (lo 0) and listed
// as an exception (row-sorted column and exact bf16 value), added in fp32 after the row's sum. NaN/Inf rows keep
// e = 127 in the window. So per row a 16-entry byte table gives hi from the nibble: one vpshufb per 64 weights.
//
// Layout, rows of K (K % 128 == 0), per row and per 128-column unit: lo [N, K]: 2 halves of 64 bytes, each half's
// byte p holds column bf12_pos; hi [N, K/2]: 64 bytes per unit, byte p's low nibble is half 0's byte p, its high
// nibble half 1's. bf12_pos is what one vpunpcklbw / vpunpckhbw of a half's lo and hi bytes puts in natural column
// order (per 128-bit lane, low 8 bytes then high 8): 32 bf16 words for columns 0..31 of the half, then 32..63 — so
// activations stay in natural order on AVX512 and, per 16 words, on AVX2. base uint8 [N]; xptr int32 [N+1] (row n's
// exceptions are xptr[n] .. xptr[n+1]-1), xcol int32, xval bf16.
#define _GNU_SOURCE
#include "moeq.h"
#include "amx.h"
#include "rows_avx2.h"

// The gemv prefetches BF12_PF bytes (two rows of K = 2048) ahead in each of its streams: on a 151936 x 2048 head, 2
// threads, Intel SPR, 17-18 / 18-19 / 20-21 / 35 ms at 1 / 2 / 4 / 8 rows against 20-21 / 23-25 / 29-33 / 45 without
// (1024 bytes ahead: 18 / 19 / 21 / 34); the AVX2 build on the same CPU 24.4 / 28.8 / 39 -> 18.2 / 19.4 / 26-28 at 1 / 2 / 4
// rows. The tile kernel (moeq_bf12_gemm_amx) runs the head from BF12_AMX_ROWS rows
// (moeq_bf12_matmul; 26 ms at 5-16 rows against the gemv's 25 / 28 / 35 / 71 at 5 / 6 / 8 / 16); it unpacks a tile
// of 16 rows by BF12_AMX_KC columns at a time (one 128-column unit: 4 KB, in L1), prefetching each row's next unit.
// Tried for it: 32-row blocks 27-29 ms (64 streams), 256 / 512 columns 24 / 33, no prefetch 34-35, prefetch two
// units ahead 26, whole rows unpacked into L2 33 (against 23.5-24.6 for this form, measured before the gemv's
// prefetch).
// Without the tile unit, the AVX512-BF16 form of the tile kernel (moeq_bf12_gemm_bf16) from BF12_BF16_ROWS rows: on
// Zen 4, 2 threads, 39-40 ms at any 1-16 rows (the dot products' rate) against the gemv's 27 / 43 / 56 at 8 / 12 / 16.
enum { BF12_AMX_ROWS = 6, BF12_BF16_ROWS = 12, BF12_AMX_KC = 128, BF12_PF = 4096 };

static inline int bf12_pos(int c) {  // c in 0..127 -> byte offset in the unit's lo bytes
    const int d = c & 63;
    return (c & 64) + (d < 32 ? (d >> 3) * 16 + (d & 7) : ((d - 32) >> 3) * 16 + 8 + (d & 7));
}

static inline int bf12_base(const uint16_t* r, i64 K) {
    int mx = 0;
    for (i64 k = 0; k < K; k++) {
        const int e = (r[k] >> 8) & 0x7f;
        mx = e > mx ? e : mx;
    }
    return mx > 7 ? mx - 7 : 0;
}

static inline int bf12_exception(uint16_t v, int b) {  // stored as a signed zero and listed
    return b && ((v >> 8) & 0x7f) <= b && (v & 0x7fff);
}

// Pass 1 of packing w [N, K] bf16 (K % 128 == 0): lo, hi, base, and each row's exception count in nexc [N].
void moeq_bf12_pack(const uint16_t* w, i64 N, i64 K, uint8_t* lo, uint8_t* hi, uint8_t* base, int32_t* nexc) {
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++) {
        const uint16_t* r = w + n * K;
        const int b = bf12_base(r, K);
        uint8_t* L = lo + n * K;
        uint8_t* Hn = hi + n * (K / 2);
        int32_t cnt = 0;
        memset(Hn, 0, (size_t)(K / 2));
        for (i64 u = 0; u < K; u += 128)
            for (int c = 0; c < 128; c++) {
                const uint16_t v = r[u + c];
                const int e = (v >> 8) & 0x7f, p = bf12_pos(c);
                int code = 0;
                uint8_t l = 0;
                if (bf12_exception(v, b)) {
                    cnt++;
                } else if (e > b || !b) {
                    code = e - b;
                    l = (uint8_t)(v & 0xff);
                }
                L[u + p] = l;
                Hn[u / 2 + (p & 63)] |= (uint8_t)((((v >> 15) << 3) | code) << ((p >> 6) * 4));
            }
        base[n] = (uint8_t)b;
        nexc[n] = cnt;
    }
}

// Pass 2: the exceptions of each row, in column order, at xptr[n] (the prefix sums of pass 1's counts).
void moeq_bf12_exceptions(const uint16_t* w, i64 N, i64 K, const uint8_t* base, const int32_t* xptr, int32_t* xcol,
                          uint16_t* xval) {
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++) {
        i64 i = xptr[n];
        for (i64 k = 0; k < K; k++)
            if (bf12_exception(w[n * K + k], base[n])) {
                xcol[i] = (int32_t)k;
                xval[i++] = w[n * K + k];
            }
    }
}

#if defined(__AVX512BW__) || defined(__AVX2__)
static const int8_t BF12_TAB[16] = {0, 1, 2, 3, 4, 5, 6, 7, -128, -127, -126, -125, -124, -123, -122, -121};
#endif

#if defined(__AVX512BW__)
static inline __m512i bf12_table512(int b) {  // nibble -> hi byte, in each 128-bit lane
    const __m512i t = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)BF12_TAB));
    return _mm512_mask_add_epi8(t, (__mmask64)0xFEFEFEFEFEFEFEFEull, t, _mm512_set1_epi8((char)b));
}

// One 128-column unit -> w[0..3]: bf16 words of columns 0-31, 32-63, 64-95, 96-127.
static inline __attribute__((always_inline)) void bf12_unit512(const uint8_t* L, const uint8_t* Hn, __m512i T,
                                                               __m512i* w) {
    const __m512i m4 = _mm512_set1_epi8(15), nb = _mm512_loadu_si512(Hn);
    const __m512i ha = _mm512_shuffle_epi8(T, _mm512_and_si512(nb, m4));
    const __m512i hb = _mm512_shuffle_epi8(T, _mm512_and_si512(_mm512_srli_epi16(nb, 4), m4));
    const __m512i la = _mm512_loadu_si512(L), lb = _mm512_loadu_si512(L + 64);
    w[0] = _mm512_unpacklo_epi8(la, ha);
    w[1] = _mm512_unpackhi_epi8(la, ha);
    w[2] = _mm512_unpacklo_epi8(lb, hb);
    w[3] = _mm512_unpackhi_epi8(lb, hb);
}
#endif

#if defined(__AVX2__)
// One 128-column unit -> w[0..7]: bf16 words of columns 16j .. 16j+15 (the halves' low nibbles, then high).
static inline __attribute__((always_inline)) void bf12_unit256(const uint8_t* L, const uint8_t* Hn, __m256i T,
                                                               __m256i* w) {
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i n0 = _mm256_loadu_si256((const __m256i*)Hn), n1 = _mm256_loadu_si256((const __m256i*)(Hn + 32));
    const __m256i h[4] = {_mm256_shuffle_epi8(T, _mm256_and_si256(n0, m4)),
                          _mm256_shuffle_epi8(T, _mm256_and_si256(n1, m4)),
                          _mm256_shuffle_epi8(T, _mm256_and_si256(_mm256_srli_epi16(n0, 4), m4)),
                          _mm256_shuffle_epi8(T, _mm256_and_si256(_mm256_srli_epi16(n1, 4), m4))};
    for (int half = 0; half < 2; half++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i*)(L + 64 * half));
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)(L + 64 * half + 32));
        w[4 * half + 0] = _mm256_unpacklo_epi8(l0, h[2 * half]);
        w[4 * half + 1] = _mm256_unpacklo_epi8(l1, h[2 * half + 1]);
        w[4 * half + 2] = _mm256_unpackhi_epi8(l0, h[2 * half]);
        w[4 * half + 3] = _mm256_unpackhi_epi8(l1, h[2 * half + 1]);
    }
}

static inline __m256i bf12_table256(int b) {  // entries 0 and 8 of each lane (the zeros) get no base
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)BF12_TAB));
    return _mm256_add_epi8(t, _mm256_and_si256(_mm256_set1_epi8((char)b),
                                               _mm256_set1_epi64x((long long)0xFFFFFFFFFFFFFF00ull)));
}
#endif

// Columns k0 .. k0+kc-1 of row n (k0, kc multiples of 128) back to bf16, exactly: o [kc].
static inline void bf12_unpack_cols(const moeq_bf12* w, i64 n, i64 k0, i64 kc, uint16_t* o) {
    const i64 K = w->K;
    const uint8_t* L = w->lo + n * K;
    const uint8_t* Hn = w->hi + n * (K / 2);
    const int b = w->base[n];
#if defined(__AVX512BW__)
    const __m512i T = bf12_table512(b);
    for (i64 u = k0; u < k0 + kc; u += 128) {
        __m512i v[4];
        bf12_unit512(L + u, Hn + u / 2, T, v);
        for (int j = 0; j < 4; j++) _mm512_storeu_si512(o + (u - k0) + 32 * j, v[j]);
    }
#elif defined(__AVX2__)
    const __m256i T = bf12_table256(b);
    for (i64 u = k0; u < k0 + kc; u += 128) {
        __m256i v[8];
        bf12_unit256(L + u, Hn + u / 2, T, v);
        for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i*)(o + (u - k0) + 16 * j), v[j]);
    }
#else
    for (i64 u = k0; u < k0 + kc; u += 128)
        for (int c = 0; c < 128; c++) {
            const int p = bf12_pos(c);
            const int nib = (Hn[u / 2 + (p & 63)] >> ((p >> 6) * 4)) & 15, code = nib & 7;
            o[u - k0 + c] = (uint16_t)((((nib >> 3) << 7 | (code ? b + code : 0)) << 8) | L[u + p]);
        }
#endif
    for (i64 i = w->xptr[n]; i < w->xptr[n + 1]; i++)
        if (w->xcol[i] >= k0 && w->xcol[i] < k0 + kc) o[w->xcol[i] - k0] = w->xval[i];
}

#if defined(__AVX512BW__) || defined(__AVX2__)
// Column u's unit of a row's two streams (its two cache lines of low bytes, one of nibbles) on its way.
static inline __attribute__((always_inline)) void bf12_prefetch_unit(const uint8_t* L, const uint8_t* Hn, i64 u) {
    _mm_prefetch((const char*)(L + u), _MM_HINT_T0);
    _mm_prefetch((const char*)(L + u + 64), _MM_HINT_T0);
    _mm_prefetch((const char*)(Hn + u / 2), _MM_HINT_T0);
}
#endif

// Rows n0 .. n1-1 back to bf16, exactly: out [(n1 - n0), K].
void moeq_bf12_unpack(const moeq_bf12* w, i64 n0, i64 n1, uint16_t* out) {
#pragma omp parallel for schedule(static) if ((n1 - n0) * w->K >= (1 << 18))
    for (i64 n = n0; n < n1; n++) bf12_unpack_cols(w, n, 0, w->K, out + (n - n0) * w->K);
}

static inline float bf12_exceptions_dot(const moeq_bf12* w, i64 n, const uint16_t* x) {
    float s = 0.f;
    for (i64 i = w->xptr[n]; i < w->xptr[n + 1]; i++) s = fmaf(bf2f(w->xval[i]), bf2f(x[w->xcol[i]]), s);
    return s;
}

#if defined(__AVX512BF16__)
// One row against M (1..4) x rows: each unit unpacked once, two accumulators per x row.
static inline __attribute__((always_inline)) void bf12_row512(const moeq_bf12* w, i64 n, const uint16_t* x,
                                                              const i64 M, float* out) {
    const i64 K = w->K;
    const uint8_t* L = w->lo + n * K;
    const uint8_t* Hn = w->hi + n * (K / 2);
    const __m512i T = bf12_table512(w->base[n]);
    __m512 a[4], c[4];
    for (i64 m = 0; m < M; m++) a[m] = c[m] = _mm512_setzero_ps();
    for (i64 u = 0; u < K; u += 128) {
        __m512i v[4];
        bf12_prefetch_unit(L, Hn, u + BF12_PF);
        bf12_unit512(L + u, Hn + u / 2, T, v);
        for (i64 m = 0; m < M; m++) {
            const uint16_t* xm = x + m * K + u;
            a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)v[0], (__m512bh)_mm512_loadu_si512(xm));
            c[m] = _mm512_dpbf16_ps(c[m], (__m512bh)v[1], (__m512bh)_mm512_loadu_si512(xm + 32));
            a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)v[2], (__m512bh)_mm512_loadu_si512(xm + 64));
            c[m] = _mm512_dpbf16_ps(c[m], (__m512bh)v[3], (__m512bh)_mm512_loadu_si512(xm + 96));
        }
    }
    for (i64 m = 0; m < M; m++)
        out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], c[m])) + bf12_exceptions_dot(w, n, x + m * K);
}
#define BF12_ROWS(w, n, x, M, o) bf12_row512(w, n, x, M, o)
#elif defined(MOEQ_AVX2)
// AVX2: a 32-bit lane of bf16 words is the even one shifted left 16 and the odd one masked, for weights and x alike;
// one x row comes split to fp32 (xs: x_split16_bf16's order), as the bf16 head's one-row kernel takes it.
static inline float bf12_row256_1(const moeq_bf12* w, i64 n, const uint16_t* x, const float* xs) {
    const i64 K = w->K;
    const uint8_t* L = w->lo + n * K;
    const uint8_t* Hn = w->hi + n * (K / 2);
    const __m256i T = bf12_table256(w->base[n]), hm = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, c0 = a0, c1 = a0;
    for (i64 u = 0; u < K; u += 128) {
        __m256i v[8];
        bf12_prefetch_unit(L, Hn, u + BF12_PF);
        bf12_unit256(L + u, Hn + u / 2, T, v);
        for (int j = 0; j < 8; j += 2) {
            const float* xj = xs + u + 16 * j;
            a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v[j], 16)), _mm256_loadu_ps(xj), a0);
            c0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v[j], hm)), _mm256_loadu_ps(xj + 8), c0);
            a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v[j + 1], 16)), _mm256_loadu_ps(xj + 16), a1);
            c1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v[j + 1], hm)), _mm256_loadu_ps(xj + 24), c1);
        }
    }
    return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(c0, c1))) + bf12_exceptions_dot(w, n, x);
}

static inline __attribute__((always_inline)) void bf12_row256(const moeq_bf12* w, i64 n, const uint16_t* x,
                                                              const float* xs, const i64 M, float* out) {
    const i64 K = w->K;
    if (xs) {
        out[0] = bf12_row256_1(w, n, x, xs);
        return;
    }
    const uint8_t* L = w->lo + n * K;
    const uint8_t* Hn = w->hi + n * (K / 2);
    const __m256i T = bf12_table256(w->base[n]), hm = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 a[4], c[4];
    for (i64 m = 0; m < M; m++) a[m] = c[m] = _mm256_setzero_ps();
    for (i64 u = 0; u < K; u += 128) {
        __m256i v[8];
        bf12_prefetch_unit(L, Hn, u + BF12_PF);
        bf12_unit256(L + u, Hn + u / 2, T, v);
        for (int j = 0; j < 8; j++) {
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v[j], 16));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v[j], hm));
            for (i64 m = 0; m < M; m++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + m * K + u + 16 * j));
                a[m] = _mm256_fmadd_ps(we, _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16)), a[m]);
                c[m] = _mm256_fmadd_ps(wo, _mm256_castsi256_ps(_mm256_and_si256(xv, hm)), c[m]);
            }
        }
    }
    for (i64 m = 0; m < M; m++) out[m] = hsum8(_mm256_add_ps(a[m], c[m])) + bf12_exceptions_dot(w, n, x + m * K);
}
#define BF12_ROWS(w, n, x, M, o) bf12_row256(w, n, x, xs, M, o)
#endif

// y[M, N] = bf16(x[M, K] @ W^T), x bf16; fp32 sums rounded once. Returns 0 (nothing written) without a SIMD kernel
// (AVX512-BF16, or AVX2 + FMA) or for K % 128.
int moeq_bf12_gemv(const moeq_bf12* w, const uint16_t* x, i64 M, uint16_t* y) {
#if defined(BF12_ROWS)
    const i64 N = w->N, K = w->K;
    if (K % 128 || M < 1) return 0;
    float* xs = NULL;  // AVX2, one row: x split to fp32 once
#if defined(MOEQ_AVX2)
    if (M == 1) {  // (2-4 rows of x stay bf16: as fp32, whole rows or by 16-row x 512-column tiles, 28.7-30.5 ms
                   // against 16.5-17.8 at 4 rows; both forms are FMA-bound there, the bf16 head's too)
        xs = (float*)malloc((size_t)K * sizeof(float));
        if (!xs) return 0;
        x_split16_bf16(x, K, xs);
    }
#endif
#pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
    for (i64 n = 0; n < N; n++)
        for (i64 m0 = 0; m0 < M; m0 += 4) {
            const i64 mc = M - m0 < 4 ? M - m0 : 4;
            const uint16_t* xm = x + m0 * K;
            float o[4];
            switch (mc) {
                case 1: BF12_ROWS(w, n, xm, 1, o); break;
                case 2: BF12_ROWS(w, n, xm, 2, o); break;
                case 3: BF12_ROWS(w, n, xm, 3, o); break;
                default: BF12_ROWS(w, n, xm, 4, o); break;
            }
            for (i64 m = 0; m < mc; m++) y[(m0 + m) * N + n] = f2bf(o[m]);
        }
    free(xs);
    return 1;
#else
    (void)w; (void)x; (void)M; (void)y;
    return 0;
#endif
}

#if (defined(MOEQ_AMX) && defined(__AVX512BW__)) || defined(__AVX512BF16__)
// The tile kernels' shared parts. x [M, K] bf16 as pairs [K/2][16], the M rows in the lanes (zero past M); NULL when
// memory cannot be had.
static uint32_t* bf12_x_pairs16(const uint16_t* x, i64 M, i64 K) {
    uint32_t* xt = (uint32_t*)malloc((size_t)(K / 2) * 16 * sizeof(uint32_t));
    if (!xt) return NULL;
    for (i64 kp = 0; kp < K / 2; kp++)
        for (i64 p = 0; p < 16; p++)
            xt[kp * 16 + p] = p < M ? (uint32_t)x[p * K + 2 * kp] | (uint32_t)x[p * K + 2 * kp + 1] << 16 : 0;
    return xt;
}

// Rows n0 .. n0+r-1 of W, columns k0 .. k0+BF12_AMX_KC-1, into wt [r][BF12_AMX_KC] bf16; each row's next unit on its
// way (16 rows are 32 streams).
static inline void bf12_unpack_tile(const moeq_bf12* w, i64 n0, i64 r, i64 k0, uint16_t* wt) {
    const i64 K = w->K;
    for (i64 i = 0; i < r; i++) {
        if (k0 + BF12_AMX_KC < K)
            bf12_prefetch_unit(w->lo + (n0 + i) * K, w->hi + (n0 + i) * (K / 2), k0 + BF12_AMX_KC);
        bf12_unpack_cols(w, n0 + i, k0, BF12_AMX_KC, wt + i * BF12_AMX_KC);
    }
}

// A tile's sums yt [16 rows of W][16 lanes] to y [M, N], rows n0 .. n0+r-1, rounded once.
static inline void bf12_store_tile(const float* yt, i64 r, i64 M, i64 N, i64 n0, uint16_t* y) {
    for (i64 i = 0; i < r; i++)
        for (i64 m = 0; m < M; m++) y[m * N + n0 + i] = f2bf(yt[i * 16 + m]);
}
#endif

// y[M, N] = bf16(x[M, K] @ W^T) on the tile unit, for M 1..16: per thread, tiles of 16 rows of W, each unpacked
// exactly one unit of 128 columns at a time into an L1-resident bf16 buffer (the weight tile's A operand), times the M
// x rows (bf16 pairs [K/2][16], zero past M) into one accumulator tile that stays on the unit for the whole row. What
// the gemv spends per x row on dot products (45 ms at 8 rows of a 151936 x 2048 head, against 29 at 4) the tile unit
// does for all 16 at once; the unpacking is the same. fp32 sums in the tile unit's order, rounded once: each row's
// logits have the same bits for any M. Returns 0 (nothing written) unless the tiles may run (moeq_amx_on) and
// K % 128 == 0, 1 <= M <= 16; -1 when scratch could not be allocated.
int moeq_bf12_gemm_amx(const moeq_bf12* w, const uint16_t* x, i64 M, uint16_t* y) {
#if defined(MOEQ_AMX) && defined(__AVX512BW__)
    enum { R = 16, KC = BF12_AMX_KC };
    const i64 N = w->N, K = w->K, NB = (N + R - 1) / R;
    if (!moeq_amx_on() || K % KC || M < 1 || M > 16) return 0;
    uint32_t* xt = bf12_x_pairs16(x, M, K);
    if (!xt) return -1;
#pragma omp parallel
    {
        uint16_t wt[R * KC];
        float yt[R * 16];
        amx_configure();
#pragma omp for schedule(static)
        for (i64 b = 0; b < NB; b++) {
            const i64 n0 = b * R, r = N - n0 < R ? N - n0 : R;
            if (r < R) memset(wt + r * KC, 0, sizeof(uint16_t) * (size_t)((R - r) * KC));
            _tile_zero(0);
            for (i64 k0 = 0; k0 < K; k0 += KC) {
                bf12_unpack_tile(w, n0, r, k0, wt);
                for (i64 k = 0; k < KC; k += 32) {
                    _tile_loadd(6, xt + ((k0 + k) / 2) * 16, 64);
                    _tile_loadd(4, wt + k, KC * 2);
                    _tile_dpbf16ps(0, 4, 6);
                }
            }
            _tile_stored(0, yt, 64);
            bf12_store_tile(yt, r, M, N, n0, y);
        }
        _tile_release();
    }
    free(xt);
    return 1;
#else
    (void)w; (void)x; (void)M; (void)y;
    return 0;
#endif
}

// y[M, N] = bf16(x[M, K] @ W^T) with AVX512-BF16 dot products, for M 1..16: the tile kernel's form without the tile
// unit. Per thread, blocks of 16 rows of W, each 128-column unit unpacked once into an L1-resident bf16 buffer; the M
// x rows sit in the lanes (bf16 pairs [K/2][16], zero past M, 4 KB per unit, also in L1), each weight pair is
// broadcast, and one accumulator per weight row holds all 16 x rows for the whole row. Where the gemv unpacks each
// weight unit once per 4 x rows and reads x from L2 past 4 rows, this reads both from L1 and does the same dot
// products. fp32 sums in one order per lane: each row's logits have the same bits for any M. Returns 0 (nothing
// written) without AVX512-BF16 or for K % 128, M outside 1..16; -1 when scratch could not be allocated.
int moeq_bf12_gemm_bf16(const moeq_bf12* w, const uint16_t* x, i64 M, uint16_t* y) {
#if defined(__AVX512BF16__)
    enum { R = 16, KC = BF12_AMX_KC };
    const i64 N = w->N, K = w->K, NB = (N + R - 1) / R;
    if (K % KC || M < 1 || M > 16) return 0;
    uint32_t* xt = bf12_x_pairs16(x, M, K);
    if (!xt) return -1;
#pragma omp parallel
    {
        uint32_t wt[R * KC / 2];
        float yt[R * 16];
#pragma omp for schedule(static)
        for (i64 b = 0; b < NB; b++) {
            const i64 n0 = b * R, r = N - n0 < R ? N - n0 : R;
            if (r < R) memset(wt + r * (KC / 2), 0, sizeof(uint32_t) * (size_t)((R - r) * (KC / 2)));
            __m512 acc[R];
            for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
            for (i64 k0 = 0; k0 < K; k0 += KC) {
                bf12_unpack_tile(w, n0, r, k0, (uint16_t*)wt);
                const uint32_t* xk = xt + (k0 / 2) * 16;
                for (i64 kp = 0; kp < KC / 2; kp++) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xk + kp * 16);
                    for (int i = 0; i < R; i++)
                        acc[i] = _mm512_dpbf16_ps(acc[i], xv, (__m512bh)_mm512_set1_epi32((int)wt[i * (KC / 2) + kp]));
                }
            }
            for (int i = 0; i < R; i++) _mm512_storeu_ps(yt + i * 16, acc[i]);
            bf12_store_tile(yt, r, M, N, n0, y);
        }
    }
    free(xt);
    return 1;
#else
    (void)w; (void)x; (void)M; (void)y;
    return 0;
#endif
}

// y[M, N] = bf16(x[M, K] @ W^T) by the kernel this CPU runs best at M rows — the tile unit from BF12_AMX_ROWS rows
// (where it may run), else the AVX512-BF16 tile form from BF12_BF16_ROWS, else the gemv — decided here once for the native decode step and the module's forward alike,
// so both give the same bits. Returns 0 (nothing written) where neither runs.
int moeq_bf12_matmul(const moeq_bf12* w, const uint16_t* x, i64 M, uint16_t* y) {
    if (M >= BF12_AMX_ROWS) {
        const int r = moeq_bf12_gemm_amx(w, x, M, y);
        if (r) return r > 0;
    }
    if (M >= BF12_BF16_ROWS) {
        const int r = moeq_bf12_gemm_bf16(w, x, M, y);
        if (r) return r > 0;
    }
    return moeq_bf12_gemv(w, x, M, y);
}
