/* Many kernel calls in one call from Python: the loop of a replayed decode step
 * (kernels/cpu/calls.py).
 *
 * Every kernel of this layer has an entry `<kernel>_call(const void *args)` that takes its
 * arguments as one struct and returns 0, or nonzero where it refuses them. A step bound once
 * is a list of (entry, argument block) pairs; `run_calls` makes them in order, so the ~330
 * calls of a decode step cross from Python into C once instead of once each. */

#include <stdint.h>

typedef int (*kernel_entry)(const void *args);

/* Calls entries[i](args[i]) for i < n in order and returns n, or the index of the first call
 * that returned nonzero (the calls after it are not made). */
int64_t run_calls(int64_t n, const kernel_entry *entries, const void *const *args) {
    for (int64_t i = 0; i < n; i++)
        if (entries[i](args[i]) != 0) return i;
    return n;
}
