/* The decode stack's helper threads (stack_parts.h says what they take): compiled once,
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
        p->status = PC_OK;
        break;
    }
}

/* One helper's mailbox, on its own cache lines: the caller writes `part` and bumps `posted`;
   the helper runs it and stores the ticket in `finished`. */
typedef struct {
    _Alignas(64) atomic_uint posted;
    _Alignas(64) atomic_uint finished;
    work_part part;
} mailbox;

static struct {
    pthread_mutex_t lock; /* guards `stepping`'s changes and the threads' start */
    pthread_cond_t wake;
    pthread_mutex_t owner; /* held by the call that uses the helpers */
    int started;           /* helpers running: mailboxes [0, started) */
    atomic_int stepping;   /* 1 while a call may post work: spin, don't sleep */
    mailbox box[PC_MAX_THREADS - 1];
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER,
          .owner = PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A spin-wait's n-th turn: pause, and past ~20 us (a projection's share takes 10-100) yield
   the core, so that a thread waiting for one (the server's event loop, or a helper on a
   machine with fewer cores than threads) runs now instead of at the end of our time slice,
   while this one has nothing to do. */
#define SPINS_BEFORE_YIELD 4096
static inline void spin_turn(unsigned *spins) {
    if (++*spins < SPINS_BEFORE_YIELD)
        cpu_relax();
    else
        sched_yield();
}

static void *helper_main(void *arg) {
    mailbox *box = arg;
    unsigned seen = 0;
    for (;;) {
        unsigned spins = 0;
        while (atomic_load_explicit(&box->posted, memory_order_acquire) == seen) {
            if (atomic_load_explicit(&pool.stepping, memory_order_acquire)) {
                spin_turn(&spins);
                continue;
            }
            pthread_mutex_lock(&pool.lock);
            while (!atomic_load(&pool.stepping) && atomic_load(&box->posted) == seen)
                pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load_explicit(&box->posted, memory_order_acquire);
        pc_run_part(&box->part);
        atomic_store_explicit(&box->finished, seen, memory_order_release);
    }
    return NULL;
}

/* A forked child has no helper threads (fork copies only the caller): it starts its own on
   its first split call, from a reset state, instead of spinning for ones that are not
   there. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_mutex_init(&pool.owner, NULL);
    pool.started = 0;
    atomic_store(&pool.stepping, 0);
    for (int i = 0; i < PC_MAX_THREADS - 1; i++) {
        atomic_store(&pool.box[i].posted, 0);
        atomic_store(&pool.box[i].finished, 0);
    }
}

static pthread_once_t fork_hook = PTHREAD_ONCE_INIT;

static void register_fork_hook(void) {
    pthread_atfork(NULL, NULL, pool_after_fork);
}

int64_t pc_helpers_take(int64_t threads) {
    if (threads < 2)
        return 1;
    if (threads > PC_MAX_THREADS)
        threads = PC_MAX_THREADS;
    pthread_once(&fork_hook, register_fork_hook);
    if (pthread_mutex_trylock(&pool.owner))
        return 1;
    pthread_mutex_lock(&pool.lock);
    while (pool.started < threads - 1) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, helper_main, &pool.box[pool.started]))
            break;
        pthread_detach(thread);
        pool.started++;
    }
    const int64_t ours = 1 + (pool.started < threads - 1 ? pool.started : threads - 1);
    if (ours > 1) {
        atomic_store(&pool.stepping, 1);
        pthread_cond_broadcast(&pool.wake);
    }
    pthread_mutex_unlock(&pool.lock);
    if (ours == 1)
        pthread_mutex_unlock(&pool.owner);
    return ours;
}

void pc_helpers_release(int64_t threads) {
    if (threads < 2)
        return;
    pthread_mutex_lock(&pool.lock);
    atomic_store(&pool.stepping, 0);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.owner);
}

int64_t pc_run_parts(work_part *parts, int64_t count) {
    unsigned tickets[PC_MAX_THREADS - 1];
    for (int64_t i = 1; i < count; i++) {
        mailbox *box = &pool.box[i - 1];
        box->part = parts[i];
        tickets[i - 1] = atomic_fetch_add_explicit(&box->posted, 1, memory_order_release) + 1;
    }
    pc_run_part(&parts[0]);
    int64_t status = parts[0].status;
    for (int64_t i = 1; i < count; i++) {
        mailbox *box = &pool.box[i - 1];
        unsigned spins = 0;
        while (atomic_load_explicit(&box->finished, memory_order_acquire) != tickets[i - 1])
            spin_turn(&spins);
        parts[i].status = box->part.status;
        if (status == PC_OK)
            status = parts[i].status;
    }
    return status;
}

int64_t pc_run_even(const work_part *part, int64_t threads, int64_t grain) {
    work_part parts[PC_MAX_THREADS];
    const int64_t units = (part->end - part->begin + grain - 1) / grain;
    const int64_t count = threads < units ? threads : units > 0 ? units : 1;
    for (int64_t i = 0; i < count; i++) {
        parts[i] = *part;
        parts[i].begin = part->begin + units * i / count * grain;
        parts[i].end = i + 1 < count ? part->begin + units * (i + 1) / count * grain : part->end;
    }
    return pc_run_parts(parts, count);
}
