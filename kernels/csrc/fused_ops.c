/*
 * Fused per-layer elementwise work of a Llama-style decoder layer on CPUs (float32).
 *
 * Why this exists: on a narrow model (SmolLM2-135M: hidden 576, 30 layers) torch runs each
 * layer's small elementwise steps as separate ops (RMSNorm alone is pow, mean, add, rsqrt and
 * two muls; rope is four muls, a sub, an add and a cat; SwiGLU is silu then mul), each a full
 * pass over an activation that, in a 2048-token prefill chunk, does not fit the caches, plus a
 * fresh allocation and the per-op dispatch cost. A torch profile of SmolLM2 prefill+decode put
 * those ops at ~30% of self CPU time. Here each is one pass:
 *
 *   ps_silu_mul_f32      out = silu(gate) * up, reading the fused gate_up projection's rows
 *   ps_add_rms_norm_f32  residual += delta (optional), out = weight * (residual * rsqrt(ms+eps))
 *   ps_rope_kv_f32       rotate q and k in place inside the qkv rows, then copy k and v to their
 *                        cache slots (what write_kv did with two index_copy_ calls)
 *   ps_rope_kv_bf16      the same into bfloat16 caches (--kv-cache-dtype bfloat16), rounded
 *                        to nearest even as torch rounds
 *
 * Threads: OpenMP only when a call has enough work (PS_PAR_MIN elements); decode-sized calls
 * run on the calling thread, so no fork-join per layer per step (a previous attempt's per-layer
 * OpenMP kernel was suspected of costing more than it saved on 2 cores). The library links
 * libgomp by soname, as paged_decode.c does, so its threads are torch's.
 *
 * Numerics: built with -ffp-contract=off, so rope does exactly torch's arithmetic (each
 * product rounded, then the sub/add): bit-identical. RMSNorm sums squares in a different
 * order than torch's reduction and SiLU uses its own exp (Cephes polynomial, ~1 ulp): both
 * differ from torch by float32 rounding only (tests/test_kernels_fused.py bounds it, and the
 * greedy parity tests against transformers hold).
 *
 * Built at first use by kernels/fused.py with the machine's C compiler; called through ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ps_vec.h"

#define PS_PAR_MIN (1 << 16)


static inline v8sf ps_ld(const float *p) { return *(const v8sf_u *)p; }
static inline void ps_st(float *p, v8sf v) { *(v8sf_u *)p = v; }

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i]; rows in_stride / out_stride floats apart.
 * The build's widest vectors first (16 floats under AVX-512: 1.43-1.55x the 8-float loop at
 * 16-256 rows of 1536 on Zen 4, 1.09x at 2048 rows where the pass is memory-bound; the same
 * arithmetic per lane, so bit-identical), then 8 floats, then the last < 8 as 8 padded lanes
 * (not libm's expf: the same arithmetic for every element, as the GEMM's SwiGLU epilogue). */
void ps_silu_mul_f32(const float *gu, int64_t rows, int64_t inter, int64_t in_stride,
                     float *out, int64_t out_stride, int32_t threads) {
    const int64_t wide_end = inter / PS_WIDE_LANES * PS_WIDE_LANES, vec_end = inter / 8 * 8;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * inter >= PS_PAR_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gu + r * in_stride, *u = g + inter;
        float *o = out + r * out_stride;
        for (int64_t i = 0; i < wide_end; i += PS_WIDE_LANES) {
            ps_wstore(o + i, ps_wsilu(ps_wload(g + i)) * ps_wload(u + i));
        }
        for (int64_t i = wide_end; i < vec_end; i += 8)
            ps_st(o + i, ps_silu8(ps_ld(g + i)) * ps_ld(u + i));
        if (vec_end < inter) { /* the last < 8: the same vector arithmetic, lanes padded */
            float gt[8] = {0}, ut[8] = {0}, ot[8];
            memcpy(gt, g + vec_end, (size_t)(inter - vec_end) * sizeof(float));
            memcpy(ut, u + vec_end, (size_t)(inter - vec_end) * sizeof(float));
            ps_st(ot, ps_silu8(ps_ld(gt)) * ps_ld(ut));
            memcpy(o + vec_end, ot, (size_t)(inter - vec_end) * sizeof(float));
        }
    }
}

/* One row: x += d (when d), then out = w * (x * (1 / sqrt(mean(x^2) + eps))). */
static inline void ps_add_rms_row(float *x, const float *d, const float *w, float *out,
                                  int64_t dim, float eps) {
    const int64_t vec_end = dim / 8 * 8;
    v8sf acc[4] = {ps_splat(0.0f), ps_splat(0.0f), ps_splat(0.0f), ps_splat(0.0f)};
    int64_t i = 0;
    for (; i < vec_end; i += 8) {
        v8sf v = ps_ld(x + i);
        if (d) {
            v = v + ps_ld(d + i);
            ps_st(x + i, v);
        }
        acc[(i / 8) & 3] += v * v;
    }
    float tail = 0.0f;
    for (; i < dim; ++i) {
        if (d) x[i] += d[i];
        tail += x[i] * x[i];
    }
    const v8sf a = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    float sum = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])) + tail;
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    const v8sf iv = ps_splat(inv);
    for (i = 0; i < vec_end; i += 8) ps_st(out + i, ps_ld(w + i) * (ps_ld(x + i) * iv));
    for (; i < dim; ++i) out[i] = w[i] * (x[i] * inv);
}

/* residual [rows, dim] (contiguous, updated in place when delta is given), delta rows
 * delta_stride apart (or NULL), out [rows, dim] contiguous. */
void ps_add_rms_norm_f32(float *residual, const float *delta, int64_t delta_stride,
                         const float *weight, float *out, int64_t rows, int64_t dim, float eps,
                         int32_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= PS_PAR_MIN)
    for (int64_t r = 0; r < rows; ++r)
        ps_add_rms_row(residual + r * dim, delta ? delta + r * delta_stride : NULL, weight,
                       out + r * dim, dim, eps);
}

/* Token t's row of qkv (row_stride floats; [H q heads | Hkv k heads | Hkv v heads] x D): its
 * q and k heads rotated in place by position pos (table: [P, 2, D / 2] cos then sin, Hugging
 * Face half-split pairs). */
static inline void ps_rope_row(float *row, int64_t rotated, int64_t head_dim, const float *table,
                               int64_t pos) {
    const int64_t half = head_dim / 2;
    const float *c = table + pos * head_dim, *s = c + half;
    for (int64_t h = 0; h < rotated; ++h) {
        float *x1 = row + h * head_dim, *x2 = x1 + half;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
            const v8sf a = ps_ld(x1 + i), b = ps_ld(x2 + i);
            const v8sf cv = ps_ld(c + i), sv = ps_ld(s + i);
            ps_st(x1 + i, a * cv - b * sv);
            ps_st(x2 + i, b * cv + a * sv);
        }
        for (; i < half; ++i) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i] + a * s[i];
        }
    }
}

/* n floats to bfloat16, rounded to nearest even as torch's .to(torch.bfloat16) does (NaN to a
 * quiet NaN, 0x7fc0, as torch's scalar conversion): the same bits. */
typedef uint32_t ps_v8su __attribute__((vector_size(32)));
typedef uint16_t ps_v8hu __attribute__((vector_size(16)));
typedef uint16_t ps_v8hu_u __attribute__((vector_size(16), aligned(2)));
static inline uint16_t ps_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if (x != x) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline void ps_to_bf16(uint16_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8sf x = ps_ld(src + i);
        const ps_v8su u = (ps_v8su)x;
        ps_v8su r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        const ps_v8su nan = (ps_v8su)(x != x); /* all ones where NaN */
        r = (r & ~nan) | (0x7fc0u & nan);
        *(ps_v8hu_u *)(dst + i) = __builtin_convertvector(r, ps_v8hu);
    }
    for (; i < n; ++i) dst[i] = ps_bf16(src[i]);
}

/* Each token's row rotated (ps_rope_row), then its k and v stored at cache slot slots[t] (caches
 * [slots, Hkv, D] contiguous, float32 or, with bf16, bfloat16 rounded on store) when slots is
 * not NULL. bf16 is a constant at both call sites below. */
static inline __attribute__((always_inline)) void ps_rope_kv(
    float *qkv, int64_t tokens, int64_t row_stride, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, const float *table, const int64_t *positions, void *k_cache,
    void *v_cache, const int64_t *slots, int32_t threads, const int bf16) {
    const int64_t rotated = num_heads + num_kv_heads, kv_elems = num_kv_heads * head_dim;
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (tokens * rotated * head_dim >= PS_PAR_MIN)
    for (int64_t t = 0; t < tokens; ++t) {
        float *row = qkv + t * row_stride;
        ps_rope_row(row, rotated, head_dim, table, positions[t]);
        if (!slots) continue;
        const float *k = row + num_heads * head_dim, *v = row + rotated * head_dim;
        const int64_t at = slots[t] * kv_elems;
        if (bf16) {
            ps_to_bf16((uint16_t *)k_cache + at, k, kv_elems);
            ps_to_bf16((uint16_t *)v_cache + at, v, kv_elems);
        } else {
            memcpy((float *)k_cache + at, k, (size_t)kv_elems * sizeof(float));
            memcpy((float *)v_cache + at, v, (size_t)kv_elems * sizeof(float));
        }
    }
}

/* The exported pair: ps_rope_kv_f32 (float32 caches) and ps_rope_kv_bf16 (bfloat16 caches,
 * --kv-cache-dtype bfloat16: k and v rounded on store). */
#define PS_ROPE_KV_FN(suffix, cache_t, bf16)                                                   \
    void ps_rope_kv_##suffix(float *qkv, int64_t tokens, int64_t row_stride, int64_t num_heads, \
                             int64_t num_kv_heads, int64_t head_dim, const float *table,        \
                             const int64_t *positions, cache_t *k_cache, cache_t *v_cache,      \
                             const int64_t *slots, int32_t threads) {                           \
        ps_rope_kv(qkv, tokens, row_stride, num_heads, num_kv_heads, head_dim, table,           \
                   positions, k_cache, v_cache, slots, threads, bf16);                          \
    }
PS_ROPE_KV_FN(f32, float, 0)
PS_ROPE_KV_FN(bf16, uint16_t, 1)
#undef PS_ROPE_KV_FN

/* out[r] = the index of the largest of x[r, 0..cols) (the first where several are equal), rows
 * ld floats apart; returns 1 if any value read was NaN (the caller then asks torch, whose
 * argmax counts NaN as the largest), else 0.
 *
 * Why: torch's argmax over the last dimension of a [rows, vocab] float32 tensor ran at ~3.5
 * GB/s on an Intel Xeon (2 threads; [48, 49152]: 2.6 ms, [96, 49152]: 5.5 ms, every greedy
 * decode step). Each lane here keeps the first position of its own maximum (strict >), then
 * the lanes' maxima meet: the largest value, and of equal ones the smallest position. */
int ps_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t ld, int64_t *out,
                  int32_t threads) {
    int nan_seen = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * cols >= PS_PAR_MIN) \
    reduction(| : nan_seen)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * ld;
        float best = row[0];
        int64_t at = 0, j = 0;
        int nan_row = best != best;
        if (cols >= PS_WIDE_LANES) {
            vwsi lane_at, next;
            for (int l = 0; l < PS_WIDE_LANES; ++l) lane_at[l] = l;
            next = lane_at + PS_WIDE_LANES;
            vwsf lane_best = ps_wload(row);
            vwsi nan = lane_best != lane_best;
            for (j = PS_WIDE_LANES; j + PS_WIDE_LANES <= cols; j += PS_WIDE_LANES) {
                const vwsf v = ps_wload(row + j);
                const vwsi gt = v > lane_best;
                lane_best = (vwsf)(((vwsi)v & gt) | ((vwsi)lane_best & ~gt));
                lane_at = (next & gt) | (lane_at & ~gt);
                next += PS_WIDE_LANES;
                nan |= v != v;
            }
            best = lane_best[0];
            at = lane_at[0];
            for (int l = 1; l < PS_WIDE_LANES; ++l)
                if (lane_best[l] > best || (lane_best[l] == best && lane_at[l] < at)) {
                    best = lane_best[l];
                    at = lane_at[l];
                }
            for (int l = 0; l < PS_WIDE_LANES; ++l) nan_row |= nan[l] != 0;
        }
        for (; j < cols; ++j) {
            if (row[j] > best) {
                best = row[j];
                at = j;
            }
            nan_row |= row[j] != row[j];
        }
        out[r] = at;
        nan_seen |= nan_row;
    }
    return nan_seen;
}
