// Decode-step helpers for bf16 models: RMSNorm, RoPE and single-query attention, each reproducing transformers'
// own bf16 rounding.
#include "moeq.h"

// ---------------------------------------------------------------- decode-step helpers ---------------------------
// transformers' bf16 RMSNorm: y = w * bf16(x * rsqrt(mean(x^2) + eps)), the mean and the product in fp32, the
// normalized value rounded to bf16 before the (rounded) product with the weight. x, w, y bf16 bits; rows of n.
void moeq_rmsnorm_bf16(const uint16_t* x, const uint16_t* w, i64 rows, i64 n, float eps, uint16_t* y) {
    for (i64 r = 0; r < rows; r++) {
        const uint16_t* xr = x + r * n;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (i64 k = 0; k < n; k++) ss += bf2f(xr[k]) * bf2f(xr[k]);
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
        uint16_t* yr = y + r * n;
        for (i64 k = 0; k < n; k++) yr[k] = f2bf(bf2f(w[k]) * bf2f(f2bf(bf2f(xr[k]) * inv)));
    }
}

// One query token of grouped-query attention over a bf16 KV cache, in fp32 (a product of two bf16 values is exact in
// fp32): out[b, h] = softmax(scale q[b, h] . K[b, h / g] + mask[b]) V[b, h / g], g = Hq / Hkv. q [B, Hq, D],
// k/v [B, Hkv, S, D], mask additive fp32 [B, S] or NULL, out [B, Hq, D] bf16. A row masked everywhere gives NaN,
// as softmax does.
void moeq_attn_decode_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* mask, i64 B, i64 Hq,
                           i64 Hkv, i64 S, i64 D, float scale, uint16_t* out) {
    const i64 g = Hq / Hkv;
#pragma omp parallel
    {
        float* p = (float*)malloc((size_t)(S + 2 * D) * sizeof(float));
        float* qf = p + S;
        float* acc = qf + D;
#pragma omp for schedule(static)
        for (i64 t = 0; t < B * Hq; t++) {
            const i64 b = t / Hq, kh = (t % Hq) / g;
            const uint16_t* kb = k + (b * Hkv + kh) * S * D;
            const uint16_t* vb = v + (b * Hkv + kh) * S * D;
            for (i64 d = 0; d < D; d++) qf[d] = bf2f(q[t * D + d]);
            float mx = -INFINITY;
            for (i64 s = 0; s < S; s++) {
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (i64 d = 0; d < D; d++) dot += qf[d] * bf2f(kb[s * D + d]);
                const float sc = dot * scale + (mask ? mask[b * S + s] : 0.f);
                p[s] = sc;
                mx = sc > mx ? sc : mx;
            }
            float sum = 0.f;
            for (i64 s = 0; s < S; s++) {
                p[s] = expf(p[s] - mx);
                sum += p[s];
            }
            for (i64 d = 0; d < D; d++) acc[d] = 0.f;
            for (i64 s = 0; s < S; s++) {
                const float ps = p[s];
#pragma omp simd
                for (i64 d = 0; d < D; d++) acc[d] += ps * bf2f(vb[s * D + d]);
            }
            const float inv = 1.f / sum;
            for (i64 d = 0; d < D; d++) out[t * D + d] = f2bf(acc[d] * inv);
        }
        free(p);
    }
}

// RoPE for one token, in place: x [B, H, D] bf16 becomes x cos + rotate_half(x) sin with cos/sin [B, D] bf16,
// rotate_half(x) = (-x[D/2:], x[:D/2]); each product and the sum rounded to bf16, exactly as torch's bf16 ops do.
void moeq_rope_bf16(uint16_t* x, i64 B, i64 H, i64 D, const uint16_t* cos, const uint16_t* sin) {
    const i64 h2 = D / 2;
    for (i64 b = 0; b < B; b++)
        for (i64 h = 0; h < H; h++) {
            uint16_t* r = x + (b * H + h) * D;
            const uint16_t *c = cos + b * D, *s = sin + b * D;
            for (i64 d = 0; d < h2; d++) {
                const float x1 = bf2f(r[d]), x2 = bf2f(r[d + h2]);
                r[d] = f2bf(bf2f(f2bf(x1 * bf2f(c[d]))) + bf2f(f2bf(-x2 * bf2f(s[d]))));
                r[d + h2] = f2bf(bf2f(f2bf(x2 * bf2f(c[d + h2]))) + bf2f(f2bf(x1 * bf2f(s[d + h2]))));
            }
        }
}

