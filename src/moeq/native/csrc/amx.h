// The tile unit (AMX-BF16, Sapphire Rapids and later), shared by the kernels that use it (gemm.c: a prompt's expert
// GEMMs; bf12.c: the kept head for several rows; moe.c: an il16 linear's few decode rows). Linux grants the tile data
// per process (moeq_amx_ready, gemm.c); moeq_amx_on says whether the tile kernels may run now. A kernel configures
// the tiles in each thread that uses them (amx_configure) and releases them at the end of its parallel region
// (_tile_release).
#ifndef MOEQ_AMX_H
#define MOEQ_AMX_H
#include "moeq.h"
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__) && \
    defined(SYS_arch_prctl)
#define MOEQ_AMX 1
#endif

int moeq_amx_on(void);  // built with AMX, permission granted (moeq_amx_ready) and not turned off (moeq_set_amx)

#if defined(MOEQ_AMX)
// Tile t rows[t] x 64 bytes (8 tiles).
static inline void amx_configure_rows(const uint8_t rows[8]) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = rows[t];
    }
    _tile_loadconfig(&cfg);
}

// Every tile 16 rows x 64 bytes: A (weights 16 x 32 bf16), B (16 pairs x 16 tokens), C (16 x 16 fp32).
static inline void amx_configure(void) {
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    amx_configure_rows(rows);
}

// y [16 RB][ldy] (from token p) = RB weight tiles of 16 rows (wt [16 RB][K]) times NB token blocks of 16 (xt pairs):
// C tile 2r + j for weight tile r and token block j, A tiles 4-5, B tiles 6-7; every loaded tile feeds RB or NB
// products (2 x 2: four loads per four products; one weight tile re-read the tokens' pairs for each product). RB, NB
// compile-time constants per call site (1 or 2); K % 32 == 0. Each output is its own chain over K in steps of 32:
// its bits do not depend on the other rows or tokens of the block.
static inline __attribute__((always_inline)) void amx_block(const uint16_t* wt, i64 K, const uint32_t* xt, i64 Pp,
                                                            i64 p, const int RB, const int NB, float* y) {
    const i64 ldx = Pp * 4, ldw = K * 2, ldy = Pp * 4;
    _tile_zero(0);
    if (NB > 1) _tile_zero(1);
    if (RB > 1) _tile_zero(2);
    if (RB > 1 && NB > 1) _tile_zero(3);
    for (i64 k = 0; k < K; k += 32) {
        const uint32_t* xp = xt + (k / 2) * Pp + p;
        _tile_loadd(6, xp, ldx);
        if (NB > 1) _tile_loadd(7, xp + 16, ldx);
        _tile_loadd(4, wt + k, ldw);
        _tile_dpbf16ps(0, 4, 6);
        if (NB > 1) _tile_dpbf16ps(1, 4, 7);
        if (RB > 1) {
            _tile_loadd(5, wt + 16 * K + k, ldw);
            _tile_dpbf16ps(2, 5, 6);
            if (NB > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, y + p, ldy);
    if (NB > 1) _tile_stored(1, y + p + 16, ldy);
    if (RB > 1) _tile_stored(2, y + 16 * Pp + p, ldy);
    if (RB > 1 && NB > 1) _tile_stored(3, y + 16 * Pp + p + 16, ldy);
}
#endif
#endif
