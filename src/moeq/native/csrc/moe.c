// The fused MoE layer for decode (one call runs every routed expert of a layer) and the one-call quantized linear,
// both over moeq_wstack descriptions of the weights.
#include "moeq.h"
#include "rtn4_rows.h"
#include "rows_avx2.h"
#include "il16_rows.h"
#include "amx.h"

// ---------------------------------------------------------------- fused MoE (decode) -----------------------------
// One call per MoE layer for the token-expert pairs of a decode step: for each expert with rows, y = w2 @
// act(w13 @ x) and out[token] += weight * y. Removes the per-expert Python dispatch that dominates small batches.

static int run_rtn8_bf16(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    const i64 N = w->N, K = w->K, G = K / w->gs;
    uint16_t* xb = (uint16_t*)scratch;
    for (i64 r = 0; r < m; r++)
        for (i64 k = 0; k < K; k++) xb[r * K + k] = f2bf(x[r * K + k]);
    const void* sc = (const char*)w->scale + e * N * G * scale_size(w->scale_bf16);
    return moeq_rtn8_gemv_bf16(xb, m, w->q + e * (N * K), sc, w->scale_bf16, w->zero ? w->zero + e * N * G : NULL, N, K,
                               w->gs, y);
}

// Whether w (an expert stack or one weight) can take the il16 decode layout (il16_rows.h) on this build: symmetric
// 4-bit RTN read through a 16-value table (lut: the signed grid or a codebook), N % 16 == 0, K % 64 == 0, groups of
// a multiple of 16 dividing K, fp32/bf16 scales, int8 codes with row factors or E8M0 bytes.
int moeq_il16_takes(const moeq_wstack* w) {
#if defined(MOEQ_IL16)
    return w->fmt == MOEQ_FMT_RTN && w->bits == 4 && !w->zero && w->lut && w->dot_bf16 && w->N > 0 && w->N % 16 == 0 &&
           w->K > 0 && w->K % 64 == 0 && w->gs > 0 && w->gs % 16 == 0 && w->K % w->gs == 0 &&
           (w->scale_bf16 == 2 ? w->scale_super != NULL : w->scale_bf16 >= 0 && w->scale_bf16 <= 3);
#elif defined(MOEQ_IL16_AVX2)  // int16 activation chunks of 32 inside a group; the values an int8 table
    __m128i t[2];
    return w->fmt == MOEQ_FMT_RTN && w->bits == 4 && !w->zero && w->values && w->dot_bf16 && w->N > 0 &&
           w->N % 16 == 0 && w->K > 0 && w->K % 64 == 0 && w->gs > 0 && w->gs % 32 == 0 && w->K % w->gs == 0 &&
           (w->scale_bf16 == 2 ? w->scale_super != NULL : w->scale_bf16 >= 0 && w->scale_bf16 <= 3) &&
           cb_tables_i8(w->values, 4, t);
#else
    (void)w;
    return 0;
#endif
}

#if defined(MOEQ_IL16_AVX2)
// The AVX2 form of il16_gemv below: x as int16 il16 pairs (scratch: m*K/2 floats) and chunk scales (m*K/32).
static void il16_gemv(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    const i64 N = w->N, K = w->K, NB = N / 16;
    int16_t* xq = (int16_t*)scratch;
    float* sx = scratch + m * K / 2;
    for (i64 r = 0; r < m; r++) x_to_il16_i16(x + r * K, K, xq + r * K, sx + r * (K / 32));
    __m128i t[2];
    cb_tables_i8(w->values, 4, t);
#pragma omp parallel for schedule(static)
    for (i64 b0 = 0; b0 < NB; b0++)
        il16_block_avx2_m(il16_codes(w, e, b0), il16_scale_at(w, e, b0), w->scale_bf16, il16_sup(w, e, b0), t[0], xq,
                          sx, m, K, w->gs, y + 16 * b0, N);
}

// Inside a parallel region: y[a, 8, N] rows 0..rows(a)-1 = W[act[a]] x[a] (x at [a, 8, K] from x_to_il16_i16, chunk
// scales at [a, 8, K/32]), the 16-row blocks of all experts shared out over the threads.
static inline void il16_pass_avx2(const moeq_wstack* w, const i64* act, const i64* start, i64 A, const int16_t* xq,
                                  const float* sx, __m128i tab, i64 K, i64 N, float* y) {
    const i64 NB = N / 16;
#pragma omp for schedule(static)
    for (i64 t = 0; t < A * NB; t++) {
        const i64 a = t / NB, b = t % NB, e = act[a];
        il16_block_avx2_m(il16_codes(w, e, b), il16_scale_at(w, e, b), w->scale_bf16, il16_sup(w, e, b), tab,
                          xq + a * 8 * K, sx + a * 8 * (K / 32), start[e + 1] - start[e], K, w->gs,
                          y + a * 8 * N + 16 * b, N);
    }
}
#endif

// Whether several activation rows per il16 block take the int16 rows (il16_block_i16) on AVX512-BF16 builds. Set by
// moeq.native from the CPU at load: on for CPUs with AMX (Sapphire Rapids and later, where vdpbf16ps issues at a
// third of vpdpwssd's rate and the kernels already change with the batch size), off elsewhere (Zen 4: the bf16 rows
// are fast there and keep a row's logits bit for bit the same at every batch size).
static int il16_rows_i16 = 0;
void moeq_set_il16_i16(int on) { il16_rows_i16 = on; }

#if defined(MOEQ_IL16)
// Whether several rows of il16 stack w take the int16 rows here (set, groups of 32k, an integer table: into lut16).
static inline int il16_i16_rows(const moeq_wstack* w, __m512i* lut16) {
    return il16_rows_i16 && w->il16 && w->gs % 32 == 0 && il16_lut16(w, lut16);
}

// y[m, N] = x[m, K] @ W[e]^T for an il16 stack: x as bf16 pairs in scratch (m*K/2 floats), blocks over the threads.
static void il16_gemv(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    const i64 N = w->N, K = w->K, NB = N / 16;
    __m512i lut16;
    if (m >= 2 && il16_i16_rows(w, &lut16)) {  // several rows: il16_block_i16
        int16_t* xq = (int16_t*)scratch;
        float* sx = scratch + m * K / 2;  // the scratch holds 2K + K/16 floats per row
        for (i64 r = 0; r < m; r++) x_to_il16_i16(x + r * K, K, xq + r * K, sx + r * (K / 32));
#pragma omp parallel for schedule(static)
        for (i64 b0 = 0; b0 < NB; b0++)
            for (i64 m0 = 0; m0 < m; m0 += 8)
                il16_block_i16_m(il16_codes(w, e, b0), il16_scale_at(w, e, b0), w->scale_bf16, il16_sup(w, e, b0),
                                 lut16, xq + m0 * K, sx + m0 * (K / 32), m - m0 < 8 ? m - m0 : 8, K, w->gs,
                                 y + m0 * N + 16 * b0, N);
        return;
    }
    uint16_t* xb = (uint16_t*)scratch;
    for (i64 r = 0; r < m; r++) x_to_il16(x + r * K, K, xb + r * K);
    const __m512i lut = _mm512_loadu_si512(w->lut);
#pragma omp parallel for schedule(static)
    for (i64 b0 = 0; b0 < NB; b0++)
        for (i64 m0 = 0; m0 < m; m0 += 8)
            il16_block_m(il16_codes(w, e, b0), il16_scale_at(w, e, b0), w->scale_bf16, il16_sup(w, e, b0), lut,
                         (const uint32_t*)(xb + m0 * K), m - m0 < 8 ? m - m0 : 8, K, w->gs, y + m0 * N + 16 * b0, N);
}

// Inside a parallel region: y[a, 8, N] rows 0..rows(a)-1 = W[act[a]] x[a] for every active expert a (x at [a, 8, K]
// in x_to_il16's order; rows NULL: one each), the 16-row blocks of all experts shared out over the threads.
static inline void il16_pass(const moeq_wstack* w, const i64* act, const i64* start, i64 A, const uint16_t* xb, i64 K,
                             i64 N, float* y) {
    const __m512i lut = _mm512_loadu_si512(w->lut);
    const i64 NB = N / 16;
#pragma omp for schedule(static)
    for (i64 t = 0; t < A * NB; t++) {
        const i64 a = t / NB, b = t % NB, e = act[a];
        il16_block_m(il16_codes(w, e, b), il16_scale_at(w, e, b), w->scale_bf16, il16_sup(w, e, b), lut,
                     (const uint32_t*)(xb + a * 8 * K), start ? start[e + 1] - start[e] : 1, K, w->gs,
                     y + a * 8 * N + 16 * b, N);
    }
}

// il16_pass with int16 activations (x at [a, 8, K] from x_to_il16_i16, chunk scales at [a, 8, K/32]) and the table as
// int16 (il16_lut16): the several-rows form (il16_block_i16).
static inline void il16_pass_i16(const moeq_wstack* w, const i64* act, const i64* start, i64 A, const int16_t* xq,
                                 const float* sx, __m512i lut16, i64 K, i64 N, float* y) {
    const i64 NB = N / 16;
#pragma omp for schedule(static)
    for (i64 t = 0; t < A * NB; t++) {
        const i64 a = t / NB, b = t % NB, e = act[a];
        il16_block_i16_m(il16_codes(w, e, b), il16_scale_at(w, e, b), w->scale_bf16, il16_sup(w, e, b), lut16,
                         xq + a * 8 * K, sx + a * 8 * (K / 32), start[e + 1] - start[e], K, w->gs,
                         y + a * 8 * N + 16 * b, N);
    }
}
#endif

// ---------------------------------------------------------------- a few rows on the tile unit ----------------------
// Past a few rows the il16 gemv is compute-bound (each weight re-expanded per row, 4 bf16 dot products per row and
// 128 weights: Qwen3-30B-A3B's attention at 8 rows streams at a fifth of the read bandwidth). On CPUs with AMX the
// codes of an il16 block, expanded through the table, are already the B operand of TDPBF16PS (per 4-column unit two
// vectors of 16 rows x one column pair: 16 such vectors are one 32-column B tile) and x_to_il16's pairs are the A
// operand's rows: one tile product per 32 columns for all rows at once, each group's sums scaled in fp32 as il16_block
// does (the same weights and group sums; the sum order inside a group is the tile unit's).

enum { LINEAR_AMX_MAX = 16 };
static int linear_amx_rows = 4;  // fewest rows the tile path takes (moeq_set_linear_amx_rows; 0: never)

void moeq_set_linear_amx_rows(int rows) { linear_amx_rows = rows; }

int moeq_linear_amx_takes(const moeq_wstack* w, i64 M) {
#if defined(MOEQ_IL16) && defined(MOEQ_AMX)
    return linear_amx_rows > 0 && M >= linear_amx_rows && M <= LINEAR_AMX_MAX && w->il16 && w->gs % 32 == 0 &&
           w->K <= 32768 && moeq_amx_on();
#else
    (void)w, (void)M;
    return 0;
#endif
}

#if defined(MOEQ_IL16) && defined(MOEQ_AMX)
// Tiles for M activation rows: C (fp32 [M][16]) 0, 4, 5, 6 — four groups in flight, so their products overlap —,
// A (bf16 [M][32]) 1 and 7, B ([16 pairs][16]) 2 and 3.
static inline void amx_configure_m(i64 M) {
    const uint8_t m = (uint8_t)M, rows[8] = {m, m, 16, 16, m, m, m, m};
    amx_configure_rows(rows);
}

// The B tile of 8 il16 units (32 columns x 16 rows) from their codes: per unit the table's values of the low and the
// high nibbles, each a vector of 16 rows x one column pair.
static inline void il16_b_tile(const uint8_t* cb, __m512i lut, uint16_t* b) {
    for (int u = 0; u < 8; u++) {
        const __m512i wv = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(cb + 32 * u)));
        _mm512_storeu_si512(b + 64 * u, _mm512_permutexvar_epi16(wv, lut));
        _mm512_storeu_si512(b + 64 * u + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(wv, 4), lut));
    }
}

// The product of one 32-column step of group slot j (C tile C) at unit c0, its B tile built earlier into bt's slot.
#define IL16_AMX_STEP(C, A, B, j)                                                                                 \
    do {                                                                                                        \
        _tile_loadd(A, xb + 4 * (((g0 + (j)) * gs + 32 * s) / 4), K * 2);                                       \
        _tile_loadd(B, bt + 512 * (j), 64);                                                                     \
        _tile_dpbf16ps(C, A, B);                                                                                \
    } while (0)

// y[m * ldy + r] (m < M) = row r of one il16 block against activation row m; xb: the rows in x_to_il16's order (bf16,
// K apart); bt: 4 x 512 halves, cs: 4 x 256 floats (the thread's). gs % 32 == 0. Four groups at a time, each in its
// own C tile; their sums scaled in fp32 as il16_block does. Each step's four B tiles are built before the first is
// loaded (a tile load of just-stored bytes waits for the stores to land).
static void il16_block_amx(const uint8_t* cb, const void* sb, int kind, const uint16_t* sup16, __m512i lut,
                           const uint16_t* xb, i64 M, i64 K, i64 gs, float* y, i64 ldy, uint16_t* bt, float* cs) {
    const i64 G = K / gs, ss = 16 * scale_size(kind);
    __m512 tot[LINEAR_AMX_MAX];
    for (i64 m = 0; m < M; m++) tot[m] = _mm512_setzero_ps();
    for (i64 g0 = 0; g0 < G; g0 += 4) {
        const i64 nj = G - g0 < 4 ? G - g0 : 4;
        _tile_zero(0);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        for (i64 s = 0; s < gs / 32; s++) {
            for (i64 j = 0; j < nj; j++) {
                const i64 c0 = ((g0 + j) * gs + 32 * s) / 4;
                for (int p = 0; p < 4; p++) _mm_prefetch((const char*)(cb + 32 * c0 + 4096 + 64 * p), _MM_HINT_T0);
                il16_b_tile(cb + 32 * c0, lut, bt + 512 * j);
            }
            IL16_AMX_STEP(0, 1, 2, 0);
            if (nj > 1) IL16_AMX_STEP(4, 7, 3, 1);
            if (nj > 2) IL16_AMX_STEP(5, 1, 2, 2);
            if (nj > 3) IL16_AMX_STEP(6, 7, 3, 3);
        }
        _tile_stored(0, cs, 64);
        _tile_stored(4, cs + 256, 64);
        _tile_stored(5, cs + 512, 64);
        _tile_stored(6, cs + 768, 64);
        for (i64 j = 0; j < nj; j++) {
            const __m512 d = il16_scales((const char*)sb + (g0 + j) * ss, kind);
            for (i64 m = 0; m < M; m++) tot[m] = _mm512_fmadd_ps(_mm512_loadu_ps(cs + 256 * j + 16 * m), d, tot[m]);
        }
    }
    const __m512 f = sup16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)sup16)), 16))
                           : _mm512_set1_ps(1.f);
    for (i64 m = 0; m < M; m++) _mm512_storeu_ps(y + m * ldy, _mm512_mul_ps(tot[m], f));
}
#undef IL16_AMX_STEP
#endif

// y [M][N] fp32 = x [M][K] (bf16) @ W^T for an il16 weight (expert 0) on the tile unit. Returns 1, or 0 (nothing
// written) where moeq_linear_amx_takes declines or memory cannot be had.
static int linear_amx(const moeq_wstack* w, const uint16_t* x, i64 M, float* y) {
#if defined(MOEQ_IL16) && defined(MOEQ_AMX)
    if (!moeq_linear_amx_takes(w, M)) return 0;
    const i64 N = w->N, K = w->K, NB = N / 16;
    uint16_t* xb = (uint16_t*)malloc((size_t)(M * K) * sizeof(uint16_t));
    if (!xb) return 0;
    for (i64 i = 0; i < M * K; i += 4) {  // x_to_il16's order: (x0, x2, x1, x3) per 4 columns
        xb[i] = x[i];
        xb[i + 1] = x[i + 2];
        xb[i + 2] = x[i + 1];
        xb[i + 3] = x[i + 3];
    }
    const __m512i lut = _mm512_loadu_si512(w->lut);
#pragma omp parallel
    {
        uint16_t bt[2048] __attribute__((aligned(64)));
        float cs[1024] __attribute__((aligned(64)));
        amx_configure_m(M);
#pragma omp for schedule(static)
        for (i64 b = 0; b < NB; b++)
            il16_block_amx(il16_codes(w, 0, b), il16_scale_at(w, 0, b), w->scale_bf16, il16_sup(w, 0, b), lut, xb, M, K,
                           w->gs, y + 16 * b, N, bt, cs);
        _tile_release();
    }
    free(xb);
    return 1;
#else
    (void)w, (void)x, (void)M, (void)y;
    return 0;
#endif
}

// ---------------------------------------------------------------- the decode kernel table ------------------------
// One row per decode kernel (y[m, N] = x[m, K] @ W[e]^T, m <= 8, scratch as moeq_quant_linear_bf16 sizes it): which
// weights it takes on this build and how it runs. moeq_wstack_plan ranks, once per weight when moeq describes it,
// the rows that take the weight (w->kernels, best first, ending with a row that always runs); expert_gemv runs the
// first, and the next only when a row declines for what only the call knows (more rows than it holds, activations it
// cannot quantize, memory it could not get). A format with a native kernel adds its rows here.

static int run_il16(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
#if defined(MOEQ_IL16) || defined(MOEQ_IL16_AVX2)
    il16_gemv(w, e, x, m, y, scratch);  // its codes are not row-major: no other row may read them
    return 1;
#else
    (void)w, (void)e, (void)x, (void)m, (void)y, (void)scratch;
    return 0;
#endif
}

// A decode copy by 16 output rows (one weight: the head), 8 rows of x per pass. Past 8 rows each pass re-reads the
// copy and is still faster than the row-major row (151936 x 2048 Q8_0 head, Zen 4, 2 threads: 16 rows in two passes
// against 2.3x the time row-major), and every row's logits keep the bits they have in a batch of up to 8. A pass that
// declines leaves y to the next row, which writes all of it.
static int run_rows16(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    (void)scratch;
    if (e != 0) return 0;
    for (i64 m0 = 0; m0 < m; m0 += 8)
        if (!moeq_rows16_gemv(w, x + m0 * w->K, m - m0 < 8 ? m - m0 : 8, y + m0 * w->N)) return 0;
    return 1;
}

static int run_i8(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    (void)scratch;
    return moeq_i8_gemv(w, e, x, m, y);  // declines for m > 8 and activations without a finite int8 scale
}

static int run_fp8_bf16(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    const i64 N = w->N, K = w->K, tiles = ((N + w->bn - 1) / w->bn) * ((K + w->gs - 1) / w->gs);
    uint16_t* xb = (uint16_t*)scratch;  // a bf16 model: its activations are bf16 already (exact)
    for (i64 i = 0; i < m * K; i++) xb[i] = f2bf(x[i]);
    return moeq_fp8_gemv_bf16(xb, m, w->q + e * N * K, (const float*)w->scale + e * tiles, N, K, w->bn, w->gs, y);
}

static int run_iq2s(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    (void)scratch;
    const i64 N = w->N, K = w->K;
    return moeq_iq2s_gemv(x, m, w->q + e * N * (K / 256 * 82), N, K, (const uint8_t*)w->scale, y);
}

static int run_fp8(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    (void)scratch;
    const i64 N = w->N, K = w->K, tiles = ((N + w->bn - 1) / w->bn) * ((K + w->gs - 1) / w->gs);
    moeq_fp8_gemv(x, m, w->q + e * N * K, (const float*)w->scale + e * tiles, N, K, w->bn, w->gs, y);
    return 1;
}

static inline const void* rtn_scale_at(const moeq_wstack* w, i64 e) {
    return (const char*)w->scale + e * w->N * (w->K / w->gs) * scale_size(w->scale_bf16);
}

static int run_cb_bf16(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    const i64 K = w->K, G = K / w->gs;  // the describer sets dot_bf16 only for K % 64 == 0, gs 16, 32 or 64k
    uint16_t* xb = (uint16_t*)scratch;
    float* xs = scratch + m * K;
    for (i64 r = 0; r < m; r++) x_to_bf16(x + r * K, K, w->gs, 1, xb + r * K, xs + r * G);
    return moeq_cb4_gemv_bf16(xb, m, w->q + e * w->N * packed_row_bytes(w->bits, K), rtn_scale_at(w, e),
                              w->scale_bf16, w->scale_super ? w->scale_super + e * w->N : NULL, w->lut, w->N, K,
                              w->gs, w->bits, y);
}

static int run_cb(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    (void)scratch;
    moeq_cb4_gemv(x, m, w->q + e * w->N * packed_row_bytes(w->bits, w->K), rtn_scale_at(w, e), w->scale_bf16,
                  w->scale_super ? w->scale_super + e * w->N : NULL, w->values, w->N, w->K, w->gs, w->bits, y);
    return 1;
}

static int run_rtn4_bf16(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    const i64 N = w->N, K = w->K, G = K / w->gs;
    uint16_t* xb = (uint16_t*)scratch;  // m*K bf16 = m*K/2 floats
    float* xs = scratch + m * K;
    const int p64 = w->gs % 64 == 0;
    for (i64 r = 0; r < m; r++) x_to_bf16(x + r * K, K, w->gs, p64, xb + r * K, xs + r * G);
    moeq_rtn4_gemv_bf16(xb, xs, m, w->q + e * (N * K / 2), rtn_scale_at(w, e), w->scale_bf16,
                        w->zero ? w->zero + e * N * G : NULL, N, K, w->gs, y, p64);
    return 1;
}

static int run_rtn(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    const i64 N = w->N, K = w->K, G = K / w->gs;
    float* xe = scratch;
    float* xo = xe + m * K;
    float* xs = xo + m * K;
    for (i64 r = 0; r < m; r++) {
        for (i64 g = 0; g < G; g++) {
            float s = 0.f;
            for (i64 k = 0; k < w->gs; k++) s += x[r * K + g * w->gs + k];
            xs[r * G + g] = s;
        }
        if (w->bits == 4)
            for (i64 j = 0; j < K / 2; j++) {
                xe[r * (K / 2) + j] = x[r * K + 2 * j];
                xo[r * (K / 2) + j] = x[r * K + 2 * j + 1];
            }
    }
    moeq_rtn_gemv(w->bits == 4 ? xe : x, xo, xs, m, w->q + e * (N * K * w->bits / 8), rtn_scale_at(w, e),
                  w->scale_bf16, w->zero ? w->zero + e * N * G : NULL, w->bits, N, K, w->gs, y);
    return 1;
}

// NF4/FP4: expert e's block scales resolved (double quant: through the nested code) into am [spe * nb].
static void bnb4_absmax(const moeq_wstack* w, i64 e, float* am) {
    const i64 nb = w->N * w->K / w->spe / w->gs, nn = (nb + 255) / 256;
    for (i64 s = 0; s < w->spe; s++) {
        const i64 S = e * w->spe + s;
        for (i64 b = 0; b < nb; b++)
            am[s * nb + b] = w->absmax_u8 ? w->nested_code[((const uint8_t*)w->scale)[S * nb + b]] *
                                                    w->nested_absmax[S * nn + b / 256] + w->offset[S]
                                          : ((const float*)w->scale)[S * nb + b];
    }
}

static int run_bnb4_bf16(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    const i64 N = w->N, K = w->K;
    uint16_t* xb = (uint16_t*)scratch;  // m*K bf16: what run_bnb4 holds as xe
    float* sums = scratch + m * (K / 2);  // per-64 sums, unused by NF4/FP4
    float* am = scratch + m * K;
    bnb4_absmax(w, e, am);
    for (i64 r = 0; r < m; r++) x_to_bf16(x + r * K, K, 64, 1, xb + r * K, sums);
    return moeq_bnb4_gemv_bf16(xb, m, w->q + e * (N * K / 2), am, w->code, N, K, w->gs, y);
}

static int run_bnb4(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    const i64 N = w->N, K = w->K;
    float* xe = scratch;
    float* xo = xe + m * (K / 2);
    float* am = xo + m * (K / 2);
    bnb4_absmax(w, e, am);
    for (i64 r = 0; r < m; r++)
        for (i64 j = 0; j < K / 2; j++) {
            xe[r * (K / 2) + j] = x[r * K + 2 * j];
            xo[r * (K / 2) + j] = x[r * K + 2 * j + 1];
        }
    moeq_bnb4_gemv(xe, xo, m, w->q + e * (N * K / 2), am, w->code, N, K, w->gs, y);
    return 1;
}

// What each row takes (besides its fmt), on this build. The describer has checked shapes, strides and domains
// (rows16 and act_i8 are set only inside their kernels' domains, il16 only where moeq_il16_takes said so).
static int takes_il16(const moeq_wstack* w) {
#if defined(MOEQ_IL16) || defined(MOEQ_IL16_AVX2)
    return w->il16;
#else
    (void)w;
    return 0;
#endif
}
static int takes_rows16(const moeq_wstack* w) { return w->rows16 != NULL; }
static int takes_i8(const moeq_wstack* w) { return w->act_i8; }
static int takes_avx2(const moeq_wstack* w) {
#if defined(MOEQ_AVX2)
    return w->dot_bf16;
#else
    (void)w;
    return 0;
#endif
}
static int takes_fp8_bf16(const moeq_wstack* w) { return w->dot_bf16 && w->K % 32 == 0 && w->gs % 32 == 0; }
static int takes_cb_bf16(const moeq_wstack* w) { return w->values && w->dot_bf16; }
static int takes_cb(const moeq_wstack* w) { return w->values != NULL; }
static int takes_rtn4_bf16(const moeq_wstack* w) { return !w->values && w->bits == 4 && w->dot_bf16; }
static int takes_rtn8_bf16(const moeq_wstack* w) { return !w->values && w->bits == 8 && w->dot_bf16; }
static int takes_rtn(const moeq_wstack* w) { return !w->values; }
static int takes_bnb4_bf16(const moeq_wstack* w) { return w->dot_bf16 && w->gs % 64 == 0; }
static int takes_any(const moeq_wstack* w) { (void)w; return 1; }

#if defined(__AVX512BF16__)
#define BF16_ROW(r) r
#else
#define BF16_ROW(r) NULL  // the AVX512-BF16 rows do not exist on this build
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define VNNI_ROW(r) r
#else
#define VNNI_ROW(r) NULL
#endif

typedef struct {
    const char* name;
    int fmt;  // the moeq_fmt it reads (-1: any; the row's takes decides)
    int (*takes)(const moeq_wstack* w);
    int (*run)(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch);
    int always;  // run never declines: the ranking ends here
} moeq_kernel;

// In preference order; row 0 is "not planned" (a zeroed moeq_wstack).
static const moeq_kernel KERNELS[] = {
    {"unplanned", -1, NULL, NULL, 0},
    {"il16", MOEQ_FMT_RTN, takes_il16, run_il16, 1},
    {"rows16", MOEQ_FMT_RTN, takes_rows16, run_rows16, 0},
    {"i8", MOEQ_FMT_RTN, takes_i8, run_i8, 0},
    {"avx2_i16", MOEQ_FMT_RTN, takes_avx2, moeq_avx2_gemv_i16, 0},
    {"fp8_bf16", MOEQ_FMT_FP8, BF16_ROW(takes_fp8_bf16), run_fp8_bf16, 0},
    {"fp8", MOEQ_FMT_FP8, takes_any, run_fp8, 1},
    {"cb_bf16", MOEQ_FMT_RTN, BF16_ROW(takes_cb_bf16), run_cb_bf16, 0},
    {"cb", MOEQ_FMT_RTN, takes_cb, run_cb, 1},
    {"rtn4_bf16", MOEQ_FMT_RTN, takes_rtn4_bf16, run_rtn4_bf16, 1},
    {"rtn8_bf16", MOEQ_FMT_RTN, VNNI_ROW(takes_rtn8_bf16), run_rtn8_bf16, 0},
    {"rtn", MOEQ_FMT_RTN, takes_rtn, run_rtn, 1},
    {"bnb4_bf16", MOEQ_FMT_BNB4, BF16_ROW(takes_bnb4_bf16), run_bnb4_bf16, 0},
    {"bnb4", MOEQ_FMT_BNB4, takes_any, run_bnb4, 1},
    {"iq2s", MOEQ_FMT_IQ2S, takes_any, run_iq2s, 1},
};
enum { NKERNELS = (int)(sizeof(KERNELS) / sizeof(KERNELS[0])) };
#undef BF16_ROW
#undef VNNI_ROW

// The ranking itself: the rows that take w, best first, up to and including the first that always runs. Returns how
// many (0: no row takes w — a format or build without decode kernels).
static int rank_kernels(const moeq_wstack* w, uint8_t* out) {
    int n = 0;
    for (int k = 1; k < NKERNELS && n < MOEQ_MAX_KERNELS; k++) {
        const moeq_kernel* r = &KERNELS[k];
        if ((r->fmt >= 0 && r->fmt != w->fmt) || !r->takes || (r->takes == takes_il16) != (w->il16 != 0) ||
            !r->takes(w))
            continue;  // il16 codes are not row-major: only the il16 row reads them
        out[n++] = (uint8_t)k;
        if (r->always) return n;
    }
    return 0;
}

// The layer kernels (moeq_moe_routed) that take w as one of a layer's two stacks: MOEQ_LAYER_I8 the int8-activation
// layer, MOEQ_LAYER_EXPERTS the expert-parallel bf16 layer (4-bit RTN and codebook grids), MOEQ_LAYER_GEMM the
// prompt's grouped GEMM (gemm.c).
static int rank_layers(const moeq_wstack* w) {
    int l = 0;
    if (w->act_i8 && !w->il16) l |= MOEQ_LAYER_I8;
    if (moeq_simd_level() > 0 && w->fmt == MOEQ_FMT_RTN && (w->bits == 4 || w->lut) && w->dot_bf16)
        l |= MOEQ_LAYER_EXPERTS;
    if (moeq_gemm_takes(w)) l |= MOEQ_LAYER_GEMM;
    return l;
}

// w's layer kernels (an unplanned w is ranked here).
static int layers_of(const moeq_wstack* w) { return w->kernels[0] ? w->layers : rank_layers(w); }

// Plans w once (the describer calls it after the last field is set): its ranked decode kernels and layer kernels.
// Returns the number of decode kernels that take it (0: none; then expert_gemv must not be called with it).
int moeq_wstack_plan(moeq_wstack* w) {
    memset(w->kernels, 0, sizeof(w->kernels));
    const int n = rank_kernels(w, w->kernels);
    if (n == 0) memset(w->kernels, 0, sizeof(w->kernels));
    w->layers = rank_layers(w);
    return n;
}

// A row's name (for moeq's describer and logs), or NULL past the table.
const char* moeq_kernel_name(int k) { return k >= 0 && k < NKERNELS ? KERNELS[k].name : NULL; }

// y[m, N] = x[m, K] @ W[e]^T through w's planned rows (an unplanned w is ranked here, each call).
static void expert_gemv(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    uint8_t local[MOEQ_MAX_KERNELS] = {0};
    const uint8_t* ks = w->kernels;
    if (ks[0] == 0) {
        rank_kernels(w, local);
        ks = local;
    }
    for (int i = 0; i < MOEQ_MAX_KERNELS && ks[i]; i++)
        if (KERNELS[ks[i]].run(w, e, x, m, y, scratch)) return;
    memset(y, 0, (size_t)(m * w->N) * sizeof(float));  // unreachable for a planned w (its last row always runs)
}

// A whole decode-path linear in one call for bf16 activations: y [M, N] bf16 = bf16(bf16(x W^T) + bias) as the Python
// path computes it (rounded, then the bias added in bf16), W described like one expert (RTN 4/8-bit or NF4/FP4,
// double quant included). Saves the torch glue per call the Python path spends around the same kernels.
// scratch (floats): M*K + expert_gemv's + M*N.
void moeq_quant_linear_bf16(const moeq_wstack* w, const uint16_t* x, i64 M, const uint16_t* bias, uint16_t* y,
                            float* scratch) {
    const i64 N = w->N, K = w->K;
    float* xf = scratch;
    float* yf = xf + M * K;
    float* sc = yf + M * N;
    if (!linear_amx(w, x, M, yf)) {  // a few rows on the tile unit where it takes them
        for (i64 i = 0; i < M * K; i++) xf[i] = bf2f(x[i]);
        expert_gemv(w, 0, xf, M, yf, sc);
    }
#pragma omp parallel for schedule(static) if (M * N >= 65536)
    for (i64 i = 0; i < M * N; i++) {
        const uint16_t h = f2bf(yf[i]);
        y[i] = bias ? f2bf(bf2f(h) + bf2f(bias[i % N])) : h;
    }
}

void moeq_moe_forward(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I,
                      const i64* pair_tok, const float* pair_w, const i64* expert_start, i64 E, float* out,
                      float* scratch) {
    // scratch: 8*H (x rows) + 8*2I (h) + 8*I (act) + 8*H (y) + gemv scratch (max of both)
    float* xr = scratch;
    float* h = xr + 8 * H;
    float* a = h + 8 * 2 * I;
    float* y = a + 8 * I;
    float* gs = y + 8 * H;
    for (i64 e = 0; e < E; e++) {
        for (i64 p0 = expert_start[e]; p0 < expert_start[e + 1]; p0 += 8) {
            const i64 m = expert_start[e + 1] - p0 < 8 ? expert_start[e + 1] - p0 : 8;
            for (i64 r = 0; r < m; r++) memcpy(xr + r * H, x + pair_tok[p0 + r] * H, (size_t)H * sizeof(float));
            expert_gemv(w13, e, xr, m, h, gs);
            for (i64 r = 0; r < m; r++)
                silu_glu_row(h + r * 2 * I, h + r * 2 * I + I, I, a + r * I);
            expert_gemv(w2, e, a, m, y, gs);
            for (i64 r = 0; r < m; r++) {
                const float wgt = pair_w[p0 + r];
                float* o = out + pair_tok[p0 + r] * H;
                for (i64 k = 0; k < H; k++) o[k] += wgt * y[r * H + k];
            }
        }
    }
}

#if defined(__AVX512BF16__)
// One activation row as w's bf16 kernels read it: il16's pairs, or x_to_bf16's 64-chunk order with group sums.
static inline void x_rows(const moeq_wstack* w, const float* x, uint16_t* dst, float* sums) {
    if (w->il16) x_to_il16(x, w->K, dst);
    else x_to_bf16(x, w->K, w->gs, 1, dst, sums);
}

// Inside a parallel region: y[a, 8, N] row 0 = W[act[a]] x[a] for every active expert a (one x row each, K in
// groups of 64, x in x_to_bf16's layout at [a, 8, K]), the rows of all experts shared out over the threads.
static inline void one_row_pass(const moeq_wstack* w, const i64* act, i64 A, const uint16_t* xb, const float* xs, i64 K,
                                i64 N, float* y) {
    if (w->il16) {
        il16_pass(w, act, NULL, A, xb, K, N, y);
        return;
    }
    const i64 G = K / w->gs, sb = scale_size(w->scale_bf16);
#pragma omp for schedule(static)
    for (i64 t = 0; t < A * N; t++) {
        const i64 a = t / N, n = t % N, e = act[a];
        if (w->lut) {
            cb4_row_bf16(xb + a * 8 * K, 1, w->q + e * N * packed_row_bytes(w->bits, K),
                         (const char*)w->scale + e * N * G * sb, w->scale_bf16, w->lut, n, K, w->gs, w->bits,
                         y + a * 8 * N + n);
            y[a * 8 * N + n] *= row_super(w->scale_super ? w->scale_super + e * N : NULL, n);
        } else
            y[a * 8 * N + n] = rtn4_row1_p64(xb + a * 8 * K, xs + a * 8 * G, w->q + e * (N * K / 2),
                                             (const char*)w->scale + e * N * G * sb, w->scale_bf16,
                                             w->zero ? w->zero + e * N * G : NULL, n, K, w->gs);
    }
}

// The layer kernel below when every active expert has one row (a batch-1 decode step), x in groups of 64: one
// parallel region whose loops also spread the glue (activation conversion, SiLU-GLU, the weighted sum, which keeps
// the serial order per element) over the threads, and the one-row gemv form (rtn4_row1_p64).
static void moe_rtn4_one_row(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I,
                             const i64* pair_tok, const float* pair_w, const i64* expert_start, const i64* act, i64 A,
                             float* out, float* scratch) {
    const i64 G1 = H / w13->gs, G2 = I / w2->gs, I2 = 2 * I;
    uint16_t* xb = (uint16_t*)scratch;  // the layer kernel's scratch layout, one row per expert used
    float* xs = scratch + A * 8 * H / 2;
    float* h = xs + A * 8 * G1;
    uint16_t* ab = (uint16_t*)(h + A * 8 * I2);
    float* as = h + A * 8 * I2 + A * 8 * I / 2;
    float* y = as + A * 8 * G2;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (i64 a = 0; a < A; a++)
            x_rows(w13, x + pair_tok[expert_start[act[a]]] * H, xb + a * 8 * H, xs + a * 8 * G1);
        one_row_pass(w13, act, A, xb, xs, H, I2, h);
#pragma omp for schedule(static)
        for (i64 a = 0; a < A; a++) {
            const float* hr = h + a * 8 * I2;
            float* t = y + a * 8 * H;  // free until the w2 loop: the fp32 activation row
            silu_glu_row(hr, hr + I, I, t);
            x_rows(w2, t, ab + a * 8 * I, as + a * 8 * G2);
        }
        one_row_pass(w2, act, A, ab, as, I, H, y);
#pragma omp for schedule(static)
        for (i64 k = 0; k < H; k++)
            for (i64 a = 0; a < A; a++) {
                const i64 p = expert_start[act[a]];
                out[pair_tok[p] * H + k] += pair_w[p] * y[a * 8 * H + k];
            }
    }
}
#endif

#if defined(MOEQ_AVX2)
// One output row n of one expert for its m (1..8) x rows (int16, x_to_i16_32's split layout, scales sx [8, K/32]):
// rows_avx2.h's row_i16 in chunks of 4 rows; q, scale and zero point at the expert's weight.
static inline void avx2_rows(const moeq_wstack* w, const int16_t* xq, const float* sx, i64 m, const uint8_t* q,
                             const void* sc, const uint8_t* z, const __m128i* t, i64 n, i64 K, float* o) {
    for (i64 r0 = 0; r0 < m; r0 += 4) {
        const i64 mc = m - r0 < 4 ? m - r0 : 4;
        const int16_t* xr = xq + r0 * K;
        const float* sr = sx + r0 * (K / 32);
#define AR(B, CB)                                                                                              \
    switch (mc) {                                                                                              \
        case 1: row_i16(xr, sr, 1, q, sc, w->scale_bf16, z, t, n, K, w->gs, B, CB, o + r0); break;             \
        case 2: row_i16(xr, sr, 2, q, sc, w->scale_bf16, z, t, n, K, w->gs, B, CB, o + r0); break;             \
        case 3: row_i16(xr, sr, 3, q, sc, w->scale_bf16, z, t, n, K, w->gs, B, CB, o + r0); break;             \
        default: row_i16(xr, sr, 4, q, sc, w->scale_bf16, z, t, n, K, w->gs, B, CB, o + r0); break;            \
    }
        if (w->lut && w->bits == 5) { AR(5, 1) }
        else if (w->lut) { AR(4, 1) }
        else { AR(4, 0) }
#undef AR
    }
}
#endif

#if defined(MOEQ_IL16) || defined(MOEQ_IL16_AVX2)
// One pass of the layer kernel below over an il16 stack, a parallel region of its own: y[a, 8, N] for every active
// expert's rows. xb/xs: the activations as this build's il16 kernels take them (bf16 pairs; AVX2, and AVX512 with
// tab: int16 and chunk scales), tab: the AVX2 build's int8 value table; on AVX512 the int16 table (il16_lut16) or
// NULL for the bf16 rows.
static void il16_layer_pass(const moeq_wstack* w, const i64* act, const i64* start, i64 A, const uint16_t* xb,
                            const float* xs, const void* tab, i64 K, i64 N, float* y) {
#pragma omp parallel
    {
#if defined(MOEQ_IL16)
        if (tab) il16_pass_i16(w, act, start, A, (const int16_t*)xb, xs, _mm512_loadu_si512(tab), K, N, y);
        else il16_pass(w, act, start, A, xb, K, N, y);
#else
        il16_pass_avx2(w, act, start, A, (const int16_t*)xb, xs, ((const __m128i*)tab)[0], K, N, y);
#endif
    }
}
#endif

// The same layer for 4-bit RTN experts with bf16 activations, parallel across experts: one parallel loop over the
// rows of every active expert's w13 (SiLU-GLU applied after), one over every active expert's w2 — two fork/joins
// per layer instead of two per expert, and the threads stream the experts' weights back to back.
// scratch (floats): A*8*(H/2 + H/16 + 2I + I/2 + I/16 + H) + 64, A = active experts (rows per expert <= 8).
void moeq_moe_forward_rtn4_bf16(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I,
                                const i64* pair_tok, const float* pair_w, const i64* expert_start, i64 E,
                                float* out, float* scratch) {
    if ((layers_of(w13) & layers_of(w2) & MOEQ_LAYER_I8) &&
        moeq_moe_forward_i8(w13, w2, x, H, I, pair_tok, pair_w, expert_start, E, out))
        return;
    i64 A = 0;
    for (i64 e = 0; e < E; e++) A += expert_start[e + 1] > expert_start[e];
    i64* act = (i64*)malloc((size_t)(A + 1) * sizeof(i64));
    A = 0;
    for (i64 e = 0; e < E; e++)
        if (expert_start[e + 1] > expert_start[e]) act[A++] = e;
    const i64 I2 = 2 * I;
#if defined(MOEQ_AVX2)  // x as int16 per 32-chunk (rows_avx2.h): one scale per chunk instead of a sum per group
    const i64 G1 = H / w13->gs, G2 = I / w2->gs, C1 = H / 32, C2 = I / 32;
    __m128i t13[2], t2[2];
    if ((w13->values && !cb_tables_i8(w13->values, w13->bits, t13)) ||
        (w2->values && !cb_tables_i8(w2->values, w2->bits, t2))) {
        free(act);
        moeq_moe_forward(w13, w2, x, H, I, pair_tok, pair_w, expert_start, E, out, scratch);
        return;
    }
    const void *tab13 = t13, *tab2 = t2;  // the il16 passes' value tables
#else
    const i64 G1 = H / w13->gs, G2 = I / w2->gs;
    i64 C1 = G1, C2 = G2;  // x's per-group sums (il16 in int16: the chunk scales, K/32 <= K/16 as the scratch allows)
    const void *tab13 = NULL, *tab2 = NULL;
#if defined(MOEQ_IL16)
    __m512i l13, l2;  // several rows per expert: the il16 stacks' int16 rows where their tables are integers
    if (il16_i16_rows(w13, &l13)) tab13 = &l13, C1 = H / 32;
    if (il16_i16_rows(w2, &l2)) tab2 = &l2, C2 = I / 32;
#endif
    (void)tab13, (void)tab2;
#endif
    const int p13 = w13->gs % 64 == 0 || w13->lut, p2 = w2->gs % 64 == 0 || w2->lut;  // codebook: K % 64 == 0
    uint16_t* xb = (uint16_t*)scratch;                  // [A, 8, H] bf16 (AVX2: int16)
    float* xs = scratch + A * 8 * H / 2;                // [A, 8, C1] (C <= K/16, as the scratch size allows)
    float* h = xs + A * 8 * C1;                         // [A, 8, 2I]
    uint16_t* ab = (uint16_t*)(h + A * 8 * I2);         // [A, 8, I] bf16 (AVX2: int16)
    float* as = h + A * 8 * I2 + A * 8 * I / 2;         // [A, 8, C2]
    float* y = as + A * 8 * C2;                         // [A, 8, H]
    const i64 sb13 = scale_size(w13->scale_bf16), sb2 = scale_size(w2->scale_bf16);
    int one = p13 && p2;  // every active expert has one row (a batch-1 decode step)
    for (i64 a = 0; a < A; a++) one &= expert_start[act[a] + 1] - expert_start[act[a]] == 1;
#if defined(__AVX512BF16__)
    if (one) {
        moe_rtn4_one_row(w13, w2, x, H, I, pair_tok, pair_w, expert_start, act, A, out, scratch);
        free(act);
        return;
    }
#endif
    for (i64 a = 0; a < A; a++) {
        const i64 e = act[a], p0 = expert_start[e], m = expert_start[e + 1] - p0;
        for (i64 r = 0; r < m; r++)
#if defined(MOEQ_AVX2)
            if (w13->il16) x_to_il16_i16(x + pair_tok[p0 + r] * H, H, (int16_t*)xb + (a * 8 + r) * H, xs + (a * 8 + r) * C1);
            else x_to_i16_32(x + pair_tok[p0 + r] * H, H, 1, (int16_t*)xb + (a * 8 + r) * H, xs + (a * 8 + r) * C1);
#else
#if defined(MOEQ_IL16)
            if (tab13) x_to_il16_i16(x + pair_tok[p0 + r] * H, H, (int16_t*)xb + (a * 8 + r) * H, xs + (a * 8 + r) * C1);
            else if (w13->il16) x_to_il16(x + pair_tok[p0 + r] * H, H, xb + (a * 8 + r) * H);
            else
#endif
            x_to_bf16(x + pair_tok[p0 + r] * H, H, w13->gs, p13, xb + (a * 8 + r) * H, xs + (a * 8 + r) * C1);
#endif
    }
#if defined(MOEQ_IL16) || defined(MOEQ_IL16_AVX2)
    if (w13->il16) il16_layer_pass(w13, act, expert_start, A, xb, xs, tab13, H, I2, h);
    else
#endif
#pragma omp parallel for schedule(static)
    for (i64 t = 0; t < A * I2; t++) {
        const i64 a = t / I2, n = t % I2, e = act[a], m = expert_start[e + 1] - expert_start[e];
        float zt[8] = {0}, o[8] = {0};
        const uint8_t* q = w13->q + e * I2 * packed_row_bytes(w13->bits, H);
        const void* sc = (const char*)w13->scale + e * I2 * G1 * sb13;
        const uint8_t* z = w13->zero ? w13->zero + e * I2 * G1 : NULL;
        const uint16_t* xa = xb + a * 8 * H;
        const float* xsa = xs + a * 8 * C1;
#if defined(__AVX512BF16__)
        if (w13->lut) cb4_row_bf16(xa, m, q, sc, w13->scale_bf16, w13->lut, n, H, w13->gs, w13->bits, o);
        else rtn4_row_bf16(p13, xa, xsa, m, q, sc, w13->scale_bf16, z, n, H, w13->gs, o, zt);
#elif defined(MOEQ_AVX2)
        avx2_rows(w13, (const int16_t*)xa, xsa, m, q, sc, z, t13, n, H, o);
#endif
        const float f = row_super(w13->scale_super ? w13->scale_super + e * I2 : NULL, n);
        for (i64 r = 0; r < m; r++) h[(a * 8 + r) * I2 + n] = o[r] * f - zt[r];
    }
    for (i64 a = 0; a < A; a++) {
        const i64 e = act[a], m = expert_start[e + 1] - expert_start[e];
        for (i64 r = 0; r < m; r++) {
            const float* hr = h + (a * 8 + r) * I2;
            uint16_t* dst = ab + (a * 8 + r) * I;
            float* t = y;  // y is free until the w2 pass: the fp32 activation row
            silu_glu_row(hr, hr + I, I, t);
#if defined(MOEQ_AVX2)
            if (w2->il16) x_to_il16_i16(t, I, (int16_t*)dst, as + (a * 8 + r) * C2);
            else x_to_i16_32(t, I, 1, (int16_t*)dst, as + (a * 8 + r) * C2);
#else
#if defined(MOEQ_IL16)
            if (tab2) x_to_il16_i16(t, I, (int16_t*)dst, as + (a * 8 + r) * C2);
            else if (w2->il16) x_to_il16(t, I, dst);
            else
#endif
            x_to_bf16(t, I, w2->gs, p2, dst, as + (a * 8 + r) * C2);
#endif
        }
    }
#if defined(MOEQ_IL16) || defined(MOEQ_IL16_AVX2)
    if (w2->il16) il16_layer_pass(w2, act, expert_start, A, ab, as, tab2, I, H, y);
    else
#endif
#pragma omp parallel for schedule(static)
    for (i64 t = 0; t < A * H; t++) {
        const i64 a = t / H, n = t % H, e = act[a], m = expert_start[e + 1] - expert_start[e];
        float zt[8] = {0}, o[8] = {0};
        const uint8_t* q = w2->q + e * H * packed_row_bytes(w2->bits, I);
        const void* sc = (const char*)w2->scale + e * H * G2 * sb2;
        const uint8_t* z = w2->zero ? w2->zero + e * H * G2 : NULL;
#if defined(__AVX512BF16__)
        if (w2->lut) cb4_row_bf16(ab + a * 8 * I, m, q, sc, w2->scale_bf16, w2->lut, n, I, w2->gs, w2->bits, o);
        else rtn4_row_bf16(p2, ab + a * 8 * I, as + a * 8 * C2, m, q, sc, w2->scale_bf16, z, n, I, w2->gs, o, zt);
#elif defined(MOEQ_AVX2)
        avx2_rows(w2, (const int16_t*)(ab + a * 8 * I), as + a * 8 * C2, m, q, sc, z, t2, n, I, o);
#endif
        const float f = row_super(w2->scale_super ? w2->scale_super + e * H : NULL, n);
        for (i64 r = 0; r < m; r++) y[(a * 8 + r) * H + n] = o[r] * f - zt[r];
    }
    for (i64 a = 0; a < A; a++) {
        const i64 e = act[a], p0 = expert_start[e], m = expert_start[e + 1] - p0;
        for (i64 r = 0; r < m; r++) {
            const float wgt = pair_w[p0 + r];
            float* o = out + pair_tok[p0 + r] * H;
            const float* yr = y + (a * 8 + r) * H;
            for (i64 k = 0; k < H; k++) o[k] += wgt * yr[k];
        }
    }
    free(act);
}

// A decode step's MoE layer straight from the router's output: groups the token-expert pairs by expert (a stable
// counting sort, the order of argsort(top_k_index.flatten(), stable=True)) and runs the layer kernel above, in one
// call instead of a dozen small torch ops. The layer kernels take up to 8 rows per expert: an expert with more (a
// batch past 8 rows) runs in passes, each expert's next 8 rows per pass, the passes adding into out in turn.
// Returns 1 (nothing written) when an index is outside [0, E), T > MOEQ_ROUTED_ROWS, or a buffer cannot be had: the
// caller takes its general path. scratch: as the layer kernel for min(E, T*A) active experts.
static void moe_layer(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I, const i64* tok,
                      const float* wts, const i64* starts, i64 E, float* out, float* scratch) {
    const int both = layers_of(w13) & layers_of(w2);
    if ((both & MOEQ_LAYER_I8) && moeq_moe_forward_i8(w13, w2, x, H, I, tok, wts, starts, E, out))
        ;  // the int8-activation option
    else if (both & MOEQ_LAYER_EXPERTS)
        moeq_moe_forward_rtn4_bf16(w13, w2, x, H, I, tok, wts, starts, E, out, scratch);
    else if (!moeq_moe_rtn8_layer(w13, w2, x, H, I, tok, wts, starts, E, out))  // 8-bit: one region per layer
        moeq_moe_forward(w13, w2, x, H, I, tok, wts, starts, E, out, scratch);
}

int moeq_moe_routed(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I, const i64* idx,
                    const float* wt, i64 T, i64 A, i64 E, float* out, float* scratch) {
    const i64 P = T * A;
    if (T < 1 || T > MOEQ_ROUTED_ROWS || A < 1 || E < 1) return 1;
    i64* starts = (i64*)calloc((size_t)(2 * (E + 1) + E), sizeof(i64));
    i64* tok = (i64*)malloc((size_t)(2 * P) * sizeof(i64));
    float* wts = (float*)malloc((size_t)(2 * P) * sizeof(float));
    int declined = !starts || !tok || !wts;
    for (i64 p = 0; p < P && !declined; p++) {
        if (idx[p] < 0 || idx[p] >= E) { declined = 1; break; }
        starts[idx[p] + 1]++;
    }
    i64 most = 0;
    for (i64 e = 0; e < E && !declined; e++) {
        most = starts[e + 1] > most ? starts[e + 1] : most;
        starts[e + 1] += starts[e];
    }
    if (!declined) {
        i64* fill = starts + 2 * (E + 1);
        memcpy(fill, starts, (size_t)E * sizeof(i64));
        for (i64 p = 0; p < P; p++) {
            const i64 slot = fill[idx[p]]++;
            tok[slot] = p / A;
            wts[slot] = wt[p];
        }
        if (most <= 8) {
            moe_layer(w13, w2, x, H, I, tok, wts, starts, E, out, scratch);
        } else {  // pass k: rows 8k .. 8k+7 of each expert, grouped as the layer kernels take them
            i64* ps = starts + (E + 1);
            i64* ptok = tok + P;
            float* pwts = wts + P;
            for (i64 k = 0; 8 * k < most; k++) {
                ps[0] = 0;
                for (i64 e = 0; e < E; e++) {
                    const i64 lo = starts[e] + 8 * k, hi = starts[e + 1] < lo + 8 ? starts[e + 1] : lo + 8;
                    const i64 n = hi > lo ? hi - lo : 0;
                    memcpy(ptok + ps[e], tok + lo, (size_t)n * sizeof(i64));
                    memcpy(pwts + ps[e], wts + lo, (size_t)n * sizeof(float));
                    ps[e + 1] = ps[e] + n;
                }
                moe_layer(w13, w2, x, H, I, ptok, pwts, ps, E, out, scratch);
            }
        }
    }
    free(starts);
    free(tok);
    free(wts);
    return declined;
}

