/* Paged-attention decode for a CPU: every decoding sequence's query heads attend over its KV
 * blocks where they lie in the cache, with an online softmax (Milakov & Gimelshein, 2018; the
 * vLLM paper's PagedAttention kernel, Kwon et al., SOSP'23, section 4.1, reads blocks in place
 * the same way). No block is copied out of the cache, nothing is converted per layer: a K or V
 * row is read once per KV head, in the cache's dtype, for all the query heads that share it.
 *
 * Layout (minipaged.attention.contract): q and out [T, H, D]; k_cache and v_cache
 * [num_blocks, block_size, H_kv, D]; block_tables [B, max_blocks] int32; seq_lens [B] int32;
 * rows [n] and seqs [n] int32: decode i is q's row rows[i] of sequence seqs[i]. Query head h
 * reads KV head h / (H / H_kv). Accumulation is float32; bfloat16 inputs are widened on load and
 * the output rounded to nearest even once.
 *
 * Built by minipaged.kernels.cpu.build with -O3 -ffast-math for the machine it runs on, so the
 * dot products, the exponentials and the V accumulation vectorize. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernel_args.h"

#define MAX_GROUP 64    /* query heads per KV head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256   /* tokens per block */

/* One row of D values as float32: in place for a float32 cache, else widened into `buf`. */
static inline const float *row_f32(const void *base, int64_t index, int bf16, int d,
                                   float *restrict buf) {
    if (!bf16) return (const float *)base + index;
    const uint16_t *src = (const uint16_t *)base + index;
    for (int i = 0; i < d; i++) buf[i] = bf16_to_float(src[i]);
    return buf;
}

/* Fetch a row into L2 (prefetcht1), not L1: an L1 prefetch holds one of the core's few L1 miss
 * buffers until its line arrives, so fewer misses are in flight at once; the L2 has more. It
 * reads K/V 1.3-1.7x faster here (benchmarks/cpu/attention.py, docs/benchmarks.md). */
static inline void prefetch_row(const void *base, int64_t index, int bf16, int d) {
    const char *row = (const char *)base + index * (bf16 ? 2 : 4);
    for (int b = 0; b < d * (bf16 ? 2 : 4); b += 64) __builtin_prefetch(row + b, 0, 2);
}

/* One decode and one KV head: the group's g query heads over the sequence's len keys. `then`
 * is where the next pair's first block starts (its rows are fetched during this pair's last
 * block). Inlined into `attend` with g and d known at compile time for the common sizes. */
static inline __attribute__((always_inline)) void attend_one(
    const void *q, const void *k_cache, const void *v_cache, void *out, const int32_t *table,
    int64_t row, int32_t len, int kv_head, int h, int hkv, int g, int d, int bs, float scale,
    int bf16, int64_t then) {
    float qs[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
    float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_BLOCK];
    float krow[MAX_HEAD_DIM], vrow[MAX_HEAD_DIM];
    for (int j = 0; j < g; j++) {
        const float *qrow = row_f32(q, (row * h + (int64_t)kv_head * g + j) * d, bf16, d, krow);
        for (int i = 0; i < d; i++) { qs[j][i] = qrow[i] * scale; acc[j][i] = 0.0f; }
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    for (int start = 0; start < len; start += bs) {
        const int64_t block = table[start / bs];
        const int n = len - start < bs ? len - start : bs;
        const int64_t first = (block * bs * hkv + kv_head) * d; /* token 0 of the block */
        /* The next block's rows (after the last block, the next pair's first) are fetched a row
         * per key and value while this one computes: one thread's misses alone would leave
         * memory idle (benchmarks/cpu/attention.py). */
        const int64_t ahead = start + bs < len ? (table[start / bs + 1] * bs * hkv + kv_head) * d
                                               : then;
        for (int t = 0; t < n; t++) {  /* scores of the block's keys */
            prefetch_row(k_cache, ahead + (int64_t)t * hkv * d, bf16, d);
            const float *key = row_f32(k_cache, first + (int64_t)t * hkv * d, bf16, d, krow);
            for (int j = 0; j < g; j++) {
                float dot = 0.0f;
                for (int i = 0; i < d; i++) dot += qs[j][i] * key[i];
                s[j][t] = dot;
            }
        }
        for (int j = 0; j < g; j++) {  /* online softmax: rescale what came before */
            float top = m[j];
            for (int t = 0; t < n; t++) top = s[j][t] > top ? s[j][t] : top;
            const float correction = expf(m[j] - top);
            float sum = 0.0f;
            for (int t = 0; t < n; t++) { s[j][t] = expf(s[j][t] - top); sum += s[j][t]; }
            l[j] = l[j] * correction + sum;
            m[j] = top;
            for (int i = 0; i < d; i++) acc[j][i] *= correction;
        }
        for (int t = 0; t < n; t++) {  /* weighted values */
            prefetch_row(v_cache, ahead + (int64_t)t * hkv * d, bf16, d);
            const float *value = row_f32(v_cache, first + (int64_t)t * hkv * d, bf16, d, vrow);
            for (int j = 0; j < g; j++) {
                const float p = s[j][t];
                for (int i = 0; i < d; i++) acc[j][i] += p * value[i];
            }
        }
    }
    for (int j = 0; j < g; j++) {
        const int64_t at = (row * h + (int64_t)kv_head * g + j) * d;
        const float inv = 1.0f / l[j];
        if (bf16) {
            uint16_t *dst = (uint16_t *)out + at;
            for (int i = 0; i < d; i++) dst[i] = float_to_bf16(acc[j][i] * inv);
        } else {
            float *dst = (float *)out + at;
            for (int i = 0; i < d; i++) dst[i] = acc[j][i] * inv;
        }
    }
}

#define SIZED(G, D)                                                                         \
    if (g == G && d == D) {                                                                 \
        attend_one(q, k, v, out, table, row, len, kv_head, h, hkv, G, D, bs, scale, bf16,   \
                   then);                                                                   \
        return;                                                                             \
    }

/* `attend_one`, specialised for head dims 64 and 128 with 1 to 8 query heads per KV head. */
static void attend(const void *q, const void *k, const void *v, void *out, const int32_t *table,
                   int64_t row, int32_t len, int kv_head, int h, int hkv, int d, int bs,
                   float scale, int bf16, int64_t then) {
    const int g = h / hkv;
    SIZED(1, 64) SIZED(2, 64) SIZED(3, 64) SIZED(4, 64) SIZED(5, 64) SIZED(6, 64) SIZED(8, 64)
    SIZED(1, 128) SIZED(2, 128) SIZED(4, 128) SIZED(6, 128) SIZED(8, 128)
    attend_one(q, k, v, out, table, row, len, kv_head, h, hkv, g, d, bs, scale, bf16, then);
}

/* Every (decode, KV head) pair, split over `threads` OpenMP threads. Returns 0, or -1 when a
 * size is beyond the fixed buffers (the caller checks first). */
int paged_decode(const void *q, const void *k_cache, const void *v_cache, void *out,
                 const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                 const int32_t *rows, const int32_t *seqs, int64_t n, int h, int hkv, int d,
                 int bs, float scale, int bf16, int threads) {
    if (h % hkv || h / hkv > MAX_GROUP || d > MAX_HEAD_DIM || bs > MAX_BLOCK) return -1;
    const int64_t pairs = n * hkv;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t i = p / hkv;
        const int32_t seq = seqs[i];
        const int64_t next = p + 1 < pairs ? p + 1 : p; /* its first block is fetched early */
        const int64_t first_block = block_tables[(int64_t)seqs[next / hkv] * max_blocks];
        const int64_t then = (first_block * bs * hkv + next % hkv) * d;
        attend(q, k_cache, v_cache, out, block_tables + (int64_t)seq * max_blocks, rows[i],
                   seq_lens[seq], (int)(p % hkv), h, hkv, d, bs, scale, bf16, then);
    }
    return 0;
}

/* paged_decode as a bound call over its argument block (`paged_decode_args`, kernel_args.h). */
int paged_decode_call(const void *args) {
    const paged_decode_args *a = args;
    return paged_decode(a->q, a->k_cache, a->v_cache, a->out, a->block_tables, a->max_blocks,
                        a->seq_lens, a->rows, a->seqs, a->n, a->h, a->hkv, a->d, a->bs,
                        a->scale, a->bf16, a->threads);
}

/* The step's new keys and values into their cache slots (the attention contract's
 * reshape_and_cache): row t of key and of value, `width` = H_kv * D values each, `key_stride` /
 * `value_stride` elements after row t - 1 (views of a fused projection's output need no copy),
 * to slot slot_mapping[t] of k_cache and v_cache ([num_slots, width] contiguous); a slot of -1
 * is skipped. `elem` bytes per value. The caller checks the slots against the cache. */
void write_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride,
              void *k_cache, void *v_cache, const int64_t *slot_mapping, int64_t t,
              int64_t width, int elem) {
    const size_t row = (size_t)width * elem;
    for (int64_t i = 0; i < t; i++) {
        const int64_t slot = slot_mapping[i];
        if (slot < 0) continue;
        memcpy((char *)k_cache + slot * row, (const char *)key + i * key_stride * elem, row);
        memcpy((char *)v_cache + slot * row, (const char *)value + i * value_stride * elem, row);
    }
}

/* write_kv as a bound call over its argument block (`write_kv_args`, kernel_args.h). */
int write_kv_call(const void *args) {
    const write_kv_args *a = args;
    write_kv(a->key, a->key_stride, a->value, a->value_stride, a->k_cache, a->v_cache,
             a->slot_mapping, a->t, a->width, a->elem);
    return 0;
}
