/*
 * The KV cache's element type for the attention kernels (paged_decode.c with paged_prefill.h):
 * float32, or bfloat16 in the library built with -DPS_KV_BF16=1 (``--kv-cache-dtype
 * bfloat16``). Keys and values are widened to float32 as they are loaded (a bfloat16 is the
 * upper half of a float32: a zero-extend and a shift), so every sum, softmax and output stays
 * float32 and only the bytes read change. Offsets, strides and block sizes are counted in
 * elements in both builds; what depends on bytes (cache lines, prefetch steps) goes through
 * PS_KV_LINE. The exported functions carry the type in their names (PS_KV_FN: _f32 / _bf16),
 * so the two libraries can never be mistaken for each other.
 */
#ifndef PS_KV_H
#define PS_KV_H

#include <stdint.h>
#include <string.h>

#include "ps_vec.h"

#ifndef PS_KV_BF16
#define PS_KV_BF16 0
#endif

#define PS_KV_CAT2(a, b) a##_##b
#define PS_KV_CAT(a, b) PS_KV_CAT2(a, b)
#if PS_KV_BF16
typedef uint16_t ps_kv_t;
#define PS_KV_FN(name) PS_KV_CAT(name, bf16)
#else
typedef float ps_kv_t;
#define PS_KV_FN(name) PS_KV_CAT(name, f32)
#endif
/* elements of the cache in one 64-byte line */
#define PS_KV_LINE ((int)(64 / sizeof(ps_kv_t)))

#if PS_KV_BF16
typedef uint16_t ps_v8hu_u __attribute__((vector_size(16), aligned(2)));
typedef uint32_t ps_v8su __attribute__((vector_size(32)));
typedef uint16_t ps_vwhu_u __attribute__((vector_size(PS_WIDE_LANES * 2), aligned(2)));
typedef uint32_t ps_vwsu __attribute__((vector_size(PS_WIDE_LANES * 4)));

/* 8 cached values as float32 (vpmovzxwd + vpslld) */
static inline v8sf ps_kv_load8(const ps_kv_t *p) {
    return (v8sf)(__builtin_convertvector(*(const ps_v8hu_u *)p, ps_v8su) << 16);
}
/* a wide vector's worth of cached values as float32 */
static inline vwsf ps_kv_wload(const ps_kv_t *p) {
    return (vwsf)(__builtin_convertvector(*(const ps_vwhu_u *)p, ps_vwsu) << 16);
}
static inline float ps_kv_float(ps_kv_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#else
static inline v8sf ps_kv_load8(const ps_kv_t *p) { return *(const v8sf_u *)p; }
static inline vwsf ps_kv_wload(const ps_kv_t *p) { return *(const vwsf_u *)p; }
static inline float ps_kv_float(ps_kv_t x) { return x; }
#endif

#endif
