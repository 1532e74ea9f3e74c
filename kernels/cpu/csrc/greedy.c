/* The greedy choice of a decode step's next tokens, with their log-probabilities, in one pass
 * over each row of logits (kernels/cpu/greedy.py).
 *
 * PyTorch takes it in four or five operators (argmax, log_softmax, a gather, the finite check),
 * each a microsecond or two warm; but a decode step runs them right after streaming the model's
 * weights through the caches, and there each operator's first call costs 0.1-0.3 ms of cache
 * misses in its dispatch code. One C call does the same work on one row of 49152 logits in
 * ~30 us.
 *
 * Built by minipaged.kernels.cpu.build (-O3 -ffast-math -march=native: the sum of exponentials
 * vectorizes, with glibc's vector expf). Fast-math lets the compiler assume no value is a NaN
 * or an infinity, so those are found from their bits. */

#include <math.h>
#include <stdint.h>
#include <string.h>

/* token_ids[r] = the first index of row r's largest value (as torch.argmax), logprobs[r] = its
 * log-probability, -log(sum_i exp(x_i - max)), for float32 logits [rows, vocab]. Returns 0, or
 * -1 where a row holds a NaN or an infinity, or has no values (the caller's general path
 * takes those). */
int greedy_tokens(const float *logits, int64_t rows, int64_t vocab, int64_t *token_ids,
                  float *logprobs) {
    if (vocab < 1) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        uint32_t non_finite = 0;
        for (int64_t i = 0; i < vocab; i++) {
            uint32_t bits;
            memcpy(&bits, &x[i], sizeof bits);
            non_finite |= (bits & 0x7f800000u) == 0x7f800000u;
        }
        if (non_finite) return -1;
        float top = x[0];
        for (int64_t i = 1; i < vocab; i++) top = x[i] > top ? x[i] : top;
        int64_t best = 0;
        while (x[best] != top) best++;
        float sum = 0.0f;
        for (int64_t i = 0; i < vocab; i++) sum += expf(x[i] - top);
        token_ids[r] = best;
        logprobs[r] = -logf(sum);
    }
    return 0;
}
