/* A small pool of worker threads for the products: a decode step runs ~60-200 of them, each
 * 10-500 microseconds, so a worker spins a short while for the next one before it sleeps (a
 * thread woken from sleep costs tens of microseconds; one spinning for ever steals a core from
 * the rest of the step, which torch runs on the calling thread). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "llmcli_cpu.h"

#define MAX_WORKERS 255
#define SPIN_NANOSECONDS 200000 /* 0.2 ms: longer than the Python between two products */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t one_job = PTHREAD_MUTEX_INITIALIZER; /* two callers (two models' threads) take turns */
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_once_t fork_handler_once = PTHREAD_ONCE_INIT;
static int workers = 0;              /* started so far; they stay for the process's life */
static atomic_uint generation = 0;   /* one more for each job published */
static atomic_int sleepers = 0;
static atomic_int remaining = 0;     /* workers yet to answer the current job */
static pool_task job_task;
static void *job_context;
static int job_threads;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

typedef struct { int index; unsigned seen; } worker_start;

static void *worker_main(void *arg) {
    /* `seen` is read by the thread that starts this one, before it publishes the job this
     * worker must take part in: read here, it could already be that job's. */
    const worker_start start = *(worker_start *)arg;
    free(arg);
    const int index = start.index; /* 1 .. workers: the caller is 0 */
    unsigned seen = start.seen;
    for (;;) {
        long long spun_since = 0;
        unsigned spins = 0;
        while (atomic_load_explicit(&generation, memory_order_acquire) == seen) {
            cpu_relax();
            if ((++spins & 63) != 0) continue;
            const long long t = now_ns();
            if (!spun_since) spun_since = t;
            if (t - spun_since < SPIN_NANOSECONDS) continue;
            pthread_mutex_lock(&lock);
            atomic_fetch_add(&sleepers, 1);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &lock);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&lock);
        }
        seen = atomic_load_explicit(&generation, memory_order_acquire);
        /* Every worker answers every job, taking part or not: none can still be reading one
         * job's fields when the next is published. */
        if (index < job_threads) job_task(job_context, index, job_threads);
        atomic_fetch_sub_explicit(&remaining, 1, memory_order_release);
    }
    return NULL;
}

/* A forked child has none of its parent's threads: it starts its own when it needs them. */
static void forget_workers(void) {
    workers = 0;
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&lock, NULL);
    pthread_mutex_init(&one_job, NULL);
    pthread_cond_init(&wake, NULL);
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_workers); }

void pool_run(pool_task task, void *context, int n_threads) {
    if (n_threads > MAX_WORKERS + 1) n_threads = MAX_WORKERS + 1;
    if (n_threads <= 1) {
        task(context, 0, 1);
        return;
    }
    pthread_once(&fork_handler_once, register_fork_handler);
    pthread_mutex_lock(&one_job);
    while (workers < n_threads - 1) {
        pthread_t thread;
        worker_start *start = malloc(sizeof *start);
        if (!start) break;
        start->index = workers + 1;
        start->seen = atomic_load(&generation);
        if (pthread_create(&thread, NULL, worker_main, start) != 0) {
            free(start);
            break;
        }
        pthread_detach(thread);
        workers++;
    }
    if (workers < n_threads - 1) n_threads = workers + 1; /* as many as could start */
    job_task = task;
    job_context = context;
    job_threads = n_threads;
    atomic_store(&remaining, workers);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&lock);
    }
    task(context, 0, n_threads);
    while (atomic_load_explicit(&remaining, memory_order_acquire) > 0) cpu_relax();
    pthread_mutex_unlock(&one_job);
}
