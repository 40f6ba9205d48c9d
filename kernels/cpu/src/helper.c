/* The helper thread of the decode stack (stack_parts.h says what it takes): compiled once,
   beside stack.c. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#include "stack_parts.h"

/* Rows [begin, end) of a projection: each part's share of them, at its place in y, from the
   inputs as they are or as prepared (int8 inputs). */
static int64_t project_rows(const pc_kernels *kernels, const pc_projection *w, const float *x,
                            const uint8_t *prepared, int64_t m, float *y, int64_t begin,
                            int64_t end) {
    int64_t offset = 0, status = PC_OK;
    for (int64_t i = 0; i < w->parts && status == PC_OK; i++) {
        const pc_weight *p = &w->part[i];
        const int64_t first = begin > offset ? begin : offset;
        const int64_t last = end < offset + p->n ? end : offset + p->n;
        if (first < last && prepared)
            status = kernels->gemv_prepared(p->type, p->data, p->row_bytes, prepared, m, p->k,
                                            y + offset, w->n, first - offset, last - offset);
        else if (first < last)
            status = kernels->gemv(p->type, p->data, p->row_bytes, x, m, p->k, y + offset, w->n,
                                   first - offset, last - offset);
        offset += p->n;
    }
    return status;
}

void pc_run_part(work_part *p) {
    switch (p->kind) {
    case PART_GEMV:
        p->status =
            project_rows(p->kernels, p->weight, p->x, p->prepared, p->m, p->y, p->begin, p->end);
        break;
    case PART_ATTENTION_ROWS:
    case PART_ATTENTION_CONTEXT:
        p->status =
            p->kernels->attend(&p->attention, p->begin, p->end, p->kind == PART_ATTENTION_CONTEXT);
        break;
    case PART_GATED:
        (p->activation == PC_GELU_TANH ? p->kernels->gelu_tanh_mul : p->kernels->silu_mul)(
            p->x, p->y, p->inter, p->begin, p->end);
        break;
    }
}

static struct {
    pthread_mutex_t lock; /* guards `stepping`'s changes and the thread's start */
    pthread_cond_t wake;
    pthread_mutex_t owner; /* held by the call that uses the helper */
    int started;
    atomic_int stepping;          /* 1 while a call may post work: spin, don't sleep */
    atomic_uint posted, finished; /* work counters: the helper's part runs when they differ */
    work_part part;
} helper = {.lock = PTHREAD_MUTEX_INITIALIZER,
            .wake = PTHREAD_COND_INITIALIZER,
            .owner = PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A spin-wait's n-th turn: pause, and past ~20 us (a projection's half takes 10-100) yield
   the core, so that a third thread (the server's event loop) waiting for one runs now
   instead of at the end of our time slice, while this one has nothing to do. */
#define SPINS_BEFORE_YIELD 4096
static inline void spin_turn(unsigned *spins) {
    if (++*spins < SPINS_BEFORE_YIELD)
        cpu_relax();
    else
        sched_yield();
}

static void *helper_main(void *unused) {
    (void)unused;
    unsigned seen = 0;
    for (;;) {
        unsigned spins = 0;
        while (atomic_load_explicit(&helper.posted, memory_order_acquire) == seen) {
            if (atomic_load_explicit(&helper.stepping, memory_order_acquire)) {
                spin_turn(&spins);
                continue;
            }
            pthread_mutex_lock(&helper.lock);
            while (!atomic_load(&helper.stepping) && atomic_load(&helper.posted) == seen)
                pthread_cond_wait(&helper.wake, &helper.lock);
            pthread_mutex_unlock(&helper.lock);
        }
        seen = atomic_load_explicit(&helper.posted, memory_order_acquire);
        pc_run_part(&helper.part);
        atomic_store_explicit(&helper.finished, seen, memory_order_release);
    }
    return NULL;
}

/* A forked child has no helper thread (fork copies only the caller): it starts its own on
   its first split call, from a reset state, instead of spinning for one that is not there. */
static void helper_after_fork(void) {
    pthread_mutex_init(&helper.lock, NULL);
    pthread_cond_init(&helper.wake, NULL);
    pthread_mutex_init(&helper.owner, NULL);
    helper.started = 0;
    atomic_store(&helper.stepping, 0);
    atomic_store(&helper.posted, 0);
    atomic_store(&helper.finished, 0);
}

static pthread_once_t helper_fork_hook = PTHREAD_ONCE_INIT;

static void helper_register_fork_hook(void) {
    pthread_atfork(NULL, NULL, helper_after_fork);
}

int pc_helper_take(void) {
    pthread_once(&helper_fork_hook, helper_register_fork_hook);
    if (pthread_mutex_trylock(&helper.owner))
        return 0;
    pthread_mutex_lock(&helper.lock);
    if (!helper.started) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, helper_main, NULL) == 0) {
            pthread_detach(thread);
            helper.started = 1;
        }
    }
    const int ours = helper.started;
    if (ours) {
        atomic_store(&helper.stepping, 1);
        pthread_cond_signal(&helper.wake);
    }
    pthread_mutex_unlock(&helper.lock);
    if (!ours)
        pthread_mutex_unlock(&helper.owner);
    return ours;
}

void pc_helper_release(void) {
    pthread_mutex_lock(&helper.lock);
    atomic_store(&helper.stepping, 0);
    pthread_mutex_unlock(&helper.lock);
    pthread_mutex_unlock(&helper.owner);
}

int64_t pc_run_split(const work_part *theirs, work_part *mine) {
    helper.part = *theirs;
    const unsigned ticket = atomic_fetch_add_explicit(&helper.posted, 1, memory_order_release) + 1;
    pc_run_part(mine);
    unsigned spins = 0;
    while (atomic_load_explicit(&helper.finished, memory_order_acquire) != ticket)
        spin_turn(&spins);
    return mine->status != PC_OK ? mine->status : helper.part.status;
}

int64_t pc_run_shared(const work_part *part, int split, int64_t middle) {
    work_part theirs = *part, mine = *part;
    if (!split || middle <= part->begin || middle >= part->end) {
        pc_run_part(&mine);
        return mine.status;
    }
    theirs.begin = middle;
    mine.end = middle;
    return pc_run_split(&theirs, &mine);
}
