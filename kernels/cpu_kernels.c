/* kvscope's CPU kernels for float32 decode steps (see cpu.py): a few-row linear layer, RMSNorm,
 * rotary embedding, SiLU-and-multiply, the paged KV store and paged decode attention.
 * Each replaces a chain of small torch ops (a few microseconds of dispatch each, ~70 per layer)
 * or, for the linear layer, a slow path. Portable C: GCC/clang vector extensions, lowered to
 * AVX-512, AVX2 or NEON by -march=native. Optional OpenMP. Callers check shapes, dtypes and
 * strides; every array is contiguous unless a leading-dimension argument says otherwise.
 *
 * Linear: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]). A decode step is a chain of matrix-vector products: it reads every weight once and does one
 * multiply-add per weight, so its speed is the speed at which the weights stream from memory.
 * This kernel streams each weight row once, front to back (the order the hardware prefetcher
 * follows best), and dots it with every x row while it is in L1. Portable C: GCC/clang vector
 * extensions, lowered to AVX-512, AVX2 or NEON by -march=native. Optional OpenMP over rows of W.
 */
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

/* One x row: four independent accumulators keep the multiply-adds off the critical path. */
static void rows_m1(const float *x, const float *W, const float *b, float *y,
                    int64_t n0, int64_t n1, int64_t K) {
    const int64_t k64 = K & ~(int64_t)63, k16 = K & ~(int64_t)15;
    for (int64_t n = n0; n < n1; n++) {
        const float *w = W + n * K;
        v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t k = 0;
        for (; k < k64; k += 64) {
            a0 += ld(w + k) * ld(x + k);
            a1 += ld(w + k + 16) * ld(x + k + 16);
            a2 += ld(w + k + 32) * ld(x + k + 32);
            a3 += ld(w + k + 48) * ld(x + k + 48);
        }
        for (; k < k16; k += 16) a0 += ld(w + k) * ld(x + k);
        float s = hsum((a0 + a1) + (a2 + a3));
        for (; k < K; k++) s += w[k] * x[k];
        y[n] = b ? s + b[n] : s;
    }
}

/* Several x rows, in tiles of 2 weight rows x 4 x rows: each weight row is read from memory
 * once; the tile keeps loads per multiply-add low enough for the FMA units to be the limit. */
static void rows_mk(const float *x, int64_t ldx, const float *W, const float *b, float *y,
                    int64_t M, int64_t n0, int64_t n1, int64_t K, int64_t N) {
    const int64_t k16 = K & ~(int64_t)15;
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) {
        const float *w0 = W + n * K, *w1 = w0 + K;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {
            const float *x0 = x + m * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
            int64_t k = 0;
            for (; k < k16; k += 16) {
                v16 u = ld(w0 + k), v = ld(w1 + k);
                v16 e0 = ld(x0 + k), e1 = ld(x1 + k), e2 = ld(x2 + k), e3 = ld(x3 + k);
                a0 += u * e0;
                a1 += u * e1;
                a2 += u * e2;
                a3 += u * e3;
                c0 += v * e0;
                c1 += v * e1;
                c2 += v * e2;
                c3 += v * e3;
            }
            float s[8] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3),
                          hsum(c0), hsum(c1), hsum(c2), hsum(c3)};
            for (; k < K; k++) {
                const float *xs[4] = {x0, x1, x2, x3};
                for (int i = 0; i < 4; i++) {
                    s[i] += w0[k] * xs[i][k];
                    s[4 + i] += w1[k] * xs[i][k];
                }
            }
            for (int i = 0; i < 4; i++) {
                y[(m + i) * N + n] = b ? s[i] + b[n] : s[i];
                y[(m + i) * N + n + 1] = b ? s[4 + i] + b[n + 1] : s[4 + i];
            }
        }
        for (; m < M; m++) rows_m1(x + m * ldx, W, b, y + m * N, n, n + 2, K);
    }
    for (int64_t m = 0; n < n1 && m < M; m++) rows_m1(x + m * ldx, W, b, y + m * N, n, n1, K);
}

int kv_linear_f32(const float *x, int64_t ldx, const float *W, const float *b, float *y,
                  int64_t M, int64_t K, int64_t N, int num_threads) {
    int parts = num_threads > 1 && N * K >= (1 << 16) ? num_threads : 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
#endif
    for (int p = 0; p < parts; p++) {
        int64_t n0 = N * p / parts, n1 = N * (p + 1) / parts;
        if (M == 1)
            rows_m1(x, W, b, y, n0, n1, K);
        else
            rows_mk(x, ldx, W, b, y, M, n0, n1, K, N);
    }
    return 0;
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

/* out = weight * (x / sqrt(mean(x^2) + eps)) per row of D (HF's order: normalise, then scale). */
int kv_rms_norm_f32(const float *x, const float *w, float *out, int64_t M, int64_t D, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * D;
        float *o = out + m * D;
        float inv = 1.0f / sqrtf(dot(r, r, D) / (float)D + eps);
        for (int64_t i = 0; i < D; i++) o[i] = w[i] * (r[i] * inv);
    }
    return 0;
}

/* In place on x [T, heads, D]: x * cos + rotate_half(x) * sin, cos/sin [T, D]. */
int kv_rope_f32(float *x, int64_t T, int64_t heads, int64_t D, const float *cos_, const float *sin_) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * D, *s = sin_ + t * D;
        for (int64_t h = 0; h < heads; h++) {
            float *r = x + (t * heads + h) * D;
            for (int64_t i = 0; i < half; i++) {
                float a = r[i], b = r[i + half];
                r[i] = a * c[i] - b * s[i];
                r[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
    return 0;
}

/* out = silu(g) * u over n values. */
int kv_silu_mul_f32(const float *g, const float *u, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    return 0;
}

/* Copy rows of `row` floats of key/value [T, row] to slots of the caches [num_slots, row];
 * slot -1 is skipped. Returns -1 (nothing written) if a slot is out of range. */
int kv_store_f32(const float *key, const float *value, float *k_cache, float *v_cache,
                 const int64_t *slots, int64_t T, int64_t row, int64_t num_slots) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row, key + t * row, row * sizeof(float));
        memcpy(v_cache + slots[t] * row, value + t * row, row * sizeof(float));
    }
    return 0;
}

/* One query per sequence: q, out [B, H, D]; caches [blocks, BS, Hkv, D]; block_tables int32
 * [B, table_stride]; context_lens int32 [B]. Each query head of a KV head's group reads that
 * head's keys and values once, in place in the pool (no gathered copy). Returns -2 if a
 * context needs a block id outside [0, num_blocks) or more blocks than the table has, -1 when
 * out of memory for the score rows. */
int kv_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                            const int32_t *block_tables, int64_t table_stride,
                            const int32_t *context_lens, float *out, int64_t B, int64_t H,
                            int64_t Hkv, int64_t D, int64_t BS, int64_t num_blocks,
                            float scale, int num_threads) {
    const int64_t group = H / Hkv, tasks = B * Hkv;
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = context_lens[b];
        if (n < 0 || (n + BS - 1) / BS > table_stride) return -2;
        for (int64_t i = 0; i < (n + BS - 1) / BS; i++) {
            const int32_t id = block_tables[b * table_stride + i];
            if (id < 0 || id >= num_blocks) return -2;
        }
        if (n > max_ctx) max_ctx = n;
    }
    int failed = 0;
    int parts = num_threads > 1 && tasks > 1 ? num_threads : 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(dynamic) if (parts > 1)
#endif
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t b = task / Hkv, g = task % Hkv, n = context_lens[b];
        const int32_t *table = block_tables + b * table_stride;
        float *p = malloc(sizeof(float) * (size_t)(group * (max_ctx > 0 ? max_ctx : 1)));
        if (!p) {
            failed = 1;
            continue;
        }
        const float *qg = q + (b * H + g * group) * D;
        for (int64_t t = 0; t < n; t++) {
            const int64_t slot = (int64_t)table[t / BS] * BS + t % BS;
            const float *k = k_cache + (slot * Hkv + g) * D;
            for (int64_t j = 0; j < group; j++) p[j * n + t] = dot(qg + j * D, k, D) * scale;
        }
        for (int64_t j = 0; j < group; j++) {
            float *pj = p + j * n, mx = -INFINITY, sum = 0.0f;
            for (int64_t t = 0; t < n; t++) mx = pj[t] > mx ? pj[t] : mx;
            for (int64_t t = 0; t < n; t++) {
                pj[t] = expf(pj[t] - mx);
                sum += pj[t];
            }
            float *o = out + (b * H + g * group + j) * D;
            for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
            for (int64_t t = 0; t < n; t++) {
                const int64_t slot = (int64_t)table[t / BS] * BS + t % BS;
                const float *v = v_cache + (slot * Hkv + g) * D, w = pj[t] / sum;
                for (int64_t i = 0; i < D; i++) o[i] += w * v[i];
            }
        }
        free(p);
    }
    return failed ? -1 : 0;
}
