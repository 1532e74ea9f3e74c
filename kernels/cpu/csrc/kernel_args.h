/* The argument block of every kernel's bound-call entry (`<kernel>_call(const void *args)`):
 * a call bound once from Python and made again and again (kernels/cpu/calls.py), each laid out
 * field for field by its ctypes Structure (gemv.py's GemvArgs, native.py's PagedDecodeArgs and
 * WriteKvArgs, norm_rotary.py's *Args). One definition, which the kernels and the aarch64
 * harness (tests/kernels/cpu/aarch64_harness.c) both include. */

#ifndef MINIPAGED_KERNEL_ARGS_H
#define MINIPAGED_KERNEL_ARGS_H

#include <stdint.h>

/* gemv.c */
typedef struct {
    const void *x;
    int64_t m, k;
    int32_t io_bf16, nw;
    const void *const *ws;
    const int *types;
    const int64_t *ns;
    const float *const *scales;
    const int64_t *groups;
    const void *const *biases;
    void *out;
    int32_t isa, fetch_ahead, threads;
} gemv_args;

/* paged_decode.c */
typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int32_t *block_tables;
    int64_t max_blocks;
    const int32_t *seq_lens, *rows, *seqs;
    int64_t n;
    int32_t h, hkv, d, bs;
    float scale;
    int32_t bf16, threads;
} paged_decode_args;

typedef struct {
    const void *key;
    int64_t key_stride;
    const void *value;
    int64_t value_stride;
    void *k_cache, *v_cache;
    const int64_t *slot_mapping;
    int64_t t, width;
    int32_t elem;
} write_kv_args;

/* norm_rotary.c */
typedef struct {
    const void *x, *weight;
    void *out;
    int64_t rows, n;
    float eps;
    int32_t bf16;
} rms_norm_args;

typedef struct {
    void *x;
    const void *residual, *weight;
    void *out;
    int64_t rows, n;
    float eps;
    int32_t bf16;
} add_rms_norm_args;

typedef struct {
    const void *x;
    int64_t row_stride;
    const void *cos, *sin;
    void *out;
    int64_t rows, heads, d;
    int32_t bf16;
} rotary_args;

typedef struct {
    const void *gate, *up;
    int64_t row_stride;
    void *out;
    int64_t rows, n;
    int32_t bf16;
} silu_mul_args;

typedef struct {
    const void *table;
    int64_t table_rows, row_bytes;
    const int64_t *index;
    int64_t n;
    void *out;
} gather_rows_args;

typedef struct {
    const uint16_t *x;
    float *out;
    int64_t n;
} to_float32_args;

#endif
