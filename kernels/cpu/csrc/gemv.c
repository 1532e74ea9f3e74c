/* Few-row linear layers for a CPU: out[m, :] = x[m, :] @ W.T (+ bias) for a handful of rows m,
 * over one or more weights that read the same x (a layer's q, k and v projections, say), their
 * outputs side by side in one row of `out`.
 *
 * At a decode step's few rows a linear layer is a matrix-vector product: every weight byte is
 * read once from memory and used for m multiply-adds, so its speed is the memory's, and the
 * kernel's job is to keep reading at that speed. Each weight is row-major [n, k], as a
 * checkpoint stores it: its rows follow one another in memory, so one pass over them is one
 * sequential stream for the hardware prefetcher. A tile of R output rows is computed at once
 * for all m input rows (R * m vector accumulators), so each weight vector loaded serves m
 * multiply-adds and each x vector (from L1) R of them.
 *
 * Weights are float32, bfloat16 (widened to float32 in registers) or int8 with a float32 scale
 * per group of `group` consecutive input features of each output row (dequantised in
 * registers: the group's integer-weighted sum of x times its scale; no float copy of the weight
 * exists). x and out are float32 or bfloat16 (x widened once into a float32 buffer, out
 * rounded to nearest even once); accumulation is float32. Rows beyond 8 are done 8 at a time.
 *
 * Every path builds on every CPU: on x86-64 the AVX-512 and AVX2 paths are compiled side by side,
 * each function with its own `target` attribute, and chosen when called by what the CPU reports
 * (`__builtin_cpu_supports`), so the file needs no -march flag; on aarch64 the NEON path (part
 * of every aarch64 CPU); plain C everywhere, and alone on any other CPU. The caller may ask for
 * a narrower path than the widest (`isa`). OpenMP splits the output rows over threads. Built by
 * minipaged.kernels.cpu.build. */

#if defined(__x86_64__) || defined(__i386__)
#define GEMV_X86 1
#include <immintrin.h>
#elif defined(__aarch64__)
#define GEMV_NEON 1
#include <arm_neon.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernel_args.h"

enum { W_F32 = 0, W_BF16 = 1, W_INT8 = 2 };
#define MAX_ROWS 8 /* input rows per pass over the weights */

/* Bytes ahead of each weight row's read that it is fetched into L2, where a call fetches ahead
 * (`fetch_ahead`): on some CPUs one thread's demand misses alone leave memory idle, on others
 * the hardware prefetcher keeps up alone and the extra requests only slow it. Measured, one
 * row, one thread: SmolLM2's 49152 x 576 head on a Xeon with AVX-512, bfloat16 8.7 GB/s with
 * 2 KiB, 11.2 with 16 KiB (float32 9.8 -> 11.3); its 30 layers and head on an AMD EPYC, float32
 * one weight row at a time, 22 GB/s with 16 KiB and 25-26 without, bfloat16 four rows at a
 * time 21 with 16 KiB and 9 without. The caller chooses by measurement
 * (minipaged.kernels.cpu.gemv.fetch_ahead). */
#ifndef PREFETCH
#define PREFETCH 16384
#endif
static inline const char *w_byte(const void *w, int type, int64_t i) {
    return (const char *)w + i * (type == W_F32 ? 4 : type == W_BF16 ? 2 : 1);
}

static inline float weight_at(const void *w, int type, int64_t i) {
    if (type == W_F32) return ((const float *)w)[i];
    if (type == W_BF16) return bf16_to_float(((const uint16_t *)w)[i]);
    return (float)((const int8_t *)w)[i];
}

/* One weight's job: rows [r0, r1) of an [n, k] weight into columns col.. of out's rows. */
typedef struct {
    const void *w;
    int type;
    const float *scales; /* int8: [n, k / group] */
    int64_t group;       /* int8: input features per scale; else k */
    const void *bias;    /* [n] in x's dtype, or NULL */
} weight_t;

/* out[i * ld + r] for the m input rows (float32, or bfloat16 rounded to nearest even when
 * io_bf16) = acc[i] + the weight's bias at r. */
static inline void store_row(const weight_t *wt, int64_t r, const float *acc, int m,
                             void *out, int64_t ld, int io_bf16) {
    const float b = wt->bias == NULL ? 0.0f
                    : io_bf16 ? bf16_to_float(((const uint16_t *)wt->bias)[r])
                              : ((const float *)wt->bias)[r];
    for (int i = 0; i < m; i++) {
        if (io_bf16) ((uint16_t *)out)[i * ld + r] = float_to_bf16(acc[i] + b);
        else ((float *)out)[i * ld + r] = acc[i] + b;
    }
}

/* ---- plain C ------------------------------------------------------------------------------ */

static void tile_scalar(const float *x, int m, int64_t k, const weight_t *wt, int64_t r,
                        float *acc /* [m] */) {
    const int64_t groups = k / wt->group;
    for (int i = 0; i < m; i++) acc[i] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        float part[MAX_ROWS] = {0};
        for (int64_t j = g * wt->group; j < (g + 1) * wt->group; j++) {
            const float wv = weight_at(wt->w, wt->type, r * k + j);
            for (int i = 0; i < m; i++) part[i] += wv * x[i * k + j];
        }
        const float s = wt->type == W_INT8 ? wt->scales[r * groups + g] : 1.0f;
        for (int i = 0; i < m; i++) acc[i] += s * part[i];
    }
}

/* Rows [r0, r1) of a weight in plain C, stored: the C path, and the rows after a span's tiles. */
static void rows_scalar(const float *x, int m, int64_t k, const weight_t *wt, int64_t r0,
                        int64_t r1, void *out, int64_t ld, int io_bf16) {
    for (int64_t r = r0; r < r1; r++) {
        float acc[MAX_ROWS];
        tile_scalar(x, m, k, wt, r, acc);
        store_row(wt, r, acc, m, out, ld, io_bf16);
    }
}

#ifdef GEMV_X86
/* ---- AVX-512 ------------------------------------------------------------------------------ */

#define TARGET_tile512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma"), always_inline)) inline

static AVX512 __m512 load_w512(const void *w, int type, int64_t i, __mmask16 mask) {
    if (type == W_F32) return _mm512_maskz_loadu_ps(mask, (const float *)w + i);
    if (type == W_BF16) {
        __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    __m128i b = _mm_maskz_loadu_epi8(mask, (const int8_t *)w + i);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

/* R output rows from r, M input rows: sums in out_acc[R][M]; each read's weight bytes `ahead`
 * (0: none) fetched into L2. Inlined with R, M, type and ahead fixed. */
static AVX512 void tile512(const float *x, int64_t k, const weight_t *wt, int64_t r, int R,
                           int M, int type, int64_t ahead, float out_acc[4][MAX_ROWS]) {
    const int64_t groups = k / wt->group, group = wt->group;
    __m512 acc[4][MAX_ROWS];
    for (int a = 0; a < R; a++)
        for (int i = 0; i < M; i++) acc[a][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 part[4][MAX_ROWS];
        for (int a = 0; a < R; a++)
            for (int i = 0; i < M; i++) part[a][i] = _mm512_setzero_ps();
        const int64_t end = (g + 1) * group;
        for (int64_t j = g * group; j < end; j += 16) {
            const __mmask16 mask = end - j >= 16 ? 0xffff : (__mmask16)((1u << (end - j)) - 1);
            __m512 wv[4];
            for (int a = 0; a < R; a++) {
                wv[a] = load_w512(wt->w, type, (r + a) * k + j, mask);
                if (ahead) _mm_prefetch(w_byte(wt->w, type, (r + a) * k + j) + ahead, _MM_HINT_T1);
            }
            for (int i = 0; i < M; i++) {
                const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * k + j);
                for (int a = 0; a < R; a++) part[a][i] = _mm512_fmadd_ps(wv[a], xv, part[a][i]);
            }
        }
        for (int a = 0; a < R; a++) {
            if (type == W_INT8) {
                const __m512 s = _mm512_set1_ps(wt->scales[(r + a) * groups + g]);
                for (int i = 0; i < M; i++) acc[a][i] = _mm512_fmadd_ps(s, part[a][i], acc[a][i]);
            } else {
                for (int i = 0; i < M; i++) acc[a][i] = _mm512_add_ps(acc[a][i], part[a][i]);
            }
        }
    }
    for (int a = 0; a < R; a++)
        for (int i = 0; i < M; i++) out_acc[a][i] = _mm512_reduce_add_ps(acc[a][i]);
}

/* ---- AVX-512 BF16 ------------------------------------------------------------------------- */

/* bfloat16 weights times bfloat16 x, one output row at a time: VDPBF16PS multiplies 32 pairs
 * of bfloat16 and adds each two neighbouring products into one of 16 float32 sums, so one
 * 64-byte weight vector costs one instruction per input row, where widening it to float32
 * costs two shuffles, two shifts and two multiply-adds. One thread then reads bfloat16 weights
 * at 27-29 GB/s (SmolLM2's 30 layers and head on huge pages, one row, AMD EPYC; widening, four
 * rows a tile, fetching ahead: 22-23), as fast as an AVX-512 sum in C and 5-10% behind torch's
 * `sum`; an add in the instruction's place reads 6% faster, and two or four accumulators,
 * 256-bit loads or the input held in registers win back 1-2% of it (not kept). The products
 * are exact in float32; the sums are float32, in another order than the widening path's, with
 * subnormal inputs and results taken as zero, as the instruction does. It never fetches ahead:
 * the hardware prefetcher keeps up with one row's stream, and fetching 16 KiB ahead made the
 * replayed bfloat16 step's calls slower (11.1-11.3 ms against 8.3-8.9, same process). */
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10)
#define HAVE_DPBF16 1
#define AVX512BF16                                                                           \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline

static AVX512BF16 void tile_dp(const uint16_t *x, int64_t k, const uint16_t *w, int M,
                               float out_acc[MAX_ROWS]) {
    __m512 acc[MAX_ROWS];
    for (int i = 0; i < M; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 32) {
        const __mmask32 mask = k - j >= 32 ? 0xffffffffu : (__mmask32)((1u << (k - j)) - 1);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j);
        for (int i = 0; i < M; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], wv,
                                      (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * k + j));
    }
    for (int i = 0; i < M; i++) out_acc[i] = _mm512_reduce_add_ps(acc[i]);
}

/* Rows [r0, r1) of a bfloat16 weight for M bfloat16 input rows, stored (as a TILE span). */
typedef void (*dp_span_fn)(const uint16_t *, int64_t, const weight_t *, int64_t, int64_t,
                           void *, int64_t);
#define DP_SPAN(M)                                                                            \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void dp_##M(     \
        const uint16_t *x, int64_t k, const weight_t *wt, int64_t r0, int64_t r1, void *out,  \
        int64_t ld) {                                                                         \
        for (int64_t r = r0; r < r1; r++) {                                                   \
            float acc[MAX_ROWS];                                                              \
            tile_dp(x, k, (const uint16_t *)wt->w + r * k, M, acc);                           \
            store_row(wt, r, acc, M, out, ld, 1);                                             \
        }                                                                                     \
    }
DP_SPAN(1) DP_SPAN(2) DP_SPAN(3) DP_SPAN(4) DP_SPAN(5) DP_SPAN(6) DP_SPAN(7) DP_SPAN(8)
static const dp_span_fn DP_TABLE[MAX_ROWS] = {dp_1, dp_2, dp_3, dp_4, dp_5, dp_6, dp_7, dp_8};
#endif

/* ---- AVX2 --------------------------------------------------------------------------------- */

#define TARGET_tile256 __attribute__((target("avx2,fma")))
#define AVX2 __attribute__((target("avx2,fma"), always_inline)) inline

static AVX2 __m256 load_w256(const void *w, int type, int64_t i) {
    if (type == W_F32) return _mm256_loadu_ps((const float *)w + i);
    if (type == W_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)w + i));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

static AVX2 float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static AVX2 void tile256(const float *x, int64_t k, const weight_t *wt, int64_t r, int R,
                         int M, int type, int64_t ahead, float out_acc[4][MAX_ROWS]) {
    const int64_t groups = k / wt->group, group = wt->group;
    for (int a = 0; a < R; a++)
        for (int i = 0; i < M; i++) out_acc[a][i] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        __m256 part[4][MAX_ROWS];
        for (int a = 0; a < R; a++)
            for (int i = 0; i < M; i++) part[a][i] = _mm256_setzero_ps();
        const int64_t start = g * group, end = start + group, vend = start + (group & ~7);
        for (int64_t j = start; j < vend; j += 8) {
            __m256 wv[4];
            for (int a = 0; a < R; a++) {
                wv[a] = load_w256(wt->w, type, (r + a) * k + j);
                if (ahead) _mm_prefetch(w_byte(wt->w, type, (r + a) * k + j) + ahead, _MM_HINT_T1);
            }
            for (int i = 0; i < M; i++) {
                const __m256 xv = _mm256_loadu_ps(x + i * k + j);
                for (int a = 0; a < R; a++) part[a][i] = _mm256_fmadd_ps(wv[a], xv, part[a][i]);
            }
        }
        for (int a = 0; a < R; a++) {
            const float s = type == W_INT8 ? wt->scales[(r + a) * groups + g] : 1.0f;
            for (int i = 0; i < M; i++) {
                float sum = hsum256(part[a][i]);
                for (int64_t j = vend; j < end; j++)
                    sum += weight_at(wt->w, type, (r + a) * k + j) * x[i * k + j];
                out_acc[a][i] += s * sum;
            }
        }
    }
}

#endif /* GEMV_X86 */

#ifdef GEMV_NEON
/* ---- NEON (aarch64) ----------------------------------------------------------------------- */

#define TARGET_tile_neon
#define NEON __attribute__((always_inline)) inline

/* Eight weights from i as float32, in two halves. */
static NEON void load_w_neon(const void *w, int type, int64_t i, float32x4_t *lo,
                             float32x4_t *hi) {
    if (type == W_F32) {
        *lo = vld1q_f32((const float *)w + i);
        *hi = vld1q_f32((const float *)w + i + 4);
    } else if (type == W_BF16) {
        const uint16x8_t h = vld1q_u16((const uint16_t *)w + i);
        *lo = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
        *hi = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(h), 16));
    } else {
        const int16x8_t b = vmovl_s8(vld1_s8((const int8_t *)w + i));
        *lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(b)));
        *hi = vcvtq_f32_s32(vmovl_s16(vget_high_s16(b)));
    }
}

/* As tile256, eight input features a step in two 4-lane halves. */
static NEON void tile_neon(const float *x, int64_t k, const weight_t *wt, int64_t r, int R,
                           int M, int type, int64_t ahead, float out_acc[4][MAX_ROWS]) {
    const int64_t groups = k / wt->group, group = wt->group;
    for (int a = 0; a < R; a++)
        for (int i = 0; i < M; i++) out_acc[a][i] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        float32x4_t part[4][MAX_ROWS];
        for (int a = 0; a < R; a++)
            for (int i = 0; i < M; i++) part[a][i] = vdupq_n_f32(0.0f);
        const int64_t start = g * group, end = start + group, vend = start + (group & ~7);
        for (int64_t j = start; j < vend; j += 8) {
            float32x4_t lo[4], hi[4];
            for (int a = 0; a < R; a++) {
                load_w_neon(wt->w, type, (r + a) * k + j, &lo[a], &hi[a]);
                if (ahead) __builtin_prefetch(w_byte(wt->w, type, (r + a) * k + j) + ahead, 0, 2);
            }
            for (int i = 0; i < M; i++) {
                const float *xi = x + i * k + j;
                const float32x4_t xlo = vld1q_f32(xi), xhi = vld1q_f32(xi + 4);
                for (int a = 0; a < R; a++)
                    part[a][i] = vfmaq_f32(vfmaq_f32(part[a][i], lo[a], xlo), hi[a], xhi);
            }
        }
        for (int a = 0; a < R; a++) {
            const float s = type == W_INT8 ? wt->scales[(r + a) * groups + g] : 1.0f;
            for (int i = 0; i < M; i++) {
                float sum = vaddvq_f32(part[a][i]);
                for (int64_t j = vend; j < end; j++)
                    sum += weight_at(wt->w, type, (r + a) * k + j) * x[i * k + j];
                out_acc[a][i] += s * sum;
            }
        }
    }
}
#endif /* GEMV_NEON */

/* ---- dispatch ----------------------------------------------------------------------------- */

/* Whether a weight of `type` goes to the bfloat16 dot-product path on path `isa`. */
static int takes_dp(int isa, int io_bf16, int type) {
#ifdef HAVE_DPBF16
    return isa >= 3 && io_bf16 && type == W_BF16;
#else
    (void)isa, (void)io_bf16, (void)type;
    return 0;
#endif
}


/* A run of whole tiles, rows [r0, r1) of a weight, for M input rows, each tile's sums stored
 * into out (rows ld apart) as it is done: one function per (ISA, R, M, type, fetching ahead or
 * not), so that the compiler keeps R * M accumulators in registers (the loops' bounds are
 * constants) and a tile costs no call. */
typedef void (*span_fn)(const float *, int64_t, const weight_t *, int64_t, int64_t, void *,
                        int64_t, int);
#define TILE(isa, R, M, T, P)                                                                 \
    TARGET_##isa static void isa##_##R##_##M##_##T##_##P(                                     \
        const float *x, int64_t k, const weight_t *wt, int64_t r0, int64_t r1, void *out,     \
        int64_t ld, int io_bf16) {                                                            \
        for (int64_t r = r0; r < r1; r += R) {                                                \
            float acc[4][MAX_ROWS];                                                           \
            isa(x, k, wt, r, R, M, T, P ? PREFETCH : 0, acc);                                 \
            for (int a = 0; a < R; a++) store_row(wt, r + a, acc[a], M, out, ld, io_bf16);   \
        }                                                                                     \
    }
/* The tiles tile_rows picks: R = 1 (float32) or 4 at one or two rows, 2 at three or four, 1
 * beyond. */
#define TILES(isa, T, P)                                                                      \
    TILE(isa, 2, 3, T, P) TILE(isa, 2, 4, T, P) TILE(isa, 1, 5, T, P) TILE(isa, 1, 6, T, P)   \
    TILE(isa, 1, 7, T, P) TILE(isa, 1, 8, T, P)
#define ALL_TILES(isa, P)                                                                    \
    TILES(isa, 0, P) TILES(isa, 1, P) TILES(isa, 2, P) TILE(isa, 1, 1, 0, P)                 \
    TILE(isa, 1, 2, 0, P) TILE(isa, 4, 1, 1, P) TILE(isa, 4, 2, 1, P) TILE(isa, 4, 1, 2, P)  \
    TILE(isa, 4, 2, 2, P)
#ifdef GEMV_X86
ALL_TILES(tile512, 0) ALL_TILES(tile512, 1) ALL_TILES(tile256, 0) ALL_TILES(tile256, 1)
#endif
#ifdef GEMV_NEON
ALL_TILES(tile_neon, 0) ALL_TILES(tile_neon, 1)
#endif

/* [fetch ahead][type][m - 1]: R as tile_rows says. */
#define TYPE_ROW(isa, R, T, P)                                                               \
    {isa##_##R##_1_##T##_##P, isa##_##R##_2_##T##_##P, isa##_2_3_##T##_##P,                 \
     isa##_2_4_##T##_##P, isa##_1_5_##T##_##P, isa##_1_6_##T##_##P, isa##_1_7_##T##_##P,    \
     isa##_1_8_##T##_##P}
#define TABLE(isa, P) {TYPE_ROW(isa, 1, 0, P), TYPE_ROW(isa, 4, 1, P), TYPE_ROW(isa, 4, 2, P)}
#ifdef GEMV_X86
static const span_fn TABLE512[2][3][MAX_ROWS] = {TABLE(tile512, 0), TABLE(tile512, 1)};
static const span_fn TABLE256[2][3][MAX_ROWS] = {TABLE(tile256, 0), TABLE(tile256, 1)};
#endif
#ifdef GEMV_NEON
static const span_fn TABLE_NEON[2][3][MAX_ROWS] = {TABLE(tile_neon, 0), TABLE(tile_neon, 1)};
#endif

/* The span function of path `isa` for m input rows of a weight of `type`; NULL: plain C. */
static span_fn span_for(int isa, int ahead, int type, int m) {
#if defined(GEMV_X86)
    return isa >= 2 ? TABLE512[ahead][type][m - 1] : isa == 1 ? TABLE256[ahead][type][m - 1] : NULL;
#elif defined(GEMV_NEON)
    return isa >= 1 ? TABLE_NEON[ahead][type][m - 1] : NULL;
#else
    (void)isa, (void)ahead, (void)type, (void)m;
    return NULL;
#endif
}

/* Output rows a tile computes at once for m input rows of a weight of `type`. The rows of a
 * tile are read side by side, as R short streams. At m <= 2, float32 rows read fastest one at
 * a time and bfloat16 and int8 ones four at a time (SmolLM2's 30 layers and head, one row,
 * one thread, AMD EPYC with 26-28 GB/s of streaming reads: float32 25-26 GB/s with R = 1 and
 * 13 with R = 4, not fetching ahead; bfloat16 21-23 GB/s with R = 4, fetching ahead, and the
 * same with R = 1 reading a 64-byte vector as 16 even and 16 odd values, two integer
 * operations instead of a widening shuffle: not kept). */
static int tile_rows(int m, int type) {
    if (m <= 2) return type == W_F32 ? 1 : 4;
    return m <= 4 ? 2 : 1;
}

/* The widest path this CPU can take: 3 AVX-512 with its bfloat16 dot products, 2 AVX-512, 1
 * AVX2 (x86-64) or NEON (aarch64), 0 plain C. */
int gemv_isa(void) {
#if defined(GEMV_NEON)
    return 1;
#elif !defined(GEMV_X86)
    return 0;
#else
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
#ifdef HAVE_DPBF16
        if (__builtin_cpu_supports("avx512bf16")) return 3;
#endif
        return 2;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
#endif
}

/* out [m, sum(n)] (float32, or bfloat16 when io_bf16) = x [m, k] (same dtype) times each of
 * the nw weights, side by side. ws/types/ns/scales/groups/biases: one entry per weight.
 * isa: as gemv_isa() returns, or lower to force a path; fetch_ahead: 1 to fetch weights
 * PREFETCH bytes ahead into L2, 0 not to. Returns 0, or -1 for bad sizes. */
int gemv(const void *x_in, int64_t m, int64_t k, int io_bf16, int nw, const void *const *ws,
         const int *types, const int64_t *ns, const float *const *scales, const int64_t *groups,
         const void *const *biases, void *out, int isa, int fetch_ahead, int threads) {
    if (m < 1 || k < 1 || nw < 1) return -1;
    int64_t width = 0;
    int widen = 0; /* bfloat16 x widened once, for the weights that read float32 x */
    for (int w = 0; w < nw; w++) {
        if (ns[w] < 1 || types[w] < 0 || types[w] > 2) return -1;
        if (types[w] == W_INT8 && (groups[w] < 1 || k % groups[w] != 0)) return -1;
        width += ns[w];
        widen |= !takes_dp(isa, io_bf16, types[w]);
    }
    float *xf = NULL;
    const float *x = (const float *)x_in;
    if (io_bf16 && widen) {
        xf = malloc(sizeof(float) * m * k);
        if (xf == NULL) return -1;
        for (int64_t i = 0; i < m * k; i++) xf[i] = bf16_to_float(((const uint16_t *)x_in)[i]);
        x = xf;
    }
    for (int64_t m0 = 0; m0 < m; m0 += MAX_ROWS) {
        const int mm = m - m0 < MAX_ROWS ? (int)(m - m0) : MAX_ROWS;
        const float *xc = x + m0 * k;
        char *out_rows = (char *)out + m0 * width * (io_bf16 ? 2 : 4);
        int64_t col = 0;
        for (int w = 0; w < nw; w++) {
            const weight_t wt = {ws[w], types[w], scales[w],
                                 types[w] == W_INT8 ? groups[w] : k, biases[w]};
            const int64_t n = ns[w];
            char *dst = out_rows + col * (io_bf16 ? 2 : 4);
            col += n;
#ifdef HAVE_DPBF16
            if (takes_dp(isa, io_bf16, wt.type)) {
                const uint16_t *xh = (const uint16_t *)x_in + m0 * k;
                const int runs = threads > 1 ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
                for (int c = 0; c < runs; c++)
                    DP_TABLE[mm - 1](xh, k, &wt, n * c / runs, n * (c + 1) / runs, dst, width);
                continue;
            }
#endif
            const int R = tile_rows(mm, types[w]);
            const int64_t whole = n / R;
            const int ahead = fetch_ahead != 0;
            const span_fn fn = span_for(isa, ahead, wt.type, mm);
            /* Each thread a run of whole tiles; the rows after the last whole tile in plain C. */
            const int runs = threads > 1 ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
            for (int c = 0; c < runs; c++) {
                const int64_t r0 = whole * c / runs * R, r1 = whole * (c + 1) / runs * R;
                if (fn != NULL) fn(xc, k, &wt, r0, r1, dst, width, io_bf16);
                else rows_scalar(xc, mm, k, &wt, r0, r1, dst, width, io_bf16);
            }
            rows_scalar(xc, mm, k, &wt, whole * R, n, dst, width, io_bf16);
        }
    }
    free(xf);
    return 0;
}

/* gemv as a bound call over its argument block (`gemv_args`, kernel_args.h). */
int gemv_call(const void *args) {
    const gemv_args *a = args;
    return gemv(a->x, a->m, a->k, a->io_bf16, a->nw, a->ws, a->types, a->ns, a->scales,
                a->groups, a->biases, a->out, a->isa, a->fetch_ahead, a->threads);
}
