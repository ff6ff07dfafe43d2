/* Paged decode attention over the KV formats other than float32 (kv_formats.py; called from
 * cpu_formats.py), reading the packed blocks in place, block by block: each key or value row
 * is turned from its codes into D floats in a buffer (L1) and used at once by every query head
 * of its KV head's group; the context is never dequantized into a copy.
 *
 * The scales and zero points stay outside the dot products where the math allows:
 * - fp8 (per tensor or per head): score = k_scale[g] (q . c); acc += (p_t v_scale[g]) c.
 * - int8 per token and head: score = s_t (q . c); acc += (p_t s_t) c.
 * - int4 per token and head: a row is stored rotated, y = H S x (H the unnormalised
 *   Walsh-Hadamard transform on blocks of b, S the diagonal of random signs; H H = b I) and
 *   read x = S H y / b. H and S are symmetric, so q . x = (H S q / b) . y: the query is rotated
 *   once, not every key; with y = s_t (c - zp_t), score = s_t (q' . c - zp_t sum(q')). The
 *   output sum_t p_t x_t = S H (sum_t p_t y_t) / b: summed in the rotated space, rotated back
 *   once per query head.
 * - KIVI: K = c s[ch] + z[ch] per channel over a group of G tokens, so score = (q s) . c + q . z
 *   with the scaled query made once per group; the open group's K (not in the blocks yet) is
 *   read from the full-precision residual. V per token: acc += (p_t s_t) c, plus p_t z_t.
 * - bfloat16, float16: converted per element.
 * Sub-byte codes (int4, KIVI) are unpacked in plane order: lane p * (D / per) + i holds element
 * per * i + p (per codes a byte), so unpacking is a shift and mask per plane; the query is
 * permuted to match once, the output back once.
 */
#include "cpu_simd.h"

enum { KV_F32, KV_BF16, KV_F16, KV_FP8, KV_INT8, KV_INT4, KV_KIVI };

/* One side (K or V) of a layer's cache. */
typedef struct {
    int64_t kind, bits, group; /* bits per code; group: KIVI's K tokens per group */
    const void *data;          /* [num_blocks, BS, Hkv, D * bits / 8] */
    const float *scale;        /* fp8: [Hkv]; int8, int4: [num_blocks * BS, Hkv] */
    const uint16_t *meta;      /* KIVI, float16 (scale, zero): K [num_blocks * BS / G, Hkv, D, 2],
                                  V [num_blocks * BS, Hkv, 2] */
} kv_side;

typedef struct {
    kv_side k, v;
    const float *fp8;         /* the float values of the 256 e4m3 codes */
    const float *signs;       /* int4: the rotation's signs [rht] */
    int64_t rht;              /* int4: its block, the largest power of two dividing D */
    const float *residual;    /* KIVI K: the open groups' rows [res_rows, Hkv, D]; NULL: none */
    int64_t res_rows;
    const int64_t *res_start; /* [B]: the first position read from the residual (n: none) */
    const int64_t *res_row;   /* [B]: its row */
} kv_packed;

static inline float f32_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float half_to_f32(uint16_t h) {
    const uint32_t e = (h >> 10) & 31, m = h & 1023;
    const float v = e == 0 ? (float)m * 0x1p-24f
                  : e == 31 ? (m ? NAN : INFINITY) : f32_bits((e + 112) << 23 | m << 13);
    return h & 0x8000 ? -v : v;
}

/* int4's float32 scale carries the zero point in its low 4 mantissa bits (vLLM's layout). */
static inline void int4_scale_zero(float packed, float *scale, float *zp) {
    uint32_t u;
    memcpy(&u, &packed, sizeof u);
    *scale = f32_bits(u & ~15u);
    *zp = (float)(u & 15);
}

static inline int64_t per_byte(const kv_side *s) {
    return s->kind == KV_INT4 || s->kind == KV_KIVI ? 8 / s->bits : 1;
}

/* Row `row` (= slot * Hkv + head) of a side as D floats in its lane order: `buf`, or the row
 * itself for float32. */
static const float *codes_row(const kv_side *s, const float *fp8, int64_t row, int64_t D,
                              float *restrict buf) {
    switch (s->kind) {
    case KV_F32:
        return (const float *)s->data + row * D;
    case KV_BF16: {
        const uint16_t *r = (const uint16_t *)s->data + row * D;
        for (int64_t i = 0; i < D; i++) buf[i] = f32_bits((uint32_t)r[i] << 16);
        break;
    }
    case KV_F16: {
        const uint16_t *r = (const uint16_t *)s->data + row * D;
        for (int64_t i = 0; i < D; i++) buf[i] = half_to_f32(r[i]);
        break;
    }
    case KV_FP8: {
        const uint8_t *r = (const uint8_t *)s->data + row * D;
        for (int64_t i = 0; i < D; i++) buf[i] = fp8[r[i]];
        break;
    }
    case KV_INT8: {
        const int8_t *r = (const int8_t *)s->data + row * D;
        for (int64_t i = 0; i < D; i++) buf[i] = r[i];
        break;
    }
    default: {
        const int bits = (int)s->bits, mask = (1 << bits) - 1;
        const int64_t nb = D / (8 / bits);
        const uint8_t *r = (const uint8_t *)s->data + row * nb;
        for (int p = 0; p < 8 / bits; p++)
            for (int64_t i = 0; i < nb; i++) buf[p * nb + i] = (float)((r[i] >> (bits * p)) & mask);
    }
    }
    return buf;
}

/* x <- H x on each block of b values (the butterfly of kv_formats._hadamard). */
static void hadamard(float *x, int64_t D, int64_t b) {
    for (int64_t o = 0; o < D; o += b)
        for (int64_t h = 1; h < b; h <<= 1)
            for (int64_t i = o; i < o + b; i += 2 * h)
                for (int64_t k = i; k < i + h; k++) {
                    const float u = x[k], w = x[k + h];
                    x[k] = u + w;
                    x[k + h] = u - w;
                }
}

/* The query of one head in the K side's space: H S q / b for int4, in the side's lane order. */
static void prepare_query(const kv_packed *f, const float *q, int64_t D, float *tmp,
                          float *out) {
    memcpy(tmp, q, sizeof(float) * (size_t)D);
    if (f->k.kind == KV_INT4) {
        for (int64_t i = 0; i < D; i++) tmp[i] *= f->signs[i % f->rht] / (float)f->rht;
        hadamard(tmp, D, f->rht);
    }
    const int64_t per = per_byte(&f->k), nb = D / per;
    for (int64_t p = 0; p < per; p++)
        for (int64_t i = 0; i < nb; i++) out[p * nb + i] = tmp[per * i + p];
}

/* One head's V sum (lane order, plus `shift` on every element) -> its output row: back in
 * natural order, and rotated back (S H y / b) for int4. */
static void finish_output(const kv_packed *f, const float *acc, float shift, int64_t D,
                          float *out) {
    const int64_t per = per_byte(&f->v), nb = D / per;
    for (int64_t p = 0; p < per; p++)
        for (int64_t i = 0; i < nb; i++) out[per * i + p] = acc[p * nb + i] + shift;
    if (f->v.kind == KV_INT4) {
        hadamard(out, D, f->rht);
        for (int64_t i = 0; i < D; i++) out[i] *= f->signs[i % f->rht] / (float)f->rht;
    }
}

/* KIVI: the group's per-channel (scale, zero) `meta` [D, 2] folded into each query head:
 * qs = q * scale in lane order, qz = q . zero. */
static void kivi_group_query(const uint16_t *meta, const float *qp, float *qs, float *qz,
                             int64_t heads, int64_t D, int64_t per) {
    const int64_t nb = D / per;
    for (int64_t j = 0; j < heads; j++) qz[j] = 0.0f;
    for (int64_t p = 0; p < per; p++)
        for (int64_t i = 0; i < nb; i++) {
            const int64_t lane = p * nb + i, ch = per * i + p;
            const float s = half_to_f32(meta[2 * ch]), z = half_to_f32(meta[2 * ch + 1]);
            for (int64_t j = 0; j < heads; j++) {
                qs[j * D + lane] = qp[j * D + lane] * s;
                qz[j] += qp[j * D + lane] * z;
            }
        }
}

/* y += a x over n floats. */
static inline void axpy(float *restrict y, float a, const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* The positions [lo, n) of sequence b read from the KIVI residual: [n, n) when none. */
static inline int64_t residual_from(const kv_packed *f, int64_t b, int64_t lo, int64_t n) {
    if (!f->residual || f->res_start[b] >= n) return n;
    return f->res_start[b] > lo ? f->res_start[b] : lo;
}

/* One query per sequence over caches in the formats of `f` (see kv_decode_attention_f32 for
 * q, out, the tables, window and softcap). Returns 0, -1 out of memory, -2 a block table out
 * of range, -4 a residual row out of range. */
int kv_decode_attention_packed(const float *q, const kv_packed *f, const int32_t *block_tables,
                               int64_t table_stride, const int32_t *context_lens, float *out,
                               int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t BS,
                               int64_t num_blocks, int64_t window, float scale, float softcap,
                               int num_threads) {
    const int64_t group = H / Hkv, tasks = B * Hkv;
    const int64_t max_ctx = check_tables(block_tables, table_stride, context_lens, B, BS,
                                         num_blocks, window);
    if (max_ctx < 0) return -2;
    for (int64_t b = 0; f->residual && b < B; b++) {
        const int64_t n = context_lens[b], s = f->res_start[b];
        if (s < n && (s < 0 || f->res_row[b] < 0 || f->res_row[b] + n - s > f->res_rows))
            return -4;
    }
    const kv_side *K = &f->k, *V = &f->v;
    const int64_t G = K->kind == KV_KIVI ? K->group : 1, per = per_byte(K);
    int failed = 0;
    int parts = num_threads > 1 && tasks > 1 ? num_threads : 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(dynamic) if (parts > 1)
#endif
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t b = task / Hkv, g = task % Hkv, n = context_lens[b];
        const int64_t lo = window > 0 && n > window ? n - window : 0, mid = residual_from(f, b, lo, n);
        const int32_t *table = block_tables + b * table_stride;
        /* scores [group, max_ctx]; queries qp, qs and sums acc [group, D]; rows buf, tmp [D];
         * per head qsum, qz, shift [group] */
        float *p = malloc(sizeof(float) * (size_t)(group * (max_ctx + 3 * D + 3) + 2 * D));
        if (!p) {
            failed = 1;
            continue;
        }
        float *qp = p + group * max_ctx, *qs = qp + group * D, *acc = qs + group * D;
        float *buf = acc + group * D, *tmp = buf + D, *qsum = tmp + D, *qz = qsum + group;
        float *shift = qz + group;
        const float *qg = q + (b * H + g * group) * D;
        for (int64_t j = 0; j < group; j++) {
            prepare_query(f, qg + j * D, D, tmp, qp + j * D);
            qsum[j] = 0.0f;
            for (int64_t i = 0; i < D; i++) qsum[j] += qp[j * D + i];
        }
        int64_t cur = -1; /* KIVI: the group qs and qz were made for */
        EACH_POSITION(t, slot, lo, mid, table, BS) {
            const float *Q = qp, *R = qsum;
            float alpha = 1.0f, gamma = 0.0f; /* score = alpha (Q . c + gamma R) */
            if (K->kind == KV_FP8) alpha = K->scale[g];
            else if (K->kind == KV_INT8) alpha = K->scale[slot * Hkv + g];
            else if (K->kind == KV_INT4) {
                int4_scale_zero(K->scale[slot * Hkv + g], &alpha, &gamma);
                gamma = -gamma;
            } else if (K->kind == KV_KIVI) {
                if (t / G != cur) {
                    cur = t / G;
                    kivi_group_query(K->meta + ((slot / G) * Hkv + g) * D * 2, qp, qs, qz, group,
                                     D, per);
                }
                Q = qs, R = qz, gamma = 1.0f;
            }
            const float *c = codes_row(K, f->fp8, slot * Hkv + g, D, buf);
            for (int64_t j = 0; j < group; j++)
                p[j * n + t] = capped(alpha * (dot(Q + j * D, c, D) + gamma * R[j]) * scale,
                                      softcap);
        }
        for (int64_t t = mid; t < n; t++) {
            const float *k = f->residual + ((f->res_row[b] + t - f->res_start[b]) * Hkv + g) * D;
            for (int64_t j = 0; j < group; j++)
                p[j * n + t] = capped(dot(qg + j * D, k, D) * scale, softcap);
        }
        for (int64_t j = 0; j < group; j++) {
            softmax(p + j * n, lo, n);
            shift[j] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * (size_t)(group * D));
        EACH_POSITION(t, slot, lo, n, table, BS) {
            float alpha = 1.0f, beta = 0.0f; /* the row is alpha c + beta */
            if (V->kind == KV_FP8) alpha = V->scale[g];
            else if (V->kind == KV_INT8) alpha = V->scale[slot * Hkv + g];
            else if (V->kind == KV_INT4) {
                int4_scale_zero(V->scale[slot * Hkv + g], &alpha, &beta);
                beta *= -alpha;
            } else if (V->kind == KV_KIVI) {
                alpha = half_to_f32(V->meta[(slot * Hkv + g) * 2]);
                beta = half_to_f32(V->meta[(slot * Hkv + g) * 2 + 1]);
            }
            const float *c = codes_row(V, f->fp8, slot * Hkv + g, D, buf);
            for (int64_t j = 0; j < group; j++) {
                axpy(acc + j * D, p[j * n + t] * alpha, c, D);
                shift[j] += p[j * n + t] * beta;
            }
        }
        for (int64_t j = 0; j < group; j++)
            finish_output(f, acc + j * D, shift[j], D, out + (b * H + g * group + j) * D);
        free(p);
    }
    return failed ? -1 : 0;
}
