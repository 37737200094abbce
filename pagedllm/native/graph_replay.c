/* A CPU decode graph's native replay: the recorded kernel calls of one decode step, each in its task form
 * (native_team.h), run in order inside one OpenMP parallel region, with a spinning barrier between calls.
 *
 * Why one region: under OMP_WAIT_POLICY=PASSIVE (pagedllm's default, kind to a shared machine) every parallel
 * region of a kernel wakes sleeping threads through the kernel, which costs about what a batch-1 projection
 * computes, so small products ran on one thread. Here the team wakes once per step, its threads spin between the
 * step's calls (as llama.cpp's own thread pool does; past a bound a waiter sleeps) and sleep again when the region
 * ends, before any torch code runs. Plain C11 atomics; no ISA-specific code. */
#define _POSIX_C_SOURCE 200809L
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "native_team.h"

#ifdef _OPENMP
#include <omp.h>
#endif

int pagedllm_graph_replay_abi_version(void) { return 1; }

/* 1 when built with OpenMP (a team), else 0 (every entry on the calling thread). */
int pagedllm_graph_replay_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* One recorded call: fn(args, ith, n) for ith < n, n = min(nth, the team's size) (nth >= 1). */
struct replay_entry {
    team_task_fn fn;
    const void *args;
    int nth;
};

/* A waiter spins this many pause rounds, then yields the core this many times more, then sleeps SLEEP_NS between
 * checks: a team mate descheduled on a busy host then costs the waiter no core (PASSIVE's point) once the step's
 * usual waits (microseconds) are long past. */
#define SPINS_BEFORE_YIELD 4096
#define YIELDS_BEFORE_SLEEP 64
#define SLEEP_NS 20000

struct spin_barrier {
    _Atomic int arrived;
    _Atomic unsigned generation;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* The last of nth threads to arrive resets the count and releases the others (acquire / release: every write
 * before the barrier is visible after it). */
static void barrier_wait(struct spin_barrier *b, int nth) {
    const unsigned generation = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->generation, 1, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&b->generation, memory_order_acquire) == generation; spins++) {
        if (spins < SPINS_BEFORE_YIELD) {
            cpu_relax();
        } else if (spins < SPINS_BEFORE_YIELD + YIELDS_BEFORE_SLEEP) {
            sched_yield();
        } else {
            const struct timespec pause = {0, SLEEP_NS};
            nanosleep(&pause, NULL);
        }
    }
}

/* Runs entries[0 .. n) in order on a team of num_threads. Returns 0, else 1 + the index of the first entry whose
 * task returned non-zero (every entry still runs: the caller discards the step). */
int graph_replay(const struct replay_entry *entries, int n, int num_threads) {
    _Atomic int failed = 0;
    struct spin_barrier barrier = {0, 0};
    if (num_threads < 1)
        num_threads = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
#endif
    {
        int ith = 0, nth = 1;
#ifdef _OPENMP
        ith = omp_get_thread_num();
        nth = omp_get_num_threads();
#endif
        for (int i = 0; i < n; i++) {
            const int use = entries[i].nth < nth ? entries[i].nth : nth;
            if (ith < use && entries[i].fn(entries[i].args, ith, use) != 0) {
                int expected = 0;
                atomic_compare_exchange_strong(&failed, &expected, i + 1);
            }
            if (nth > 1)
                barrier_wait(&barrier, nth);
        }
    }
    return atomic_load(&failed);
}
