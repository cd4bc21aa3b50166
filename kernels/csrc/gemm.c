/*
 * Projection GEMM for CPUs (float32): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W pre-packed.
 *
 * Why this exists: a decode step multiplies a few dozen rows by every weight of the model, and
 * the weights do not fit the last-level cache, so each step streams them all from DRAM. oneDNN
 * (packed weights, the previous path) ran those small products at 3-6 GB/s of weights on a
 * 2-core Zen 3 EPYC: 9-54 GFLOP/s in the engine against 90-160 with the same weights hot, while
 * the machine reads 22 GB/s. Here each thread walks its own contiguous run of weight panels
 * front to back exactly once per call (a plain sequential stream the hardware prefetchers
 * follow) and keeps each panel in L2 while every row tile of x is multiplied by it.
 *
 * Layout: W is packed into panels of PS_GEMM_NR output columns: wp[p][k][c] = W[p * NR + c][k]
 * (columns past N are zero), so one k step of a panel is NR contiguous floats (one 64-byte
 * line on AVX2). A micro-tile is MR rows x NR columns held in registers (AVX2: 6 x 16 in 12 of
 * the 16 registers; AVX-512: 12 x 32 in 24 of 32 for decode-sized calls, 10 x 32 past them:
 * PS_GEMM_MR_BIG); each k step loads the panel's NR floats once and broadcasts one x value per
 * row.
 *
 * Numerics: every output is one sum over k in order 0..K-1 (fused multiply-adds), then + bias:
 * the result does not depend on M, on which rows share a call, or on the thread count (a row's
 * logits are the same alone or in a batch of 200). It differs from oneDNN / MKL by float32
 * rounding only (their blocking sums k in other orders); tests/test_kernels_gemm.py bounds it
 * against a float64 reference, and the greedy parity suites hold.
 *
 * Built at first use by kernels/gemm.py with the machine's C compiler; called through ctypes.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "ps_vec.h"

#define PS_GEMM_NRV 2 /* vectors per panel row */
#define PS_GEMM_NR (PS_GEMM_NRV * PS_WIDE_LANES)
#if PS_WIDE_LANES == 16
#define PS_GEMM_MR 12
#else
#define PS_GEMM_MR 6
#endif
/* Rows of a tile in calls of more than PS_GEMM_NEXT_ROWS rows (prefill chunks; at most
 * PS_GEMM_MR). Why not 12 there too: a 12-row tile needs 12 row pointers of x beside the
 * panel's, the k index and the prefetch pointers, more than x86's 16 general registers, so
 * GCC kept two or three of them in vector registers or on the stack and moved them back at
 * every k step (objdump of the 12-row loop); 10 rows fit. Zen 4 EPYC, 2 threads, 300-2048
 * rows, bit-identical: 1.00-1.08x (median ~1.04) on SmolLM2's and the bench model's products
 * (bench/README.md, a thirty-sixth session). Decode-sized calls keep 12: 10 rows there, with the
 * request runs below, measured 0.94-1.08x at 24-48 rows (not resolved); before those runs
 * 0.78-0.84x. AVX2's 6 rows fit already. */
#ifndef PS_GEMM_MR_BIG
#if PS_WIDE_LANES == 16
#define PS_GEMM_MR_BIG 10
#else
#define PS_GEMM_MR_BIG PS_GEMM_MR
#endif
#endif
/* bytes of weight panels kept in L2 while every row tile passes over them */
#define PS_GEMM_BLOCK_BYTES (192 * 1024)
#ifndef PS_GEMM_X_BYTES
#define PS_GEMM_X_BYTES (192 * 1024) /* rows of x per chunk (below) */
#endif
/* Each k step asks for the panel's line(s) PS_GEMM_PF steps ahead into L1 (hint 3). Zen 3
 * EPYC, 2 threads, 30 layers of cold bench-model weights: 8 / 16 / 48 rows 38 / 55 / 100
 * GFLOP/s with 16 steps, 32 / 49 / 84 without, 33 / 52 / 87 with 32 steps into L2. */
#ifndef PS_GEMM_PF
#define PS_GEMM_PF 16
#endif
#ifndef PS_GEMM_PFL
#define PS_GEMM_PFL 3
#endif
/* While a block of panels is multiplied by its row tiles, the thread's next block is asked into
 * L2, a few lines at each k step spread evenly over all the block's tiles (``ps_gemm_ahead``).
 * Why: only the first row tile of a block reads it from memory (the rest find it in L2), so
 * without this the weight stream ran in bursts during a sixth of a 64-row call and the core
 * sat on misses meanwhile; with the requests spread, the stream overlaps the other tiles'
 * multiply-adds. Intel Xeon (AVX-512, 2 threads), each layer's weights after an 80 MB read
 * (from its 480 MB L3): 48-128 rows 1.09-1.16x, 16 rows 1.04-1.09x, bit-identical; the engine
 * 1.03-1.06x. Only for calls of up to PS_GEMM_NEXT_ROWS rows: at 2048 rows (x in chunks of
 * tens of rows, each going over all the weights, which the hardware streams well from L3) the
 * requests cost 4-5%. 0 switches it off. */
#ifndef PS_GEMM_NEXT
#define PS_GEMM_NEXT 1
#endif
#ifndef PS_GEMM_NEXT_ROWS
#define PS_GEMM_NEXT_ROWS 256
#endif
/* The requests fall due per run of PS_GEMM_KB k steps and go out together before the run,
 * instead of a check (and a loop of up to a few requests) at every k step inside it. Why: in
 * tiles of one or two per block (decode steps of up to ~24 rows) a thread's share is a line or
 * more per k step, and the per-step loop kept the k loop from being one unrolled body. Zen 4
 * EPYC, 2 threads, bit-identical (bench/README.md, a thirty-sixth session): hot products at 4
 * rows 1.22-1.28x, 16 rows 1.11-1.18x, 24-48 rows 0.96-1.01x; 30 cold SmolLM2 layers at 16
 * rows 1.07x, 8 and 48 rows 0.99x. Runs of 8 keep a burst near 8 lines at one line a step. */
#ifndef PS_GEMM_KB
#define PS_GEMM_KB 8
#endif

/* The next block's lines still to request, from ``p``: ``inc`` more fall due at every k step
 * of the current block's tiles (16.16 fixed point, so a run of PS_GEMM_KB steps costs a
 * multiply-add and a compare). */
typedef struct {
    const char *p;
    int64_t left;      /* lines not yet requested */
    uint64_t due, inc; /* lines due and not yet requested, and per k step (16.16) */
} ps_gemm_ahead;

int ps_gemm_panel_width(void) { return PS_GEMM_NR; }

/* Where a GLU call (ps_gemm_f32_glu, below) puts a tile's silu(gate) * up: its rows ldo floats
 * apart (the tile's first row and the panel's first output column); ``up``: how far the up
 * rows' biases lie past the gate rows' (the intermediate size). */
typedef struct {
    float *out;
    int64_t ldo, up;
} ps_gemm_glu;

/* *p in every lane, loaded by the broadcast itself (ps_wsplat's scalar add and register
 * shuffle took issue slots the multiply-adds need) */
static inline vwsf ps_wbcast(const float *p) {
    const float v = *p;
#if PS_WIDE_LANES == 16
    return (vwsf){v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v};
#else
    return (vwsf){v, v, v, v, v, v, v, v};
#endif
}

/* The weight kinds of a tile (ps_gemm_tile's ``bf16``): 0 float32, 1 bfloat16 pairs, this one
 * int8 quads (ps_gemm_i8). */
#define PS_GEMM_I8 2
/* int8 weights have a scale per column per group of this many k steps: one run of PS_GEMM_KB
 * 4-step elements, so a tile loads a group's scales once per run (ps_gemm_tile). */
#define PS_GEMM_I8_GROUP (4 * PS_GEMM_KB)
/* what kernels/gemm.py's quantize_int8 must group by (checked when the library loads) */
int ps_gemm_i8_group(void) { return PS_GEMM_I8_GROUP; }

/* PS_WIDE_LANES int8 weights widened to float32 (vpmovsxbd, vcvtdq2ps). Intrinsics where the
 * build has them: GCC 12 compiled __builtin_convertvector from int8 lanes (directly to float,
 * or to int32 first) into a scalar sign extension and insert per lane. */
#if defined(__AVX512F__) && PS_WIDE_LANES == 16
#include <immintrin.h>
static inline vwsf ps_i8_load(const int8_t *p) {
    return (vwsf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__) && PS_WIDE_LANES == 8
#include <immintrin.h>
static inline vwsf ps_i8_load(const int8_t *p) {
    return (vwsf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
typedef int8_t vwsb __attribute__((vector_size(PS_WIDE_LANES), aligned(1)));
static inline vwsf ps_i8_load(const int8_t *p) {
    return __builtin_convertvector(__builtin_convertvector(*(const vwsb *)p, vwsi), vwsf);
}
#endif

/* bfloat16 products where the build has AVX512-BF16 with 16-float vectors (ps_gemm_bf16) */
#if PS_WIDE_LANES == 16 && defined(__AVX512BF16__)
#define PS_GEMM_HAS_BF16 1
#include <immintrin.h>
#else
#define PS_GEMM_HAS_BF16 0
#endif

/* silu(gate) * up of a GLU tile's rows (ps_gemm_f32_glu): ``ncols`` outputs of each row to
 * glu->out. Out of line and without FMA contraction (the rest of this file contracts): the
 * same arithmetic, rounding for rounding, as ps_silu_mul_f32 in fused_ops.c (built with
 * -ffp-contract=off), so the fused product gives the bits the two passes gave. */
__attribute__((noinline, optimize("fp-contract=off"))) static void ps_gemm_glu_store(
    const float (*sums)[PS_GEMM_NR], int mr, const ps_gemm_glu *glu, int64_t ncols) {
    for (int i = 0; i < mr; ++i) {
        const vwsf o = ps_wsilu(ps_wload(sums[i])) * ps_wload(sums[i] + PS_WIDE_LANES);
        float *dst = glu->out + i * glu->ldo;
        if (ncols == PS_WIDE_LANES) {
            ps_wstore(dst, o);
        } else {
            float tmp[PS_WIDE_LANES];
            ps_wstore(tmp, o);
            memcpy(dst, tmp, (size_t)ncols * sizeof(float));
        }
    }
}

/* k steps per iteration of the tile's loop. Why: with one step per iteration, the loop's own
 * adds, compare and branch (and, at 12 rows, row pointers reloaded from where they spilled) took
 * issue slots on the ports the multiply-adds need. Intel Xeon (AVX-512, 2 threads), float32,
 * 2048-row products of the bench model's and SmolLM2's shapes: 1.03-1.10x with 4 (0.87-0.95 of
 * MKL, from 0.80-0.86), 8 no better; 30 layers of cold SmolLM2 weights at 16-64 rows 1.03x; the
 * 8-float build without AVX-512 (16 registers) 1.04-1.10x at 16 rows, 0.98-1.20x at 2048. */
#ifndef PS_GEMM_UNROLL
#define PS_GEMM_UNROLL 4
#endif
#define PS_GEMM_PRAGMA(x) _Pragma(#x)
#define PS_GEMM_UNROLL_N(n) PS_GEMM_PRAGMA(GCC unroll n)
#define PS_GEMM_UNROLL_K PS_GEMM_UNROLL_N(PS_GEMM_UNROLL)

/* rows [0, mr) of x times one panel, into y (ncols <= NR valid columns). mr and bf16 are
 * constants at every call site (the switch below), so acc[][] lives in registers. With bf16,
 * each k step is a k pair: x's 4-byte element holds (x[k], x[k + 1]) in bfloat16, the panel's
 * step each column's (W[c][k], W[c][k + 1]), and vdpbf16ps adds both products per column.
 * nxt (also a constant): whether the loop carries the next block's requests (``ahead``); a
 * tile with none left is compiled without them, since at 12 rows their registers pushed row
 * pointers of x out to the stack and into vector registers, moves beside every k step's FMAs.
 * glu (NULL, or a GLU call's outputs: ps_gemm_f32_glu): the last k slice's sums (+ bias) go
 * out as silu(gate) * up, ncols outputs a row; earlier slices' partial sums to y as usual. */
static inline __attribute__((always_inline)) void ps_gemm_tile(
    const float *x, int64_t ldx, const float *wp, int64_t K, float *y, int64_t ldy,
    const int mr, const float *bias, const float *scale, int64_t ncols, int64_t k0, int64_t k1,
    ps_gemm_ahead *ahead, const int bf16, const int nxt, const ps_gemm_glu *glu) {
    vwsf acc[PS_GEMM_MR][PS_GEMM_NRV];
    const char *ahead_p = ahead->p; /* in locals: kept in registers across the k loop */
    int64_t ahead_left = ahead->left;
    uint64_t ahead_due = ahead->due;
    for (int i = 0; i < mr; ++i) /* a later k slice goes on from the sums stored in y */
        for (int j = 0; j < PS_GEMM_NRV; ++j)
            acc[i][j] = k0 == 0 ? ps_wsplat(0.0f) : ps_wload(y + i * ldy + j * PS_WIDE_LANES);
    const uint64_t ahead_inc = ahead->inc;
    for (int64_t kb = k0; kb < k1; kb += PS_GEMM_KB) { /* the k steps in runs of PS_GEMM_KB */
        const int64_t ke = kb + PS_GEMM_KB < k1 ? kb + PS_GEMM_KB : k1;
        vwsf sc[PS_GEMM_NRV]; /* int8: this run's group of scales (kb is a multiple of KB) */
        if (bf16 == PS_GEMM_I8)
            for (int j = 0; j < PS_GEMM_NRV; ++j)
                sc[j] = ps_wload(scale + kb / PS_GEMM_KB * PS_GEMM_NR + j * PS_WIDE_LANES);
#if PS_GEMM_NEXT
        if (nxt && ahead_left > 0) { /* the run's share of the next block's requests */
            ahead_due += ahead_inc * (uint64_t)(ke - kb);
            for (; ahead_due >= (1u << 16) && ahead_left > 0; ahead_due -= 1u << 16) {
                __builtin_prefetch(ahead_p, 0, 2); /* into L2 */
                ahead_p += 64;
                --ahead_left;
            }
        }
#endif
        PS_GEMM_UNROLL_K
        for (int64_t k = kb; k < ke; ++k) {
            vwsf w[PS_GEMM_NRV];
#if PS_GEMM_PF > 0
            for (int j = 0; j < PS_GEMM_NRV * PS_WIDE_LANES / 16; ++j)
                __builtin_prefetch(wp + (k + PS_GEMM_PF) * PS_GEMM_NR + 16 * j, 0, PS_GEMM_PFL);
#endif
            if (bf16 == PS_GEMM_I8) { /* 4 k steps of int8 panel rows (ps_gemm_i8) */
                const int8_t *wq = (const int8_t *)(wp + k * PS_GEMM_NR);
                for (int s = 0; s < 4; ++s) {
                    for (int j = 0; j < PS_GEMM_NRV; ++j) /* the weight as float32 holds it */
                        w[j] = ps_i8_load(wq + s * PS_GEMM_NR + j * PS_WIDE_LANES) * sc[j];
                    for (int i = 0; i < mr; ++i) {
                        const vwsf xb = ps_wbcast(x + i * ldx + 4 * k + s);
                        for (int j = 0; j < PS_GEMM_NRV; ++j) acc[i][j] += xb * w[j];
                    }
                }
                continue;
            }
            for (int j = 0; j < PS_GEMM_NRV; ++j)
                w[j] = ps_wload(wp + k * PS_GEMM_NR + j * PS_WIDE_LANES);
            for (int i = 0; i < mr; ++i) {
                const vwsf xb = ps_wbcast(x + i * ldx + k);
#if PS_GEMM_HAS_BF16
                if (bf16 == 1) {
                    for (int j = 0; j < PS_GEMM_NRV; ++j)
                        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xb, (__m512bh)w[j]);
                    continue;
                }
#endif
                for (int j = 0; j < PS_GEMM_NRV; ++j) acc[i][j] += xb * w[j];
            }
        }
    }
    (void)bf16;
    ahead->p = ahead_p;
    ahead->left = ahead_left;
    ahead->due = ahead_due;
    if (bias && k1 == K) {
        float bpad[PS_GEMM_NR] = {0};
        if (glu) { /* the panel's gate biases, then its up biases (ncols of each) */
            memcpy(bpad, bias, (size_t)ncols * sizeof(float));
            memcpy(bpad + PS_WIDE_LANES, bias + glu->up, (size_t)ncols * sizeof(float));
            bias = bpad;
        } else if (ncols < PS_GEMM_NR) { /* the last panel: no reads past the bias's end */
            memcpy(bpad, bias, (size_t)ncols * sizeof(float));
            bias = bpad;
        }
        vwsf b[PS_GEMM_NRV];
        for (int j = 0; j < PS_GEMM_NRV; ++j) b[j] = ps_wload(bias + j * PS_WIDE_LANES);
        for (int i = 0; i < mr; ++i)
            for (int j = 0; j < PS_GEMM_NRV; ++j) acc[i][j] += b[j];
    }
    if (glu && k1 == K) { /* silu(gate) * up: ncols of the panel's outputs to glu->out */
        float sums[PS_GEMM_MR][PS_GEMM_NR] __attribute__((aligned(64)));
        for (int i = 0; i < mr; ++i)
            for (int j = 0; j < PS_GEMM_NRV; ++j) ps_wstore(sums[i] + j * PS_WIDE_LANES, acc[i][j]);
        ps_gemm_glu_store(sums, mr, glu, ncols);
        return;
    }
    if (glu || ncols == PS_GEMM_NR) { /* a GLU call's partial sums: whole panels wide */
        for (int i = 0; i < mr; ++i)
            for (int j = 0; j < PS_GEMM_NRV; ++j) ps_wstore(y + i * ldy + j * PS_WIDE_LANES, acc[i][j]);
        return;
    }
    for (int i = 0; i < mr; ++i) { /* the last panel of an N that is not a multiple of NR */
        float tmp[PS_GEMM_NR];
        for (int j = 0; j < PS_GEMM_NRV; ++j) ps_wstore(tmp + j * PS_WIDE_LANES, acc[i][j]);
        memcpy(y + i * ldy, tmp, (size_t)ncols * sizeof(float));
    }
}

static inline __attribute__((always_inline)) void ps_gemm_rows_of(
    const float *x, int64_t ldx, const float *wp, int64_t K, float *y, int64_t ldy, int64_t mr,
    const float *bias, const float *scale, int64_t ncols, int64_t k0, int64_t k1,
    ps_gemm_ahead *ahead, const int bf16, const int is_glu, const ps_gemm_glu *glu) {
    const int nxt = ahead->left > 0; /* lines still to request (ps_gemm_tile's nxt) */
    switch (mr) {
#define PS_GEMM_CASE(n) \
    case n:                                                                                \
        if (is_glu && nxt)                                                                 \
            ps_gemm_tile(x, ldx, wp, K, y, ldy, n, bias, 0, ncols, k0, k1, ahead, 0, 1, glu); \
        else if (is_glu)                                                                   \
            ps_gemm_tile(x, ldx, wp, K, y, ldy, n, bias, 0, ncols, k0, k1, ahead, 0, 0, glu); \
        else if (nxt)                                                                      \
            ps_gemm_tile(x, ldx, wp, K, y, ldy, n, bias, scale, ncols, k0, k1, ahead, bf16, 1, 0);\
        else ps_gemm_tile(x, ldx, wp, K, y, ldy, n, bias, scale, ncols, k0, k1, ahead, bf16, 0, 0); \
        break;
        PS_GEMM_CASE(1) PS_GEMM_CASE(2) PS_GEMM_CASE(3) PS_GEMM_CASE(4) PS_GEMM_CASE(5)
        PS_GEMM_CASE(6)
#if PS_GEMM_MR > 6
        PS_GEMM_CASE(7) PS_GEMM_CASE(8) PS_GEMM_CASE(9) PS_GEMM_CASE(10) PS_GEMM_CASE(11)
        PS_GEMM_CASE(12)
#endif
#undef PS_GEMM_CASE
    default: break;
    }
}

static void ps_gemm_rows(const float *x, int64_t ldx, const float *wp, int64_t K, float *y,
                         int64_t ldy, int64_t mr, const float *bias, int64_t ncols, int64_t k0,
                         int64_t k1, ps_gemm_ahead *ahead) {
    ps_gemm_rows_of(x, ldx, wp, K, y, ldy, mr, bias, 0, ncols, k0, k1, ahead, 0, 0, 0);
}

/* The same with a GLU call's epilogue (ps_gemm_f32_glu), in a function of its own: with both
 * in one, the plain products ran 7-8% slower at 2048 rows (bench model down, SmolLM2 qkv). */
static void ps_gemm_rows_glu(const float *x, int64_t ldx, const float *wp, int64_t K, float *y,
                             int64_t ldy, int64_t mr, const float *bias, int64_t ncols,
                             int64_t k0, int64_t k1, ps_gemm_ahead *ahead,
                             const ps_gemm_glu *glu) {
    ps_gemm_rows_of(x, ldx, wp, K, y, ldy, mr, bias, 0, ncols, k0, k1, ahead, 0, 1, glu);
}

/* bfloat16 panels (ps_gemm_bf16, below): both layouts step 4-byte elements of x and
 * PS_GEMM_NR x 4 bytes of panel per k step, so the blocking below serves both. */
static void ps_gemm_bf16_rows(const float *x, int64_t ldx, const float *wp, int64_t K, float *y,
                              int64_t ldy, int64_t mr, const float *bias, int64_t ncols,
                              int64_t k0, int64_t k1, ps_gemm_ahead *ahead) {
    ps_gemm_rows_of(x, ldx, wp, K, y, ldy, mr, bias, 0, ncols, k0, k1, ahead, 1, 0, 0);
}

/* int8 panels (ps_gemm_i8, below): a 4-byte element of the panel holds 4 k steps of a column,
 * so the blocking steps K / 4 elements as it steps bfloat16's K / 2; x stays float32 (ldx and
 * its k index in floats). ``scale``: the panel's scales (NR floats per group of k steps). */
static void ps_gemm_i8_rows(const float *x, int64_t ldx, const float *wp, int64_t K, float *y,
                            int64_t ldy, int64_t mr, const float *bias, const float *scale,
                            int64_t ncols, int64_t k0, int64_t k1, ps_gemm_ahead *ahead) {
    ps_gemm_rows_of(x, ldx, wp, K, y, ldy, mr, bias, scale, ncols, k0, k1, ahead, PS_GEMM_I8, 0,
                    0);
}

/* The k slice of a call: all of K up to PS_GEMM_KC_MAX (every product of the models measured
 * here), else PS_GEMM_KC at a time, so that a row chunk of x (below) stays tens of rows high
 * for a long K (Qwen2-0.5B's down projection: K 4864) instead of a tile or two. A later slice
 * goes on from the partial sums stored in y: the same additions in the same order, so the
 * result does not change (checked bit for bit). Zen 3, 2 threads, 2048 rows: 2048 x 2048 x
 * 2048 100 -> 127 GFLOP/s, K 4864 -> 896 92 -> 125 (oneDNN 132 / 129). */
#ifndef PS_GEMM_KC_MAX
#define PS_GEMM_KC_MAX 1536
#endif
#ifndef PS_GEMM_KC
#define PS_GEMM_KC 512
#endif
/* Decode-sized calls (up to 64 rows) keep one pass where their x fits half the L2, as it does
 * for every K up to PS_GEMM_KC_MAX; ``f32``: a float32 call (x and panels), which otherwise
 * slices too. Why: past half the L2 (Qwen2-0.5B's down product, K 4864: 32 rows are 622 KB)
 * the row chunks (ps_gemm_panels) fell to one tile of 12 rows, and each chunk walked all the
 * thread's weights, 3-6 times a call; in k slices of PS_GEMM_KC all the rows are one chunk.
 * The slices carry partial sums in y (the same additions in the same order: the same bits).
 * Zen 5 EPYC, 2 threads, bit-identical: the down product hot at 32 / 48 / 64 rows 1.12x; 24
 * layers of Qwen2-0.5B's four products from memory 1.08x at each (bench/README.md, a
 * forty-ninth session); 16 rows (311 KB) keep one pass. */
static int64_t ps_gemm_l2_bytes(void);
static inline int64_t ps_gemm_kc(int64_t M, int64_t K, int f32) {
    if (K <= PS_GEMM_KC_MAX) return K;
    if (M > 64) return PS_GEMM_KC;
    const int fits = M * K * (int64_t)sizeof(float) <= ps_gemm_l2_bytes() / 2;
    return fits || !f32 ? K : PS_GEMM_KC;
}

/* The requests for the block after panels [b0, b1) of a thread's [p0, p1): its panels spread
 * over the k steps of all the current block's tiles; with ``wrap`` (another row chunk
 * follows) the range's first block comes after its last. */
static ps_gemm_ahead ps_gemm_next_block(const float *wp, int64_t K, int64_t b0, int64_t b1,
                                        int64_t p0, int64_t p1, int64_t per_block, int64_t tiles,
                                        int wrap) {
    ps_gemm_ahead a = {0, 0, 0, 0};
    const int64_t n0 = b1 < p1 ? b1 : wrap ? p0 : p1;
    const int64_t n1 = n0 + per_block < p1 ? n0 + per_block : p1;
    const int64_t steps = tiles * (b1 - b0) * K; /* > 0: M, K and the block are not empty */
    if (n1 <= n0 || n0 == b0) return a; /* nothing next, or a wrap onto this block itself */
    a.p = (const char *)(wp + n0 * K * PS_GEMM_NR);
    a.left = (n1 - n0) * K * PS_GEMM_NR * (int64_t)sizeof(float) / 64;
    a.inc = (((uint64_t)a.left << 16) + (uint64_t)steps - 1) / (uint64_t)steps;
    return a;
}

/* int8 calls of more than this many rows multiply float32 panels: each block of int8 panels is
 * widened and scaled once into a scratch of float32 panels (ps_gemm_i8_widen), which every
 * row tile then multiplies on the float32 path (ps_gemm_block_rows' ``wide``). Why: widening
 * in the tile (ps_gemm_tile) costs a sign extension, a convert and a multiply per panel vector
 * at every k step of every tile, ~a quarter of a full tile's work: at prefill sizes the
 * products ran 0.68-0.82x float32's rate (Xeon, SmolLM2 shapes, 128-2048 rows). Widened once
 * per block for all the tiles of a row chunk (PS_GEMM_I8_X_BYTES), the cost is shared by 17-45
 * tiles at SmolLM2's shapes. The values are the same (the same widening and scaling, then the
 * same sums in the same order): bit for bit the tile's own int8 path. Calls of up to 32 rows
 * keep widening in the tile: with 1-3 tiles a block the scratch's stores and re-reads cost as
 * much as they save. No requests for the next block there (the float32 path makes them up to
 * PS_GEMM_NEXT_ROWS rows): the widening reads each block in order, as the prefetchers follow. */
#ifndef PS_GEMM_I8_WIDEN_ROWS
#define PS_GEMM_I8_WIDEN_ROWS 32
#endif
/* Bytes of x per row chunk there (0: half the L2, at least PS_GEMM_X_BYTES): taller chunks
 * than the float32 path's, so that more tiles share each widening (SmolLM2's down projection,
 * K 1536: 30-row chunks ran 0.79-0.81x float32, 160-row ones 0.93-1.07x; Xeon, 2 MB L2). */
#ifndef PS_GEMM_I8_X_BYTES
#define PS_GEMM_I8_X_BYTES 0
#endif

/* A scratch of ``floats`` floats for this thread, 64-byte aligned, kept for the thread's next
 * calls (grown when too small) and freed when the thread ends (a thread-specific key's
 * destructor: without it each ended thread that had called left its scratch behind, ~1.8 MB a
 * thread at K 4864); NULL if it cannot be had (the caller then widens in the tiles). */
typedef struct {
    float *buf;
    int64_t cap;
} ps_gemm_scratch_t;
static pthread_key_t ps_gemm_scratch_key;
static int ps_gemm_scratch_ok;
static pthread_once_t ps_gemm_scratch_once = PTHREAD_ONCE_INIT;
static void ps_gemm_scratch_free(void *p) {
    ps_gemm_scratch_t *s = p;
    free(s->buf);
    free(s);
}
static void ps_gemm_scratch_init(void) {
    ps_gemm_scratch_ok = pthread_key_create(&ps_gemm_scratch_key, ps_gemm_scratch_free) == 0;
}
static float *ps_gemm_scratch(int64_t floats) {
    pthread_once(&ps_gemm_scratch_once, ps_gemm_scratch_init);
    if (!ps_gemm_scratch_ok) return 0;
    ps_gemm_scratch_t *s = pthread_getspecific(ps_gemm_scratch_key);
    if (!s) {
        s = calloc(1, sizeof *s);
        if (!s || pthread_setspecific(ps_gemm_scratch_key, s)) {
            free(s);
            return 0;
        }
    }
    if (floats <= s->cap) return s->buf;
    free(s->buf);
    const int64_t bytes = (floats * (int64_t)sizeof(float) + 63) / 64 * 64;
    s->buf = aligned_alloc(64, (size_t)bytes);
    s->cap = s->buf ? floats : 0;
    return s->buf;
}

/* Int8 panel p's elements [e0, e1) (4 k steps each) as float32 panel rows 4 e0 .. 4 e1 - 1 of
 * dst (a float32 panel of the same K: dst[k][c]), each weight widened and scaled exactly as
 * ps_gemm_tile's int8 path does. K4: the panel's elements; scale: the panels' scales. */
static void ps_gemm_i8_widen(const float *wp, const float *scale, int64_t K4, int64_t p,
                             int64_t e0, int64_t e1, float *dst) {
    const int8_t *wq = (const int8_t *)(wp + p * K4 * PS_GEMM_NR);
    const float *st = scale + p * ((K4 + PS_GEMM_KB - 1) / PS_GEMM_KB) * PS_GEMM_NR;
    for (int64_t e = e0; e < e1; ++e) {
        vwsf sc[PS_GEMM_NRV];
        for (int j = 0; j < PS_GEMM_NRV; ++j)
            sc[j] = ps_wload(st + e / PS_GEMM_KB * PS_GEMM_NR + j * PS_WIDE_LANES);
        for (int s = 0; s < 4; ++s)
            for (int j = 0; j < PS_GEMM_NRV; ++j)
                ps_wstore(dst + (4 * e + s) * PS_GEMM_NR + j * PS_WIDE_LANES,
                          ps_i8_load(wq + (4 * e + s) * PS_GEMM_NR + j * PS_WIDE_LANES) * sc[j]);
    }
}

/* Bytes of a cache level (sysconf's _SC_LEVEL2_CACHE_SIZE, ...; 0 where the C library cannot
 * tell), looked up once into *cached (every thread finds the same value: a benign race). */
static int64_t ps_gemm_cache_bytes(int64_t *cached, int name) {
    if (*cached < 0) {
        const long s = sysconf(name);
        *cached = s > 0 ? s : 0;
    }
    return *cached;
}

/* Bytes of this core's L2 (0 where the C library cannot tell). */
static int64_t ps_gemm_l2_bytes(void) {
    static int64_t bytes = -1;
    return ps_gemm_cache_bytes(&bytes, _SC_LEVEL2_CACHE_SIZE);
}

/* Bytes of weight panels per block: PS_GEMM_BLOCK_BYTES, or in calls of more than
 * PS_GEMM_NEXT_ROWS rows (prefill chunks) PS_GEMM_BLOCK_BIG_BYTES (0: a quarter of the L2, at
 * least PS_GEMM_BLOCK_BYTES). ``widened``: an int8 call's float32 blocks (ps_gemm_i8_widen)
 * keep the small size: their scratch lies in L2 beside x chunks of half of it.
 * Why: at 192 KB a block held 2 panels of a K of 576 (SmolLM2), so each row tile of x went
 * from L1 back to L2 after every 2 panels, and the x chunk was re-read from L2 for every 2;
 * with 512 KB of a 2 MB L2 (beside the 192 KB x chunk) each tile stays for 6. Intel Xeon
 * (2 MB L2, 2 threads; bench.gemm_ab, 15 rounds, bit-identical): 2048-row products
 * 1.00-1.06x (gate/up 1.05-1.06x), 512 rows 1.01-1.03x; decode-sized calls keep 192 KB
 * (with 512 KB their next-block requests ran 30 cold SmolLM2 layers at 16 / 48 rows 0.94 /
 * 0.96x). A quarter, not a fixed size: on a 512 KB L2 (Zen 3) it is the 192 KB of before. */
#ifndef PS_GEMM_BLOCK_BIG_BYTES
#define PS_GEMM_BLOCK_BIG_BYTES 0
#endif
static inline int64_t ps_gemm_block_bytes(int64_t M, int widened) {
    if (M <= PS_GEMM_NEXT_ROWS || widened) return PS_GEMM_BLOCK_BYTES;
    const int64_t b = PS_GEMM_BLOCK_BIG_BYTES ? PS_GEMM_BLOCK_BIG_BYTES : ps_gemm_l2_bytes() / 4;
    return b > PS_GEMM_BLOCK_BYTES ? b : PS_GEMM_BLOCK_BYTES;
}

/* Panels per block: a k slice of kc elements of each fits ``bytes`` (at least 1). */
static inline int64_t ps_gemm_per_block(int64_t kc, int64_t bytes) {
    const int64_t n = bytes / (kc * PS_GEMM_NR * (int64_t)sizeof(float));
    return n < 1 ? 1 : n;
}

/* Rows [0, M) times panels [p0, p1) over k slices of kc: blocks of per_block panels (their
 * slice fits ps_gemm_block_bytes), each read from memory once per slice and reused from L2 by
 * every row tile. The last panel of an N that is not a multiple of NR has no room for partial
 * sums in y: it runs the whole K in the first slice. ``next``: 0 no requests ahead, 1 the next
 * block, 2 also the first block after the last. ``glu`` (NULL: none): a GLU call's outputs
 * (ps_gemm_f32_glu; N is then its outputs, y its partial sums, whole panels wide). ``wide``
 * (NULL: none): wp holds int8 panels (with ``scale``) and K, kc count floats; each block's
 * slice is widened into ``wide`` (ps_gemm_i8_widen: per_block float32 panels of K rows) and
 * the float32 tiles (bf16 0) multiply that. */
static void ps_gemm_block_rows(const float *x, int64_t M, int64_t K, int64_t ldx,
                               const float *wp, int64_t N, const float *bias,
                               const float *scale, float *y, int64_t ldy, int64_t p0, int64_t p1,
                               int64_t kc, int64_t per_block, int next, int bf16,
                               const ps_gemm_glu *glu, int64_t mr_max, float *wide) {
    const int64_t panel_floats = K * PS_GEMM_NR;
    /* row tiles of near-equal height (20 rows: 5 + 5 + 5 + 5, not 6 + 6 + 6 + 2): a tile of
     * 1-2 rows has too few independent sums to hide the multiply-add's latency */
    const int64_t tiles = (M + mr_max - 1) / mr_max;
    for (int64_t b0 = p0; b0 < p1; b0 += per_block) {
        const int64_t b1 = b0 + per_block < p1 ? b0 + per_block : p1;
        /* one k slice (every decode-sized call): the next block is contiguous in wp */
        ps_gemm_ahead ahead = {0, 0, 0, 0};
        if (next && kc == K)
            ahead = ps_gemm_next_block(wp, K, b0, b1, p0, p1, per_block, tiles, next == 2);
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
            const int64_t k1 = k0 + kc < K ? k0 + kc : K;
            for (int64_t p = b0; wide && p < b1; ++p) { /* the whole last panel at k0 == 0 */
                const int whole = N - p * PS_GEMM_NR < PS_GEMM_NR;
                if (whole && k0 > 0) continue;
                ps_gemm_i8_widen(wp, scale, K / 4, p, whole ? 0 : k0 / 4, whole ? K / 4 : k1 / 4,
                                 wide + (p - b0) * panel_floats);
            }
            for (int64_t ti = 0, m0 = 0; ti < tiles; ++ti) {
                const int64_t mr = M / tiles + (ti < M % tiles);
                for (int64_t p = b0; p < b1; ++p) {
                    const int64_t c0 = p * PS_GEMM_NR;
                    /* a GLU panel: PS_WIDE_LANES outputs (gate and up columns side by side) */
                    const int64_t cw = glu ? PS_WIDE_LANES : PS_GEMM_NR, o0 = p * cw;
                    const int64_t ncols = N - o0 < cw ? N - o0 : cw;
                    const int whole = !glu && ncols < PS_GEMM_NR;
                    if (whole && k0 > 0) continue;
                    /* a direct call each (the float32 one inlined here, as before) */
                    const float *xt = x + m0 * ldx;
                    const float *wt =
                        wide ? wide + (p - b0) * panel_floats : wp + p * panel_floats;
                    const int64_t kt = whole ? K : k1;
                    float *yt = y ? y + m0 * ldy + c0 : 0;
                    const float *bt = bias ? bias + (glu ? o0 : c0) : 0;
                    if (bf16 == PS_GEMM_I8) {
                        /* the panel's scales: a group per PS_GEMM_KB elements of K */
                        const int64_t groups = (K + PS_GEMM_KB - 1) / PS_GEMM_KB;
                        const float *st = scale + p * groups * PS_GEMM_NR;
                        ps_gemm_i8_rows(xt, ldx, wt, K, yt, ldy, mr, bt, st, ncols, k0, kt,
                                        &ahead);
                    } else if (PS_GEMM_HAS_BF16 && bf16) {
                        ps_gemm_bf16_rows(xt, ldx, wt, K, yt, ldy, mr, bt, ncols, k0, kt, &ahead);
                    } else if (glu) {
                        const ps_gemm_glu g = {glu->out + m0 * glu->ldo + o0, glu->ldo, glu->up};
                        ps_gemm_rows_glu(xt, ldx, wt, K, yt, ldy, mr, bt, ncols, k0, kt, &ahead,
                                         &g);
                    } else {
                        ps_gemm_rows(xt, ldx, wt, K, yt, ldy, mr, bt, ncols, k0, kt, &ahead);
                    }
                }
                m0 += mr;
            }
        }
    }
}

/* Rows in chunks whose k slice of x fits PS_GEMM_X_BYTES beside the weight block (a 2048-row
 * prefill's x is megabytes: re-read from L3 for every weight block it ran ~15% slower than
 * oneDNN); a call of up to PS_GEMM_ONE_PASS_ROWS rows whose x fits half the L2 goes in one
 * chunk. Why: each chunk walks all of the thread's panels, so a decode step of 33-128 rows cut
 * into 32-row chunks (K 1536: the down projections) read its weights 2-4 times, from memory
 * once they are cold. */
#ifndef PS_GEMM_ONE_PASS_ROWS
#define PS_GEMM_ONE_PASS_ROWS 128
#endif
/* Calls of more than PS_GEMM_NEXT_ROWS rows take the thread's panels in runs of at most this
 * many bytes (0: no runs), every row chunk of x over one run before the next run starts.
 * Why: each row chunk walks all the panels it is given, so a thread's share of a weight
 * larger than what the L3 keeps was read from memory once per chunk (Qwen2-0.5B's gate/up,
 * 35 MB, past a 32 MB L3 shared with the other tenants' cores: 41 chunks of 50 rows at 2048
 * rows); in runs that the L3 keeps, each weight comes from memory once a call and x (megabytes
 * at most, read in order) once a run. The sums are the same, in the same order. Zen 4 EPYC
 * (1 MB L2, 32 MB L3), 2 threads, 2048 rows, bit-identical (bench/README.md, a fifty-fourth
 * session): Qwen2-0.5B's gate/up (with SwiGLU) 1.08x (bench.gemm_ab, 7 rounds; control
 * 1.03x), 1.09-1.10x with 2-4 MB runs in a throwaway sweep (8 MB 1.03x), its down 1.01-1.09x;
 * the Qwen2-0.5B shape's engine on `mixed` 1.06x. The bench model's and SmolLM2's products
 * (under 4 MB a thread) take one run, as before. */
#ifndef PS_GEMM_RUN_BYTES
#define PS_GEMM_RUN_BYTES (4 << 20)
#endif
/* A run's bytes for a team of ``team`` threads: PS_GEMM_RUN_BYTES, or less where the team's
 * runs would fill over half the L3 (PS_GEMM_RUN_BYTES where the L3's size is unknown). */
static int64_t ps_gemm_run_bytes(int64_t team) {
    static int64_t bytes = -1;
    const int64_t l3 = ps_gemm_cache_bytes(&bytes, _SC_LEVEL3_CACHE_SIZE);
    const int64_t share = l3 > 0 && team > 0 ? l3 / (2 * team) : PS_GEMM_RUN_BYTES;
    return share < PS_GEMM_RUN_BYTES ? share : PS_GEMM_RUN_BYTES;
}
static void ps_gemm_panels(const float *x, int64_t M, int64_t K, int64_t ldx, const float *wp,
                           int64_t N, const float *bias, const float *scale, float *y,
                           int64_t ldy, int64_t p0, int64_t p1, int bf16,
                           const ps_gemm_glu *glu, int64_t team) {
    /* bytes of one panel as stored (int8 panels: K counts 4-byte elements, as here) */
    const int64_t panel_bytes = K * PS_GEMM_NR * (int64_t)sizeof(float);
    float *wide = 0; /* int8 past PS_GEMM_I8_WIDEN_ROWS rows: float32 panels from here on */
    int64_t x_bytes = PS_GEMM_X_BYTES;
    if (bf16 == PS_GEMM_I8 && M > PS_GEMM_I8_WIDEN_ROWS) {
        const int64_t n =
            ps_gemm_per_block(ps_gemm_kc(M, 4 * K, 0), ps_gemm_block_bytes(M, 1));
        wide = ps_gemm_scratch(n * 4 * K * PS_GEMM_NR);
        if (wide) { /* else (no memory) the tiles widen */
            K *= 4;
            bf16 = 0;
            x_bytes = PS_GEMM_I8_X_BYTES ? PS_GEMM_I8_X_BYTES : ps_gemm_l2_bytes() / 2;
            if (x_bytes < PS_GEMM_X_BYTES) x_bytes = PS_GEMM_X_BYTES;
        }
    }
    const int64_t kc = ps_gemm_kc(M, K, !bf16 && !wide);
    const int64_t per_block = ps_gemm_per_block(kc, ps_gemm_block_bytes(M, wide != 0));
    const int ahead = PS_GEMM_NEXT && M <= PS_GEMM_NEXT_ROWS && !wide;
    const int64_t mr_max = M <= PS_GEMM_NEXT_ROWS ? PS_GEMM_MR : PS_GEMM_MR_BIG;
    /* bytes of x per element step: int8 panels step 4 float32 values of x at a time */
    const int64_t xstep = (int64_t)sizeof(float) * (bf16 == PS_GEMM_I8 ? 4 : 1);
    int64_t chunk = x_bytes / (kc * xstep) / mr_max * mr_max;
    if (chunk < mr_max) chunk = mr_max;
    if (M <= PS_GEMM_ONE_PASS_ROWS && M * kc * xstep <= ps_gemm_l2_bytes() / 2)
        chunk = M;
    /* runs of whole blocks (PS_GEMM_RUN_BYTES); one run where there are no chunks to share */
    int64_t run = p1 - p0;
    if (PS_GEMM_RUN_BYTES > 0 && M > PS_GEMM_NEXT_ROWS && chunk < M) {
        const int64_t blocks = ps_gemm_run_bytes(team) / (per_block * panel_bytes);
        run = (blocks > 1 ? blocks : 1) * per_block;
    }
    for (int64_t q0 = p0; q0 < p1; q0 += run) {
        const int64_t q1 = q0 + run < p1 ? q0 + run : p1;
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t mc = M - m0 < chunk ? M - m0 : chunk;
            const ps_gemm_glu g =
                glu ? (ps_gemm_glu){glu->out + m0 * glu->ldo, glu->ldo, glu->up}
                    : (ps_gemm_glu){0, 0, 0};
            ps_gemm_block_rows(x + m0 * ldx, mc, K, ldx, wp, N, bias, scale,
                               y ? y + m0 * ldy : 0, ldy, q0, q1, kc, per_block,
                               ahead ? (m0 + mc < M ? 2 : 1) : 0, bf16, glu ? &g : 0, mr_max,
                               wide);
        }
    }
}

/* Threads for ``panels`` panels: at least 1, at most one per panel. */
static inline int32_t ps_gemm_team_size(int32_t threads, int64_t panels) {
    if (threads < 1) threads = 1;
    return threads > panels ? (int32_t)panels : threads;
}

/* This thread's index in its OpenMP team and the team's size (0 and 1 without OpenMP). */
static inline void ps_gemm_member(int64_t *t, int64_t *nt) {
#ifdef _OPENMP
    *t = omp_get_thread_num();
    *nt = omp_get_num_threads();
#else
    *t = 0;
    *nt = 1;
#endif
}

/* Each thread takes a contiguous run of panels (the weights are read once in all). */
static void ps_gemm_threads(const float *x, int64_t M, int64_t K, int64_t ldx, const float *wp,
                            int64_t N, const float *bias, const float *scale, float *y,
                            int64_t ldy, int32_t threads, int bf16, const ps_gemm_glu *glu) {
    const int64_t cw = glu ? PS_WIDE_LANES : PS_GEMM_NR; /* outputs per panel */
    const int64_t panels = (N + cw - 1) / cw;
    if (M <= 0 || panels <= 0) return;
    threads = ps_gemm_team_size(threads, panels);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t t, nt;
        ps_gemm_member(&t, &nt);
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        ps_gemm_panels(x, M, K, ldx, wp, N, bias, scale, y, ldy, p0, p1, bf16, glu, nt);
    }
}

/* y = x @ W^T (+ bias). x: [M, K] rows ldx apart; wp: W packed (above), N columns; bias: NULL
 * or [N] floats; y: [M, N] rows ldy apart. */
void ps_gemm_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const float *wp, int64_t N,
                 const float *bias, float *y, int64_t ldy, int32_t threads) {
    ps_gemm_threads(x, M, K, ldx, wp, N, bias, 0, y, ldy, threads, 0, 0);
}

/*
 * A gated unit in one call (SwiGLU's first half): out = silu(x @ G^T + bg) * (x @ U^T + bu),
 * out [M, I] rows ldo apart, with G and U packed together (``NativeGemm.pack_glu``): panel p
 * holds gate rows [p * L, p * L + L) in its first L columns and the same rows of U in its last
 * L (L = PS_WIDE_LANES, so a tile's two vectors per row are one output vector's gate and up);
 * columns past I are zero. bias: NULL or [2I] floats, the gate rows' then the up rows'.
 *
 * Why: the fused gate/up product wrote [M, 2I] floats that the SwiGLU pass then read back to
 * write [M, I]: at a 2048-row prefill chunk 25-37 MB a layer each way for the bench model and
 * SmolLM2 (past the L2), and one more call a layer. Here each tile's sums go through the
 * activation while in registers. Each output is the same sum over k as in ps_gemm_f32, then
 * the fused pass's silu arithmetic without FMA contraction (ps_gemm_glu_store): the bits the
 * product and the fused pass gave.
 *
 * partial: NULL where ps_gemm_glu_partial(M, K) is 0, else [M, panels * 2L] floats for the
 * sums of a K too long for one slice (ps_gemm_kc), carried between slices as ps_gemm_f32 does
 * in y.
 */
int ps_gemm_glu_partial(int64_t M, int64_t K) { return ps_gemm_kc(M, K, 1) < K; }

void ps_gemm_f32_glu(const float *x, int64_t M, int64_t K, int64_t ldx, const float *wp,
                     int64_t I, const float *bias, float *out, int64_t ldo, float *partial,
                     int32_t threads) {
    const ps_gemm_glu g = {out, ldo, I};
    const int64_t ldp = (I + PS_WIDE_LANES - 1) / PS_WIDE_LANES * PS_GEMM_NR;
    ps_gemm_threads(x, M, K, ldx, wp, I, bias, 0, partial, ldp, threads, 0, &g);
}

/*
 * int8 weights (``--weight-dtype int8``): y = x @ (Q * S)^T (+ bias), each weight an int8 step
 * of its column's scale for its group of PS_GEMM_I8_GROUP k steps (W[n][k] ~ Q[n][k] *
 * S[n][k / 32]), x float32, every product and sum in float32 (weight-only: x is not quantized).
 *
 * Why: a decode step streams every weight from DRAM; at a few rows a step that stream is the
 * step's time, and int8 panels are ~0.28 of float32's bytes with their scales (~0.56 of
 * bfloat16's). In calls of up to 32 rows each k step widens the panel's int8 row to float32
 * in registers (a sign extension, a convert and a multiply by the group's scale per vector,
 * beside the tile's multiply-adds); past that each block of panels is widened once into
 * float32 panels that all the tiles of a row chunk multiply (PS_GEMM_I8_WIDEN_ROWS). Why a
 * scale per group of 32 and not per row: a row's few large weights coarsen all of it
 * (SmolLM2's projections: 0.89% relative RMS error with a scale per row, 0.52% per group of
 * 32; bfloat16 0.14%); a group's scale follows the weights' local range (GGUF's Q8_0 blocks are
 * 32 too).
 *
 * Layout: panels of NR columns (as float32's), wp[p][k][c] = Q[p * NR + c][k] as int8, K a
 * multiple of 4 (columns past N are zero): 4 k steps of a panel are NR 4-byte elements, so the
 * blocking and prefetching above run it as K / 4 steps of float32-sized elements, and only the
 * tile's body differs (4 sub-steps, each an int8 row of the panel times its scales against one
 * float of each row of x). scale[p][g][c] = S[p * NR + c][g], ceil(K / 32) groups (zeros past
 * N). Each weight is widened and scaled in float32 exactly as torch computes Q * S, and summed
 * over k in order as ps_gemm_f32 sums: the output is, bit for bit, the float32 product with
 * the weight Q * S (tests/test_kernels_gemm.py); independent of M, of the rows sharing a call
 * and of the thread count.
 */
void ps_gemm_i8(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *wp, int64_t N,
                const float *scale, const float *bias, float *y, int64_t ldy, int32_t threads) {
    ps_gemm_threads(x, M, K / 4, ldx, (const float *)wp, N, bias, scale, y, ldy, threads,
                    PS_GEMM_I8, 0);
}

/*
 * bfloat16 weights (``--weight-dtype bfloat16``), where the CPU has AVX512-BF16 (vdpbf16ps):
 * y = x @ W^T (+ bias) with x and W in bfloat16 (x rounded by the caller), products summed in
 * float32, bias added in float32.
 *
 * Why: a decode step streams every weight from DRAM; in bfloat16 that is half the bytes, and
 * oneDNN's bfloat16 kernels (what the mode used alone) ran the decode-sized products well below
 * the rate the halved stream allows (bench/README.md). Same blocking and prefetching as the
 * float32 path: an AVX-512 float32 panel's k step and a bfloat16 panel's k *pair* step are both
 * 32 columns x 4 bytes, so the code above runs it with K / 2 steps of 4-byte elements of x
 * (each a pair of bfloat16 values) and only the tile's multiply-add differs (ps_gemm_tile).
 *
 * Layout: panels of 32 columns, wp[p][k / 2][c][k % 2] = W[p * 32 + c][k] (K even; columns past
 * N are zero). Each k pair step loads two 16-lane vectors of column pairs and, per row,
 * broadcasts x's pair (x[k], x[k + 1]); vdpbf16ps adds both products to each column's sum.
 * Every output is one sum over the pairs in order, then + bias: independent of M, of the rows
 * sharing a call and of the thread count, as in float32.
 */
#if PS_GEMM_HAS_BF16
int ps_gemm_bf16_available(void) { return 1; }

/* x: [M, K] bfloat16 (uint16 bit patterns) rows ldx elements apart (ldx and K even); wp: the
 * packed bfloat16 weight (above); bias, y, ldy as in ps_gemm_f32. */
void ps_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp,
                  int64_t N, const float *bias, float *y, int64_t ldy, int32_t threads) {
    ps_gemm_threads((const float *)x, M, K / 2, ldx / 2, (const float *)wp, N, bias, 0, y, ldy,
                    threads, 1, 0);
}
#else
int ps_gemm_bf16_available(void) { return 0; }
void ps_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp,
                  int64_t N, const float *bias, float *y, int64_t ldy, int32_t threads) {
    (void)x, (void)M, (void)K, (void)ldx, (void)wp, (void)N, (void)bias, (void)y, (void)ldy,
        (void)threads;
}
#endif

/*
 * bfloat16 weights through AMX tiles (TDPBF16PS), where the CPU and the kernel allow them:
 * the same packed panels and the same y = x @ W^T (+ bias) as ps_gemm_bf16.
 *
 * Why: on a 2-core Intel Xeon with AMX, oneDNN's AMX kernels (what the mode used there) ran
 * SmolLM2's decode-sized products over cold weights at 10-12 GB/s of weights against the
 * machine's 22 GB/s read, and the vdpbf16ps path at ~200 GFLOP/s is compute-bound there. A
 * tile product reads a 16-pair x 16-column block of a panel straight from the packed layout
 * (two column halves of a 128-byte k-pair row, tileloadd with a 128-byte stride), so each
 * thread still walks its contiguous run of panels front to back once per call; the stream is
 * asked into L2 ahead of the tiles (ps_amx_pass).
 *
 * Tiles: tmm0-3 the sums of up to 32 rows x 32 columns (rows [0, 16) and [16, 32) of the row
 * group, column halves [0, 16) and [16, 32)); tmm4/5 the row group's x (16 rows x 32 k);
 * tmm6/7 the panel's two column halves (16 k pairs x 16 columns). K must be a multiple of 32
 * (the caller falls back to ps_gemm_bf16 otherwise). Rows go in groups of 32, all under one
 * configuration (every tile 16 rows): a last group of fewer rows multiplies x's zero rows
 * past M too (tile products are cheap beside the weights' stream) and stores only its own. A
 * tail group of its own configuration ran as a second pass over the weights: 48 rows took
 * longer than 64.
 *
 * Numerics: each output is the sum over k steps of 32 in order, each step one TDPBF16PS (its
 * 16 pairs in the hardware's order; bfloat16 denormals read as zero): independent of M, of the
 * rows sharing a call and of the thread count, as the other paths, though not bit-identical
 * to ps_gemm_bf16 (a different order within each step).
 */
#if PS_GEMM_HAS_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PS_GEMM_HAS_AMX 1
#include <sys/syscall.h>
#else
#define PS_GEMM_HAS_AMX 0
#endif

#if PS_GEMM_HAS_AMX
#ifndef PS_AMX_PF
#define PS_AMX_PF 4096 /* bytes of the panel stream asked ahead (into L2) */
#endif
#ifndef PS_AMX_X_BYTES
#define PS_AMX_X_BYTES (512 * 1024) /* x rows per chunk: kept in L2 while the panels pass */
#endif

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) ps_amx_cfg;

/* Linux gives a process the tile registers only once asked (arch_prctl XTILEDATA). */
int ps_gemm_amx_available(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
    return state;
}

/* every tile 16 rows of 64 bytes: sums of 16 x 16 floats, x's 16 x 32 and the panel's 16 k
 * pairs x 16 columns (bfloat16 pairs) */
static void ps_amx_configure(void) {
    ps_amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; ++i) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}

/* x's rows in tile order: xp[g][s][r][0..32) = x[16 g + r][32 s .. 32 s + 32) in bfloat16, so
 * every A tile is 1 KB in a row (tileloadd with a 64-byte stride, a sequential read) and each
 * row's rounding is done once per call for both threads: rows [m0, m1), K / 32 steps; rows
 * from M to the next multiple of 16 are zeros (every tile has 16 rows: one configuration). The
 * rounding is vcvtne2ps2bf16's, to nearest even as Tensor.to(bfloat16), except that it reads
 * float32 denormals as zero, which TDPBF16PS does with bfloat16 denormals anyway. */
static void ps_amx_pack_x(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t M,
                          int64_t K, uint16_t *xp) {
    const int64_t steps = K / 32;
    for (int64_t m = m0; m < m1; ++m) {
        uint16_t *dst = xp + ((m / 16) * steps * 16 + m % 16) * 32;
        if (m >= M) { /* a row of the last tile past M: zeros, its sums never stored */
            for (int64_t s = 0; s < steps; ++s) memset(dst + s * 512, 0, 64);
            continue;
        }
        const float *row = x + m * ldx;
        for (int64_t s = 0; s < steps; ++s) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 32 * s + 16),
                                                   _mm512_loadu_ps(row + 32 * s));
            _mm512_storeu_si512((void *)(dst + s * 512), (__m512i)v);
        }
    }
}

/* One row group (16 rows, or 32 with ``two``: x's tile blocks from ``xa``, the second 16 rows'
 * K / 32 blocks after the first's) times one panel. Each k step also asks for ``pf_bytes`` of
 * the weight stream into L2, from ``pf`` on (ps_amx_pass says how far ahead), never past
 * ``pf_end``. */
static inline __attribute__((always_inline)) void ps_amx_group(
    const uint16_t *xa, const uint16_t *wp, int64_t K, float *y, int64_t ldy, const int two,
    const int rows, const float *bias, int64_t ncols, const char *pf, int64_t pf_bytes,
    const char *pf_end) {
    const uint16_t *xb = xa + K * 16; /* the second 16 rows' blocks (K / 32 of 512) */
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < K; k += 32) {
        const uint16_t *b = wp + k * 32; /* k pair k / 2: 32 columns x 2 values */
        { /* this step's share of the stream ahead */
            const char *p = pf + (k / 32) * pf_bytes;
            for (int64_t l = 0; l < pf_bytes && p + l < pf_end; l += 64)
                __builtin_prefetch(p + l, 0, 2);
        }
        _tile_loadd(4, xa + k * 16, 64);
        _tile_loadd(6, b, 128);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b + 32, 128);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, xb + k * 16, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    float tmp[32 * 32];
    const int direct = ncols == 32 && rows == (two ? 32 : 16); /* else only some are stored */
    float *out = direct ? y : tmp;
    const int64_t ld = direct ? ldy : 32;
    _tile_stored(0, out, ld * 4);
    _tile_stored(1, out + 16, ld * 4);
    if (two) {
        _tile_stored(2, out + 16 * ld, ld * 4);
        _tile_stored(3, out + 16 * ld + 16, ld * 4);
    }
    if (!direct)
        for (int i = 0; i < rows; ++i) memcpy(y + i * ldy, tmp + i * 32, (size_t)ncols * 4);
    if (bias)
        for (int i = 0; i < rows; ++i)
            for (int64_t c = 0; c < ncols; ++c) y[i * ldy + c] += bias[c];
}

/* Rows [m0, m1) (m0 a multiple of 32) in groups of 32 (the last one 1-32: its tiles run
 * whole on x's zero rows, and only its rows are stored) times panels [p0, p1). */
static void ps_amx_pass(const uint16_t *xp, int64_t m0, int64_t m1, int64_t K,
                        const uint16_t *wp, int64_t N, const float *bias, float *y, int64_t ldy,
                        int64_t p0, int64_t p1) {
    const int64_t panel = K * 32; /* uint16 per panel */
    const char *end = (const char *)(wp + p1 * panel);
    /* the stream ahead: PS_AMX_PF bytes past each k step's own (one row group), or, with
     * several row groups per panel, the next panel spread over all of this one's groups (the
     * later groups find the panel in L1 and would otherwise leave the memory idle) */
    const int64_t groups = (m1 - m0 + 31) / 32, steps = K / 32;
    const int64_t share = groups == 1 ? 2048 : ((2048 + groups - 1) / groups + 63) / 64 * 64;
    for (int64_t p = p0; p < p1; ++p) {
        const int64_t c0 = p * 32, ncols = N - c0 < 32 ? N - c0 : 32;
        const uint16_t *w = wp + p * panel;
        const float *b = bias ? bias + c0 : 0;
        for (int64_t m = m0, g = 0; m < m1; m += 32, ++g) {
            const char *pf = groups == 1 ? (const char *)w + PS_AMX_PF
                                         : (const char *)(w + panel) + g * steps * share;
            const uint16_t *xa = xp + m * K; /* (m / 16) groups of 16 K values a row */
            const int rows = m1 - m < 32 ? (int)(m1 - m) : 32;
            float *yt = y + m * ldy + c0;
            if (rows > 16)
                ps_amx_group(xa, w, K, yt, ldy, 1, rows, b, ncols, pf, share, end);
            else
                ps_amx_group(xa, w, K, yt, ldy, 0, rows, b, ncols, pf, share, end);
        }
    }
}

/* x: [M, K] float32 rows ldx floats apart (K a multiple of 32), rounded to bfloat16 here into
 * ``xp`` (scratch of ceil(M / 16) * 16 * K uint16); wp, N, bias, y, ldy as in ps_gemm_bf16. */
void ps_gemm_bf16_amx(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp,
                      int64_t N, const float *bias, float *y, int64_t ldy, uint16_t *xp,
                      int32_t threads) {
    const int64_t panels = (N + 31) / 32;
    if (M <= 0 || panels <= 0) return;
    threads = ps_gemm_team_size(threads, panels);
    int64_t chunk = PS_AMX_X_BYTES / (K * 2) / 32 * 32;
    if (chunk < 32) chunk = 32;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t t, nt;
        ps_gemm_member(&t, &nt);
        const int64_t groups = (M + 15) / 16;
        const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
        ps_amx_pack_x(x, ldx, g0 * 16, g1 * 16, M, K, xp);
#pragma omp barrier
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        ps_amx_configure();
        for (int64_t c = 0; c < M; c += chunk)
            ps_amx_pass(xp, c, M - c < chunk ? M : c + chunk, K, wp, N, bias, y, ldy, p0, p1);
        _tile_release();
    }
}
#else
int ps_gemm_amx_available(void) { return 0; }
void ps_gemm_bf16_amx(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp,
                      int64_t N, const float *bias, float *y, int64_t ldy, uint16_t *xp,
                      int32_t threads) {
    (void)x, (void)M, (void)K, (void)ldx, (void)wp, (void)N, (void)bias, (void)y, (void)ldy,
        (void)xp, (void)threads;
}
#endif

/*
 * Exact greedy tokens of a float32 head from a bfloat16 screen (kernels/greedy_head.py).
 *
 * Why: in a decode step of a small model the output head is one of the largest products
 * (SmolLM2-135M: 49152 x 576, a fifth of a token's weights), and a greedy row needs only
 * the position of its largest logit. approx [M, N] (rows lda apart) holds the same products
 * with x and W rounded to bfloat16 (ps_gemm_bf16 or the AMX path: half the bytes, twice the
 * rate). With |approx[r][j] - f[r][j]| <= s * norms[j] + t for the float32 products f
 * (the caller's bound, slack[r] = (s, t): a rounding term times |x_r| |W_j|, and an absolute
 * one for subnormals the bfloat16 products flush to zero), the float32 maximum lies among the
 * columns j with approx[j] + s * norms[j] + t >= approx[m] - s * norms[m] - t (m: a largest
 * approx); only those are computed in float32, each exactly as ps_gemm_f32 computes it (one
 * fused multiply-add chain over k from 0 in k order, no bias; the values from wrows, W's rows
 * ldw floats apart, where the caller has them, else from the packed panels wp), and
 * tokens[r] is the first of their largest: the token ps_argmax_f32 takes from the float32
 * head's logits, bit for bit. A row with more than cap candidates, or a NaN / infinity read,
 * gets -1: the caller runs the float32 head for it.
 *
 * nmax: the largest of norms (the first listing uses it for every m; the list is then cut
 * to m's own bound). cand: PS_HEAD_LIST int64 per thread (scratch from the caller).
 */
#define PS_HEAD_LIST 256 /* columns listed per row before the final bound (the scratch's) */
#define PS_HEAD_WAYS 8
static int64_t ps_head_row(const float *x, int64_t K, const float *wp, const float *wrows,
                           int64_t ldw, const float *a, int64_t N, const float *norms, float s,
                           float t, float nmax, int64_t cap, int64_t *cand) {
    /* 1: the largest approximate logit (and whether any is NaN or infinite) */
    float best = -INFINITY;
    int bad = 0;
    int64_t j = 0;
    if (N >= PS_WIDE_LANES) {
        vwsf vmax = ps_wload(a);
        vwsi vbad = (vwsi)(vmax - vmax) != 0;
        for (j = PS_WIDE_LANES; j + PS_WIDE_LANES <= N; j += PS_WIDE_LANES) {
            const vwsf v = ps_wload(a + j);
            vmax = ps_wvmax(v, vmax);
            vbad |= (vwsi)(v - v) != 0;
        }
        best = ps_wmax(vmax);
        for (int l = 0; l < PS_WIDE_LANES; ++l) bad |= vbad[l] != 0;
    }
    for (; j < N; ++j) {
        best = a[j] > best ? a[j] : best;
        bad |= !(a[j] - a[j] == 0.0f);
    }
    if (bad) return -1;
    /* 2: every column that could reach it under the widest bound (the largest norm), in
     * runs of 4 vectors: one horizontal test per run, the rare hits listed one by one */
    const float loose = best - s * nmax - 2 * t;
    const vwsf vs = ps_wsplat(s);
    int64_t n = 0;
    for (j = 0; j + 4 * PS_WIDE_LANES <= N; j += 4 * PS_WIDE_LANES) {
        vwsf hi = ps_wload(a + j) + vs * ps_wload(norms + j);
        for (int u = 1; u < 4; ++u) {
            const int64_t o = j + u * PS_WIDE_LANES;
            hi = ps_wvmax(hi, ps_wload(a + o) + vs * ps_wload(norms + o));
        }
        if (ps_wmax(hi) < loose) continue;
        for (int64_t i = j; i < j + 4 * PS_WIDE_LANES; ++i) {
            if (a[i] + s * norms[i] < loose) continue;
            if (n == PS_HEAD_LIST) return -1;
            cand[n++] = i;
        }
    }
    for (; j < N; ++j) {
        if (a[j] + s * norms[j] < loose) continue;
        if (n == PS_HEAD_LIST) return -1;
        cand[n++] = j;
    }
    /* 3: the bound of a largest column m itself (it is listed: a[m] = best >= loose) */
    float floor = loose;
    for (int64_t i = 0; i < n; ++i)
        if (a[cand[i]] == best) {
            floor = best - s * norms[cand[i]] - 2 * t;
            break;
        }
    int64_t w = 0;
    for (int64_t i = 0; i < n; ++i)
        if (a[cand[i]] + s * norms[cand[i]] >= floor) cand[w++] = cand[i];
    if (w > cap) return -1;
    /* 4: the candidates in float32, as ps_gemm_f32 sums them (one fused multiply-add chain
     * each, PS_HEAD_WAYS chains side by side); ascending columns, so the first of equal
     * maxima wins (as in ps_argmax_f32) */
    int64_t tok = -1;
    float top = -INFINITY;
    for (int64_t i0 = 0; i0 < w; i0 += PS_HEAD_WAYS) {
        const int nw = w - i0 < PS_HEAD_WAYS ? (int)(w - i0) : PS_HEAD_WAYS;
        const float *col[PS_HEAD_WAYS];
        float acc[PS_HEAD_WAYS];
        const int64_t step = wrows ? 1 : PS_GEMM_NR; /* a row of W, or a column of a panel */
        for (int u = 0; u < PS_HEAD_WAYS; ++u) {
            const int64_t c = cand[i0 + (u < nw ? u : 0)];
            col[u] = wrows ? wrows + c * ldw
                           : wp + (c / PS_GEMM_NR) * K * PS_GEMM_NR + c % PS_GEMM_NR;
            acc[u] = 0.0f;
        }
        for (int64_t k = 0; k < K; ++k)
            for (int u = 0; u < PS_HEAD_WAYS; ++u)
                acc[u] = __builtin_fmaf(x[k], col[u][k * step], acc[u]);
        for (int u = 0; u < nw; ++u) {
            if (!(acc[u] - acc[u] == 0.0f)) return -1;
            if (acc[u] > top) {
                top = acc[u];
                tok = cand[i0 + u];
            }
        }
    }
    return tok;
}

int64_t ps_gemm_head_list(void) { return PS_HEAD_LIST; }

void ps_gemm_head_greedy(const float *x, int64_t M, int64_t K, int64_t ldx, const float *wp,
                         const float *wrows, int64_t ldw, int64_t N, const float *approx,
                         int64_t lda, const float *norms, float nmax, const float *slack,
                         int64_t cap, int64_t *cand, int64_t *tokens, int32_t threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (M > 1)
    for (int64_t r = 0; r < M; ++r) {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        tokens[r] = ps_head_row(x + r * ldx, K, wp, wrows, ldw, approx + r * lda, N, norms,
                                slack[2 * r], slack[2 * r + 1], nmax, cap,
                                cand + t * PS_HEAD_LIST);
    }
}

/*
 * The integer screen of a float32 head (kernels/greedy_head.py), for CPUs without bfloat16
 * products: y[r][j] = ((float)D[r][j] * colscale[j]) * rowscale[r] with D[r][j] the exact
 * sum over k of xq[r][k] * wq[j][k] (int16 values; the caller keeps K * max|xq| * max|wq|
 * below 2^31, so the int32 sums never wrap).
 *
 * Why: without AVX512-BF16 the bfloat16 screen is not there, and a greedy row took the whole
 * float32 head (the Qwen2-0.5B shape: 136M of its 494M weights, a quarter of a 48-row decode
 * step on a Zen 3). vpmaddwd multiplies 16 int16 pairs and adds each pair into an int32 lane:
 * twice the multiply-adds of a float32 FMA per instruction (AVX512-VNNI's vpdpwssd also adds
 * into the accumulator).
 *
 * Layout: wq[p][k / 2][c][2]: panel p's PS_I16_NR columns (32 with AVX-512, else 16), the
 * two k steps of a pair side by side (vpmaddwd's pairs), columns past N zero; xq [M][K] rows
 * ldx apart, K even. Threads take contiguous runs of panels; each panel (K * NR * 2 bytes)
 * stays in L1 / L2 while every PS_I16_MR-row tile of xq passes over it. On a Zen 5 the
 * AVX-512 build with one 16-column vector per row ran SmolLM2's head at 48 rows in 4.4 ms,
 * with two (now) in 3.0 (the bfloat16 screen: 2.7).
 */
#if defined(__AVX2__) || defined(__AVX512BW__)
#include <immintrin.h>
#endif
#if defined(__AVX512BW__) /* two 16-lane vectors of columns, 8 rows: 16 of 32 registers */
#define PS_I16_NR 32
#define PS_I16_MR 8
#else /* AVX2: two 8-lane vectors, 6 rows: 12 of 16 registers */
#define PS_I16_NR 16
#define PS_I16_MR 6
#endif
#ifndef PS_I16_PF
#define PS_I16_PF 16 /* k pairs of a panel asked ahead (one 64-byte line each on AVX2) */
#endif

int ps_head_i16_panel_width(void) { return PS_I16_NR; }
/* Whether this build multiplies the int16 pairs in vector instructions (AVX2 or AVX-512BW):
 * elsewhere the plain C loop below is no faster than the float32 head, so the screen stays off
 * unless asked for (kernels/greedy_head.py). */
int ps_head_i16_vector(void) {
#if defined(__AVX512BW__) || defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

static inline __attribute__((always_inline)) void ps_i16_tile(
    const int32_t *const *xr, const int16_t *w, int64_t pairs, int32_t out[PS_I16_MR][PS_I16_NR],
    const int MR) {
#if defined(__AVX512BW__)
    __m512i acc[PS_I16_MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int64_t kk = 0; kk < pairs; ++kk) {
        const int16_t *wk = w + kk * 2 * PS_I16_NR;
        __builtin_prefetch(wk + PS_I16_PF * 2 * PS_I16_NR, 0, 3);
        __builtin_prefetch(wk + PS_I16_PF * 2 * PS_I16_NR + 32, 0, 3);
        const __m512i w0 = _mm512_loadu_si512((const void *)wk);
        const __m512i w1 = _mm512_loadu_si512((const void *)(wk + 32));
        for (int r = 0; r < MR; ++r) {
            const __m512i xb = _mm512_set1_epi32(xr[r][kk]);
#if defined(__AVX512VNNI__)
            acc[r][0] = _mm512_dpwssd_epi32(acc[r][0], w0, xb);
            acc[r][1] = _mm512_dpwssd_epi32(acc[r][1], w1, xb);
#else
            acc[r][0] = _mm512_add_epi32(acc[r][0], _mm512_madd_epi16(w0, xb));
            acc[r][1] = _mm512_add_epi32(acc[r][1], _mm512_madd_epi16(w1, xb));
#endif
        }
    }
    for (int r = 0; r < MR; ++r) {
        _mm512_storeu_si512((void *)out[r], acc[r][0]);
        _mm512_storeu_si512((void *)(out[r] + 16), acc[r][1]);
    }
#elif defined(__AVX2__)
    __m256i acc[PS_I16_MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t kk = 0; kk < pairs; ++kk) {
        const int16_t *wk = w + kk * 2 * PS_I16_NR;
        __builtin_prefetch(wk + PS_I16_PF * 2 * PS_I16_NR, 0, 3);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)wk);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wk + PS_I16_NR));
        for (int r = 0; r < MR; ++r) {
            const __m256i xb = _mm256_set1_epi32(xr[r][kk]);
#if defined(__AVXVNNI__)
            acc[r][0] = _mm256_dpwssd_avx_epi32(acc[r][0], w0, xb);
            acc[r][1] = _mm256_dpwssd_avx_epi32(acc[r][1], w1, xb);
#else
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, xb));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, xb));
#endif
        }
    }
    for (int r = 0; r < MR; ++r) {
        _mm256_storeu_si256((__m256i *)out[r], acc[r][0]);
        _mm256_storeu_si256((__m256i *)(out[r] + 8), acc[r][1]);
    }
#else
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < PS_I16_NR; ++c) out[r][c] = 0;
    for (int64_t kk = 0; kk < pairs; ++kk)
        for (int r = 0; r < MR; ++r) {
            const int16_t *xp = (const int16_t *)(xr[r] + kk);
            const int16_t *wk = w + kk * 2 * PS_I16_NR;
            for (int c = 0; c < PS_I16_NR; ++c) /* unsigned: wraps as the int32 lanes do */
                out[r][c] = (int32_t)((uint32_t)out[r][c] + (uint32_t)(xp[0] * wk[2 * c] +
                                                                       xp[1] * wk[2 * c + 1]));
        }
#endif
}

/* The tile for mr rows, the row count a compile-time constant in each case (no dead rows). */
static void ps_i16_tile_rows(const int32_t *const *xr, const int16_t *w, int64_t pairs,
                             int32_t out[PS_I16_MR][PS_I16_NR], int mr) {
    switch (mr) {
#define PS_I16_CASE(n) \
    case n: ps_i16_tile(xr, w, pairs, out, n); break;
        PS_I16_CASE(1) PS_I16_CASE(2) PS_I16_CASE(3) PS_I16_CASE(4) PS_I16_CASE(5)
#if PS_I16_MR > 6
        PS_I16_CASE(6) PS_I16_CASE(7)
#endif
        default: ps_i16_tile(xr, w, pairs, out, PS_I16_MR); break;
#undef PS_I16_CASE
    }
}

void ps_head_i16_screen(const int16_t *xq, int64_t M, int64_t K, int64_t ldx, const int16_t *wq,
                        int64_t N, const float *colscale, const float *rowscale, float *y,
                        int64_t ldy, int32_t threads) {
    const int64_t panels = (N + PS_I16_NR - 1) / PS_I16_NR, pairs = K / 2;
    if (M <= 0 || panels <= 0) return;
    /* M rows in the fewest tiles, as even as they go (8 rows: 4 + 4, not 6 + 2) */
    const int64_t tiles = (M + PS_I16_MR - 1) / PS_I16_MR;
#define rows_of(i) (M / tiles + ((i) < M % tiles))
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        int32_t out[PS_I16_MR][PS_I16_NR];
        for (int64_t p = p0; p < p1; ++p) {
            const int16_t *w = wq + p * pairs * 2 * PS_I16_NR;
            const int64_t c0 = p * PS_I16_NR;
            const int64_t nc = N - c0 < PS_I16_NR ? N - c0 : PS_I16_NR;
            for (int64_t r0 = 0, tile = 0; r0 < M; r0 += rows_of(tile++)) {
                const int mr = (int)rows_of(tile);
                const int32_t *xr[PS_I16_MR];
                for (int r = 0; r < mr; ++r) xr[r] = (const int32_t *)(xq + (r0 + r) * ldx);
                ps_i16_tile_rows(xr, w, pairs, out, mr);
                for (int r = 0; r < mr; ++r) {
                    float *yr = y + (r0 + r) * ldy + c0;
                    const float rs = rowscale[r0 + r];
                    for (int c = 0; c < nc; ++c) yr[c] = ((float)out[r][c] * colscale[c0 + c]) * rs;
                }
            }
        }
    }
}
#undef rows_of
