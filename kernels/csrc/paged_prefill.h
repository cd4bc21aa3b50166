/*
 * Tiled causal attention of prefill chunks over the paged cache (float32), included by
 * paged_decode.c (one library, one loader).
 *
 * Why this exists: a prefill chunk used to join the decode kernel as one decode row per query
 * token, so every query token read its whole context alone (three query heads per key load at
 * GQA 3): 40-43 useful GFLOP/s for the bench model's and SmolLM2's prompts of 16-512 tokens in
 * the engine on a Zen 4 EPYC (2 threads), against ~190 for the projections around it. Here a
 * tile of up to PS_PF_MR query vectors ((token, head) pairs of one KV head) runs against
 * PS_WIDE_LANES keys at a time like a small GEMM: a task's keys are transposed once into
 * [D][lanes] tiles, so that a score tile is MR accumulators of one key vector each (a broadcast
 * query value times a row of keys, no horizontal sums), and each value row is loaded once for
 * PS_PF_NG query vectors. An online softmax per PS_PF_KB keys (running max and sum, the output
 * rescaled) keeps one pass over the keys. Measured against the decode-row path (same process,
 * 2 threads, Zen 4, bench/README.md): 1.4-1.8x for prompts of 128-768 tokens at 9/3, 8/4 and
 * 14/2 heads of 64; 0.8-1.5x at 32. On AVX2 (16 registers) a score pass takes two key tiles
 * and a value pass 3 query vectors x half a head of 64: against one tile and one vector (Zen 3,
 * 2 threads, outputs bit-identical) 1.25-1.32x at 8/4 heads of 64, 1.12-1.17x at 9/3 and 14/2,
 * 1.19-1.37x at 16/4 of 128.
 *
 * Contract: every key of the chunk (positions seq_len - query_len .. seq_len - 1) is already
 * written to the cache; query token t of a chunk is at position seq_len - query_len + t and
 * sees keys 0 .. its position (causal, no window, nothing merged from a shared prefix). Output
 * rows out[start + t] get every head of that token.
 */
#ifndef PS_PAGED_PREFILL_H
#define PS_PAGED_PREFILL_H

#include <stdlib.h>

typedef struct {
    const float *query;          /* [T, num_heads, head_dim], rows query_row_stride apart */
    int64_t query_row_stride;
    const float *k_cache;        /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const float *v_cache;
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
#define PS_PF_KB 64   /* keys per online-softmax update */
/* Keys [0, kmax) of KV head g into kt: tile j holds keys j*KT .. j*KT+KT-1 as [D][KT]
 * (zeros past kmax: those are masked anyway). */
static inline void ps_pf_transpose_keys(const ps_prefill_args *a, const int32_t *table,
                                        int64_t g, int64_t kmax, const int64_t D, float *kt) {
    const int64_t BS = a->block_size, token_stride = a->num_kv_heads * D;
    const int64_t tiles = (kmax + PS_KT - 1) / PS_KT;
    for (int64_t j = 0; j < tiles; ++j) {
        float *dst = kt + j * D * PS_KT;
        for (int64_t l = 0; l < PS_KT; ++l) {
            const int64_t p = j * PS_KT + l;
            if (p >= kmax) {
                for (int64_t d = 0; d < D; ++d) dst[d * PS_KT + l] = 0.0f;
                continue;
            }
            const float *src = a->k_cache + ((int64_t)table[p / BS] * BS + p % BS) * token_stride +
                               g * D;
            for (int64_t d = 0; d < D; ++d) dst[d * PS_KT + l] = src[d];
        }
    }
}

/* Value sums over nkeys keys for nv (<= PS_PF_NG) query vectors, d-vectors [j0, j0 + nj) of
 * their heads: o[i] += sum_l p[i][l] * V[l]. nv and nj are constants at the call sites, so the
 * nv x nj accumulators stay in registers. */
static inline __attribute__((always_inline)) void ps_pf_values(
    float (*o)[PS_MAX_HEAD_DIM], const float (*p)[PS_PF_KB], const int nv, const int64_t j0,
    const int nj, const float *const *vrows, int64_t nkeys) {
    vwsf acc[PS_PF_NG][PS_MAX_HEAD_DIM / PS_WIDE_LANES];
    for (int i = 0; i < nv; ++i)
        for (int j = 0; j < nj; ++j) acc[i][j] = ps_wload(&o[i][(j0 + j) * PS_WIDE_LANES]);
    for (int64_t l = 0; l < nkeys; ++l) {
        const float *v = vrows[l] + j0 * PS_WIDE_LANES;
        for (int j = 0; j < nj; ++j) {
            const vwsf vv = ps_wload(v + j * PS_WIDE_LANES);
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
    const int nj, const float *const *vrows, int64_t nkeys) {
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

/* One tile of nv query vectors (consecutive (token, head) pairs of KV head g, token-major)
 * against keys 0 .. the last vector's position, PS_PF_KB keys per softmax update (the scores
 * of PS_PF_KB / PS_KT key tiles go to p first): the row max, exp and rescale of the output are
 * paid once per PS_PF_KB keys, not per vector of keys. */
static inline __attribute__((always_inline)) void ps_pf_tile(
    const ps_prefill_args *a, const int32_t *table, int64_t c, int64_t g, int64_t v0, int nv,
    const float *kt, const int64_t D, const int64_t G) {
    const int64_t BS = a->block_size, token_stride = a->num_kv_heads * D;
    const int64_t DV = D / PS_WIDE_LANES;
    const int64_t first_pos = a->seq_lens[c] - a->query_lens[c];
    float q[PS_PF_MR][PS_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float o[PS_PF_MR][PS_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float p[PS_PF_MR][PS_PF_KB] __attribute__((aligned(64)));
    float m[PS_PF_MR], l[PS_PF_MR];
    int64_t pos[PS_PF_MR];
    for (int i = 0; i < nv; ++i) {
        const int64_t t = (v0 + i) / G, h = g * G + (v0 + i) % G;
        const float *src = a->query + (a->starts[c] + t) * a->query_row_stride + h * D;
        for (int64_t d = 0; d < D; ++d) {
            q[i][d] = src[d] * a->scale;
            o[i][d] = 0.0f;
        }
        m[i] = -INFINITY;
        l[i] = 0.0f;
        pos[i] = first_pos + t;
    }
    const int64_t last = pos[nv - 1], first = pos[0];
    const vwsf ninf = ps_wsplat(-INFINITY);
    const float *vrows[PS_PF_KB];
    for (int64_t k0 = 0; k0 <= last; k0 += PS_PF_KB) {
        const int64_t nkeys = last - k0 + 1 < PS_PF_KB ? last - k0 + 1 : PS_PF_KB;
        const int64_t ntiles = (nkeys + PS_KT - 1) / PS_KT;
        int64_t jt = 0;
#if PS_WIDE_LANES == 8
        /* two key tiles per pass on AVX2: 2 x nv score accumulators (12 of the 16 registers at
         * nv 6), so that enough independent FMA chains cover the FMA's latency (one tile's 6
         * chains could not), and each broadcast query value serves two key vectors */
        for (; jt + 1 < ntiles; jt += 2) {
            const int64_t kj0 = k0 + jt * PS_KT;
            vwsf s[PS_PF_MR], s2[PS_PF_MR];
            for (int i = 0; i < nv; ++i) s[i] = s2[i] = ps_wsplat(0.0f);
            const float *kj = kt + (kj0 / PS_KT) * D * PS_KT;
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
            const float *kj = kt + (kj0 / PS_KT) * D * PS_KT;
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
        for (int64_t lk = 0; lk < nkeys; ++lk) {
            const int64_t pk = k0 + lk;
            vrows[lk] = a->v_cache + ((int64_t)table[pk / BS] * BS + pk % BS) * token_stride +
                        g * D;
        }
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
    for (int i = 0; i < nv; ++i) {
        const int64_t t = (v0 + i) / G, h = g * G + (v0 + i) % G;
        float *dst = a->out + (a->starts[c] + t) * a->out_row_stride + h * D;
        const float inv = 1.0f / l[i];
        for (int64_t d = 0; d < D; ++d) dst[d] = o[i][d] * inv;
    }
}

/* Task: chunk c, KV head g, query tokens [t0, t1) of the chunk. */
static inline __attribute__((always_inline)) void ps_pf_task_impl(
    const ps_prefill_args *a, int64_t c, int64_t g, int64_t t0, int64_t t1, float *kt,
    const int64_t D, const int64_t G) {
    const int32_t *table = a->block_tables + a->seq_index[c] * a->block_table_stride;
    const int64_t first_pos = a->seq_lens[c] - a->query_lens[c];
    ps_pf_transpose_keys(a, table, g, first_pos + t1, D, kt);
    const int64_t v1 = t1 * G;
    for (int64_t v = t0 * G; v < v1; v += PS_PF_MR) {
        const int64_t nv = v1 - v < PS_PF_MR ? v1 - v : PS_PF_MR;
        switch (nv) { /* a constant count per call: the score accumulators stay in registers */
#define PS_PF_TILE(k) case k: ps_pf_tile(a, table, c, g, v, k, kt, D, G); break;
            PS_PF_TILE(1) PS_PF_TILE(2) PS_PF_TILE(3) PS_PF_TILE(4) PS_PF_TILE(5) PS_PF_TILE(6)
#if PS_PF_MR > 6
            PS_PF_TILE(7) PS_PF_TILE(8) PS_PF_TILE(9) PS_PF_TILE(10) PS_PF_TILE(11)
            PS_PF_TILE(12)
#endif
#undef PS_PF_TILE
        default: break;
        }
    }
}

static void ps_pf_task(const ps_prefill_args *a, int64_t c, int64_t g, int64_t t0, int64_t t1,
                       float *kt) {
    const int64_t D = a->head_dim, G = a->num_heads / a->num_kv_heads;
    if (D == 64) ps_pf_task_impl(a, c, g, t0, t1, kt, 64, G);
    else if (D == 128) ps_pf_task_impl(a, c, g, t0, t1, kt, 128, G);
    else ps_pf_task_impl(a, c, g, t0, t1, kt, D, G);
}

/* head_dim must be a multiple of this (the vectors' width); the caller checks */
int ps_prefill_lanes(void) { return PS_WIDE_LANES; }

int ps_prefill_attention_f32(const ps_prefill_args *a) {
    if (a->head_dim > PS_MAX_HEAD_DIM || a->head_dim % PS_WIDE_LANES != 0 ||
        a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads != 0 || a->block_size <= 0)
        return -1;
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
