/*
 * Vector helpers shared by the CPU kernels (paged_decode.c with paged_prefill.h, fused_ops.c,
 * gemm.c): GCC vector types of 8 floats and of the build's widest vector (the compiler picks
 * AVX2 or AVX-512 code for them under -march=native), splats, a vectorised exp, lane sums and
 * maxima. Included, not compiled on its own; kernels/native.py hashes it into every
 * kernel's build key.
 */
#ifndef PS_VEC_H
#define PS_VEC_H

#include <stdint.h>

typedef float v8sf __attribute__((vector_size(32)));
typedef int32_t v8si __attribute__((vector_size(32)));
typedef float v8sf_u __attribute__((vector_size(32), aligned(4))); /* unaligned access */

static inline v8sf ps_splat(float x) { return (v8sf){x, x, x, x, x, x, x, x}; }

/* The widest vector the build's target has for long dot products and value sums: 16 floats
 * (one AVX-512 register) where the compiler may use AVX-512, else 8. -DPS_WIDE_LANES=8 forces
 * the narrow one (the tests build both on an AVX-512 machine). Why not 16 everywhere: GCC
 * splits a 64-byte vector into two AVX2 registers, which spends the 16 registers an AVX2 core
 * has twice as fast. */
#ifndef PS_WIDE_LANES
#if defined(__AVX512F__)
#define PS_WIDE_LANES 16
#else
#define PS_WIDE_LANES 8
#endif
#endif
typedef float vwsf __attribute__((vector_size(PS_WIDE_LANES * 4)));
typedef float vwsf_u __attribute__((vector_size(PS_WIDE_LANES * 4), aligned(4)));

static inline vwsf ps_wload(const float *p) { return *(const vwsf_u *)p; }
static inline void ps_wstore(float *p, vwsf v) { *(vwsf_u *)p = v; }
/* An initializer of x in every lane: GCC emits one broadcast (from memory where x is loaded
 * there). Not x + (vwsf){0}: adding 0.0 is not an identity in IEEE arithmetic (-0 + 0 = +0),
 * so that form cost a scalar add before every broadcast. Not a loop over the lanes either: GCC
 * 12 turned that into a chain of masked broadcasts, one per lane group, with their mask loads
 * (seen in the tiled prefill kernel's score loop, bench/README.md). */
static inline vwsf ps_wsplat(float x) {
#if PS_WIDE_LANES == 16
    return (vwsf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
    return (vwsf){x, x, x, x, x, x, x, x};
#endif
}

/* The wide vector's lanes folded to 8 (lane j: the sum of lanes j, j + 8, ...). */
static inline v8sf ps_fold8(vwsf x) {
#if PS_WIDE_LANES == 16
    return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return x;
#endif
}

/* exp(x) for x <= 0, about 1 ulp (Cephes' expf polynomial after a 2^n split); lanes below
 * -87.3 give ~1e-38, which callers multiply by zero or add to a sum of at least 1. Defined once
 * for both vector types: ps_exp8 (8 floats) and ps_wexp (the wide vector; on AVX-512 one
 * 16-float pass, 1.01-1.04x the tiled prefill kernel's speed against two 8-float halves,
 * bit-identical). */
typedef int32_t vwsi __attribute__((vector_size(PS_WIDE_LANES * 4)));
#define PS_DEFINE_EXP(name, vf, vi, splat)                                                  \
    static inline vf name(vf x) {                                                           \
        const vf lo = splat(-87.3f);                                                        \
        const vi below = x < lo; /* all-ones lanes where x < lo (C has no vector ?:) */     \
        x = (vf)(((vi)x & ~below) | ((vi)lo & below));                                      \
        const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adds round to an integer */     \
        vf t = x * splat(1.44269504088896341f) + magic;                                     \
        vf n = t - magic;                                                                   \
        vf r = x - n * splat(0.693359375f);                                                 \
        r = r - n * splat(-2.12194440e-4f);                                                 \
        vf y = splat(1.9875691500e-4f);                                                     \
        y = y * r + splat(1.3981999507e-3f);                                                \
        y = y * r + splat(8.3334519073e-3f);                                                \
        y = y * r + splat(4.1665795894e-2f);                                                \
        y = y * r + splat(1.6666665459e-1f);                                                \
        y = y * r + splat(5.0000001201e-1f);                                                \
        y = y * (r * r) + r + splat(1.0f);                                                  \
        vi bits = (vi)t - (vi)magic; /* n as an integer */                                  \
        return (vf)((vi)y + (bits << 23));                                                  \
    }
PS_DEFINE_EXP(ps_exp8, v8sf, v8si, ps_splat)
PS_DEFINE_EXP(ps_wexp, vwsf, vwsi, ps_wsplat)

/* exp(x) for any x: clamped above to 88.3 (below, ps_exp8 / ps_wexp clamp at -87.3); one
 * definition for both vector types. */
#define PS_DEFINE_EXP_ANY(name, exp, vf, vi, splat)                                         \
    static inline vf name(vf x) {                                                           \
        const vf hi = splat(88.3f);                                                         \
        const vi above = x > hi;                                                            \
        return exp((vf)(((vi)x & ~above) | ((vi)hi & above)));                              \
    }
PS_DEFINE_EXP_ANY(ps_exp8_any, ps_exp8, v8sf, v8si, ps_splat)
PS_DEFINE_EXP_ANY(ps_wexp_any, ps_wexp, vwsf, vwsi, ps_wsplat)

/* silu(g) = g / (1 + exp(-g)), lane-wise (the fused SwiGLU's and the GEMM's GLU epilogue's) */
static inline vwsf ps_wsilu(vwsf g) { return g / (ps_wsplat(1.0f) + ps_wexp_any(-g)); }
static inline v8sf ps_silu8(v8sf g) { return g / (ps_splat(1.0f) + ps_exp8_any(-g)); }

/* The sum of 8 lanes (a shuffle tree, pairwise), and of a wide vector's lanes. */
static inline float ps_v8sum(v8sf f) {
    f += __builtin_shufflevector(f, f, 4, 5, 6, 7, 0, 1, 2, 3);
    f += __builtin_shufflevector(f, f, 2, 3, 0, 1, 6, 7, 4, 5);
    f += __builtin_shufflevector(f, f, 1, 0, 3, 2, 5, 4, 7, 6);
    return f[0];
}
static inline float ps_wsum(vwsf x) { return ps_v8sum(ps_fold8(x)); }

/* Lane-wise maxima (C has no vector ?:, hence the masks). */
static inline vwsf ps_wvmax(vwsf a, vwsf b) {
    const vwsi gt = a > b;
    return (vwsf)(((vwsi)a & gt) | ((vwsi)b & ~gt));
}
static inline v8sf ps_v8max(v8sf a, v8sf b) {
    const v8si gt = a > b;
    return (v8sf)(((v8si)a & gt) | ((v8si)b & ~gt));
}

/* The largest of 8 lanes, and of a wide vector's lanes. */
static inline float ps_v8hmax(v8sf f) {
    f = ps_v8max(f, __builtin_shufflevector(f, f, 4, 5, 6, 7, 0, 1, 2, 3));
    f = ps_v8max(f, __builtin_shufflevector(f, f, 2, 3, 0, 1, 6, 7, 4, 5));
    f = ps_v8max(f, __builtin_shufflevector(f, f, 1, 0, 3, 2, 5, 4, 7, 6));
    return f[0];
}
static inline float ps_wmax(vwsf x) {
#if PS_WIDE_LANES == 16
    return ps_v8hmax(ps_v8max(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7),
                              __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15)));
#else
    return ps_v8hmax(x);
#endif
}

#endif
