/* A kernel's task form, for a CPU decode graph's native replay (graph_replay.c): thread ith of a team of nth
 * does its static share of one recorded call, whose arguments are one struct (the kernel's parameters in order,
 * pagedllm/ops/recording.py builds it from the call's ctypes argtypes). Every task form computes exactly what its
 * kernel computes with any thread count (each output element's summation order is fixed), writes only its own
 * share, and runs no OpenMP construct: the replay's team is the only one. Returns 0, else the kernel's error code.
 */
#ifndef PAGEDLLM_NATIVE_TEAM_H
#define PAGEDLLM_NATIVE_TEAM_H

typedef int (*team_task_fn)(const void *args, int ith, int nth);

/* [*begin, *end): thread ith's contiguous share of n items, shares differing by at most one item. */
static inline void team_share(long long n, int ith, int nth, long long *begin, long long *end) {
    const long long q = n / nth, r = n % nth;
    *begin = ith * q + (ith < r ? ith : r);
    *end = *begin + q + (ith < r ? 1 : 0);
}

#endif
