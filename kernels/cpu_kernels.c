/* kvscope's CPU kernels for float32 decode steps (see cpu.py): a few-row linear layer, RMSNorm,
 * rotary embedding, SiLU-and-multiply, the paged KV store and paged decode attention.
 * Each replaces a chain of small torch ops (a few microseconds of dispatch each, ~70 per layer)
 * or, for the linear layer, a slow path. Portable C: GCC/clang vector extensions, lowered to
 * AVX-512, AVX2 or NEON by -march=native. Optional OpenMP. Callers check shapes, dtypes and
 * strides; every array is contiguous unless a leading-dimension argument says otherwise.
 *
 * Linear: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]). A decode step is a chain of
 * matrix-vector products: it reads every weight once and does one multiply-add per weight and
 * row, so at batch 1 its speed is the speed at which the weights stream from memory. The kernel
 * streams each weight row once, front to back (the order the hardware prefetcher follows best),
 * and dots it with every x row while it is in L1. OpenMP splits the rows of W.
 */
#include "cpu_simd.h"

/* Software prefetch of the weights `pf` bytes ahead, into L2: the hardware prefetcher alone
 * falls behind once the arithmetic per weight grows (several x rows): 8 rows ran 1.6x faster
 * with it here, and one row ~5 % faster at a shorter distance (see rows_mk). A prefetch past
 * the end of W touches the next weights in the arena, or nothing: it never faults. */
static inline void prefetch(const float *p, int64_t pf) { __builtin_prefetch((const char *)p + pf, 0, 2); }

/* One weight row against J x rows, the row streaming from memory once (one stream: two
 * interleaved weight rows read ~2x slower here) and K unrolled by U: J * U = 8 independent
 * accumulators. J and U are constants at every call. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx,
                                                       const float *w, float bias, float *y,
                                                       int64_t N, int64_t K, const int J,
                                                       const int U, int64_t pf) {
    const int64_t step = 16 * U, kmain = K / step * step, k16 = K & ~(int64_t)15;
    v16 a[8] = {{0}};
    int64_t k = 0;
    for (; k < kmain; k += step)
        for (int u = 0; u < U; u++) {
            prefetch(w + k + 16 * u, pf);
            v16 wv = ld(w + k + 16 * u);
            for (int j = 0; j < J; j++) a[u * J + j] += wv * ld(x + j * ldx + k + 16 * u);
        }
    for (; k < k16; k += 16) {
        v16 wv = ld(w + k);
        for (int j = 0; j < J; j++) a[j] += wv * ld(x + j * ldx + k);
    }
    for (int j = 0; j < J; j++) {
        v16 acc = a[j];
        for (int u = 1; u < U; u++) acc += a[u * J + j];
        float s = hsum(acc);
        for (int64_t i = k; i < K; i++) s += w[i] * x[j * ldx + i];
        y[j * N] = s + bias;
    }
}

/* tile(J = 4, U = 2) written out: the generic form ran ~15 % slower at batch 8 here. */
static inline void tile4(const float *x, int64_t ldx, const float *w, float bias, float *y,
                         int64_t N, int64_t K, int64_t pf) {
    const float *x0 = x, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
    const int64_t k32 = K & ~(int64_t)31;
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    int64_t k = 0;
    for (; k < k32; k += 32) {
        prefetch(w + k, pf);
        prefetch(w + k + 16, pf);
        v16 u = ld(w + k), v = ld(w + k + 16);
        a0 += u * ld(x0 + k);
        a1 += u * ld(x1 + k);
        a2 += u * ld(x2 + k);
        a3 += u * ld(x3 + k);
        b0 += v * ld(x0 + k + 16);
        b1 += v * ld(x1 + k + 16);
        b2 += v * ld(x2 + k + 16);
        b3 += v * ld(x3 + k + 16);
    }
    float s0 = hsum(a0 + b0), s1 = hsum(a1 + b1), s2 = hsum(a2 + b2), s3 = hsum(a3 + b3);
    for (; k < K; k++) {
        s0 += w[k] * x0[k];
        s1 += w[k] * x1[k];
        s2 += w[k] * x2[k];
        s3 += w[k] * x3[k];
    }
    y[0] = s0 + bias;
    y[N] = s1 + bias;
    y[2 * N] = s2 + bias;
    y[3 * N] = s3 + bias;
}

/* Each weight row is read from memory once, then from L1 for x rows 5 and on. Prefetch
 * distance (measured, SmolLM2 shapes): 2 KiB for 1-3 rows, 8 KiB from 4 rows (more work per
 * weight byte: the data must be asked for earlier). */
static void rows_mk(const float *x, int64_t ldx, const float *W, const float *b, float *y,
                    int64_t M, int64_t n0, int64_t n1, int64_t K, int64_t N) {
    const int64_t pf = M < 4 ? 2048 : 8192;
    for (int64_t n = n0; n < n1; n++) {
        const float *w = W + n * K;
        const float bias = b ? b[n] : 0.0f;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) tile4(x + m * ldx, ldx, w, bias, y + m * N + n, N, K, pf);
        if (m + 2 <= M) {
            tile(x + m * ldx, ldx, w, bias, y + m * N + n, N, K, 2, 4, pf);
            m += 2;
        }
        if (m < M) tile(x + m * ldx, ldx, w, bias, y + m * N + n, N, K, 1, 4, pf);
    }
}

int kv_linear_f32(const float *x, int64_t ldx, const float *W, const float *b, float *y,
                  int64_t M, int64_t K, int64_t N, int num_threads) {
    int parts = num_threads > 1 && N * K >= (1 << 16) ? num_threads : 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
#endif
    for (int p = 0; p < parts; p++) {
        int64_t n0 = N * p / parts, n1 = N * (p + 1) / parts;
        rows_mk(x, ldx, W, b, y, M, n0, n1, K, N);
    }
    return 0;
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
    const int64_t n16 = n & ~(int64_t)15;
    int64_t i = 0;
    for (; i < n16; i += 16) {
        v16 x = ld(g + i), y = x / (1.0f + vexp(-x)) * ld(u + i);
        memcpy(out + i, &y, sizeof y);
    }
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
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

/* out[D] = sum_t w[t] * v row of position t (lo <= t < n), accumulated in registers: 64
 * columns at a time, then 16, then one. */
static void weighted_rows(const float *w, int64_t lo, int64_t n, const float *v_cache,
                          const int32_t *table, int64_t BS, int64_t Hkv, int64_t g, int64_t D,
                          float *out) {
    int64_t c = 0;
    for (; c + 64 <= D; c += 64) {
        v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        EACH_POSITION(t, slot, lo, n, table, BS) {
            const float *v = v_cache + (slot * Hkv + g) * D + c;
            a0 += w[t] * ld(v);
            a1 += w[t] * ld(v + 16);
            a2 += w[t] * ld(v + 32);
            a3 += w[t] * ld(v + 48);
        }
        memcpy(out + c, &a0, sizeof a0);
        memcpy(out + c + 16, &a1, sizeof a1);
        memcpy(out + c + 32, &a2, sizeof a2);
        memcpy(out + c + 48, &a3, sizeof a3);
    }
    for (; c + 16 <= D; c += 16) {
        v16 a = {0};
        EACH_POSITION(t, slot, lo, n, table, BS) a += w[t] * ld(v_cache + (slot * Hkv + g) * D + c);
        memcpy(out + c, &a, sizeof a);
    }
    for (; c < D; c++) {
        float a = 0.0f;
        EACH_POSITION(t, slot, lo, n, table, BS) a += w[t] * v_cache[(slot * Hkv + g) * D + c];
        out[c] = a;
    }
}

/* One query per sequence: q, out [B, H, D]; caches [blocks, BS, Hkv, D]; block_tables int32
 * [B, table_stride]; context_lens int32 [B]. Each query head of a KV head's group reads that
 * head's keys and values once, in place in the pool (no gathered copy). Returns -2 if a
 * context needs a block id outside [0, num_blocks) or more blocks than the table has, -1 when
 * out of memory for the score rows. window > 0: a sliding-window layer, the query (at position
 * n - 1) sees the last `window` positions only, and blocks before them are not read (they may
 * be any id). softcap > 0: each scaled score s becomes tanh(s / softcap) * softcap (Gemma 2). */
int kv_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                            const int32_t *block_tables, int64_t table_stride,
                            const int32_t *context_lens, float *out, int64_t B, int64_t H,
                            int64_t Hkv, int64_t D, int64_t BS, int64_t num_blocks,
                            int64_t window, float scale, float softcap, int num_threads) {
    const int64_t group = H / Hkv, tasks = B * Hkv;
    const int64_t max_ctx = check_tables(block_tables, table_stride, context_lens, B, BS,
                                         num_blocks, window);
    if (max_ctx < 0) return -2;
    int failed = 0;
    int parts = num_threads > 1 && tasks > 1 ? num_threads : 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(dynamic) if (parts > 1)
#endif
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t b = task / Hkv, g = task % Hkv, n = context_lens[b];
        const int64_t lo = window > 0 && n > window ? n - window : 0;
        const int32_t *table = block_tables + b * table_stride;
        float *p = malloc(sizeof(float) * (size_t)(group * (max_ctx > 0 ? max_ctx : 1)));
        if (!p) {
            failed = 1;
            continue;
        }
        const float *qg = q + (b * H + g * group) * D;
        EACH_POSITION(t, slot, lo, n, table, BS) {
            const float *k = k_cache + (slot * Hkv + g) * D;
            for (int64_t j = 0; j < group; j++)
                p[j * n + t] = capped(dot(qg + j * D, k, D) * scale, softcap);
        }
        for (int64_t j = 0; j < group; j++) {
            float *pj = p + j * n;
            softmax(pj, lo, n);
            weighted_rows(pj, lo, n, v_cache, table, BS, Hkv, g, D,
                          out + (b * H + g * group + j) * D);
        }
        free(p);
    }
    return failed ? -1 : 0;
}

/* One Llama-family decoder layer's weights (NULL: no such bias or norm). */
typedef struct {
    const float *ln1, *wq, *bq, *wk, *bk, *wv, *bv, *q_norm, *k_norm, *wo, *bo;
    const float *ln2, *wg, *bg, *wu, *bu, *wd, *bd;
} kv_layer_f32;

static void add_rows(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* The decoder layers of a decode step (one new token per sequence, B rows) in one call, the
 * same kernels in the same order as the per-op path (llama.py), so the result is identical:
 * x += attention(rms_norm(x)); x += mlp(rms_norm(x)), layer by layer, x [B, hidden] in place.
 * cos/sin [B, D] for each row's position; kv_cache [n_layers, 2, num_blocks, BS, Hkv, D];
 * slots, block tables and context lengths as for kv_store_f32 / kv_decode_attention_f32;
 * windows [n_layers]: each layer's sliding window (0: full attention), NULL: none has one.
 * Returns 0, -1 out of memory, -2 a block table out of range, -3 a slot out of range. */
int kv_decode_layers_f32(const kv_layer_f32 *layers, int64_t n_layers, float *kv_cache,
                         float *x, int64_t B, int64_t hidden, int64_t H, int64_t Hkv, int64_t D,
                         int64_t inter,
                         float eps, float scale, const float *cos_, const float *sin_,
                         const int64_t *slots, const int32_t *block_tables,
                         int64_t table_stride, const int32_t *context_lens, int64_t BS,
                         int64_t num_blocks, const int64_t *windows, int num_threads) {
    const int64_t qw = H * D, kvw = Hkv * D;
    float *h = malloc(sizeof(float) * (size_t)(B * (2 * hidden + 2 * qw + 2 * kvw + 2 * inter)));
    if (!h) return -1;
    float *q = h + B * hidden, *k = q + B * qw, *v = k + B * kvw, *o = v + B * kvw;
    float *g = o + B * qw, *u = g + B * inter, *y = u + B * inter;
    int status = 0;
    for (int64_t l = 0; l < n_layers; l++) {
        const kv_layer_f32 *L = layers + l;
        float *k_cache = kv_cache + 2 * l * num_blocks * BS * kvw;
        float *v_cache = k_cache + num_blocks * BS * kvw;
        kv_rms_norm_f32(x, L->ln1, h, B, hidden, eps);
        kv_linear_f32(h, hidden, L->wq, L->bq, q, B, hidden, qw, num_threads);
        kv_linear_f32(h, hidden, L->wk, L->bk, k, B, hidden, kvw, num_threads);
        kv_linear_f32(h, hidden, L->wv, L->bv, v, B, hidden, kvw, num_threads);
        if (L->q_norm) {
            kv_rms_norm_f32(q, L->q_norm, q, B * H, D, eps);
            kv_rms_norm_f32(k, L->k_norm, k, B * Hkv, D, eps);
        }
        kv_rope_f32(q, B, H, D, cos_, sin_);
        kv_rope_f32(k, B, Hkv, D, cos_, sin_);
        if (kv_store_f32(k, v, k_cache, v_cache, slots, B, kvw, num_blocks * BS) != 0) {
            status = -3;
            break;
        }
        status = kv_decode_attention_f32(q, k_cache, v_cache, block_tables, table_stride,
                                         context_lens, o, B, H, Hkv, D, BS, num_blocks,
                                         windows ? windows[l] : 0, scale, 0.0f, num_threads);
        if (status != 0) break;
        kv_linear_f32(o, qw, L->wo, L->bo, y, B, qw, hidden, num_threads);
        add_rows(x, y, B * hidden);
        kv_rms_norm_f32(x, L->ln2, h, B, hidden, eps);
        kv_linear_f32(h, hidden, L->wg, L->bg, g, B, hidden, inter, num_threads);
        kv_linear_f32(h, hidden, L->wu, L->bu, u, B, hidden, inter, num_threads);
        kv_silu_mul_f32(g, u, g, B * inter);
        kv_linear_f32(g, inter, L->wd, L->bd, y, B, inter, hidden, num_threads);
        add_rows(x, y, B * hidden);
    }
    free(h);
    return status;
}
