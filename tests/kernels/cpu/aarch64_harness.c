/* Every exported C kernel of kernels/cpu/csrc over a fixed set of cases, each output value
 * printed exactly: tests/kernels/cpu/test_aarch64.py builds this for x86-64 (plain C) and for
 * aarch64 (plain C and NEON, run under qemu) and compares the two printouts.
 *
 * Linked with each kernel file compiled to its own object (their static helpers share names).
 * Inputs come from a fixed integer PRNG, so both builds see the same bits. Output:
 *
 *     case <label>                       one line per kernel call
 *     <index> <kind> <value> <scale>     one line per output value
 *
 * kind: "int" (exact: status codes, token ids, raw bits), "f32", "bf16" (one rounding of a
 * float32 result), "bf16r" (rounded more than once); value and scale in C99 hex-float (%a);
 * scale is the magnitude of the terms that make the value (the floor of its tolerance). A case
 * label with "isa=N" ran gemv on path N: 0 plain C, 1 NEON (aarch64 only). */

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernel_args.h"

/* ---- the kernels' exports (the files of csrc/) ----------------------------------------------- */

int gemv(const void *x_in, int64_t m, int64_t k, int io_bf16, int nw, const void *const *ws,
         const int *types, const int64_t *ns, const float *const *scales, const int64_t *groups,
         const void *const *biases, void *out, int isa, int fetch_ahead, int threads);
int gemv_isa(void);
int gemv_call(const void *args);
int paged_decode(const void *q, const void *k_cache, const void *v_cache, void *out,
                 const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                 const int32_t *rows, const int32_t *seqs, int64_t n, int h, int hkv, int d,
                 int bs, float scale, int bf16, int threads);
int paged_decode_call(const void *args);
void write_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride,
              void *k_cache, void *v_cache, const int64_t *slot_mapping, int64_t t,
              int64_t width, int elem);
int write_kv_call(const void *args);
int greedy_tokens(const float *logits, int64_t rows, int64_t vocab, int64_t *token_ids,
                  float *logprobs);
void rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t n, float eps,
              int bf16);
void add_rms_norm(void *x, const void *residual, const void *weight, void *out, int64_t rows,
                  int64_t n, float eps, int bf16);
void rotary(const void *x, int64_t row_stride, const void *cos, const void *sin, void *out,
            int64_t rows, int64_t heads, int64_t d, int bf16);
void silu_mul(const void *gate, const void *up, int64_t row_stride, void *out, int64_t rows,
              int64_t n, int bf16);
int gather_rows(const void *table, int64_t table_rows, int64_t row_bytes, const int64_t *index,
                int64_t n, void *out);
int to_float32(const uint16_t *x, float *out, int64_t n);
int rms_norm_call(const void *args);
int add_rms_norm_call(const void *args);
int rotary_call(const void *args);
int silu_mul_call(const void *args);
int gather_rows_call(const void *args);
int to_float32_call(const void *args);
typedef int (*kernel_entry)(const void *args);
int64_t run_calls(int64_t n, const kernel_entry *entries, const void *const *args);

/* ---- inputs ------------------------------------------------------------------------------- */

static uint64_t rng_state;

static void rng_seed(uint64_t seed) { rng_state = seed * 0x9e3779b97f4a7c15u; }

static uint64_t rng_next(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1), a multiple of 2^-23: exact in float32, the same on every machine. */
static float uniform(void) {
    return (float)((int32_t)(rng_next() >> 40) - (1 << 23)) / (float)(1 << 23);
}

static void *alloc(size_t bytes) {
    void *p = calloc(bytes ? bytes : 1, 1);
    if (p == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

static float get(const void *buf, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)buf)[i]) : ((const float *)buf)[i];
}

static void set(void *buf, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)buf)[i] = float_to_bf16(v);
    else ((float *)buf)[i] = v;
}

/* n values uniform in [lo, hi), float32 or (rounded) bfloat16. */
static void *random_values(int64_t n, int bf16, float lo, float hi) {
    void *buf = alloc((size_t)n * (bf16 ? 2 : 4));
    for (int64_t i = 0; i < n; i++) set(buf, i, lo + (hi - lo) * (uniform() + 1.0f) / 2, bf16);
    return buf;
}

/* n values of `sentinel`, for outputs: a value the kernel must (not) write shows. */
static void *filled(int64_t n, int bf16, float sentinel) {
    void *buf = alloc((size_t)n * (bf16 ? 2 : 4));
    for (int64_t i = 0; i < n; i++) set(buf, i, sentinel, bf16);
    return buf;
}

/* ---- output ------------------------------------------------------------------------------- */

static void begin(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fputs("case ", stdout);
    vprintf(fmt, args);
    putchar('\n');
    va_end(args);
}

static void put_int(const char *index, int64_t v) {
    printf("%s int %lld 0x0p+0\n", index, (long long)v);
}

static void put_value(int64_t index, const char *kind, float v, double scale) {
    printf("%lld %s %a %a\n", (long long)index, kind, (double)v, scale);
}

/* n values of buf (float32, or bfloat16 as `kind`), with their scales (NULL: all `scale`). */
static void put_values(const void *buf, int64_t n, int bf16, const char *kind,
                       const double *scales, double scale) {
    for (int64_t i = 0; i < n; i++)
        put_value(i, bf16 ? kind : "f32", get(buf, i, bf16), scales ? scales[i] : scale);
}

/* n elements of `elem` bytes as their raw bits: copies must be exact. */
static void put_bits(const void *buf, int64_t n, int elem) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = 0;
        if (elem == 4) memcpy(&bits, (const char *)buf + 4 * i, 4);
        else if (elem == 2) bits = ((const uint16_t *)buf)[i];
        else bits = ((const uint8_t *)buf)[i];
        char index[24];
        snprintf(index, sizeof index, "%lld", (long long)i);
        put_int(index, bits);
    }
}

/* ---- gemv --------------------------------------------------------------------------------- */

typedef struct {
    int type;      /* 0 float32, 1 bfloat16, 2 int8 */
    int64_t n, group;
    void *w;       /* [n, k] */
    float *scales; /* int8: [n, k / group] */
    void *bias;    /* [n] in x's dtype, or NULL */
} test_weight;

static test_weight make_weight(int type, int64_t n, int64_t k, int64_t group, int io_bf16,
                               int bias) {
    test_weight t = {type, n, type == 2 ? group : k, NULL, NULL, NULL};
    if (type == 2) {
        int8_t *w = alloc((size_t)(n * k));
        for (int64_t i = 0; i < n * k; i++) w[i] = (int8_t)((int)(rng_next() % 255) - 127);
        t.w = w;
        t.scales = random_values(n * (k / group), 0, 0.5f / 127, 1.5f / 127);
    } else {
        t.w = random_values(n * k, type == 1, -0.5f, 0.5f);
    }
    if (bias) t.bias = random_values(n, io_bf16, -1.0f, 1.0f);
    return t;
}

static float weight_value(const test_weight *t, int64_t k, int64_t r, int64_t j) {
    if (t->type == 2) {
        const float s = t->scales[r * (k / t->group) + j / t->group];
        return s * (float)((const int8_t *)t->w)[r * k + j];
    }
    return get(t->w, r * k + j, t->type == 1);
}

/* gemv over k in {1, 7, 16, 33, 100, 576} (int8 groups with and without tails past eight), 1..9
 * rows, three weights side by side (each type, and mixed) or one, with and without bias,
 * float32 and bfloat16 io, fetching ahead or not, one or two threads, each path to max_isa. */
static void gemv_cases(int max_isa) {
    static const int64_t ks[] = {1, 7, 16, 33, 100, 576};
    static const int64_t groups[][3] = {{1, 1, 1}, {7, 1, 7}, {16, 8, 4},
                                        {11, 33, 3}, {20, 100, 25}, {64, 576, 32}};
    static const int64_t ns[] = {9, 4, 6}; /* whole tiles of 1, 2 and 4 rows, and remainders */
    static const int mixed[] = {2, 0, 1};
    for (int ki = 0; ki < 6; ki++)
    for (int set_ = 0; set_ < 5; set_++)
    for (int io = 0; io < 2; io++)
    for (int bias = 0; bias < 2; bias++)
    for (int m = 1; m <= 9; m++) {
        const int64_t k = ks[ki];
        const int nw = set_ == 4 ? 1 : 3, fetch = (m + ki + bias) % 2, threads = 1 + (m + set_) % 2;
        rng_seed(1000003u * (uint64_t)(((ki * 5 + set_) * 2 + io) * 2 + bias) + (uint64_t)m);
        test_weight wts[3];
        const void *ws[3], *biases[3];
        const float *scales[3];
        int types[3];
        int64_t wns[3], wgroups[3], width = 0;
        for (int w = 0; w < nw; w++) {
            const int type = set_ < 3 ? set_ : set_ == 3 ? mixed[w] : m % 3;
            const int64_t n = set_ == 4 ? 5 : ns[w];
            wts[w] = make_weight(type, n, k, groups[ki][w], io, bias);
            ws[w] = wts[w].w, biases[w] = wts[w].bias, scales[w] = wts[w].scales;
            types[w] = type, wns[w] = n, wgroups[w] = groups[ki][w], width += n;
        }
        void *x = random_values(m * k, io, -1.0f, 1.0f);
        /* Each value's scale: the sum of its terms' magnitudes. */
        double *sc = alloc(sizeof(double) * (size_t)(m * width));
        for (int64_t i = 0, col = 0; i < m; i++, col = 0)
            for (int w = 0; w < nw; w++)
                for (int64_t r = 0; r < wns[w]; r++, col++) {
                    double s = wts[w].bias ? fabs(get(wts[w].bias, r, io)) : 0.0;
                    for (int64_t j = 0; j < k; j++)
                        s += fabs((double)weight_value(&wts[w], k, r, j) * get(x, i * k + j, io));
                    sc[i * width + col] = s;
                }
        void *out = filled(m * width, io, 12345.0f);
        for (int isa = 0; isa <= max_isa; isa++) {
            for (int64_t i = 0; i < m * width; i++) set(out, i, 12345.0f, io);
            const int rc = gemv(x, m, k, io, nw, ws, types, wns, scales, wgroups, biases, out,
                                isa, fetch, threads);
            begin("gemv isa=%d k=%lld set=%d io=%d bias=%d m=%d fetch=%d threads=%d", isa,
                  (long long)k, set_, io, bias, m, fetch, threads);
            put_int("rc", rc);
            put_values(out, m * width, io, "bf16", sc, 0.0);
        }
        for (int w = 0; w < nw; w++) free(wts[w].w), free(wts[w].scales), free(wts[w].bias);
        free(x), free(sc), free(out);
    }
    /* Refusals: no rows, an int8 group that does not divide k. */
    for (int isa = 0; isa <= max_isa; isa++) {
        float x[8] = {0}, w[8] = {0}, s[2] = {1, 1}, out[8];
        const void *ws[1] = {w}, *biases[1] = {NULL};
        const float *scales[1] = {s};
        const int types[2] = {0, 2};
        const int64_t ns[1] = {1}, groups[1] = {3};
        begin("gemv refusals isa=%d", isa);
        put_int("m0", gemv(x, 0, 8, 0, 1, ws, types, ns, scales, groups, biases, out, isa, 0, 1));
        put_int("group", gemv(x, 1, 8, 0, 1, ws, types + 1, ns, scales, groups, biases, out,
                              isa, 0, 1));
    }
}

/* ---- paged_decode and write_kv ------------------------------------------------------------ */

/* One paged_decode call: 5 sequences of lengths 1, bs, 2 bs, 37 and 3 bs + 1 over shuffled
 * blocks, 6 decodes (one sequence twice) in shuffled rows; prints the status and all of out. */
static void decode_case(int h, int hkv, int d, int bs, int bf16, int threads) {
    enum { B = 5, T = 6 };
    const int32_t lens[B] = {1, bs, 2 * bs, 37, 3 * bs + 1};
    const int32_t rows[T] = {4, 1, 0, 5, 3, 2}, seqs[T] = {3, 0, 4, 1, 2, 3};
    rng_seed(((uint64_t)h * 1000 + (uint64_t)d) * 1000 + (uint64_t)(bs * 4 + bf16 * 2 + threads));
    int64_t max_blocks = 0, used = 0;
    for (int b = 0; b < B; b++) {
        const int64_t blocks = (lens[b] + bs - 1) / bs;
        max_blocks = blocks > max_blocks ? blocks : max_blocks;
        used += blocks;
    }
    const int64_t num_blocks = used + 3; /* some blocks no sequence owns */
    int32_t *perm = alloc(sizeof(int32_t) * (size_t)num_blocks);
    for (int64_t i = 0; i < num_blocks; i++) perm[i] = (int32_t)i;
    for (int64_t i = num_blocks - 1; i > 0; i--) { /* Fisher-Yates */
        const int64_t j = (int64_t)(rng_next() % (uint64_t)(i + 1));
        const int32_t tmp = perm[i];
        perm[i] = perm[j], perm[j] = tmp;
    }
    int32_t *table = alloc(sizeof(int32_t) * (size_t)(B * max_blocks));
    for (int64_t b = 0, next = 0; b < B; b++)
        for (int64_t i = 0; i < max_blocks; i++)
            table[b * max_blocks + i] = i * bs < lens[b] ? perm[next++] : 0;
    const int64_t cache = num_blocks * bs * hkv * d;
    void *q = random_values((int64_t)T * h * d, bf16, -1.0f, 1.0f);
    void *kc = random_values(cache, bf16, -1.0f, 1.0f);
    void *vc = random_values(cache, bf16, -1.0f, 1.0f);
    void *out = filled((int64_t)T * h * d, bf16, 12345.0f);
    const int rc = paged_decode(q, kc, vc, out, table, max_blocks, lens, rows, seqs, T, h, hkv,
                                d, bs, 1.0f / sqrtf((float)d), bf16, threads);
    begin("paged_decode h=%d hkv=%d d=%d bs=%d bf16=%d threads=%d", h, hkv, d, bs, bf16,
          threads);
    put_int("rc", rc);
    put_values(out, (int64_t)T * h * d, bf16, "bf16", NULL, 1.0); /* |v| < 1 */
    free(perm), free(table), free(q), free(kc), free(vc), free(out);
}

/* GQA groups 3 (9 heads over 3), 4 and 1 at the specialised head dims, 7 and 3 at dims it has no
 * specialisation for; blocks of 16 and 5 tokens; both dtypes; one and two threads. */
static void decode_cases(void) {
    static const int configs[][3] = {{9, 3, 64}, {8, 2, 128}, {2, 2, 64}, {7, 1, 64}, {6, 2, 40}};
    static const int block_sizes[] = {5, 16};
    for (int c = 0; c < 5; c++)
        for (int b = 0; b < 2; b++)
            for (int bf16 = 0; bf16 < 2; bf16++)
                decode_case(configs[c][0], configs[c][1], configs[c][2], block_sizes[b], bf16,
                            1 + (c + bf16) % 2);
    begin("paged_decode refusal");
    put_int("group", paged_decode(NULL, NULL, NULL, NULL, NULL, 1, NULL, NULL, NULL, 0, 65, 1,
                                  64, 16, 1.0f, 0, 1));
}

/* Four rows into a cache of 7 slots, the second to slot -1 (skipped), from rows wider than the
 * cache's (a fused projection's view). */
static void write_kv_cases(void) {
    const int64_t slots[4] = {5, -1, 0, 2}, width = 6, num_slots = 7;
    for (int elem = 2; elem <= 4; elem += 2) {
        rng_seed(77 + (uint64_t)elem);
        void *key = random_values(4 * 10, elem == 2, -1.0f, 1.0f);
        void *value = random_values(4 * 8, elem == 2, -1.0f, 1.0f);
        void *kc = filled(num_slots * width, elem == 2, 12345.0f);
        void *vc = filled(num_slots * width, elem == 2, 12345.0f);
        write_kv(key, 10, value, 8, kc, vc, slots, 4, width, elem);
        begin("write_kv elem=%d k_cache", elem);
        put_bits(kc, num_slots * width, elem);
        begin("write_kv elem=%d v_cache", elem);
        put_bits(vc, num_slots * width, elem);
        free(key), free(value), free(kc), free(vc);
    }
}

/* ---- greedy_tokens ------------------------------------------------------------------------ */

static void greedy_case(const char *label, float *logits, int64_t rows, int64_t vocab) {
    int64_t ids[8];
    float logprobs[8];
    for (int i = 0; i < 8; i++) ids[i] = -7, logprobs[i] = 99.0f;
    const int rc = greedy_tokens(logits, rows, vocab, ids, logprobs);
    begin("greedy_tokens %s rows=%lld vocab=%lld", label, (long long)rows, (long long)vocab);
    put_int("rc", rc);
    for (int64_t r = 0; r < rows; r++) {
        char index[24];
        snprintf(index, sizeof index, "id%lld", (long long)r);
        put_int(index, ids[r]);
        put_value(r, "f32", logprobs[r], 1.0);
    }
}

/* Random rows (vocab 1, 7, 100, 1000), a row whose max is at 3 and at 60, a row of large
 * values, a constant row; then a row holding +inf, -inf or NaN after a good one (-1, the rows
 * before it written), and vocab 0. */
static void greedy_cases(void) {
    static const int64_t vocabs[] = {1, 7, 100, 1000};
    float *x = alloc(sizeof(float) * 4 * 1000);
    for (int v = 0; v < 4; v++) {
        const int64_t vocab = vocabs[v];
        rng_seed(500 + (uint64_t)v);
        for (int64_t i = 0; i < 4 * vocab; i++) x[i] = 4.0f * uniform();
        if (vocab >= 100) {
            x[vocab + 3] = x[vocab + 60] = 9.0f;                          /* row 1: a tie */
            for (int64_t i = 0; i < vocab; i++) x[2 * vocab + i] *= 20.0f; /* row 2: large */
            for (int64_t i = 0; i < vocab; i++) x[3 * vocab + i] = -2.5f;  /* row 3: constant */
        }
        greedy_case("finite", x, 4, vocab);
    }
    const float specials[3] = {INFINITY, -INFINITY, NAN};
    for (int s = 0; s < 3; s++) {
        rng_seed(600 + (uint64_t)s);
        for (int64_t i = 0; i < 3 * 7; i++) x[i] = uniform();
        x[7 + 2 + s] = specials[s];
        greedy_case(s == 0 ? "inf" : s == 1 ? "-inf" : "nan", x, 3, 7);
    }
    greedy_case("empty", x, 2, 0);
    free(x);
}

/* ---- norm_rotary.c ------------------------------------------------------------------------ */

/* rms_norm (also in place) and add_rms_norm over n in {1, 7, 64, 100}, both dtypes. */
static void norm_cases(void) {
    static const int64_t sizes[] = {1, 7, 64, 100};
    const int64_t rows = 3;
    for (int si = 0; si < 4; si++)
    for (int bf16 = 0; bf16 < 2; bf16++) {
        const int64_t n = sizes[si];
        rng_seed(900 + (uint64_t)(si * 2 + bf16));
        void *x = random_values(rows * n, bf16, -2.0f, 2.0f);
        void *residual = random_values(rows * n, bf16, -1.0f, 1.0f);
        void *weight = random_values(n, bf16, 0.5f, 1.5f);
        void *out = filled(rows * n, bf16, 12345.0f);
        rms_norm(x, weight, out, rows, n, 1e-6f, bf16);
        begin("rms_norm n=%lld bf16=%d", (long long)n, bf16);
        put_values(out, rows * n, bf16, "bf16r", NULL, 0.0); /* relative error only */
        void *copy = alloc((size_t)(rows * n * (bf16 ? 2 : 4)));
        memcpy(copy, x, (size_t)(rows * n * (bf16 ? 2 : 4)));
        rms_norm(copy, weight, copy, rows, n, 1e-6f, bf16);
        begin("rms_norm in place n=%lld bf16=%d", (long long)n, bf16);
        put_values(copy, rows * n, bf16, "bf16r", NULL, 0.0);
        add_rms_norm(x, residual, weight, out, rows, n, 1e-6f, bf16);
        begin("add_rms_norm n=%lld bf16=%d x", (long long)n, bf16);
        put_values(x, rows * n, bf16, "bf16r", NULL, 3.0); /* cancellation: |x| + |residual| */
        begin("add_rms_norm n=%lld bf16=%d out", (long long)n, bf16);
        put_values(out, rows * n, bf16, "bf16r", NULL, 0.0);
        free(x), free(residual), free(weight), free(out), free(copy);
    }
}

/* rotary over 3 heads of d in {2, 8, 64}, rows 5 elements wider than the heads. */
static void rotary_cases(void) {
    static const int64_t dims[] = {2, 8, 64};
    const int64_t rows = 2, heads = 3;
    for (int di = 0; di < 3; di++)
    for (int bf16 = 0; bf16 < 2; bf16++) {
        const int64_t d = dims[di], stride = heads * d + 5;
        rng_seed(1100 + (uint64_t)(di * 2 + bf16));
        void *x = random_values(rows * stride, bf16, -1.0f, 1.0f);
        void *cos = random_values(rows * d, bf16, -1.0f, 1.0f);
        void *sin = random_values(rows * d, bf16, -1.0f, 1.0f);
        void *out = filled(rows * heads * d, bf16, 12345.0f);
        rotary(x, stride, cos, sin, out, rows, heads, d, bf16);
        begin("rotary d=%lld bf16=%d", (long long)d, bf16);
        put_values(out, rows * heads * d, bf16, "bf16r", NULL, 2.0);
        free(x), free(cos), free(sin), free(out);
    }
}

/* silu_mul over n in {1, 7, 64, 100}, gate and up halves of one row; gates include 0, +-20 and
 * +-90 (whose exp underflows). */
static void silu_cases(void) {
    static const int64_t sizes[] = {1, 7, 64, 100};
    static const float specials[] = {0.0f, 20.0f, -20.0f, 90.0f, -90.0f};
    const int64_t rows = 2;
    for (int si = 0; si < 4; si++)
    for (int bf16 = 0; bf16 < 2; bf16++) {
        const int64_t n = sizes[si];
        rng_seed(1300 + (uint64_t)(si * 2 + bf16));
        void *in = random_values(rows * 2 * n, bf16, -6.0f, 6.0f);
        for (int64_t i = 0; i < 5 && i < n; i++) set(in, 2 * n + i, specials[i], bf16);
        double *sc = alloc(sizeof(double) * (size_t)(rows * n));
        for (int64_t t = 0; t < rows; t++)
            for (int64_t i = 0; i < n; i++)
                sc[t * n + i] = fabs((double)get(in, t * 2 * n + i, bf16)
                                     * get(in, t * 2 * n + n + i, bf16));
        void *out = filled(rows * n, bf16, 12345.0f);
        silu_mul(in, (char *)in + n * (bf16 ? 2 : 4), 2 * n, out, rows, n, bf16);
        begin("silu_mul n=%lld bf16=%d", (long long)n, bf16);
        put_values(out, rows * n, bf16, "bf16r", sc, 0.0);
        free(in), free(sc), free(out);
    }
}

/* gather_rows (good indices, repeated; an index past the table; a negative one) and to_float32
 * (random bits and the specials: infinities, NaN, subnormal, -0). */
static void copy_cases(void) {
    rng_seed(1500);
    float table[6 * 3], out[4 * 3];
    for (int i = 0; i < 18; i++) table[i] = uniform();
    static const int64_t good[4] = {5, 0, 5, 2}, past[2] = {1, 6}, negative[2] = {-1, 0};
    const int64_t *indices[3] = {good, past, negative};
    for (int c = 0; c < 3; c++) {
        for (int i = 0; i < 12; i++) out[i] = 12345.0f;
        const int rc = gather_rows(table, 6, 12, indices[c], c == 0 ? 4 : 2, out);
        begin("gather_rows %d", c);
        put_int("rc", rc);
        put_bits(out, 12, 4);
    }
    uint16_t bits[40];
    static const uint16_t specials[] = {0x7f80, 0xff80, 0x7fc1, 0x0001, 0x8000, 0x3f80};
    for (int i = 0; i < 40; i++) bits[i] = i < 6 ? specials[i] : (uint16_t)rng_next();
    float widened[40];
    const int rc = to_float32(bits, widened, 40);
    begin("to_float32");
    put_int("rc", rc);
    put_bits(widened, 40, 4);
}

/* ---- run_calls ---------------------------------------------------------------------------- */

/* One list of every *_call entry, chained as a step's calls are (gemv -> rms_norm -> rotary,
 * silu_mul, add_rms_norm, write_kv -> paged_decode, gather_rows, to_float32): returns the list's
 * length. Then a list whose second call refuses: returns 1, the third call not made. */
static void calls_cases(int max_isa) {
    for (int isa = 0; isa <= max_isa; isa++) {
        rng_seed(1700);
        enum { M = 2, K = 24, N = 8, H = 2, HKV = 1, D = 4, BS = 4 };
        float *x = random_values(M * K, 0, -1.0f, 1.0f);
        uint16_t *w = random_values(N * K, 1, -0.5f, 0.5f);
        float *gout = filled(M * N, 0, 12345.0f), *nout = filled(M * N, 0, 12345.0f);
        float *norm_w = random_values(N, 0, 0.5f, 1.5f);
        const void *ws[1] = {w}, *biases[1] = {NULL};
        const float *scales[1] = {NULL};
        const int types[1] = {1};
        const int64_t ns[1] = {N}, groups[1] = {K};
        const gemv_args ga = {x, M, K, 0, 1, ws, types, ns, scales, groups, biases, gout, isa,
                              1, 2};
        const rms_norm_args ra = {gout, norm_w, nout, M, N, 1e-5f, 0};
        float *cs = random_values(M * D, 0, -1.0f, 1.0f), *sn = random_values(M * D, 0, -1, 1);
        float *rout = filled(M * N, 0, 12345.0f); /* N = H * D */
        const rotary_args rot = {nout, N, cs, sn, rout, M, H, D, 0};
        float *gu = random_values(M * 2 * N, 0, -4.0f, 4.0f), *sout = filled(M * N, 0, 12345);
        const silu_mul_args sa = {gu, gu + N, 2 * N, sout, M, N, 0};
        float *res = random_values(M * N, 0, -1.0f, 1.0f), *aout = filled(M * N, 0, 12345.0f);
        const add_rms_norm_args aa = {sout, res, norm_w, aout, M, N, 1e-5f, 0};
        /* K/V rows of one token each into slots 5 and 2 of a 2-block cache, then a decode of
         * each of two sequences over them. */
        float *kc = filled(2 * BS * HKV * D, 0, 0.25f), *vc = filled(2 * BS * HKV * D, 0, 0.5f);
        const int64_t slots[2] = {5, 2};
        const write_kv_args wa = {rout, N, aout, N, kc, vc, slots, 2, HKV * D, 4};
        const int32_t table[2] = {1, 0}, lens[2] = {2, 3}, rows[2] = {1, 0}, seqs[2] = {0, 1};
        float *dout = filled(M * H * D, 0, 12345.0f);
        const paged_decode_args pa = {rout, kc, vc, dout, table, 1, lens, rows, seqs, 2, H, HKV,
                                      D, BS, 0.5f, 0, 1};
        const int64_t index[3] = {1, 0, 1};
        float *gathered = filled(3 * N, 0, 12345.0f), *wide = filled(4, 0, 12345.0f);
        const gather_rows_args gr = {dout, M, N * 4, index, 3, gathered};
        const uint16_t logits[4] = {0x3f80, 0xc000, 0x7f80, 0x0001};
        const to_float32_args ta = {logits, wide, 4};
        const kernel_entry entries[9] = {gemv_call, rms_norm_call, rotary_call, silu_mul_call,
                                         add_rms_norm_call, write_kv_call, paged_decode_call,
                                         gather_rows_call, to_float32_call};
        const void *const args[9] = {&ga, &ra, &rot, &sa, &aa, &wa, &pa, &gr, &ta};
        begin("run_calls isa=%d", isa);
        put_int("n", run_calls(9, entries, args));
        const float *outs[9] = {gout, nout, rout, sout, aout, kc, dout, gathered, wide};
        const int64_t counts[9] = {M * N, M * N, M * N, M * N, M * N, 2 * BS * HKV * D,
                                   M * H * D, 3 * N, 4};
        for (int c = 0; c < 9; c++) {
            begin("run_calls isa=%d out%d", isa, c);
            put_values(outs[c], counts[c], 0, "f32", NULL, 30.0);
        }
        begin("run_calls isa=%d v_cache", isa);
        put_values(vc, 2 * BS * HKV * D, 0, "f32", NULL, 30.0);
        /* A refusal stops the list: gather_rows with an index past the table. */
        const int64_t bad[1] = {7};
        const gather_rows_args gb = {dout, M, N * 4, bad, 1, gathered};
        float *untouched = filled(4, 0, 12345.0f);
        const to_float32_args tb = {logits, untouched, 4};
        const kernel_entry stop_entries[3] = {to_float32_call, gather_rows_call, to_float32_call};
        const void *const stop_args[3] = {&ta, &gb, &tb};
        begin("run_calls refused isa=%d", isa);
        put_int("n", run_calls(3, stop_entries, stop_args));
        put_bits(untouched, 4, 4);
        free(x), free(w), free(gout), free(nout), free(norm_w), free(cs), free(sn), free(rout);
        free(gu), free(sout), free(res), free(aout), free(kc), free(vc), free(dout);
        free(gathered), free(wide), free(untouched);
    }
}

int main(void) {
#ifdef __aarch64__
    const int max_isa = gemv_isa(); /* plain C and NEON */
#else
    const int max_isa = 0; /* the reference: plain C */
#endif
    begin("gemv_isa");
    put_int("max", max_isa);
    gemv_cases(max_isa);
    decode_cases();
    write_kv_cases();
    greedy_cases();
    norm_cases();
    rotary_cases();
    silu_cases();
    copy_cases();
    calls_cases(max_isa);
    return fflush(stdout) == 0 ? 0 : 1;
}
