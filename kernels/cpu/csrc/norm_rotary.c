/* A layer's small row operators for a CPU, one call each over a step's rows: RMSNorm (alone, or
 * after the residual add before it), rotary position embeddings, SwiGLU's SiLU-and-multiply,
 * the row look-ups before the first layer (the tokens' embeddings, their rotary angles) and the
 * widening of bfloat16 logits after the last.
 *
 * Each is a handful of PyTorch ops (RMSNorm: a square, a mean, an add, a reciprocal square
 * root, two products; rotary: two products, a half swap with a negation, a sum; SwiGLU: a
 * SiLU and a product), and at a decode step's one row every op costs more to dispatch than to
 * compute: two norms, two rotaries and a SwiGLU a layer are a few hundred microseconds of a
 * step's ~30 layers. Here each is one pass over the row.
 *
 * They compute what minipaged.models.layers' PyTorch code computes, in the same order and with
 * the same roundings: RMSNorm's statistics in float32, its normalised row rounded to the
 * input's dtype and then multiplied by the weight (rounded again); the rotary's two products
 * and their sum each rounded to the input's dtype; the residual add rounded to it; the SiLU
 * and its product each rounded to it. The norm's sum of squares is added in another order and
 * the SiLU's exponential is the C library's, not PyTorch's (each within an ulp or two); all
 * else is bit for bit. Products are never fused into multiply-adds (`fp-contract=off` below).
 *
 * Built by minipaged.kernels.cpu.build (-O3 -ffast-math -march=native: the loops vectorize). */

#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernel_args.h"

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* A float32 value as the dtype's value would be (bfloat16: rounded), in float32. */
static inline float round_to(float v, int bf16) {
    return bf16 ? bf16_to_float(float_to_bf16(v)) : v;
}

static inline void store(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = float_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* out[t] = weight * (x[t] / sqrt(mean(x[t]^2) + eps)) for rows t < rows of n features; x and
 * out [rows, n] contiguous (out may be x), weight [n], all float32 or all bfloat16 (bf16). */
void rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t n, float eps,
              int bf16) {
    for (int64_t t = 0; t < rows; t++) {
        float squares = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            const float v = load(x, t * n + i, bf16);
            squares += v * v;
        }
        const float scale = 1.0f / sqrtf(squares / (float)n + eps);
        for (int64_t i = 0; i < n; i++) {
            const float normed = round_to(load(x, t * n + i, bf16) * scale, bf16);
            store(out, t * n + i, load(weight, i, bf16) * normed, bf16);
        }
    }
}

/* Rotary embedding of x [rows, heads, d] into out (contiguous, same shape): the pair (i,
 * i + d/2) of every head of row t turned by the angle whose cos and sin are cos[t, i] and
 * sin[t, i] ([rows, d] contiguous, x's dtype). x's rows are `row_stride` elements apart and its
 * heads `d` (the q or k columns of a fused projection's output), so no copy is needed. */
void rotary(const void *x, int64_t row_stride, const void *cos, const void *sin, void *out,
            int64_t rows, int64_t heads, int64_t d, int bf16) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t in = t * row_stride + h * d, at = (t * heads + h) * d;
            for (int64_t i = 0; i < d; i++) {
                const float v = load(x, in + i, bf16);
                /* rotate_half: (x1, x2) -> (-x2, x1) */
                const float turned = i < half ? -load(x, in + i + half, bf16)
                                              : load(x, in + i - half, bf16);
                const float a = round_to(v * load(cos, t * d + i, bf16), bf16);
                const float b = round_to(turned * load(sin, t * d + i, bf16), bf16);
                store(out, at + i, a + b, bf16);
            }
        }
    }
}

/* x[t] += residual[t] (rounded to x's dtype, as PyTorch's add), then out[t] = rms_norm(x[t]):
 * a layer's residual add and the norm after it in one call (vLLM's fused_add_rms_norm). x,
 * residual and out [rows, n] contiguous, out not x. */
void add_rms_norm(void *x, const void *residual, const void *weight, void *out, int64_t rows,
                  int64_t n, float eps, int bf16) {
    for (int64_t i = 0; i < rows * n; i++)
        store(x, i, load(x, i, bf16) + load(residual, i, bf16), bf16);
    rms_norm(x, weight, out, rows, n, eps, bf16);
}

/* g / (1 + exp(-g)), from the exp of -|g| only: it never overflows (with -ffast-math an
 * overflow is not inf). */
static inline float silu(float g) {
    const float e = expf(-fabsf(g));
    return g * (g >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* out[t, i] = silu(gate[t, i]) * up[t, i], silu(g) = g / (1 + exp(-g)) rounded to the dtype, as
 * F.silu(gate) * up: SwiGLU's activation. gate's and up's rows are `row_stride` elements apart
 * (the two halves of a fused gate/up projection's output, no copy); out [rows, n]
 * contiguous, apart from both. */
void silu_mul(const void *gate, const void *up, int64_t row_stride, void *out, int64_t rows,
              int64_t n, int bf16) {
    for (int64_t t = 0; t < rows; t++) {
        if (bf16) {
            const uint16_t *restrict g = (const uint16_t *)gate + t * row_stride;
            const uint16_t *restrict u = (const uint16_t *)up + t * row_stride;
            uint16_t *restrict o = (uint16_t *)out + t * n;
            for (int64_t i = 0; i < n; i++) {
                const float activated = round_to(silu(bf16_to_float(g[i])), 1);
                o[i] = float_to_bf16(activated * bf16_to_float(u[i]));
            }
        } else {  /* separate loops, no aliasing: each vectorizes with the vector expf */
            const float *restrict g = (const float *)gate + t * row_stride;
            const float *restrict u = (const float *)up + t * row_stride;
            float *restrict o = (float *)out + t * n;
            for (int64_t i = 0; i < n; i++) o[i] = silu(g[i]) * u[i];
        }
    }
}

/* out[i] = table[index[i]] for i < n, rows of `row_bytes` bytes: an embedding's rows for the
 * step's tokens, the rotary angles for their positions. Returns -1, having written nothing,
 * where an index lies outside the table's `table_rows` rows. */
int gather_rows(const void *table, int64_t table_rows, int64_t row_bytes, const int64_t *index,
                int64_t n, void *out) {
    for (int64_t i = 0; i < n; i++)
        if (index[i] < 0 || index[i] >= table_rows) return -1;
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)out + i * row_bytes, (const char *)table + index[i] * row_bytes,
               (size_t)row_bytes);
    return 0;
}

/* out[i] = x[i] widened from bfloat16 to float32 (exactly), for i < n: a replayed step's
 * bfloat16 logits as the float32 the sampler reads. */
int to_float32(const uint16_t *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = bf16_to_float(x[i]);
    return 0;
}

/* ---- Bound calls -------------------------------------------------------------------------- */

/* Each kernel as a bound call over its argument block (kernel_args.h). */
int rms_norm_call(const void *args) {
    const rms_norm_args *a = args;
    rms_norm(a->x, a->weight, a->out, a->rows, a->n, a->eps, a->bf16);
    return 0;
}

int add_rms_norm_call(const void *args) {
    const add_rms_norm_args *a = args;
    add_rms_norm(a->x, a->residual, a->weight, a->out, a->rows, a->n, a->eps, a->bf16);
    return 0;
}

int rotary_call(const void *args) {
    const rotary_args *a = args;
    rotary(a->x, a->row_stride, a->cos, a->sin, a->out, a->rows, a->heads, a->d, a->bf16);
    return 0;
}

int silu_mul_call(const void *args) {
    const silu_mul_args *a = args;
    silu_mul(a->gate, a->up, a->row_stride, a->out, a->rows, a->n, a->bf16);
    return 0;
}

int gather_rows_call(const void *args) {
    const gather_rows_args *a = args;
    return gather_rows(a->table, a->table_rows, a->row_bytes, a->index, a->n, a->out);
}

int to_float32_call(const void *args) {
    const to_float32_args *a = args;
    return to_float32(a->x, a->out, a->n);
}
