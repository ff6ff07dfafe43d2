/* Helpers shared by kvscope's C kernels (cpu_kernels.c, cpu_kv_formats.c): 16-lane float
 * vectors (GCC/clang vector extensions), a vector exp, dot products, the walk over a
 * sequence's positions through its block table, the table check and the softmax of a score
 * row of a decode query. */
#ifndef KVSCOPE_CPU_SIMD_H
#define KVSCOPE_CPU_SIMD_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

static inline v16 ld(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

/* A tree, not a chain of 15 dependent adds: there is one of these per output. (Element
 * lists, not memcpy: taking an accumulator's address would keep it in memory.) */
static inline float hsum(v16 v) {
    v8 h = (v8){v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]} +
           (v8){v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15]};
    v4 q = (v4){h[0], h[1], h[2], h[3]} + (v4){h[4], h[5], h[6], h[7]};
    return (q[0] + q[2]) + (q[1] + q[3]);
}

typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 vsel(v16i mask, v16 a, v16 b) { return (v16)((mask & (v16i)a) | (~mask & (v16i)b)); }

/* exp(x), 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7
 * (relative error < 1e-7 before rounding), 2^n by the exponent bits. Inputs are clamped to
 * [-87, 88]: e^-87 ~ 1.6e-38 stands for 0, and nothing here exceeds e^88. */
static inline v16 vexp(v16 x) {
    const v16 lo = (v16){0} - 87.0f, hi = (v16){0} + 88.0f, magic = (v16){0} + 12582912.0f;
    x = vsel(x < lo, lo, x);
    x = vsel(x > hi, hi, x);
    v16 n = (x * 1.44269504088896341f + magic) - magic;  /* round to nearest */
    v16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  /* ln2 split in two parts */
    v16 p = (v16){0} + 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    return p * (v16)bits;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    const int64_t n16 = n & ~(int64_t)15;
    v16 acc = {0};
    int64_t i = 0;
    for (; i < n16; i += 16) acc += ld(a + i) * ld(b + i);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Walks positions t = lo .. n-1 of a sequence with `slot`, its row in the cache: block by block
 * through the table, no division per position (a 64-bit division costs more than the
 * arithmetic on a 64-float row). */
#define EACH_POSITION(t, slot, lo, n, table, BS)                                              \
    for (int64_t t = (lo), blk_ = (lo) / (BS); t < (n); blk_++)                                 \
        for (int64_t slot = (int64_t)(table)[blk_] * (BS) + t % (BS),                         \
                     end_ = (blk_ + 1) * (BS) < (n) ? (blk_ + 1) * (BS) : (n);                \
             t < end_; t++, slot++)

/* The largest context of a decode batch, or -1 if a context needs more blocks than its table
 * has or a block id outside [0, num_blocks) (blocks before a sliding window are not read and
 * not checked). */
static inline int64_t check_tables(const int32_t *block_tables, int64_t table_stride,
                                   const int32_t *context_lens, int64_t B, int64_t BS,
                                   int64_t num_blocks, int64_t window) {
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = context_lens[b];
        if (n < 0 || (n + BS - 1) / BS > table_stride) return -1;
        const int64_t lo = window > 0 && n > window ? n - window : 0;
        for (int64_t i = lo / BS; i < (n + BS - 1) / BS; i++) {
            const int32_t id = block_tables[b * table_stride + i];
            if (id < 0 || id >= num_blocks) return -1;
        }
        if (n > max_ctx) max_ctx = n;
    }
    return max_ctx;
}

/* A scaled score, soft-capped when softcap > 0: tanh(s / softcap) * softcap (Gemma 2). */
static inline float capped(float s, float softcap) {
    return softcap > 0 ? tanhf(s / softcap) * softcap : s;
}

/* Scores p[lo .. n-1] -> their softmax, in place. */
static inline void softmax(float *p, int64_t lo, int64_t n) {
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t t = lo; t < n; t++) mx = p[t] > mx ? p[t] : mx;
    int64_t t = lo;
    for (; t + 16 <= n; t += 16) {
        v16 e = vexp(ld(p + t) - mx);
        memcpy(p + t, &e, sizeof e);
        sum += hsum(e);
    }
    for (; t < n; t++) {
        p[t] = expf(p[t] - mx);
        sum += p[t];
    }
    const float inv = 1.0f / sum;
    for (t = lo; t < n; t++) p[t] *= inv;
}
#endif
