/*
 * Tiled causal attention of prefill chunks over the paged cache (float32 arithmetic; the
 * cache's element type from ps_kv.h), included by paged_decode.c (one library, one loader).
 *
 * Why this exists: a prefill chunk used to join the decode kernel as one decode row per query
 * token, so every query token read its whole context alone (three query heads per key load at GQA
 * 3): 40-43 useful GFLOP/s for the bench model's and SmolLM2's prompts of 16-512 tokens in the
 * engine on a Zen 4 EPYC (2 threads), against ~190 for the projections around it. Here a tile of up
 * to PS_PF_MR query vectors ((token, head) pairs of one KV head) runs against PS_WIDE_LANES keys at
 * a time like a small GEMM: a task's keys are transposed once into [D][lanes] tiles, so that a
 * score pass is MR accumulators for each of two key vectors (a broadcast query value times a row of
 * keys, no horizontal sums), and each value row is loaded once for PS_PF_NG query vectors. An
 * online softmax per PS_PF_KB keys (running max and sum, the output rescaled) keeps one pass over
 * the keys. Measured against the decode-row path (same process, 2 threads, Zen 4, bench/README.md):
 * 1.4-1.8x for prompts of 128-768 tokens at 9/3, 8/4 and 14/2 heads of 64; 0.8-1.5x at 32. On AVX2
 * (16 registers) a score pass takes two key tiles and a value pass 3 query vectors x half a head of
 * 64: against one tile and one vector (Zen 3, 2 threads, outputs bit-identical) 1.25-1.32x at 8/4
 * heads of 64, 1.12-1.17x at 9/3 and 14/2, 1.19-1.37x at 16/4 of 128.
 *
 * Contract: every key of the chunk (positions seq_len - query_len .. seq_len - 1) is already
 * written to the cache; query token t of a chunk is at position seq_len - query_len + t and
 * sees keys 0 .. its position (causal, no window, nothing merged from a shared prefix). Output
 * rows out[start + t] get every head of that token.
 *
 * All-keys mode (all_keys, a cascade's shared prefixes): a chunk is a group of query rows
 * (decodes of sequences whose tables start with the same blocks) that all see every key of
 * the prefix, with no mask; out and lse get each row's result over the prefix, which the
 * decode kernel then continues over the row's own blocks (start_out in paged_decode.c). The
 * prefix is read in place in panels of PS_PF_PANEL keys, every tile of a task running a panel
 * before the next (the panel stays in L1/L2) while the next panel's lines are requested, and
 * tasks split a group's query vectors so that the threads stay even. Against the C decode
 * kernel reading the prefix once per row (Zen 4, 2 threads, K/V from DRAM, per layer, 8/4 and
 * 9/3 heads of 64): 0.75-0.82x at 8K query x shared tokens, 0.92-0.98x at 16K, 1.01-1.15x at
 * 32K, 1.19-1.50x at 48-128K (bench/README.md, issue #17's eighteenth session).
 */
#ifndef PS_PAGED_PREFILL_H
#define PS_PAGED_PREFILL_H

#include <stdlib.h>

typedef struct {
    const float *query;          /* [T, num_heads, head_dim], rows query_row_stride apart */
    int64_t query_row_stride;
    const ps_kv_t *k_cache;      /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const ps_kv_t *v_cache;
    const int32_t *block_tables; /* [B, block_table_stride] */
    int64_t block_table_stride;
    const int64_t *starts;       /* [n]: first row of the chunk in query / out */
    const int64_t *query_lens;   /* [n]: its tokens */
    const int64_t *seq_lens;     /* [n]: context length after the chunk */
    const int64_t *seq_index;    /* [n]: row of block_tables */
    int64_t num_chunks;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t block_size;
    float scale;
    int32_t num_threads;
    float *out;                  /* [T, num_heads, head_dim], rows out_row_stride apart */
    int64_t out_row_stride;
    /* all_keys != 0: a shared prefix (cascade) instead of causal chunks. Every query row of a
     * chunk sees all seq_lens[c] keys (the prefix, read through table row seq_index[c]), and
     * lse[(starts[c] + t) * num_heads + h] gets each row's log-sum-exp for the merge. */
    int32_t all_keys;
    float *lse;
    /* NULL, or where a chunk's rows are in query: token t of chunk c is query row
     * query_rows[starts[c] + t] (a cascade's groups are scattered rows of the batch); out and
     * lse rows stay starts[c] + t */
    const int64_t *query_rows;
} ps_prefill_args;

#define PS_KT PS_WIDE_LANES /* keys per score tile: one vector of scores per query vector */
#if PS_WIDE_LANES == 16
#define PS_PF_MR 12  /* query vectors per tile: 12 score accumulators of the 32 registers */
#define PS_PF_ACC 24 /* value accumulators (query vectors x D / lanes) per pass */
#else
#define PS_PF_MR 6 /* AVX2's 16 registers */
#define PS_PF_ACC 12
#endif
#define PS_PF_NG 6 /* at most this many query vectors per value pass */
#define PS_PF_SPAN 64 /* query tokens per task (a task transposes its keys once) */
/* Keys per online-softmax update. Why 256 with 16-float vectors: each update costs a tile's
 * vectors a row max, a scalar exp, two horizontal reductions and a rescale of the output sums,
 * paid 4x less often than at 64 keys. Intel Xeon (AVX-512, 2 threads; bench.prefill_ab): with
 * two key tiles per score pass (below) 1.06-1.12x at the bench's six cases (64 keys and one
 * tile: base), 256 keys alone 0.98-1.05x; the 8-float build (-mno-avx512f) measured 0.97-1.03x
 * at 256 and keeps 64. Not bit-identical to 64 (the running max steps differ): float32
 * rounding only, the parity suites hold. */
#ifndef PS_PF_KB
#if PS_WIDE_LANES == 16
#define PS_PF_KB 256
#else
#define PS_PF_KB 64
#endif
#endif
#if PS_WIDE_LANES == 16 && defined(__AVX512F__)
#include <immintrin.h>
/* dst[d * 16 + l] = src[l][d] for d < 16: a 16 x 16 transpose in registers (four rounds of
 * shuffles, 64 in all) instead of 256 scalar loads and stores */
static inline void ps_pf_tr16(const ps_kv_t *const *src, int64_t d0, float *dst) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = (__m512)ps_kv_wload(src[i] + d0);
    for (int k = 0; k < 8; ++k) {
        t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; ++k) {
        const __m512d a0 = _mm512_castps_pd(t[4 * k]), a1 = _mm512_castps_pd(t[4 * k + 1]);
        const __m512d a2 = _mm512_castps_pd(t[4 * k + 2]), a3 = _mm512_castps_pd(t[4 * k + 3]);
        r[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
        r[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
        r[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
        r[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
    }
    /* r[4k + m], 128-bit lane L: rows 4k .. 4k+3 of column 4L + m */
    for (int p = 0; p < 2; ++p)
        for (int m = 0; m < 4; ++m) {
            t[8 * p + m] = _mm512_shuffle_f32x4(r[8 * p + m], r[8 * p + 4 + m], 0x88);
            t[8 * p + 4 + m] = _mm512_shuffle_f32x4(r[8 * p + m], r[8 * p + 4 + m], 0xdd);
        }
    for (int m = 0; m < 4; ++m) {
        _mm512_storeu_ps(dst + m * 16, _mm512_shuffle_f32x4(t[m], t[8 + m], 0x88));
        _mm512_storeu_ps(dst + (8 + m) * 16, _mm512_shuffle_f32x4(t[m], t[8 + m], 0xdd));
        _mm512_storeu_ps(dst + (4 + m) * 16, _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0x88));
        _mm512_storeu_ps(dst + (12 + m) * 16, _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0xdd));
    }
}
#define PS_PF_TR_VEC 16
#elif PS_WIDE_LANES == 8 && defined(__AVX__)
#include <immintrin.h>
/* the same for 8 keys x 8 dimensions (AVX2 builds): 24 shuffles for 64 values */
static inline void ps_pf_tr8(const ps_kv_t *const *src, int64_t d0, float *dst) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = (__m256)ps_kv_load8(src[i] + d0);
    for (int k = 0; k < 4; ++k) {
        t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 2; ++k) { /* r[4k + m], 128-bit lane L: rows 4k .. 4k+3, column 4L + m */
        r[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
        r[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xee);
        r[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
        r[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xee);
    }
    for (int m = 0; m < 4; ++m) {
        _mm256_storeu_ps(dst + m * 8, _mm256_permute2f128_ps(r[m], r[4 + m], 0x20));
        _mm256_storeu_ps(dst + (4 + m) * 8, _mm256_permute2f128_ps(r[m], r[4 + m], 0x31));
    }
}
#define PS_PF_TR_VEC 8
#else
#define PS_PF_TR_VEC 0
#endif

/* rows[i] = KV head g's row of key p0 + i in cache (i < n): the blocks are walked, one
 * division per call instead of one per key */
static inline void ps_pf_rows(const ps_kv_t *cache, const ps_prefill_args *a,
                              const int32_t *table, int64_t g, const int64_t D, int64_t p0,
                              int64_t n, const ps_kv_t **rows) {
    const int64_t BS = a->block_size, token_stride = a->num_kv_heads * D;
    int64_t blk = p0 / BS, off = p0 % BS;
    for (int64_t i = 0; i < n; ++i) {
        rows[i] = cache + ((int64_t)table[blk] * BS + off) * token_stride + g * D;
        if (++off == BS) {
            off = 0;
            ++blk;
        }
    }
}

/* Keys [k_lo, kmax) of KV head g into kt (k_lo a multiple of PS_KT): tile j holds keys
 * k_lo + j*KT .. k_lo + j*KT+KT-1 as [D][KT] (zeros past kmax: those are masked anyway).
 * A whole tile of keys is transposed in registers (16 x 16 on AVX-512, 8 x 8 on AVX2). */
static inline void ps_pf_transpose_keys(const ps_prefill_args *a, const int32_t *table,
                                        int64_t g, int64_t k_lo, int64_t kmax, const int64_t D,
                                        float *kt) {
    const int64_t tiles = (kmax - k_lo + PS_KT - 1) / PS_KT;
    for (int64_t j = 0; j < tiles; ++j) {
        float *dst = kt + j * D * PS_KT;
        const ps_kv_t *src[PS_KT];
        const int64_t p0 = k_lo + j * PS_KT;
        const int n = kmax - p0 < PS_KT ? (int)(kmax - p0) : PS_KT;
        ps_pf_rows(a->k_cache, a, table, g, D, p0, n, src);
#if PS_PF_TR_VEC == 16
        if (n == PS_KT) {
            for (int64_t d0 = 0; d0 < D; d0 += 16) ps_pf_tr16(src, d0, dst + d0 * PS_KT);
            continue;
        }
#elif PS_PF_TR_VEC == 8
        if (n == PS_KT) {
            for (int64_t d0 = 0; d0 < D; d0 += 8) ps_pf_tr8(src, d0, dst + d0 * PS_KT);
            continue;
        }
#endif
        for (int l = 0; l < PS_KT; ++l) {
            if (l >= n) {
                for (int64_t d = 0; d < D; ++d) dst[d * PS_KT + l] = 0.0f;
                continue;
            }
            for (int64_t d = 0; d < D; ++d) dst[d * PS_KT + l] = ps_kv_float(src[l][d]);
        }
    }
}

/* Value sums over nkeys keys for nv (<= PS_PF_NG) query vectors, d-vectors [j0, j0 + nj) of
 * their heads: o[i] += sum_l p[i][l] * V[l]. nv and nj are constants at the call sites, so the
 * nv x nj accumulators stay in registers. */
static inline __attribute__((always_inline)) void ps_pf_values(
    float (*o)[PS_MAX_HEAD_DIM], const float (*p)[PS_PF_KB], const int nv, const int64_t j0,
    const int nj, const ps_kv_t *const *vrows, int64_t nkeys) {
    vwsf acc[PS_PF_NG][PS_MAX_HEAD_DIM / PS_WIDE_LANES];
    for (int i = 0; i < nv; ++i)
        for (int j = 0; j < nj; ++j) acc[i][j] = ps_wload(&o[i][(j0 + j) * PS_WIDE_LANES]);
    for (int64_t l = 0; l < nkeys; ++l) {
        const ps_kv_t *v = vrows[l] + j0 * PS_WIDE_LANES;
        for (int j = 0; j < nj; ++j) {
            const vwsf vv = ps_kv_wload(v + j * PS_WIDE_LANES);
            for (int i = 0; i < nv; ++i) acc[i][j] += ps_wsplat(p[i][l]) * vv;
        }
    }
    for (int i = 0; i < nv; ++i)
        for (int j = 0; j < nj; ++j) ps_wstore(&o[i][(j0 + j) * PS_WIDE_LANES], acc[i][j]);
}

/* ps_pf_values with nv as a constant (1 .. PS_PF_NG), and nj too where it is 4 or 8 (the
 * common heads' passes): the accumulators stay in registers; other widths run with nj read
 * at run time, as every width did before the AVX2 half-head passes. */
static inline __attribute__((always_inline)) void ps_pf_values_pass(
    float (*o)[PS_MAX_HEAD_DIM], const float (*p)[PS_PF_KB], const int nv, const int64_t j0,
    const int nj, const ps_kv_t *const *vrows, int64_t nkeys) {
    switch (nv) {
#define PS_PF_V(k)                                                                         \
    case k:                                                                                \
        if (nj == 4) ps_pf_values(o, p, k, j0, 4, vrows, nkeys);                           \
        else if (nj == 8) ps_pf_values(o, p, k, j0, 8, vrows, nkeys);                      \
        else ps_pf_values(o, p, k, j0, nj, vrows, nkeys);                                  \
        break;
        PS_PF_V(1) PS_PF_V(2) PS_PF_V(3) PS_PF_V(4) PS_PF_V(5) PS_PF_V(6)
#undef PS_PF_V
    default: break;
    }
}

/* Scores s[i] of key tile jt (keys kj0 ..) into p, -inf for the keys after vector i's token. */
static inline __attribute__((always_inline)) void ps_pf_mask_store(
    float (*p)[PS_PF_KB], vwsf *s, const int nv, int64_t jt, int64_t kj0, int64_t first,
    const int64_t *pos) {
    if (kj0 + PS_KT - 1 > first) { /* some key after some vector's token: masked */
        vwsi keys;
        for (int j = 0; j < PS_WIDE_LANES; ++j) keys[j] = (int32_t)kj0 + j;
        const vwsf ninf = ps_wsplat(-INFINITY);
        for (int i = 0; i < nv; ++i) {
            const vwsi after = keys > (int32_t)pos[i];
            s[i] = (vwsf)(((vwsi)s[i] & ~after) | ((vwsi)ninf & after));
        }
    }
    for (int i = 0; i < nv; ++i) ps_wstore(&p[i][jt * PS_KT], s[i]);
}

/* A shared prefix's next panel, asked for (into L2) while the current one is computed: keys
 * [next, end) of KV head g still to request, per_step keys at each of the tiles' softmax
 * updates, so that the requests spread over the panel's work instead of the next panel's
 * transposition and first value pass waiting on DRAM. */
typedef struct {
    const int32_t *table;
    int64_t g, next, end, per_step;
} ps_pf_ahead;

static inline void ps_pf_ahead_step(const ps_prefill_args *a, ps_pf_ahead *pa, const int64_t D) {
    if (!pa || pa->next >= pa->end) return;
    const int64_t BS = a->block_size, token_stride = a->num_kv_heads * D;
    const int64_t stop = pa->next + pa->per_step < pa->end ? pa->next + pa->per_step : pa->end;
    for (int64_t p = pa->next; p < stop; ++p) {
        const int64_t off = ((int64_t)pa->table[p / BS] * BS + p % BS) * token_stride + pa->g * D;
        for (int64_t d = 0; d < D; d += PS_KV_LINE) {
            __builtin_prefetch(a->k_cache + off + d, 0, 2);
            __builtin_prefetch(a->v_cache + off + d, 0, 2);
        }
    }
    pa->next = stop;
}

/* A tile's running state: its nv query vectors (consecutive (token, head) pairs of one KV
 * head, token-major, pre-scaled), their output sums, running max and sum, and positions. */
typedef struct {
    float q[PS_PF_MR][PS_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float o[PS_PF_MR][PS_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float m[PS_PF_MR], l[PS_PF_MR];
    int64_t pos[PS_PF_MR]; /* the last key each vector sees */
} ps_pf_state;

static inline __attribute__((always_inline)) void ps_pf_tile_init(
    const ps_prefill_args *a, int64_t c, int64_t g, int64_t v0, int nv, const int64_t D,
    const int64_t G, ps_pf_state *st) {
    const int64_t first_pos = a->seq_lens[c] - a->query_lens[c];
    for (int i = 0; i < nv; ++i) {
        const int64_t t = (v0 + i) / G, h = g * G + (v0 + i) % G;
        const int64_t row = a->query_rows ? a->query_rows[a->starts[c] + t] : a->starts[c] + t;
        const float *src = a->query + row * a->query_row_stride + h * D;
        for (int64_t d = 0; d < D; ++d) {
            st->q[i][d] = src[d] * a->scale;
            st->o[i][d] = 0.0f;
        }
        st->m[i] = -INFINITY;
        st->l[i] = 0.0f;
        st->pos[i] = a->all_keys ? a->seq_lens[c] - 1 : first_pos + t;
    }
}

/* The tile against keys [k_lo, k_hi) (k_lo a multiple of PS_PF_KB, k_hi past no vector's last
 * key), whose transposed tiles start at kt; PS_PF_KB keys per softmax update (the scores of
 * PS_PF_KB / PS_KT key tiles go to p first): the row max, exp and rescale of the output are paid
 * once per PS_PF_KB keys, not per vector of keys. */
static inline __attribute__((always_inline)) void ps_pf_tile_keys(
    const ps_prefill_args *a, const int32_t *table, int64_t g, int nv, const float *kt,
    int64_t k_lo, int64_t k_hi, const int64_t D, ps_pf_state *st, ps_pf_ahead *ahead) {
    const int64_t DV = D / PS_WIDE_LANES;
    float(*q)[PS_MAX_HEAD_DIM] = st->q;
    float(*o)[PS_MAX_HEAD_DIM] = st->o;
    float *m = st->m, *l = st->l;
    const int64_t *pos = st->pos;
    float p[PS_PF_MR][PS_PF_KB] __attribute__((aligned(64)));
    const int64_t first = pos[0];
    const vwsf ninf = ps_wsplat(-INFINITY);
    const ps_kv_t *vrows[PS_PF_KB];
    for (int64_t k0 = k_lo; k0 < k_hi; k0 += PS_PF_KB) {
        ps_pf_ahead_step(a, ahead, D);
        const int64_t nkeys = k_hi - k0 < PS_PF_KB ? k_hi - k0 : PS_PF_KB;
        const int64_t ntiles = (nkeys + PS_KT - 1) / PS_KT;
        int64_t jt = 0;
#ifndef PS_PF_TWO_TILES
#define PS_PF_TWO_TILES 1
#endif
#if PS_PF_TWO_TILES
        /* two key tiles per pass: 2 x nv score accumulators (AVX2: 12 of the 16 registers at
         * nv 6, so that enough independent FMA chains cover the FMA's latency, which one
         * tile's 6 chains could not; AVX-512: 24 of the 32 at nv 12, where one tile's pass
         * loaded a query value per FMA), and each broadcast query value serves two key
         * vectors. AVX-512 with 64 keys per update: 0.99-1.07x (controls 0.94-1.03), with 256
         * (PS_PF_KB) the pair 1.06-1.12x. PS_PF_TWO_TILES=0: one tile a pass (A/B builds). */
        for (; jt + 1 < ntiles; jt += 2) {
            const int64_t kj0 = k0 + jt * PS_KT;
            vwsf s[PS_PF_MR], s2[PS_PF_MR];
            for (int i = 0; i < nv; ++i) s[i] = s2[i] = ps_wsplat(0.0f);
            const float *kj = kt + ((kj0 - k_lo) / PS_KT) * D * PS_KT;
            for (int64_t d = 0; d < D; ++d) {
                const vwsf kv = ps_wload(kj + d * PS_KT);
                const vwsf kv2 = ps_wload(kj + (D + d) * PS_KT);
                for (int i = 0; i < nv; ++i) {
                    const vwsf qv = ps_wsplat(q[i][d]);
                    s[i] += qv * kv;
                    s2[i] += qv * kv2;
                }
            }
            ps_pf_mask_store(p, s, nv, jt, kj0, first, pos);
            ps_pf_mask_store(p, s2, nv, jt + 1, kj0 + PS_KT, first, pos);
        }
#endif
        for (; jt < ntiles; ++jt) {
            const int64_t kj0 = k0 + jt * PS_KT;
            vwsf s[PS_PF_MR];
            for (int i = 0; i < nv; ++i) s[i] = ps_wsplat(0.0f);
            const float *kj = kt + ((kj0 - k_lo) / PS_KT) * D * PS_KT;
            for (int64_t d = 0; d < D; ++d) {
                const vwsf kv = ps_wload(kj + d * PS_KT);
                for (int i = 0; i < nv; ++i) s[i] += ps_wsplat(q[i][d]) * kv;
            }
            ps_pf_mask_store(p, s, nv, jt, kj0, first, pos);
        }
        for (int i = 0; i < nv; ++i) {
            vwsf bm = ps_wload(p[i]);
            for (int64_t jt = 1; jt < ntiles; ++jt) {
                const vwsf x = ps_wload(&p[i][jt * PS_KT]);
                bm = ps_wvmax(x, bm);
            }
            const float bmax = ps_wmax(bm);
            const float new_m = bmax > m[i] ? bmax : m[i];
            const float alpha = expf(m[i] - new_m); /* 0 on the first keys (m = -inf) */
            const vwsf mv = ps_wsplat(new_m);
            vwsf sum = ps_wsplat(0.0f);
            for (int64_t jt = 0; jt < ntiles; ++jt) {
                const vwsf x = ps_wload(&p[i][jt * PS_KT]);
                vwsf e = ps_wexp(x - mv);
                const vwsi masked = x == ninf; /* no weight (exp only clamps to ~1e-38) */
                e = (vwsf)((vwsi)e & ~masked);
                ps_wstore(&p[i][jt * PS_KT], e);
                sum += e;
            }
            l[i] = l[i] * alpha + ps_wsum(sum);
            m[i] = new_m;
            if (alpha != 1.0f)
                for (int64_t dd = 0; dd < DV; ++dd)
                    ps_wstore(&o[i][dd * PS_WIDE_LANES],
                              ps_wload(&o[i][dd * PS_WIDE_LANES]) * ps_wsplat(alpha));
        }
        ps_pf_rows(a->v_cache, a, table, g, D, k0, nkeys, vrows);
        /* value passes: query vectors x d-vectors of accumulators in registers; a head whose
         * whole width fits for at least 3 query vectors goes in one pass per group (up to
         * PS_PF_NG vectors), a wider one (head_dim 64 on AVX2) in tiles of 3 vectors x
         * PS_PF_ACC / 3 d-vectors: one vector at a time loaded each value row for 8 FMAs */
        if (DV * 3 <= PS_PF_ACC) {
            const int ng = PS_PF_ACC / DV > PS_PF_NG ? PS_PF_NG : (int)(PS_PF_ACC / DV);
            for (int i0 = 0; i0 < nv; i0 += ng) {
                const int n = nv - i0 < ng ? nv - i0 : ng;
                ps_pf_values_pass(o + i0, (const float(*)[PS_PF_KB])(p + i0), n, 0, (int)DV,
                                  vrows, nkeys);
            }
        } else {
            const int nj = PS_PF_ACC / 3;
            for (int i0 = 0; i0 < nv; i0 += 3) {
                const int n = nv - i0 < 3 ? nv - i0 : 3;
                for (int64_t j0 = 0; j0 < DV; j0 += nj) {
                    const int m = DV - j0 < nj ? (int)(DV - j0) : nj;
                    ps_pf_values_pass(o + i0, (const float(*)[PS_PF_KB])(p + i0), n, j0, m,
                                      vrows, nkeys);
                }
            }
        }
    }
}

/* Output rows (and, for a shared prefix, log-sum-exps) of a finished tile. */
static inline __attribute__((always_inline)) void ps_pf_tile_finish(
    const ps_prefill_args *a, int64_t c, int64_t g, int64_t v0, int nv, const int64_t D,
    const int64_t G, const ps_pf_state *st) {
    for (int i = 0; i < nv; ++i) {
        const int64_t t = (v0 + i) / G, h = g * G + (v0 + i) % G;
        float *dst = a->out + (a->starts[c] + t) * a->out_row_stride + h * D;
        const float inv = 1.0f / st->l[i];
        for (int64_t d = 0; d < D; ++d) dst[d] = st->o[i][d] * inv;
        if (a->all_keys)
            a->lse[(a->starts[c] + t) * a->num_heads + h] = st->m[i] + logf(st->l[i]);
    }
}

/* ps_pf_tile_keys with nv and the common head sizes as constants (the score accumulators stay
 * in registers), one function per nv: the causal and the shared-prefix tasks call the same
 * ones (inlining them into each task doubled the library's compile time). */
typedef void (*ps_pf_keys_fn)(const ps_prefill_args *, const int32_t *, int64_t, const float *,
                              int64_t, int64_t, ps_pf_state *, ps_pf_ahead *);
#define PS_PF_KEYS_FN(k)                                                                       \
    static void ps_pf_keys_##k(const ps_prefill_args *a, const int32_t *table, int64_t g,     \
                               const float *kt, int64_t k_lo, int64_t k_hi, ps_pf_state *st,  \
                               ps_pf_ahead *ah) {                                              \
        if (a->head_dim == 64) ps_pf_tile_keys(a, table, g, k, kt, k_lo, k_hi, 64, st, ah);   \
        else if (a->head_dim == 128)                                                           \
            ps_pf_tile_keys(a, table, g, k, kt, k_lo, k_hi, 128, st, ah);                      \
        else ps_pf_tile_keys(a, table, g, k, kt, k_lo, k_hi, a->head_dim, st, ah);             \
    }
#define PS_PF_KEYS_PTR(k) ps_pf_keys_##k,
#if PS_PF_MR > 6
#define PS_PF_EACH_NV(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12)
#else
#define PS_PF_EACH_NV(X) X(1) X(2) X(3) X(4) X(5) X(6)
#endif
PS_PF_EACH_NV(PS_PF_KEYS_FN)
static const ps_pf_keys_fn ps_pf_keys[PS_PF_MR + 1] = {NULL, PS_PF_EACH_NV(PS_PF_KEYS_PTR)};
#undef PS_PF_KEYS_FN
#undef PS_PF_KEYS_PTR

/* Task: chunk c, KV head g, query tokens [t0, t1) of the chunk, causal: each tile against
 * keys 0 .. its last vector's position (all of them transposed in kt first). */
static void ps_pf_task(const ps_prefill_args *a, int64_t c, int64_t g, int64_t t0, int64_t t1,
                       float *kt) {
    const int64_t D = a->head_dim, G = a->num_heads / a->num_kv_heads;
    const int32_t *table = a->block_tables + a->seq_index[c] * a->block_table_stride;
    const int64_t first_pos = a->seq_lens[c] - a->query_lens[c];
    ps_pf_transpose_keys(a, table, g, 0, first_pos + t1, D, kt);
    const int64_t v1 = t1 * G;
    ps_pf_state st;
    for (int64_t v = t0 * G; v < v1; v += PS_PF_MR) {
        const int nv = v1 - v < PS_PF_MR ? (int)(v1 - v) : PS_PF_MR;
        ps_pf_tile_init(a, c, g, v, nv, D, G, &st);
        ps_pf_keys[nv](a, table, g, kt, 0, st.pos[nv - 1] + 1, &st, NULL);
        ps_pf_tile_finish(a, c, g, v, nv, D, G, &st);
    }
}

/* Keys per panel of a shared prefix: every tile of a task runs a panel before the next, so
 * that the panel's transposed keys and its value rows are read from L1/L2 by all of them
 * (each tile streaming the whole prefix went through L2 and L3 at long prefixes). */
#define PS_PF_PANEL 256

/* Task of a shared prefix: chunk c's query vectors [v0, v1) of KV head g against all its
 * keys, panel after panel; st holds the task's tiles. */
static void ps_pf_prefix_task(const ps_prefill_args *a, int64_t c, int64_t g, int64_t v0,
                              int64_t v1, float *kt, ps_pf_state *st) {
    const int64_t D = a->head_dim, G = a->num_heads / a->num_kv_heads;
    const int32_t *table = a->block_tables + a->seq_index[c] * a->block_table_stride;
    const int64_t keys = a->seq_lens[c];
    const int64_t tiles = (v1 - v0 + PS_PF_MR - 1) / PS_PF_MR;
    for (int64_t i = 0; i < tiles; ++i) {
        const int64_t v = v0 + i * PS_PF_MR;
        ps_pf_tile_init(a, c, g, v, v1 - v < PS_PF_MR ? (int)(v1 - v) : PS_PF_MR, D, G, st + i);
    }
    for (int64_t k_lo = 0; k_lo < keys; k_lo += PS_PF_PANEL) {
        const int64_t k_hi = keys - k_lo < PS_PF_PANEL ? keys : k_lo + PS_PF_PANEL;
        ps_pf_transpose_keys(a, table, g, k_lo, k_hi, D, kt);
        /* the next panel's keys, spread over this one's tiles x softmax updates */
        const int64_t next_hi = keys - k_hi < PS_PF_PANEL ? keys : k_hi + PS_PF_PANEL;
        const int64_t steps = tiles * ((k_hi - k_lo + PS_PF_KB - 1) / PS_PF_KB);
        ps_pf_ahead ahead = {table, g, k_hi, next_hi, (next_hi - k_hi + steps - 1) / steps};
        for (int64_t i = 0; i < tiles; ++i) {
            const int64_t v = v0 + i * PS_PF_MR;
            ps_pf_keys[v1 - v < PS_PF_MR ? v1 - v : PS_PF_MR](a, table, g, kt, k_lo, k_hi,
                                                               st + i, &ahead);
        }
    }
    for (int64_t i = 0; i < tiles; ++i) {
        const int64_t v = v0 + i * PS_PF_MR;
        ps_pf_tile_finish(a, c, g, v, v1 - v < PS_PF_MR ? (int)(v1 - v) : PS_PF_MR, D, G,
                          st + i);
    }
}

/* head_dim must be a multiple of this (the vectors' width); the caller checks */
int ps_prefill_lanes(void) { return PS_WIDE_LANES; }

/* How many tasks share each (chunk, KV head) of a shared prefix: enough that no task holds
 * more than PS_PF_MAX_TILES tiles, and, where a chunk's tiles allow, a multiple of the threads
 * across its KV heads (3 KV heads on 2 threads as 3 tasks left a thread idle a third of the
 * time). Fewer, larger tasks transpose each panel of keys fewer times. */
#define PS_PF_MAX_TILES 32
static int64_t ps_pf_parts(const ps_prefill_args *a, int64_t c) {
    const int64_t G = a->num_heads / a->num_kv_heads;
    const int64_t tiles = (a->query_lens[c] * G + PS_PF_MR - 1) / PS_PF_MR;
    const int64_t threads = a->num_threads > 0 ? a->num_threads : 1;
    int64_t n = (tiles + PS_PF_MAX_TILES - 1) / PS_PF_MAX_TILES;
    while ((a->num_kv_heads * n) % threads != 0 && n < tiles) ++n;
    return n > 0 ? n : 1;
}

/* The all-keys mode (a cascade's shared prefixes): tasks (chunk, part of its query vectors,
 * KV head), taken dynamically, each running its tiles panel after panel. */
static int ps_pf_prefix_attention(const ps_prefill_args *a) {
    const int64_t G = a->num_heads / a->num_kv_heads;
    int64_t tasks = 0, max_tiles = 1;
    for (int64_t c = 0; c < a->num_chunks; ++c) {
        const int64_t n = ps_pf_parts(a, c);
        const int64_t tiles = (a->query_lens[c] * G + PS_PF_MR - 1) / PS_PF_MR;
        const int64_t per = (tiles + n - 1) / n;
        max_tiles = per > max_tiles ? per : max_tiles;
        tasks += n * a->num_kv_heads;
    }
    const size_t kt_bytes = (size_t)PS_PF_PANEL * a->head_dim * sizeof(float);
    const size_t st_bytes = (size_t)max_tiles * sizeof(ps_pf_state);
    int64_t taken = 0, done = 0;
#pragma omp parallel num_threads(a->num_threads)
    {
        float *kt = aligned_alloc(64, kt_bytes);
        ps_pf_state *st = aligned_alloc(64, st_bytes);
        if (kt && st) {
            for (int64_t task = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED); task < tasks;
                 task = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED)) {
                int64_t rest = task, c = 0, n = ps_pf_parts(a, 0);
                while (rest >= n * a->num_kv_heads) {
                    rest -= n * a->num_kv_heads;
                    n = ps_pf_parts(a, ++c);
                }
                const int64_t part = rest / a->num_kv_heads, g = rest % a->num_kv_heads;
                const int64_t vectors = a->query_lens[c] * G;
                const int64_t per = ((vectors + PS_PF_MR - 1) / PS_PF_MR + n - 1) / n * PS_PF_MR;
                const int64_t v0 = part * per;
                const int64_t v1 = v0 + per < vectors ? v0 + per : vectors;
                if (v0 < v1) ps_pf_prefix_task(a, c, g, v0, v1, kt, st);
                __atomic_fetch_add(&done, 1, __ATOMIC_RELAXED);
            }
        }
        free(kt);
        free(st);
    }
    return done == tasks ? 0 : -2; /* -2: no thread could allocate its buffers */
}

int PS_KV_FN(ps_prefill_attention)(const ps_prefill_args *a) {
    if (a->head_dim > PS_MAX_HEAD_DIM || a->head_dim % PS_WIDE_LANES != 0 ||
        a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads != 0 || a->block_size <= 0)
        return -1;
    if (a->all_keys) return ps_pf_prefix_attention(a);
    /* tasks: (chunk, KV head, span of PS_PF_SPAN tokens), the chunks' last spans (the most
     * keys) first, taken dynamically */
    int64_t spans = 0, kmax = 0;
    for (int64_t c = 0; c < a->num_chunks; ++c) {
        spans += (a->query_lens[c] + PS_PF_SPAN - 1) / PS_PF_SPAN;
        kmax = a->seq_lens[c] > kmax ? a->seq_lens[c] : kmax;
    }
    const int64_t tasks = spans * a->num_kv_heads;
    const size_t kt_bytes =
        (size_t)((kmax + PS_KT - 1) / PS_KT) * PS_KT * a->head_dim * sizeof(float);
    int64_t taken = 0, done = 0;
#pragma omp parallel num_threads(a->num_threads)
    {
        /* a thread that gets no buffer takes no task; the others take them all */
        float *kt = aligned_alloc(64, (kt_bytes + 63) / 64 * 64);
        if (kt) {
            for (int64_t task = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED); task < tasks;
                 task = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED)) {
                int64_t span = task / a->num_kv_heads;
                const int64_t g = task % a->num_kv_heads;
                int64_t c = 0, n = (a->query_lens[0] + PS_PF_SPAN - 1) / PS_PF_SPAN;
                while (span >= n) {
                    span -= n;
                    ++c;
                    n = (a->query_lens[c] + PS_PF_SPAN - 1) / PS_PF_SPAN;
                }
                const int64_t s = n - 1 - span; /* last span first */
                const int64_t t0 = s * PS_PF_SPAN;
                const int64_t t1 = t0 + PS_PF_SPAN < a->query_lens[c] ? t0 + PS_PF_SPAN
                                                                       : a->query_lens[c];
                ps_pf_task(a, c, g, t0, t1, kt);
                __atomic_fetch_add(&done, 1, __ATOMIC_RELAXED);
            }
            free(kt);
        }
    }
    return done == tasks ? 0 : -2; /* -2: no thread could allocate its key buffer */
}

#endif
