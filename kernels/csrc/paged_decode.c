/*
 * Single-pass paged decode attention for CPUs (float32 arithmetic over a float32 cache, or a
 * bfloat16 one in the library built with -DPS_KV_BF16=1: ps_kv.h).
 *
 * Why this exists: in plain torch, decode attention over a paged cache has to gather each
 * sequence's scattered blocks into a buffer before a batched attention call can read them, so
 * every cached byte is read twice and written once per layer. Here each decode row (all its
 * heads; or runs of its blocks, merged after, when there are fewer rows than threads) walks its
 * block table and reads each key and value exactly once, with an online softmax (running max
 * and sum, rescaled per block, in phases over all heads), and asks for the next
 * block's lines a few at a time while it loads the current one's (and, at a row's last block,
 * for the next row's first). Common shapes (head_dim 64
 * with GQA 2, 3 or 7, head_dim 128 / GQA 4, block 16) are compiled with constant sizes: heads of
 * one KV head share each key load (up to 3 per pass) and keep their value accumulators in
 * registers (a tile of up to 4 heads); an AVX-512 build does its dot products and value sums in
 * 16-float vectors. Measured on a Zen 5 EPYC (2 threads, 3 sizes; bench/README.md) against
 * the kernel before these: 1.3-1.6x for GQA 7, 1.25-1.35x for head_dim 128, 1.0-1.2x for GQA 2
 * and 3; the 16-float build alone 1.25x the 8-float one for head_dim 128, 1.05-1.2x for GQA 7.
 * Measured (bench/kernels.py, batch 64 x 512 tokens, 2 threads, AVX-512 EPYC cores) at 36-41 GB/s
 * of K/V, ~0.7x the time of a dense SDPA over contiguous K/V; 24 GB/s before the prefetch and the
 * specialisations (the prefetch gave most of it). On a Zen 3 EPYC (AVX2 only: 8-float vectors;
 * 2 threads, K/V from DRAM) the version without either read ~10 GB/s; this one reads 19-24 GB/s
 * for 8/4 and 9/3 heads of 64, 0.58-0.85 of a contiguous read (9/3 the lowest: there it runs
 * at ~0.8 of a plain sum over the same blocks, its compute and its misses barely overlapping).
 * Since, AVX2 builds take up to 3 heads of one KV head per pass for head_dim 64 (ps_scores4xn,
 * ps_values_halves): 1.03-1.17x for 9/3 heads, 0.96-1.14x for 8/4 there (48-256 rows), 0.79-0.91
 * of the blocks' plain sum for 9/3 (0.71-0.88 before).
 * On a Zen 4 EPYC (2 threads, K/V from DRAM; bench/README.md): 24-29 GB/s of K/V for 8/4 and 9/3
 * heads of 64, 0.96-1.0 of a plain sum over the same scattered blocks, 0.73-0.83 of a contiguous
 * read when the machine reads ~30-35 GB/s, 0.49-0.58 when it reads ~45-50 (the blocks' sum
 * itself then reaches ~0.6: one row's scattered 12-16 KB runs keep too few misses in flight).
 *
 * Layout (see kernels/__init__.py): k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
 * head_dim], contiguous. Query head h reads KV head h / (num_heads / num_kv_heads).
 *
 * Row r (one decoding sequence) attends to positions lo .. seq_len-1 where lo is
 * max(first_block * block_size, seq_len - window) (window <= 0: no window), reading its blocks
 * through block_tables[seq_index]. It writes out[token_row] ([num_heads, head_dim]) and
 * lse[r] ([num_heads], natural log of the sum of exp(scaled scores)) so that a caller can merge
 * the result exactly with attention over positions it computed elsewhere (a shared prefix).
 *
 * Built at first use by kernels/native.py with the machine's C compiler; called through ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ps_kv.h"

#define PS_MAX_HEAD_DIM 256
#define PS_MAX_HEADS 64
#define PS_MAX_BLOCK 256
#define PS_LANES 8

/* GCC/Clang vector extensions: 8 floats (one AVX register; two NEON ones elsewhere). */

typedef struct {
    const float *query;          /* [T, num_heads, head_dim], rows query_row_stride apart */
    int64_t query_row_stride;
    const ps_kv_t *k_cache;      /* float32 or bfloat16 (ps_kv.h) */
    const ps_kv_t *v_cache;
    const int32_t *block_tables; /* [B, block_table_stride] */
    int64_t block_table_stride;
    const int64_t *token_rows;   /* [n]: row of query/out for each decode row */
    const int64_t *seq_index;    /* [n]: row of block_tables */
    const int64_t *first_block;  /* [n]: first block read (after a shared prefix) */
    const int64_t *seq_lens;     /* [n]: context length including the new token */
    int64_t num_rows;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t block_size;
    int64_t window;              /* <= 0: no sliding window */
    float scale;
    int32_t num_threads;
    float *out;                  /* [T, num_heads, head_dim], rows out_row_stride apart */
    int64_t out_row_stride;
    float *lse;                  /* [n, num_heads] */
    /* Where a row continues a shared prefix's attention computed before (a cascade's group;
     * NULL: no row does): start_slot[r] >= 0 is its row of start_out ([S, num_heads,
     * head_dim], contiguous) and start_lse ([S, num_heads]); the row's online softmax starts
     * from that result (running max = its lse, sum 1, output sums = its output), so its own
     * blocks extend it exactly and no merge follows. */
    const float *start_out;
    const float *start_lse;
    const int64_t *start_slot;
    int64_t start_rows; /* S: every slot must be below it */
} ps_decode_args;

/* The next block's keys and values, asked for (into L2) a line of each at a time, spread
 * evenly over the loads of the current block: the loops below take a step for every two lines
 * they load (PS_PF_EVERY vectors), so the next block's K and V lines are requested side by
 * side at the rate this block's are read, and the requests are all out by its end.
 *
 * Why: before this, a block's next keys were asked for a row or two per head pass and its
 * next values a row per token, in bursts of 16-32 requests between compute; a burst beyond the
 * core's free miss buffers stalls the loop that issued it, so the compute and the memory
 * system took turns. Measured (bench/README.md, Zen 4, 2 threads, K/V from DRAM, 21 alternating
 * rounds, 8/4 and 9/3 heads of 64 at 64 x 512 and 48 x 400): 1.08-1.11x the kernel's K/V rate
 * when the machine read at ~50 GB/s, 1.03-1.10x at ~31 GB/s; asking for the whole next block
 * during the score loop alone measured 0.95-0.99x. */
#define PS_PF_EVERY (2 * PS_KV_LINE / PS_WIDE_LANES) /* wide vectors in two 64-byte lines */
typedef struct {
    const ps_kv_t *k, *v; /* the next block's keys and values (NULL: none) */
    int64_t o;            /* offset of the next line */
    int64_t end;          /* one past the last line */
} ps_pf;

static inline __attribute__((always_inline)) void ps_pf_step(ps_pf *p) {
    if (!p || p->o >= p->end) return; /* NULL: a pass that takes no steps (folded away) */
    __builtin_prefetch(p->k + p->o, 0, 2);
    __builtin_prefetch(p->v + p->o, 0, 2);
    p->o += PS_KV_LINE;
}

/* The fine cursor: one line a step, the block's keys and then its values (o runs over twice
 * the block), for shapes whose heads take several passes over each key and value (GQA 7 on
 * AVX-512), which step in every pass. Why: there the first passes alone are about half of a
 * block's work, so the plain cursor asked for the next block in the first half of each block
 * and left the second without requests; under the engine's traffic (bench.decode_ab) the fine
 * one reads 14/2 heads 1.027x (control 0.998), 3.5% faster in the engine. Shapes with one pass
 * per phase keep the plain cursor: with half the lines a step its requests would not be out by
 * the block's end (0.94x for 9/3 and 8/4 heads). */
static inline __attribute__((always_inline)) void ps_pf_step1(ps_pf *p) {
    if (!p || p->o >= 2 * p->end) return;
    __builtin_prefetch(p->o < p->end ? p->k + p->o : p->v + (p->o - p->end), 0, 2);
    p->o += PS_KV_LINE;
}

static inline __attribute__((always_inline)) void ps_pf_next(ps_pf *p, const int fine) {
    if (fine) ps_pf_step1(p);
    else ps_pf_step(p);
}

static inline v8sf ps_load(const float *p) { return *(const v8sf_u *)p; }

/* Lane j of the result: the sum of the 8 lanes of p[j] (a transposing reduction). */
static inline v8sf ps_hsum8(const v8sf p[8]) {
    v8sf u[4], w[2];
    for (int j = 0; j < 4; ++j)
        u[j] = __builtin_shufflevector(p[2 * j], p[2 * j + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(p[2 * j], p[2 * j + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int j = 0; j < 2; ++j)
        w[j] = __builtin_shufflevector(u[2 * j], u[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(u[2 * j], u[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    /* w[0] = [p0..p3 over lanes 0-3, p0..p3 over lanes 4-7], w[1] likewise for p4..p7 */
    v8sf lo = __builtin_shufflevector(w[0], w[1], 0, 1, 2, 3, 8, 9, 10, 11);
    v8sf hi = __builtin_shufflevector(w[0], w[1], 4, 5, 6, 7, 12, 13, 14, 15);
    return lo + hi;
}


/* Lane j of the result: the sum of the lanes of p[j], for the build's wide vectors. With 16
 * floats, one tree over the whole vectors (pairs of tokens, pairs of pairs, then quads: 15
 * shuffles and 8 adds) instead of folding each vector to 8 lanes and then ps_hsum8 (8 extracts,
 * 14 shuffles, 15 adds). Why: with 7 heads per KV head (Qwen2-0.5B's 14/2) the reductions were
 * almost as many instructions as the dot products' multiply-adds; 1.04x there on K/V the L3
 * holds, 1.02x under the engine's traffic (bench.decode_ab), 0.99-1.01x for 9/3 and 8/4 heads
 * (bench/README.md). The sums' order changes, not their terms. */
static inline v8sf ps_whsum8(const vwsf p[8]) {
#if PS_WIDE_LANES == 16
    vwsf u[4], w[2];
    for (int j = 0; j < 4; ++j) /* per 128 bits: token 2j in even lanes, 2j + 1 in odd ones */
        u[j] = __builtin_shufflevector(p[2 * j], p[2 * j + 1], 0, 16, 1, 17, 4, 20, 5, 21, 8,
                                       24, 9, 25, 12, 28, 13, 29) +
               __builtin_shufflevector(p[2 * j], p[2 * j + 1], 2, 18, 3, 19, 6, 22, 7, 23, 10,
                                       26, 11, 27, 14, 30, 15, 31);
    for (int j = 0; j < 2; ++j) /* per 128 bits: tokens 4j .. 4j + 3 */
        w[j] = __builtin_shufflevector(u[2 * j], u[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                       24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(u[2 * j], u[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10,
                                       11, 26, 27, 14, 15, 30, 31);
    /* per 256 bits: tokens 0 .. 7; the two halves' sum is the result */
    const vwsf z = __builtin_shufflevector(w[0], w[1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11,
                                           24, 25, 26, 27) +
                   __builtin_shufflevector(w[0], w[1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14,
                                           15, 28, 29, 30, 31);
    return ps_fold8(z);
#else
    return ps_hsum8(p);
#endif
}

/* Scores of 8 consecutive tokens (rows token_stride apart) for one query vector. */
static inline v8sf ps_scores8(const float *q, const ps_kv_t *k, int64_t token_stride, int64_t D,
                              ps_pf *pf) {
    v8sf p[8];
    for (int j = 0; j < 8; ++j) p[j] = ps_splat(0.0f);
    for (int64_t d = 0; d < D; d += PS_LANES) {
        const v8sf qv = ps_load(q + d);
        for (int j = 0; j < 8; ++j) {
            if (j % (2 * PS_KV_LINE / 8) == 0) ps_pf_step(pf); /* a step per two lines */
            p[j] += qv * ps_kv_load8(k + j * token_stride + d);
        }
    }
    return ps_hsum8(p);
}

/* Scores of 8 consecutive tokens (rows token_stride apart) for n query heads of one KV head
 * (GQA): each key vector is loaded once for the n heads, and the dot products run over the
 * widest vectors the build has (16 floats with AVX-512: half the instructions of 8). Head i's
 * scores go to s[i][c .. c + 8). n * 8 accumulators: n <= PS_SCORE_HEADS keeps them in
 * registers. */
#if PS_WIDE_LANES == 16
#define PS_SCORE_HEADS 3 /* 24 of the 32 AVX-512 registers */
#else
#define PS_SCORE_HEADS 2 /* spills a little on AVX2's 16, as measured before: still faster */
#endif
static inline __attribute__((always_inline)) void ps_scores8xn(
    const float (*q)[PS_MAX_HEAD_DIM], const int n, const ps_kv_t *k, int64_t token_stride,
    const int64_t D, float (*s)[PS_MAX_BLOCK], int64_t c, ps_pf *pf, const int fine) {
    if (D % PS_WIDE_LANES != 0) { /* narrow head sizes (e.g. 40): one head at a time */
        *(v8sf *)&s[0][c] = ps_scores8(q[0], k, token_stride, D, pf);
        for (int i = 1; i < n; ++i) /* the cursor steps in the first head's pass only */
            *(v8sf *)&s[i][c] = ps_scores8(q[i], k, token_stride, D, 0);
        return;
    }
    vwsf p[PS_SCORE_HEADS][8];
    for (int i = 0; i < n; ++i)
        for (int j = 0; j < 8; ++j) p[i][j] = ps_wsplat(0.0f);
    for (int64_t d = 0; d < D; d += PS_WIDE_LANES) {
        vwsf qv[PS_SCORE_HEADS];
        for (int i = 0; i < n; ++i) qv[i] = ps_wload(q[i] + d);
        for (int j = 0; j < 8; ++j) {
            if (j % PS_PF_EVERY == 0) ps_pf_next(pf, fine);
            const vwsf kv = ps_kv_wload(k + j * token_stride + d);
            for (int i = 0; i < n; ++i) p[i][j] += qv[i] * kv;
        }
    }
    for (int i = 0; i < n; ++i) *(v8sf *)&s[i][c] = ps_whsum8(p[i]);
}

#if PS_WIDE_LANES == 8
typedef float v4sf __attribute__((vector_size(16)));
typedef float v4sf_u __attribute__((vector_size(16), aligned(4)));

/* Lane j of the result: the sum of the 8 lanes of p[j], j < 4. */
static inline v4sf ps_hsum4(const v8sf p[4]) {
    v8sf u[2];
    for (int j = 0; j < 2; ++j)
        u[j] = __builtin_shufflevector(p[2 * j], p[2 * j + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(p[2 * j], p[2 * j + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    const v8sf w = __builtin_shufflevector(u[0], u[1], 0, 1, 8, 9, 4, 5, 12, 13) +
                   __builtin_shufflevector(u[0], u[1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(w, w, 0, 1, 2, 3) + __builtin_shufflevector(w, w, 4, 5, 6, 7);
}

/* AVX2 (16 vector registers): scores of 8 consecutive tokens for n <= 3 heads of one KV head,
 * 4 tokens at a time. n * 4 accumulators, n query vectors and the key vector fit the 16
 * registers, so each key vector is loaded once for all n heads; ps_scores8xn's n * 8
 * accumulators would spill past 2 heads (AVX2 took one head per pass for GQA 3 before: every
 * key loaded three times from L1). Takes ps_pf's steps at the rate ps_scores8xn does. */
static inline __attribute__((always_inline)) void ps_scores4xn(
    const float (*q)[PS_MAX_HEAD_DIM], const int n, const ps_kv_t *k, int64_t token_stride,
    const int64_t D, float (*s)[PS_MAX_BLOCK], int64_t c, ps_pf *pf) {
    for (int half = 0; half < 8; half += 4) {
        v8sf p[3][4];
        for (int i = 0; i < n; ++i)
            for (int j = 0; j < 4; ++j) p[i][j] = ps_splat(0.0f);
        for (int64_t d = 0; d < D; d += PS_LANES) {
            v8sf qv[3];
            for (int i = 0; i < n; ++i) qv[i] = ps_load(q[i] + d);
            for (int j = 0; j < 4; ++j) {
                if (((d / PS_LANES) * 4 + j) % PS_PF_EVERY == 0) ps_pf_step(pf);
                const v8sf kv = ps_kv_load8(k + (half + j) * token_stride + d);
                for (int i = 0; i < n; ++i) p[i][j] += qv[i] * kv;
            }
        }
        for (int i = 0; i < n; ++i) *(v4sf_u *)&s[i][c + half] = ps_hsum4(p[i]);
    }
}

/* AVX2: value sums over tokens [t0, t1) of a block for n <= 3 heads of one KV head, head_dim
 * 64, one half of the head at a time: 3 x 4 accumulators, 3 weights and the value vector fit
 * the 16 registers, so each value vector is loaded once for the n heads (a whole-head tile
 * holds 2 heads at most there). */
static inline __attribute__((always_inline)) void ps_values_halves(
    float (*acc)[PS_MAX_HEAD_DIM], const float (*s)[PS_MAX_BLOCK], const int n,
    const ps_kv_t *vh, ps_pf *pf, int64_t token_stride, int64_t t0, int64_t t1) {
    for (int h = 0; h < 2; ++h) {
        v8sf a[3][4];
        for (int i = 0; i < n; ++i)
            for (int j = 0; j < 4; ++j) a[i][j] = ps_load(&acc[i][(4 * h + j) * PS_LANES]);
        for (int64_t t = t0; t < t1; ++t) {
            v8sf w[3];
            for (int i = 0; i < n; ++i) w[i] = ps_splat(s[i][t]);
            for (int j = 0; j < 4; ++j) {
                if ((4 * h + j) % PS_PF_EVERY == 0) ps_pf_step(pf);
                const v8sf v = ps_kv_load8(vh + t * token_stride + (4 * h + j) * PS_LANES);
                for (int i = 0; i < n; ++i) a[i][j] += w[i] * v;
            }
        }
        for (int i = 0; i < n; ++i)
            for (int j = 0; j < 4; ++j) *(v8sf_u *)&acc[i][(4 * h + j) * PS_LANES] = a[i][j];
    }
}
#endif

/* Asks for the cache lines of len elements from base (a whole block: its rows are contiguous)
 * to be brought into L2 ahead of use (64-byte lines).
 *
 * Why: a row's blocks lie anywhere in the pool, so the hardware prefetchers, which follow
 * sequential streams within a page, stall at every block's start. Requesting block b + 1
 * while block b is computed keeps each thread's misses in flight (most of the gain in the
 * header's figures). Into L2 (prefetcht1), not L1: an L1 prefetch holds one of the core's few
 * L1 miss buffers until its line arrives, so a block's worth of them (256 lines) stalled the
 * loads of the block being computed; L2 tracks many more misses. Measured on a Zen 4 EPYC
 * (a throwaway harness, bench/README.md; 2 threads, 4 shapes x 2 sizes): 1.2-1.5x the L1
 * version's K/V rate alone, 1.2-2.1x with the key prefetches spread over the heads' score
 * passes. Two blocks ahead measured no better. Within a row the steps of ps_pf (above) now
 * do this a line at a time; this asks for the next row's first block. */
static inline void ps_prefetch_span(const ps_kv_t *base, int64_t len) {
    for (int64_t d = 0; d < len; d += PS_KV_LINE) __builtin_prefetch(base + d, 0, 2);
}

/* Value sums over tokens [t0, t1) of a block for n heads of one KV head, head_dim
 * DV * PS_WIDE_LANES: the n * DV accumulators stay in registers for the whole block and each
 * value vector is loaded once for the n heads. n and DV must be compile-time constants (the
 * loops unroll and the accumulator array becomes registers); n * DV <= 16. Takes the
 * prefetch cursor's steps (ps_pf) as it loads. */
static inline __attribute__((always_inline)) void ps_values_tile(
    float (*acc)[PS_MAX_HEAD_DIM], const float (*s)[PS_MAX_BLOCK], const int n, const int DV,
    const ps_kv_t *vh, ps_pf *pf, int64_t token_stride, int64_t t0, int64_t t1, const int fine) {
    vwsf a[4][8];
    for (int i = 0; i < n; ++i)
        for (int j = 0; j < DV; ++j) a[i][j] = ps_wload(&acc[i][j * PS_WIDE_LANES]);
    for (int64_t t = t0; t < t1; ++t) {
        vwsf w[4];
        for (int i = 0; i < n; ++i) w[i] = ps_wsplat(s[i][t]);
        for (int j = 0; j < DV; ++j) {
            if (j % PS_PF_EVERY == 0) ps_pf_next(pf, fine);
            const vwsf v = ps_kv_wload(vh + t * token_stride + j * PS_WIDE_LANES);
            for (int i = 0; i < n; ++i) a[i][j] += w[i] * v;
        }
    }
    for (int i = 0; i < n; ++i)
        for (int j = 0; j < DV; ++j) ps_wstore(&acc[i][j * PS_WIDE_LANES], a[i][j]);
}

/* A score pass (n <= PS_SCORE_HEADS heads of one KV head) and a value tile (n <= 4 heads) with
 * the n of the call; pf is &cursor in the first pass over a K or V slice and a literal NULL in
 * the others (in every pass with fine, the one-line cursor of ps_pf_step1), so each call site is
 * compiled with or without the steps. Why: where a KV head's heads take several passes (GQA 3
 * on AVX2, 7 on AVX-512), the two-line cursor stepping in every pass asked for the next block
 * too early (0.83-0.87x for 9/3 heads in a -march=haswell build), and choosing the cursor at
 * run time kept it out of registers (0.70x for 14/2 heads). */
static inline __attribute__((always_inline)) void ps_scores_pass(
    const float (*q)[PS_MAX_HEAD_DIM], const int64_t n, const ps_kv_t *k, int64_t token_stride,
    const int64_t D, float (*s)[PS_MAX_BLOCK], int64_t c, ps_pf *pf, const int halves,
    const int fine) {
#if PS_WIDE_LANES == 8
    if (halves) {
        if (n == 3) ps_scores4xn(q, 3, k, token_stride, D, s, c, pf);
        else if (n == 2) ps_scores4xn(q, 2, k, token_stride, D, s, c, pf);
        else ps_scores4xn(q, 1, k, token_stride, D, s, c, pf);
        return;
    }
#endif
    if (PS_SCORE_HEADS >= 3 && n == 3) /* never on AVX2 (SH <= 2) */
        ps_scores8xn(q, 3, k, token_stride, D, s, c, pf, fine);
    else if (n == 2) ps_scores8xn(q, 2, k, token_stride, D, s, c, pf, fine);
    else ps_scores8xn(q, 1, k, token_stride, D, s, c, pf, fine);
}

static inline __attribute__((always_inline)) void ps_values_pass(
    float (*acc)[PS_MAX_HEAD_DIM], const float (*s)[PS_MAX_BLOCK], const int64_t n, const int DV,
    const ps_kv_t *vh, ps_pf *pf, int64_t token_stride, int64_t t0, int64_t t1,
    const int halves, const int fine) {
#if PS_WIDE_LANES == 8
    if (halves) {
        if (n == 3) ps_values_halves(acc, s, 3, vh, pf, token_stride, t0, t1);
        else if (n == 2) ps_values_halves(acc, s, 2, vh, pf, token_stride, t0, t1);
        else ps_values_halves(acc, s, 1, vh, pf, token_stride, t0, t1);
        return;
    }
#endif
    if (n == 4) ps_values_tile(acc, s, 4, DV, vh, pf, token_stride, t0, t1, fine);
    else if (n == 3) ps_values_tile(acc, s, 3, DV, vh, pf, token_stride, t0, t1, fine);
    else if (n == 2) ps_values_tile(acc, s, 2, DV, vh, pf, token_stride, t0, t1, fine);
    else ps_values_tile(acc, s, 1, DV, vh, pf, token_stride, t0, t1, fine);
}

/* The first position row r reads: after its shared prefix (first_block), within its window. */
static inline int64_t ps_row_lo(const ps_decode_args *a, int64_t r, int64_t BS) {
    const int64_t last = a->seq_lens[r] - 1, lo = a->first_block[r] * BS;
    return a->window > 0 && last - a->window + 1 > lo ? last - a->window + 1 : lo;
}

/* Which of a row's blocks a task attends, and where it writes: blocks [b0, b1) counted from
 * the first block the row reads (b1 past the end: to its end); out / lse: a scratch row
 * ([num_heads, head_dim] and [num_heads]) for a run merged afterwards (ps_decode_split), or
 * NULL for the row's own output. Only the run with b0 == 0 continues a shared prefix. */
typedef struct {
    int64_t b0, b1;
    float *out, *lse;
} ps_part;

/* One decode row (all its heads), or a run of its blocks (part): each block's keys (then
 * values) are one contiguous block_size * num_kv_heads * head_dim run, read front to back
 * once. */
static inline __attribute__((always_inline)) void ps_decode_row_impl(
    const ps_decode_args *a, int64_t r, int64_t next_row, const ps_part *part, const int64_t D,
    const int64_t G, const int64_t BS, const int compiled) {
    const int64_t token_stride = a->num_kv_heads * D;
    float q[PS_MAX_HEADS][PS_MAX_HEAD_DIM] __attribute__((aligned(32)));
    float acc[PS_MAX_HEADS][PS_MAX_HEAD_DIM] __attribute__((aligned(32)));
    float s[PS_MAX_HEADS][PS_MAX_BLOCK] __attribute__((aligned(32)));
    /* running max and sum; the block's new max and rescale factor (vectors of 8 heads) */
    float m[PS_MAX_HEADS] __attribute__((aligned(32))), l[PS_MAX_HEADS];
    float newm[PS_MAX_HEADS] __attribute__((aligned(32)));
    float alpha[PS_MAX_HEADS] __attribute__((aligned(32)));
    const int64_t nh = a->num_heads;
    /* value tiles: a compiled shape whose head fits 8 wide vectors, up to 16 accumulators */
    const int64_t DV = D / PS_WIDE_LANES;
    const int TILED = compiled && D % PS_WIDE_LANES == 0 && DV <= 8;
    /* AVX2, head_dim 64: up to 3 heads per pass in both phases, 4 tokens or half a head at a
     * time (ps_scores4xn, ps_values_halves); SH: heads per score pass (sharing each key load),
     * elsewhere on AVX2 pairs for GQA 2 only; TH: heads per value tile */
    const int HALVES = PS_WIDE_LANES == 8 && TILED && DV == 8;
    const int64_t SH = HALVES ? 3 : PS_WIDE_LANES == 16 ? PS_SCORE_HEADS : (G == 2 ? 2 : 1);
    const int64_t TH = HALVES ? 3 : TILED ? (16 / DV < 4 ? 16 / DV : 4) : 1;
    /* the fine prefetch cursor, stepped in every pass (ps_pf_step1): GQA 7 on AVX-512 */
    const int FINE = PS_WIDE_LANES == 16 && TILED && G == 7;

    const float *qrow = a->query + a->token_rows[r] * a->query_row_stride;
    for (int64_t i = 0; i < nh; ++i) {
        for (int64_t d = 0; d < D; ++d) {
            q[i][d] = qrow[i * D + d] * a->scale;
            acc[i][d] = 0.0f;
        }
        l[i] = 0.0f;
    }
    const int64_t nh_lanes = (nh + PS_LANES - 1) / PS_LANES * PS_LANES;
    for (int64_t i = 0; i < nh_lanes; ++i) m[i] = newm[i] = -INFINITY; /* pad lanes unused */
    const int64_t slot = a->start_out && part->b0 == 0 ? a->start_slot[r] : -1;
    if (slot >= 0) { /* continue the shared prefix's softmax: weights relative to its lse */
        const float *so = a->start_out + slot * nh * D;
        const float *sl = a->start_lse + slot * nh;
        for (int64_t i = 0; i < nh; ++i) {
            for (int64_t d = 0; d < D; ++d) acc[i][d] = so[i * D + d];
            l[i] = 1.0f;
            m[i] = newm[i] = sl[i];
        }
    }

    const int64_t last = a->seq_lens[r] - 1, lo = ps_row_lo(a, r, BS);
    const int32_t *table = a->block_tables + a->seq_index[r] * a->block_table_stride;

    /* this part's blocks: [b_from, b_to) of the row's [lo / BS, last / BS] */
    const int64_t b_from = lo / BS + part->b0;
    const int64_t b_to = part->b1 < last / BS + 1 - lo / BS ? lo / BS + part->b1 : last / BS + 1;
    for (int64_t b = b_from; b < b_to; ++b) {
        const int64_t base = b * BS;
        const int64_t t0 = lo > base ? lo - base : 0;                      /* first valid */
        const int64_t t1 = last - base + 1 < BS ? last - base + 1 : BS;   /* one past last */
        const int64_t c0 = t0 / PS_LANES * PS_LANES, c1 = (t1 + PS_LANES - 1) / PS_LANES * PS_LANES;
        const int64_t block_off = (int64_t)table[b] * BS * token_stride;
        const ps_kv_t *kb = a->k_cache + block_off;
        const ps_kv_t *vb = a->v_cache + block_off;
        /* the next block's keys and values, requested while this block is computed */
        const int has_next = b + 1 < b_to;
        const int64_t next_off = has_next ? (int64_t)table[b + 1] * BS * token_stride : 0;
        const int64_t next_rows = last - (b + 1) * BS + 1 < BS ? last - (b + 1) * BS + 1 : BS;
        ps_pf pf = {a->k_cache + next_off, a->v_cache + next_off, 0,
                    has_next ? next_rows * token_stride : 0};
        /* scores, walking the block's keys front to back: 8 tokens (8 rows) at a time, every
         * head of the task against them while they are in L1 */
        for (int64_t c = c0; c < c1; c += PS_LANES) {
            const ps_kv_t *kc = kb + c * token_stride;
            for (int64_t i = 0; i < nh; i += G)
                for (int64_t g = 0; g < G; g += SH) {
                    const int64_t n = G - g < SH ? G - g : SH;
                    const ps_kv_t *kh = kc + (i / G) * D;
                    if (g == 0 || FINE)
                        ps_scores_pass(q + i + g, n, kh, token_stride, D, s + i + g, c, &pf,
                                       HALVES, FINE);
                    else
                        ps_scores_pass(q + i + g, n, kh, token_stride, D, s + i + g, c, 0,
                                       HALVES, FINE);
                }
        }
        if (!has_next && next_row >= 0) { /* the row's last block: the next row's first */
            const int64_t nb = a->first_block[next_row];
            const int32_t *nt = a->block_tables + a->seq_index[next_row] * a->block_table_stride;
            const int64_t off = (int64_t)nt[nb] * BS * token_stride;
            ps_prefetch_span(a->k_cache + off, BS * token_stride);
            ps_prefetch_span(a->v_cache + off, BS * token_stride);
        }
        /* online softmax over the block's valid tokens [t0, t1), in phases over all heads of
         * the task (each head's maximum, then the new maxima and rescale factors as vectors,
         * then each head's weights and sum), so that the heads' short dependency chains
         * overlap. Why: head by head (a serial scalar maximum over the tokens, a scalar expf,
         * a serial lane sum) it took ~22% of the kernel's time on L3-resident K/V (Zen 4, 8/4
         * and 9/3 heads; bench/README.md). */
        const int64_t nv = (c1 - c0) / PS_LANES; /* 8-float vectors of the block's scores */
        for (int64_t i = 0; i < nh; ++i) {
            v8sf bm = ps_splat(-INFINITY);
            for (int64_t v = 0; v < nv; ++v) {
                const int64_t c = c0 + v * PS_LANES;
                v8sf x = *(v8sf *)&s[i][c];
                if (c < t0 || c + PS_LANES > t1) { /* outside the context: never the maximum */
                    for (int j = 0; j < PS_LANES; ++j)
                        if (c + j < t0 || c + j >= t1) x[j] = -INFINITY;
                    *(v8sf *)&s[i][c] = x;
                }
                bm = ps_v8max(bm, x);
            }
            const float bmax = ps_v8hmax(bm);
            newm[i] = bmax > m[i] ? bmax : m[i];
        }
        /* on the first block m = -inf: ps_exp8's floor, ~1e-38, times l = acc = 0 */
        for (int64_t i = 0; i < nh; i += PS_LANES)
            *(v8sf *)&alpha[i] = ps_exp8(*(v8sf *)&m[i] - *(v8sf *)&newm[i]);
        for (int64_t i = 0; i < nh; ++i) {
            const v8sf mv = ps_splat(newm[i]);
            v8sf vsum = ps_splat(0.0f);
            for (int64_t v = 0; v < nv; ++v) {
                const int64_t c = c0 + v * PS_LANES;
                const v8sf x = *(v8sf *)&s[i][c];
                v8sf e = ps_exp8(x - mv);
                if (c < t0 || c + PS_LANES > t1) /* no weight outside the context */
                    e = (v8sf)((v8si)e & ~(v8si)(x == ps_splat(-INFINITY)));
                *(v8sf *)&s[i][c] = e;
                vsum += e;
            }
            if (alpha[i] != 1.0f)
                for (int64_t d = 0; d < D; d += PS_LANES)
                    *(v8sf *)&acc[i][d] *= ps_splat(alpha[i]);
            l[i] = l[i] * alpha[i] + ps_v8sum(vsum);
            m[i] = newm[i];
        }
        /* values, front to back: each value vector is loaded once for its group of heads */
        if (TILED) { /* the compiled shapes: accumulators in registers, a tile at a time */
            for (int64_t i = 0; i < nh; i += G) {
                const ps_kv_t *vh = vb + (i / G) * D;
                for (int64_t g = 0; g < G; g += TH) {
                    const int64_t n = G - g < TH ? G - g : TH;
                    float(*ac)[PS_MAX_HEAD_DIM] = acc + i + g;
                    const float(*sc)[PS_MAX_BLOCK] = (const float(*)[PS_MAX_BLOCK])(s + i + g);
                    if (g == 0 || FINE)
                        ps_values_pass(ac, sc, n, DV, vh, &pf, token_stride, t0, t1, HALVES,
                                       FINE);
                    else
                        ps_values_pass(ac, sc, n, DV, vh, 0, token_stride, t0, t1, HALVES, FINE);
                }
            }
        } else {
            for (int64_t t = t0; t < t1; ++t) {
                const ps_kv_t *vrow = vb + t * token_stride;
                for (int64_t i = 0; i < nh; i += G) {
                    const ps_kv_t *vh = vrow + (i / G) * D;
                    for (int64_t d = 0; d < D; d += PS_LANES) {
                        if (d % (2 * PS_KV_LINE) == 0) ps_pf_step(&pf); /* per two lines */
                        const v8sf v = ps_kv_load8(vh + d);
                        for (int64_t g = 0; g < G; ++g)
                            *(v8sf *)&acc[i + g][d] += ps_splat(s[i + g][t]) * v;
                    }
                }
            }
        }
        while (pf.o < (FINE ? 2 : 1) * pf.end) ps_pf_next(&pf, FINE); /* what the loads left */
    }

    float *orow = part->out ? part->out : a->out + a->token_rows[r] * a->out_row_stride;
    float *lrow = part->out ? part->lse : a->lse + r * a->num_heads;
    for (int64_t h = 0; h < nh; ++h) {
        const float inv = 1.0f / l[h];
        for (int64_t d = 0; d < D; ++d) orow[h * D + d] = acc[h][d] * inv;
        lrow[h] = m[h] + logf(l[h]);
    }
}

/* The common head sizes, GQA ratios and block size as compile-time constants. */
static void ps_decode_row(const ps_decode_args *a, int64_t r, int64_t nr, const ps_part *p) {
    const int64_t D = a->head_dim, G = a->num_heads / a->num_kv_heads, BS = a->block_size;
    if (BS == 16 && D == 64 && G == 2) ps_decode_row_impl(a, r, nr, p, 64, 2, 16, 1);
    else if (BS == 16 && D == 128 && G == 4)
        ps_decode_row_impl(a, r, nr, p, 128, 4, 16, 1);
    /* SmolLM2-135M (9 heads / 3 KV heads) and Qwen2-0.5B (14 / 2): head_dim 64 */
    else if (BS == 16 && D == 64 && G == 3) ps_decode_row_impl(a, r, nr, p, 64, 3, 16, 1);
    else if (BS == 16 && D == 64 && G == 7) ps_decode_row_impl(a, r, nr, p, 64, 7, 16, 1);
    else ps_decode_row_impl(a, r, nr, p, D, G, BS, 0);
}

/* The blocks a row reads (after its shared prefix, within its window); at least 1. */
static int64_t ps_row_blocks(const ps_decode_args *a, int64_t r) {
    const int64_t BS = a->block_size, last = a->seq_lens[r] - 1;
    const int64_t n = last / BS + 1 - ps_row_lo(a, r, BS) / BS;
    return n > 1 ? n : 1;
}

/* Fewer rows than threads: each row's blocks cut into up to ceil(threads / rows) runs, each
 * attended by a task of its own into a scratch row (output and log-sum-exp over its run), the
 * runs then merged exactly by their log-sum-exps. Why: one thread per row leaves threads idle
 * (a single sequence decoding), and a task per KV head instead read a strided span of every
 * token row, which the prefetchers cover poorly (bench/README.md). Returns 0, or -2 where the
 * scratch could not be allocated (the caller then takes whole rows). */
static int ps_decode_split(const ps_decode_args *a) {
    const int64_t R = a->num_rows, T = a->num_threads, H = a->num_heads, D = a->head_dim;
    const int64_t want = (T + R - 1) / R;
    int64_t *first = malloc((size_t)(R + 1) * sizeof *first); /* row r's tasks: [first[r], ..) */
    if (!first) return -2;
    first[0] = 0;
    for (int64_t r = 0; r < R; ++r) {
        const int64_t nb = ps_row_blocks(a, r);
        first[r + 1] = first[r] + (nb < want ? nb : want);
    }
    const int64_t tasks = first[R];
    float *scratch = malloc((size_t)tasks * H * (D + 1) * sizeof *scratch);
    if (!scratch) {
        free(first);
        return -2;
    }
    int64_t taken = 0;
#pragma omp parallel num_threads(a->num_threads)
    {
        for (int64_t t = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED); t < tasks;
             t = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED)) {
            int64_t r = 0;
            while (first[r + 1] <= t) ++r;
            const int64_t n = first[r + 1] - first[r], k = t - first[r], nb = ps_row_blocks(a, r);
            ps_part part = {nb * k / n, nb * (k + 1) / n, NULL, NULL};
            if (n > 1) { /* else straight into the row's output */
                part.out = scratch + t * H * (D + 1);
                part.lse = part.out + H * D;
            }
            ps_decode_row(a, r, -1, &part);
        }
    }
    for (int64_t r = 0; r < R; ++r) { /* merge the runs: weights exp(lse_k - lse) */
        const int64_t n = first[r + 1] - first[r];
        if (n == 1) continue;
        const float *base = scratch + first[r] * H * (D + 1);
        float *orow = a->out + a->token_rows[r] * a->out_row_stride;
        for (int64_t h = 0; h < H; ++h) {
            float m = -INFINITY, sum = 0.0f;
            for (int64_t k = 0; k < n; ++k) {
                const float x = base[k * H * (D + 1) + H * D + h];
                if (x > m) m = x;
            }
            for (int64_t d = 0; d < D; ++d) orow[h * D + d] = 0.0f;
            for (int64_t k = 0; k < n; ++k) {
                const float *part = base + k * H * (D + 1);
                const float w = expf(part[H * D + h] - m);
                sum += w;
                for (int64_t d = 0; d < D; ++d) orow[h * D + d] += w * part[h * D + d];
            }
            for (int64_t d = 0; d < D; ++d) orow[h * D + d] /= sum;
            a->lse[r * H + h] = m + logf(sum);
        }
    }
    free(scratch);
    free(first);
    return 0;
}

/* Limits the caller checks before calling (stack buffers above). */
int ps_decode_limits(int64_t *head_dim, int64_t *heads, int64_t *block_size, int64_t *lanes) {
    *lanes = PS_LANES; /* head_dim and block_size must be multiples of it */
    *head_dim = PS_MAX_HEAD_DIM;
    *heads = PS_MAX_HEADS;
    *block_size = PS_MAX_BLOCK;
    return 0;
}

int PS_KV_FN(ps_decode_attention)(const ps_decode_args *a) {
    if (a->head_dim > PS_MAX_HEAD_DIM || a->block_size > PS_MAX_BLOCK ||
        a->head_dim % PS_LANES != 0 || a->block_size % PS_LANES != 0 ||
        a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads != 0 ||
        a->num_heads > PS_MAX_HEADS)
        return -1;
    if (a->start_out)
        for (int64_t r = 0; r < a->num_rows; ++r)
            if (a->start_slot[r] >= a->start_rows) return -1;
    /* Fewer rows than threads: runs of each row's blocks (ps_decode_split). Else a task is a
     * row, all its heads; dynamic scheduling evens out rows of different lengths. Why whole
     * rows down to one per thread (rows were split below 4 per thread, a task per KV head): a
     * task of some KV heads read a span of every token row, strided, which the prefetchers
     * cover poorly; whole rows read 1.23-1.7x as fast at 2-7 rows on 2 threads, even of unequal
     * lengths (a Zen 3 EPYC, K/V from DRAM; bench/README.md). */
    const int64_t threads = a->num_threads, rows = a->num_rows;
    if (rows < threads && ps_decode_split(a) == 0) return 0;
    const ps_part whole = {0, INT64_MAX, NULL, NULL};
    /* A thread takes its next row before it starts the current one, so that the current
     * row's last block can ask for the next row's first: without that, every row began with a
     * block's worth of misses in a row (1/16 of a 256-token row). Only while more rows are left
     * than the threads could be holding: at the tail a row taken ahead would wait for its
     * thread while another thread had nothing (with few rows, one thread could take two of
     * them before a second one had started). */
    int64_t taken = 0;
#pragma omp parallel num_threads(a->num_threads)
    {
        int64_t cur = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
        while (cur < rows) {
            int64_t nxt = -1;
            if (rows - __atomic_load_n(&taken, __ATOMIC_RELAXED) > threads)
                nxt = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
            ps_decode_row(a, cur, nxt < rows ? nxt : -1, &whole);
            cur = nxt >= 0 ? nxt : __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
        }
    }
    return 0;
}
/* The bandwidth ceiling of the access pattern, for bench/kernels.py: the same rows and blocks
 * as ps_decode_attention_f32, a row per task (where the kernel has fewer rows than threads it
 * splits them into runs of blocks; this does not), with no attention, only a sum of every key
 * and value float the kernel reads (each block's valid keys, then its values, the next block
 * asked for meanwhile). The scattered 12 KB runs of a block pool read slower than one
 * contiguous buffer (a plain sum over the same blocks measured 28-30 GB/s against 38-40
 * contiguous on 2 Zen 5 cores with huge pages): this tells the kernel's own cost from the
 * layout's. Returns the sum
 * (so that the reads cannot be optimised away). */
double PS_KV_FN(ps_read_blocks)(const ps_decode_args *a) {
    const int64_t D = a->head_dim, BS = a->block_size, token_stride = a->num_kv_heads * D;
    double total = 0.0;
    int64_t taken = 0;
#pragma omp parallel num_threads(a->num_threads) reduction(+ : total)
    {
        /* two sums, so that one add's latency per vector does not pace the loads (a single
         * chain read 0-10% slower on a Zen 3 EPYC: it understated the layout's ceiling) */
        vwsf acc = ps_wsplat(0.0f), acc2 = ps_wsplat(0.0f);
        for (int64_t r = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED); r < a->num_rows;
             r = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED)) {
            const int64_t last = a->seq_lens[r] - 1, lo = ps_row_lo(a, r, BS);
            const int32_t *table = a->block_tables + a->seq_index[r] * a->block_table_stride;
            for (int64_t b = lo / BS; b * BS <= last; ++b) {
                const int64_t t0 = lo > b * BS ? lo - b * BS : 0;
                const int64_t t1 = last - b * BS + 1 < BS ? last - b * BS + 1 : BS;
                const int64_t off = (int64_t)table[b] * BS * token_stride;
                const int has_next = (b + 1) * BS <= last;
                const int64_t next = has_next ? (int64_t)table[b + 1] * BS * token_stride : off;
                for (int pass = 0; pass < 2; ++pass) {
                    const ps_kv_t *src = (pass ? a->v_cache : a->k_cache) + off;
                    const ps_kv_t *pf = (pass ? a->v_cache : a->k_cache) + next;
                    const int64_t n = t1 * token_stride;
                    int64_t i = t0 * token_stride;
                    for (; i + 2 * PS_WIDE_LANES <= n; i += 2 * PS_WIDE_LANES) {
                        if (has_next)
                            for (int j = 0; j < 2 * PS_WIDE_LANES; j += PS_KV_LINE)
                                __builtin_prefetch(pf + i + j, 0, 2);
                        acc += ps_kv_wload(src + i);
                        acc2 += ps_kv_wload(src + i + PS_WIDE_LANES);
                    }
                    for (; i < n; i += PS_WIDE_LANES) acc += ps_kv_wload(src + i);
                }
            }
        }
        acc += acc2;
        for (int j = 0; j < PS_WIDE_LANES; ++j) total += acc[j];
    }
    return total;
}

/* Prefill chunks, tiled (paged_prefill.h): same library, same shape limits. */
#include "paged_prefill.h"
