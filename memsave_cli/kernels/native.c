/* Fused CPU kernels for memsave's 1-bit masks and max-pool window offsets.
 *
 * Plain C with no Python or torch headers: native.py compiles this file with the system C compiler
 * on first use and calls it through ctypes with raw pointers and sizes. Every tensor is a flat
 * array of n elements in memory order; the Python side checks dtypes, sizes and layouts.
 *
 * NOTE [float classes as integer tests]: every kernel that looks at a float looks at its bits as an
 * unsigned integer u of the element's width. With S the sign bit, m = u & ~S its magnitude and INF
 * the bits of +infinity, x is NaN iff m > INF, zero iff m == 0 and negative iff u & S. Magnitudes
 * order like the values they encode, so the signed key (u & S ? -m : m) orders non-NaN values
 * exactly as float comparison does (both zeros have key 0). The same code then serves float64,
 * float32, bfloat16 and float16 (which differ only in width and INF), it never converts, and it does
 * not depend on the calling thread's denormal mode. Stock kernels do: after
 * torch.set_flush_denormal(True) they flush denormal results and compare denormals as zero, so
 * there the two differ on denormals (memsave_flushes_denormals tells the caller).
 *
 * NOTE [thread ranges]: work is split into contiguous chunks of elements that start on multiples
 * of 64 elements, so each chunk writes whole 8-byte words of a bit array and no two threads ever
 * share a byte. Inputs below PARALLEL_MIN elements run on the calling thread only.
 */

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

/* -DMEMSAVE_GENERIC builds the portable loops only, as on a CPU without AVX2. */
#if (defined(__x86_64__) || defined(__i386__)) && !defined(MEMSAVE_GENERIC)
#define MEMSAVE_X86 1
#include <immintrin.h>
#endif

#define PARALLEL_MIN 65536
#define THREAD_MIN 32768
#define RANGE_ALIGN 64
#define MAX_THREADS 64
#define SPIN_ROUNDS 1024
#define POOL_CHUNKS 4
#define WAKE_MIN (1 << 20)

#define SIGN_OF(T) ((T)((T)1 << (8 * sizeof(T) - 1)))

/* ------------------------------------------------------------------------------------------ */
/* Threads
 *
 * NOTE [sharing torch's OpenMP threads]: torch runs its CPU kernels on an OpenMP team whose
 * threads keep spinning for a while after each parallel region. On a machine with few cores, a
 * second set of threads competes with those spinners for the same cores and gains nothing (on 2
 * cores, 2 own threads right after a torch op ran no faster than 1). So when native.py finds the
 * OpenMP runtime torch has loaded, it hands over that runtime's GOMP_parallel (the entry point
 * that `#pragma omp parallel` compiles to in GCC, also exported by LLVM's and Intel's runtimes)
 * and the chunks run on torch's own team. Without one, the worker pool below runs them.
 *
 * NOTE [worker pool]: starting a thread costs tens of microseconds, as much as a kernel takes on
 * a million elements, so workers are started once and kept. A call splits its range into a few
 * chunks per thread (NOTE [thread ranges]) that the calling thread and the workers claim one at a
 * time from a shared counter, so a worker that wakes late, or not at all, costs at most one chunk
 * of waiting. The job
 * lives on the caller's stack: a worker reaches it only through its own slot, which the caller
 * posts, and the caller returns only after taking back every unclaimed slot and seeing every
 * claimed one done. Workers spin briefly for the next job, then sleep on a condition variable;
 * as waking one costs tens of microseconds, calls below WAKE_MIN elements only use workers that
 * are still awake. One call uses the pool at a time (a concurrent call runs on its own thread); a
 * forked child starts with an empty pool. */

typedef void (*range_fn)(const void *args, int64_t begin, int64_t end);

struct job {
    range_fn fn;
    const void *args;
    int64_t n;
    int64_t chunk;
    _Atomic int64_t next; /* first element of the next unclaimed chunk */
};

enum { SLOT_IDLE, SLOT_POSTED, SLOT_TAKEN, SLOT_DONE };

struct slot {
    _Alignas(64) _Atomic int state; /* one cache line per slot */
    struct job *job;
};

static struct {
    pthread_mutex_t busy; /* held by the call using the pool */
    pthread_mutex_t lock; /* guards the sleeping workers' condition */
    pthread_cond_t wake;
    _Atomic int sleeping;
    int workers; /* threads started, worker i owning slots[i] */
    struct slot slots[MAX_THREADS];
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER,
          .lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Run chunks of the job until none is left. */
static void work(struct job *job) {
    for (;;) {
        int64_t begin = atomic_fetch_add(&job->next, job->chunk);
        if (begin >= job->n) return;
        job->fn(job->args, begin, begin + job->chunk < job->n ? begin + job->chunk : job->n);
    }
}

/* Claim a posted slot (its worker or the caller); exactly one of them succeeds. */
static int claim(struct slot *slot) {
    int expected = SLOT_POSTED;
    return atomic_compare_exchange_strong(&slot->state, &expected, SLOT_TAKEN);
}

static void *worker_main(void *arg) {
    struct slot *slot = (struct slot *)arg;
    for (;;) {
        for (int spin = 0; spin < SPIN_ROUNDS && atomic_load(&slot->state) != SLOT_POSTED; spin++)
            cpu_relax();
        if (atomic_load(&slot->state) != SLOT_POSTED) {
            pthread_mutex_lock(&pool.lock);
            atomic_fetch_add(&pool.sleeping, 1);
            while (atomic_load(&slot->state) != SLOT_POSTED) pthread_cond_wait(&pool.wake, &pool.lock);
            atomic_fetch_sub(&pool.sleeping, 1);
            pthread_mutex_unlock(&pool.lock);
        }
        if (claim(slot)) {
            work(slot->job);
            atomic_store(&slot->state, SLOT_DONE);
        }
    }
    return NULL;
}

/* A forked child has none of the parent's workers: start over with an empty pool. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.sleeping, 0);
    pool.workers = 0;
}

static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Start workers until `wanted` run (the caller holds pool.busy); return how many run. */
static int start_workers(int wanted) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 1 << 20);
    while (pool.workers < wanted) {
        pthread_t id;
        struct slot *slot = &pool.slots[pool.workers];
        atomic_store(&slot->state, SLOT_IDLE);
        if (pthread_create(&id, &attr, worker_main, slot) != 0) break;
        pool.workers++;
    }
    pthread_attr_destroy(&attr);
    return pool.workers < wanted ? pool.workers : wanted;
}

/* Take back a slot no worker claimed, or wait until its worker is done. */
static void retire(struct slot *slot) {
    if (!claim(slot)) {
        for (int spin = 1; atomic_load(&slot->state) != SLOT_DONE; spin++) {
            if (spin % 1024 == 0)
                sched_yield();
            else
                cpu_relax();
        }
    }
    atomic_store(&slot->state, SLOT_IDLE);
}

/* GOMP_parallel of the OpenMP runtime torch uses (NOTE [sharing torch's OpenMP threads]). */
typedef void (*gomp_parallel_fn)(void (*body)(void *), void *data, unsigned threads,
                                 unsigned flags);
static _Atomic(gomp_parallel_fn) openmp_parallel = NULL;

int memsave_use_openmp(void *gomp_parallel) {
    atomic_store(&openmp_parallel, (gomp_parallel_fn)gomp_parallel);
    return 0;
}

static void openmp_body(void *job) { work((struct job *)job); }

/* Run fn over [0, n) on up to nthreads threads (NOTE [thread ranges], NOTE [worker pool]). */
static void parallel(range_fn fn, const void *args, int64_t n, int nthreads) {
    int64_t threads = n < PARALLEL_MIN ? 1 : n / THREAD_MIN;
    if (threads > nthreads) threads = nthreads;
    if (threads > MAX_THREADS + 1) threads = MAX_THREADS + 1;
    gomp_parallel_fn openmp = atomic_load(&openmp_parallel);
    /* One contiguous range per thread streams fastest (measured: 20% faster than 64K-element
     * chunks); the own pool splits finer, as its workers may wake late. */
    int64_t parts = openmp ? threads : threads * POOL_CHUNKS;
    int64_t chunk = (n + parts - 1) / parts;
    chunk = (chunk + RANGE_ALIGN - 1) / RANGE_ALIGN * RANGE_ALIGN;
    struct job job = {fn, args, n, chunk, 0};
    if (threads > 1 && openmp) {
        openmp(openmp_body, &job, (unsigned)threads, 0);
        return;
    }
    pthread_once(&pool_once, pool_init);
    /* Waking a sleeping worker takes tens of microseconds: only worth it for large inputs. */
    int drowsy = n < WAKE_MIN && atomic_load(&pool.sleeping) > 0;
    if (threads <= 1 || drowsy || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(args, 0, n);
        return;
    }
    int helpers = start_workers((int)threads - 1);
    for (int i = 0; i < helpers; i++) {
        pool.slots[i].job = &job;
        atomic_store(&pool.slots[i].state, SLOT_POSTED);
    }
    if (atomic_load(&pool.sleeping) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    work(&job);
    for (int i = 0; i < helpers; i++) retire(&pool.slots[i]);
    pthread_mutex_unlock(&pool.busy);
}

/* ------------------------------------------------------------------------------------------ */
/* Bit kernels, portable loops.
 *
 * relu_pack: out = torch.relu(x): negative non-NaN values become +0, while -0 and NaN stay as
 * they are; the bit is set where not (x <= 0), i.e. x positive or NaN. compare_pack: the bit is
 * set where key(low) < key(x) (and key(x) < key(high) for "between"), never for NaN (NOTE [float
 * classes as integer tests]). select_bits: out = grad where the bit is set (clear with invert),
 * else +0, copying the bits. Each portable loop handles one output byte (8 elements) at a time
 * through a local copy, so an in-place call (out == x) does not stop the compiler from reordering
 * loads and stores. */

struct relu_args {
    const void *x;
    void *out;
    uint8_t *bits;
    uint64_t inf;
};

struct compare_args {
    const void *x;
    uint8_t *bits;
    uint64_t inf;
    int64_t low;
    int64_t high;
};

struct select_args {
    const void *grad;
    const uint8_t *bits;
    void *out;
    int invert;
};

#define BIT_KERNELS_GENERIC(T, W)                                                                 \
    static unsigned relu_byte##W(const T *x, T *out, int lanes, T inf) {                          \
        const T sign = SIGN_OF(T);                                                                \
        T v[8] = {0};                                                                             \
        unsigned byte = 0;                                                                        \
        memcpy(v, x, lanes * sizeof(T));                                                          \
        for (int j = 0; j < 8; j++) {                                                             \
            T mag = v[j] & (T)~sign;                                                              \
            unsigned set = (mag > inf) | ((v[j] < sign) & (mag != 0));                            \
            v[j] &= (T)(0 - (T)(set | (mag == 0)));                                               \
            byte |= set << j;                                                                     \
        }                                                                                         \
        memcpy(out, v, lanes * sizeof(T));                                                        \
        return byte & ((1u << lanes) - 1);                                                        \
    }                                                                                             \
                                                                                                  \
    static void relu_pack##W(const void *raw, int64_t begin, int64_t end) {                      \
        const struct relu_args *a = (const struct relu_args *)raw;                                \
        const T *x = (const T *)a->x;                                                             \
        T *out = (T *)a->out;                                                                     \
        for (int64_t i = begin; i < end; i += 8) {                                                \
            int lanes = end - i < 8 ? (int)(end - i) : 8;                                         \
            a->bits[i / 8] = (uint8_t)relu_byte##W(x + i, out + i, lanes, (T)a->inf);             \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    static unsigned compare_byte##W(const T *x, int lanes, T inf, int64_t low, int64_t high) {    \
        const T sign = SIGN_OF(T);                                                                \
        T v[8] = {0};                                                                             \
        unsigned byte = 0;                                                                        \
        memcpy(v, x, lanes * sizeof(T));                                                          \
        for (int j = 0; j < 8; j++) {                                                             \
            T mag = v[j] & (T)~sign;                                                              \
            int64_t key = v[j] < sign ? (int64_t)mag : -(int64_t)mag;                             \
            byte |= (unsigned)((mag <= inf) & (key > low) & (key < high)) << j;                   \
        }                                                                                         \
        return byte & ((1u << lanes) - 1);                                                        \
    }                                                                                             \
                                                                                                  \
    static void compare_pack##W(const void *raw, int64_t begin, int64_t end) {                   \
        const struct compare_args *a = (const struct compare_args *)raw;                          \
        const T *x = (const T *)a->x;                                                             \
        for (int64_t i = begin; i < end; i += 8) {                                                \
            int lanes = end - i < 8 ? (int)(end - i) : 8;                                         \
            a->bits[i / 8] = (uint8_t)compare_byte##W(x + i, lanes, (T)a->inf, a->low, a->high);  \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    static void select_bits##W(const void *raw, int64_t begin, int64_t end) {                    \
        const struct select_args *a = (const struct select_args *)raw;                            \
        const T *grad = (const T *)a->grad;                                                       \
        T *out = (T *)a->out;                                                                     \
        const unsigned flip = a->invert ? 0xffu : 0u;                                             \
        for (int64_t i = begin; i < end; i += 8) {                                                \
            int lanes = end - i < 8 ? (int)(end - i) : 8;                                         \
            unsigned byte = a->bits[i / 8] ^ flip;                                                \
            T v[8] = {0};                                                                         \
            memcpy(v, grad + i, lanes * sizeof(T));                                               \
            for (int j = 0; j < 8; j++) v[j] &= (T)(0 - (T)((byte >> j) & 1u));                   \
            memcpy(out + i, v, lanes * sizeof(T));                                                \
        }                                                                                         \
    }

BIT_KERNELS_GENERIC(uint16_t, 16)
BIT_KERNELS_GENERIC(uint32_t, 32)
BIT_KERNELS_GENERIC(uint64_t, 64)

/* ------------------------------------------------------------------------------------------ */
/* LeakyReLU backward: out = grad * (bit set ? 1 : slope) in the element's own type, as the
 * vectorised loop of ATen's leaky_relu_backward computes it for float and double (one IEEE
 * multiply, no contraction; multiplying by 1 quietens a signalling NaN there, which ATen's
 * scalar tail passes unchanged). Plain loops the compiler vectorises; an AVX2 clone too. */

struct scale_args {
    const void *grad;
    const uint8_t *bits;
    void *out;
    double slope;
    double one; /* 1, read at run time: a literal 1 would let the compiler drop the multiply */
};

#define SCALE_KERNEL(T, NAME, TARGET)                                                             \
    TARGET static void NAME(const void *raw, int64_t begin, int64_t end) {                        \
        const struct scale_args *a = (const struct scale_args *)raw;                              \
        const T *grad = (const T *)a->grad;                                                       \
        T *out = (T *)a->out;                                                                     \
        const T factor[2] = {(T)a->slope, (T)a->one};                                             \
        for (int64_t i = begin; i < end; i += 8) {                                                \
            int lanes = end - i < 8 ? (int)(end - i) : 8;                                         \
            unsigned byte = a->bits[i / 8];                                                       \
            for (int j = 0; j < lanes; j++) {                                                     \
                out[i + j] = grad[i + j] * factor[(byte >> j) & 1u];                              \
            }                                                                                     \
        }                                                                                         \
    }

SCALE_KERNEL(float, select_scale32, )
SCALE_KERNEL(double, select_scale64, )

/* LeakyReLU forward: out = x > 0 ? x : x * slope (NaN takes the multiply, which quietens it, as
 * in both of ATen's loops), and the bit is x > 0. Each group of 8 goes through local copies, so an
 * in-place call (out == x) leaves the compiler free to vectorise. */

struct leaky_args {
    const void *x;
    void *out;
    uint8_t *bits;
    double slope;
};

#define LEAKY_KERNEL(T, U, NAME, TARGET)                                                          \
    TARGET static void NAME(const void *raw, int64_t begin, int64_t end) {                        \
        const struct leaky_args *a = (const struct leaky_args *)raw;                              \
        const T *x = (const T *)a->x;                                                             \
        T *out = (T *)a->out;                                                                     \
        const T slope = (T)a->slope;                                                              \
        for (int64_t i = begin; i < end; i += 8) {                                                \
            int lanes = end - i < 8 ? (int)(end - i) : 8;                                         \
            T v[8] = {0}, m[8];                                                                   \
            U keep[8], vb[8], mb[8], yb[8];                                                       \
            memcpy(v, x + i, lanes * sizeof(T));                                                  \
            for (int j = 0; j < 8; j++) {                                                         \
                m[j] = v[j] * slope;                                                              \
                keep[j] = (U)0 - (U)(v[j] > (T)0);                                                \
            }                                                                                     \
            memcpy(vb, v, sizeof vb);                                                             \
            memcpy(mb, m, sizeof mb);                                                             \
            unsigned byte = 0;                                                                    \
            for (int j = 0; j < 8; j++) {                                                         \
                yb[j] = (vb[j] & keep[j]) | (mb[j] & ~keep[j]);                                   \
                byte |= (unsigned)(keep[j] & 1u) << j;                                            \
            }                                                                                     \
            memcpy(out + i, yb, lanes * sizeof(T));                                               \
            a->bits[i / 8] = (uint8_t)(byte & ((1u << lanes) - 1));                               \
        }                                                                                         \
    }

LEAKY_KERNEL(float, uint32_t, leaky_pack32, )
LEAKY_KERNEL(double, uint64_t, leaky_pack64, )

/* Hardtanh forward: out = clamp(x, low, high) and the bit low < x < high. ATen's clamp gives NaN
 * payloads and the sign of a zero meeting a zero bound differently in its vector loop and its
 * scalar tail, so such elements ("held") are copied unchanged and reported: the caller lets ATen
 * finish them (clamping is idempotent on every other element). */

struct hardtanh_args {
    const void *x;
    void *out;
    uint8_t *bits;
    double low;
    double high;
    int neg_zero_held; /* -0.0 inputs are held (a bound is +0.0) */
    int pos_zero_held; /* +0.0 inputs are held (a bound is -0.0) */
    atomic_int *held;
};

#define HARDTANH_KERNEL(T, U, NAME, TARGET)                                                       \
    TARGET static void NAME(const void *raw, int64_t begin, int64_t end) {                        \
        const struct hardtanh_args *a = (const struct hardtanh_args *)raw;                        \
        const T *x = (const T *)a->x;                                                             \
        T *out = (T *)a->out;                                                                     \
        const T low = (T)a->low, high = (T)a->high;                                               \
        const U sign = (U)1 << (8 * sizeof(U) - 1);                                               \
        unsigned held = 0;                                                                        \
        for (int64_t i = begin; i < end; i += 8) {                                                \
            int lanes = end - i < 8 ? (int)(end - i) : 8;                                         \
            T v[8] = {0}, y[8];                                                                   \
            U raw_bits[8];                                                                        \
            memcpy(v, x + i, lanes * sizeof(T));                                                  \
            memcpy(raw_bits, v, sizeof raw_bits);                                                 \
            unsigned byte = 0, hold_byte = 0;                                                     \
            for (int j = 0; j < 8; j++) {                                                         \
                int nan = v[j] != v[j];                                                           \
                int clash = (raw_bits[j] == sign && a->neg_zero_held) ||                          \
                            (raw_bits[j] == 0 && a->pos_zero_held);                               \
                T clamped = v[j] < low ? low : (v[j] > high ? high : v[j]);                       \
                y[j] = (nan | clash) ? v[j] : clamped;                                            \
                byte |= (unsigned)((v[j] > low) & (v[j] < high)) << j;                            \
                hold_byte |= (unsigned)(nan | clash) << j;                                        \
            }                                                                                     \
            memcpy(out + i, y, lanes * sizeof(T));                                                \
            a->bits[i / 8] = (uint8_t)(byte & ((1u << lanes) - 1));                               \
            held |= hold_byte & ((1u << lanes) - 1);                                              \
        }                                                                                         \
        if (held) atomic_store(a->held, 1);                                                       \
    }

HARDTANH_KERNEL(float, uint32_t, hardtanh_pack32, )
HARDTANH_KERNEL(double, uint64_t, hardtanh_pack64, )

/* ------------------------------------------------------------------------------------------ */
/* Bit kernels, AVX2: whole 64-element blocks (one 8-byte word of bits) with 256-bit vectors of
 * 16, 8 or 4 lanes, two vectors per step; the portable loops take the tail. Signed lane
 * comparisons do the integer tests: u > 0 is "positive, nonzero" and 0 > u "sign bit set". */

#ifdef MEMSAVE_X86
#define AVX2 __attribute__((target("avx2")))
#define SET1_16(v) _mm256_set1_epi16((short)(v))
#define SET1_32(v) _mm256_set1_epi32((int)(v))
#define SET1_64(v) _mm256_set1_epi64x((long long)(v))

/* One bit per lane of two lane masks (all ones or zero), first vector in the low bits. */
AVX2 static inline uint64_t lane_bits16(__m256i m0, __m256i m1) {
    __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(m0, m1), 0xD8);
    return (uint32_t)_mm256_movemask_epi8(bytes);
}
AVX2 static inline uint64_t lane_bits32(__m256i m0, __m256i m1) {
    return (uint64_t)(_mm256_movemask_ps(_mm256_castsi256_ps(m0)) |
                      (_mm256_movemask_ps(_mm256_castsi256_ps(m1)) << 8));
}
AVX2 static inline uint64_t lane_bits64(__m256i m0, __m256i m1) {
    return (uint64_t)(_mm256_movemask_pd(_mm256_castsi256_pd(m0)) |
                      (_mm256_movemask_pd(_mm256_castsi256_pd(m1)) << 4));
}

#define BIT_KERNELS_AVX2(T, W)                                                                    \
    /* relu of one vector at p (stored to q); returns the lanes whose bit is set */               \
    AVX2 static inline __m256i relu_vector##W(const T *p, T *q, __m256i inf) {                   \
        const __m256i zero = _mm256_setzero_si256(), magnitude = SET1_##W(~SIGN_OF(T));          \
        __m256i u = _mm256_loadu_si256((const __m256i *)p);                                       \
        __m256i mag = _mm256_and_si256(u, magnitude);                                             \
        __m256i set = _mm256_or_si256(_mm256_cmpgt_epi##W(u, zero), _mm256_cmpgt_epi##W(mag, inf)); \
        __m256i keep = _mm256_or_si256(set, _mm256_cmpeq_epi##W(mag, zero));                      \
        _mm256_storeu_si256((__m256i *)q, _mm256_and_si256(u, keep));                             \
        return set;                                                                               \
    }                                                                                             \
                                                                                                  \
    AVX2 static void relu_pack##W##_avx2(const void *raw, int64_t begin, int64_t end) {          \
        const struct relu_args *a = (const struct relu_args *)raw;                                \
        const T *x = (const T *)a->x;                                                             \
        T *out = (T *)a->out;                                                                     \
        const __m256i inf = SET1_##W(a->inf);                                                     \
        const int step = 64 / (int)sizeof(T); /* two vectors */                                   \
        int64_t i = begin;                                                                        \
        for (; i + 64 <= end; i += 64) {                                                          \
            uint64_t word = 0;                                                                    \
            for (int k = 0; k < 64; k += step) {                                                  \
                __m256i m0 = relu_vector##W(x + i + k, out + i + k, inf);                         \
                __m256i m1 = relu_vector##W(x + i + k + step / 2, out + i + k + step / 2, inf);   \
                word |= lane_bits##W(m0, m1) << k;                                                \
            }                                                                                     \
            memcpy(a->bits + i / 8, &word, 8); /* x86 is little-endian: byte k = bits 8k.. */     \
        }                                                                                         \
        if (i < end) relu_pack##W(raw, i, end);                                                   \
    }                                                                                             \
                                                                                                  \
    /* lanes of one vector at p with low < x (< high), never NaN */                               \
    AVX2 static inline __m256i compare_vector##W(const T *p, __m256i inf, __m256i low,            \
                                                 __m256i high) {                                  \
        const __m256i zero = _mm256_setzero_si256(), magnitude = SET1_##W(~SIGN_OF(T));          \
        __m256i u = _mm256_loadu_si256((const __m256i *)p);                                       \
        __m256i mag = _mm256_and_si256(u, magnitude);                                             \
        __m256i negative = _mm256_cmpgt_epi##W(zero, u);                                          \
        __m256i key = _mm256_sub_epi##W(_mm256_xor_si256(mag, negative), negative);              \
        __m256i set = _mm256_and_si256(_mm256_cmpgt_epi##W(key, low), _mm256_cmpgt_epi##W(high, key)); \
        return _mm256_andnot_si256(_mm256_cmpgt_epi##W(mag, inf), set);                           \
    }                                                                                             \
                                                                                                  \
    AVX2 static void compare_pack##W##_avx2(const void *raw, int64_t begin, int64_t end) {       \
        const struct compare_args *a = (const struct compare_args *)raw;                          \
        const T *x = (const T *)a->x;                                                             \
        const __m256i inf = SET1_##W(a->inf), low = SET1_##W(a->low), high = SET1_##W(a->high);  \
        const int step = 64 / (int)sizeof(T);                                                     \
        int64_t i = begin;                                                                        \
        for (; i + 64 <= end; i += 64) {                                                          \
            uint64_t word = 0;                                                                    \
            for (int k = 0; k < 64; k += step) {                                                  \
                __m256i m0 = compare_vector##W(x + i + k, inf, low, high);                        \
                __m256i m1 = compare_vector##W(x + i + k + step / 2, inf, low, high);             \
                word |= lane_bits##W(m0, m1) << k;                                                \
            }                                                                                     \
            memcpy(a->bits + i / 8, &word, 8);                                                    \
        }                                                                                         \
        if (i < end) compare_pack##W(raw, i, end);                                                \
    }                                                                                             \
                                                                                                  \
    /* Whole words of clear bits write zeros without reading the gradient. */                     \
    AVX2 static void select_bits##W##_avx2(const void *raw, int64_t begin, int64_t end) {        \
        const struct select_args *a = (const struct select_args *)raw;                            \
        const T *grad = (const T *)a->grad;                                                       \
        T *out = (T *)a->out;                                                                     \
        const uint64_t flip = a->invert ? ~(uint64_t)0 : 0;                                       \
        const int lanes = 32 / (int)sizeof(T);                                                    \
        const __m256i lane_bit = LANE_BIT_##W;                                                    \
        int64_t i = begin;                                                                        \
        for (; i + 64 <= end; i += 64) {                                                          \
            uint64_t word;                                                                        \
            memcpy(&word, a->bits + i / 8, 8);                                                    \
            word ^= flip;                                                                         \
            if (word == 0) {                                                                      \
                memset(out + i, 0, 64 * sizeof(T));                                               \
                continue;                                                                         \
            }                                                                                     \
            for (int k = 0; k < 64; k += lanes) {                                                 \
                __m256i chunk = SET1_##W((word >> k) & (~(uint64_t)0 >> (64 - lanes)));           \
                __m256i keep = _mm256_cmpeq_epi##W(_mm256_and_si256(chunk, lane_bit), lane_bit);  \
                __m256i g = _mm256_loadu_si256((const __m256i *)(grad + i + k));                  \
                _mm256_storeu_si256((__m256i *)(out + i + k), _mm256_and_si256(g, keep));         \
            }                                                                                     \
        }                                                                                         \
        if (i < end) select_bits##W(raw, i, end);                                                 \
    }

/* Lane j holds bit j. */
#define LANE_BIT_16                                                                               \
    _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,      \
                      (short)-32768)
#define LANE_BIT_32 _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128)
#define LANE_BIT_64 _mm256_setr_epi64x(1, 2, 4, 8)

/* LeakyReLU backward, 8 floats per step: each bit picks the factor (1 or slope), one multiply. */
AVX2 static void select_scale32_avx2(const void *raw, int64_t begin, int64_t end) {
    const struct scale_args *a = (const struct scale_args *)raw;
    const float *grad = (const float *)a->grad;
    float *out = (float *)a->out;
    const __m256 slope = _mm256_set1_ps((float)a->slope), one = _mm256_set1_ps((float)a->one);
    const __m256i lane_bit = LANE_BIT_32;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256i byte = _mm256_set1_epi32(a->bits[i / 8]);
        __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bit), lane_bit);
        __m256 factor = _mm256_blendv_ps(slope, one, _mm256_castsi256_ps(set));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(grad + i), factor));
    }
    if (i < end) select_scale32(raw, i, end);
}

/* The same for doubles: two vectors of 4 per byte of bits. */
AVX2 static void select_scale64_avx2(const void *raw, int64_t begin, int64_t end) {
    const struct scale_args *a = (const struct scale_args *)raw;
    const double *grad = (const double *)a->grad;
    double *out = (double *)a->out;
    const __m256d slope = _mm256_set1_pd(a->slope), one = _mm256_set1_pd(a->one);
    const __m256i lane_bit = LANE_BIT_64;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        unsigned bits = a->bits[i / 8];
        for (int half = 0; half < 2; half++) {
            __m256i nibble = _mm256_set1_epi64x((long long)(bits >> (4 * half)));
            __m256i set = _mm256_cmpeq_epi64(_mm256_and_si256(nibble, lane_bit), lane_bit);
            __m256d factor = _mm256_blendv_pd(slope, one, _mm256_castsi256_pd(set));
            __m256d g = _mm256_loadu_pd(grad + i + 4 * half);
            _mm256_storeu_pd(out + i + 4 * half, _mm256_mul_pd(g, factor));
        }
    }
    if (i < end) select_scale64(raw, i, end);
}
/* LeakyReLU forward, 8 floats (one output byte) per step: compare, multiply, blend, movemask. */
AVX2 static void leaky_pack32_avx2(const void *raw, int64_t begin, int64_t end) {
    const struct leaky_args *a = (const struct leaky_args *)raw;
    const float *x = (const float *)a->x;
    float *out = (float *)a->out;
    const __m256 slope = _mm256_set1_ps((float)a->slope), zero = _mm256_setzero_ps();
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 positive = _mm256_cmp_ps(v, zero, _CMP_GT_OQ);
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(_mm256_mul_ps(v, slope), v, positive));
        a->bits[i / 8] = (uint8_t)_mm256_movemask_ps(positive);
    }
    if (i < end) leaky_pack32(raw, i, end);
}

/* Hardtanh forward, 8 floats per step (see HARDTANH_KERNEL): max/min clamp, held lanes blended
 * back to the input. */
AVX2 static void hardtanh_pack32_avx2(const void *raw, int64_t begin, int64_t end) {
    const struct hardtanh_args *a = (const struct hardtanh_args *)raw;
    const float *x = (const float *)a->x;
    float *out = (float *)a->out;
    const __m256 low = _mm256_set1_ps((float)a->low), high = _mm256_set1_ps((float)a->high);
    const __m256i neg_zero = _mm256_set1_epi32((int)0x80000000u), pos_zero = _mm256_setzero_si256();
    const __m256i neg_held = _mm256_set1_epi32(a->neg_zero_held ? -1 : 0);
    const __m256i pos_held = _mm256_set1_epi32(a->pos_zero_held ? -1 : 0);
    int held = 0;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256i vi = _mm256_castps_si256(v);
        __m256 inside = _mm256_and_ps(_mm256_cmp_ps(v, low, _CMP_GT_OQ),
                                      _mm256_cmp_ps(v, high, _CMP_LT_OQ));
        __m256i clash = _mm256_or_si256(_mm256_and_si256(_mm256_cmpeq_epi32(vi, neg_zero), neg_held),
                                        _mm256_and_si256(_mm256_cmpeq_epi32(vi, pos_zero), pos_held));
        __m256 hold = _mm256_or_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_castsi256_ps(clash));
        __m256 clamped = _mm256_min_ps(_mm256_max_ps(v, low), high);
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(clamped, v, hold));
        a->bits[i / 8] = (uint8_t)_mm256_movemask_ps(inside);
        held |= _mm256_movemask_ps(hold);
    }
    if (held) atomic_store(a->held, 1);
    if (i < end) hardtanh_pack32(raw, i, end);
}

HARDTANH_KERNEL(double, uint64_t, hardtanh_pack64_avx2, AVX2)

/* The same for doubles: two vectors of 4 per output byte. */
AVX2 static void leaky_pack64_avx2(const void *raw, int64_t begin, int64_t end) {
    const struct leaky_args *a = (const struct leaky_args *)raw;
    const double *x = (const double *)a->x;
    double *out = (double *)a->out;
    const __m256d slope = _mm256_set1_pd(a->slope), zero = _mm256_setzero_pd();
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256d v0 = _mm256_loadu_pd(x + i), v1 = _mm256_loadu_pd(x + i + 4);
        __m256d p0 = _mm256_cmp_pd(v0, zero, _CMP_GT_OQ), p1 = _mm256_cmp_pd(v1, zero, _CMP_GT_OQ);
        _mm256_storeu_pd(out + i, _mm256_blendv_pd(_mm256_mul_pd(v0, slope), v0, p0));
        _mm256_storeu_pd(out + i + 4, _mm256_blendv_pd(_mm256_mul_pd(v1, slope), v1, p1));
        a->bits[i / 8] = (uint8_t)(_mm256_movemask_pd(p0) | (_mm256_movemask_pd(p1) << 4));
    }
    if (i < end) leaky_pack64(raw, i, end);
}

BIT_KERNELS_AVX2(uint16_t, 16)
BIT_KERNELS_AVX2(uint32_t, 32)
BIT_KERNELS_AVX2(uint64_t, 64)
#endif

/* ------------------------------------------------------------------------------------------ */
/* Max-pool window offsets. Element i belongs to window position p = (i / inner) % planes.
 * to_offsets: out[i] = inverse[indices[i] - starts[p]]; to_indices: out[i] = table[offsets[i]] +
 * starts[p]. In to_offsets a lookup outside its table reads nothing: it gives -1 (an index
 * outside its window) and sets `missed` (NOTE [argmax outside its window] in kernels/maxpool.py);
 * the inverse table holds -1 where a distance is not a window element, and a miss of index 0
 * gives -2. to_indices reads only offsets that to_offsets gave without a miss (precondition,
 * unchecked). */

struct offsets_args {
    const void *src;    /* int64 indices (to_offsets) or signed offsets (to_indices) */
    const void *lookup; /* inverse table (to_offsets) or int64 table (to_indices) */
    const int64_t *starts;
    void *out;
    int64_t planes;
    int64_t inner;
    int64_t lookup_len;
    _Atomic int *missed; /* set to 1 where any result is -1 */
};

/* Walk [begin, end) as runs sharing one window position: BODY sees i, count and the run's start s
 * (inner > 1), or walks positions p with starts[p] in step (inner == 1). */
#define FOR_EACH_RUN(a, begin, end, RUN_BODY, PLANE_BODY)                                         \
    do {                                                                                          \
        int64_t i = (begin), q = (begin) / (a)->inner, r = (begin) % (a)->inner;                  \
        int64_t p = q % (a)->planes;                                                              \
        if ((a)->inner == 1) {                                                                    \
            while (i < (end)) {                                                                   \
                int64_t count = (a)->planes - p < (end) - i ? (a)->planes - p : (end) - i;        \
                const int64_t *st = (a)->starts + p;                                              \
                PLANE_BODY;                                                                       \
                i += count;                                                                       \
                p = 0;                                                                            \
            }                                                                                     \
        } else {                                                                                  \
            while (i < (end)) {                                                                   \
                int64_t count = (a)->inner - r < (end) - i ? (a)->inner - r : (end) - i;          \
                const int64_t s = (a)->starts[p];                                                 \
                RUN_BODY;                                                                         \
                i += count;                                                                       \
                r = 0;                                                                            \
                if (++p == (a)->planes) p = 0;                                                    \
            }                                                                                     \
        }                                                                                         \
    } while (0)

/* A lookup at `at` of a table of `len` reads the table at `at` where it lies inside, else at 0,
 * and ORs the value with `mask`: 0 inside, -1 (every bit) outside; no branches. */
static inline int64_t outside_mask(int64_t at, int64_t len) {
    return -(int64_t)((uint64_t)at >= (uint64_t)len);
}

/* `v`, less one where it is negative and `index` is 0: in to_offsets a miss of index 0 gives -2
 * (NOTE [argmax outside its window]); no branches. */
static inline int64_t plane_start(int64_t v, int64_t index) {
    return v + (-(int64_t)(v < 0) & -(int64_t)(index == 0));
}

/* One conversion kernel: out[i] = VALUE(lookup, at, start of element i's window), at =
 * AT(src[i], start); CHECKED, masked as above, -2 for a negative result of index 0, and `missed`
 * set where any result is negative (outside the table, or the inverse table's -1 for a distance
 * that is no window element). */
#define OFFSET_KERNEL(NAME, SRC_T, LOOKUP_T, OUT_T, AT, VALUE, CHECKED)                           \
    static void NAME(const void *raw, int64_t begin, int64_t end) {                              \
        const struct offsets_args *a = (const struct offsets_args *)raw;                          \
        const SRC_T *src = (const SRC_T *)a->src;                                                 \
        const LOOKUP_T *lookup = (const LOOKUP_T *)a->lookup;                                     \
        const int64_t len = a->lookup_len;                                                        \
        OUT_T *out = (OUT_T *)a->out;                                                             \
        int64_t missed = 0;                                                                       \
        FOR_EACH_RUN(                                                                             \
            a, begin, end,                                                                        \
            for (int64_t j = 0; j < count; j++) {                                                 \
                const int64_t at = AT(src[i + j], s);                                             \
                const int64_t mask = CHECKED ? outside_mask(at, len) : 0;                         \
                const int64_t found = VALUE(lookup, at & ~mask, s) | mask;                        \
                const int64_t v = CHECKED ? plane_start(found, src[i + j]) : found;               \
                out[i + j] = (OUT_T)v;                                                            \
                missed |= CHECKED ? v : 0;                                                        \
            },                                                                                    \
            for (int64_t j = 0; j < count; j++) {                                                 \
                const int64_t at = AT(src[i + j], st[j]);                                         \
                const int64_t mask = CHECKED ? outside_mask(at, len) : 0;                         \
                const int64_t found = VALUE(lookup, at & ~mask, st[j]) | mask;                    \
                const int64_t v = CHECKED ? plane_start(found, src[i + j]) : found;               \
                out[i + j] = (OUT_T)v;                                                            \
                missed |= CHECKED ? v : 0;                                                        \
            });                                                                                   \
        if (missed < 0) atomic_store(a->missed, 1);                                               \
    }

/* Indices to offsets through the inverse table (at: the distance from the window's start), and
 * offsets back to indices through the table (at: the offset). */
#define DISTANCE(index, start) ((index) - (start))
#define OFFSET(offset, start) ((int64_t)(offset))
#define INVERSE_AT(inverse, at, start) ((int64_t)(inverse)[at])
#define INDEX_AT(table, at, start) ((table)[at] + (start))
/* The offsets come from to_offsets, whose misses keep stock's indices instead (NOTE [argmax
 * outside its window]): to_indices reads them unchecked, which measured a quarter faster. */
#define TO_OFFSETS(T, NAME) OFFSET_KERNEL(NAME, int64_t, T, T, DISTANCE, INVERSE_AT, 1)
#define TO_INDICES(T, NAME) OFFSET_KERNEL(NAME, T, int64_t, int64_t, OFFSET, INDEX_AT, 0)

TO_OFFSETS(int8_t, to_offsets8)
TO_OFFSETS(int16_t, to_offsets16)
TO_OFFSETS(int32_t, to_offsets32)
TO_OFFSETS(int64_t, to_offsets64)
TO_INDICES(int8_t, to_indices8)
TO_INDICES(int16_t, to_indices16)
TO_INDICES(int32_t, to_indices32)
TO_INDICES(int64_t, to_indices64)

/* ------------------------------------------------------------------------------------------ */
/* Dispatch and exported entry points (return 0, or -1 for an unsupported element size). */

static int has_avx2(void) {
#ifdef MEMSAVE_X86
    static _Atomic int cached = -1;
    if (atomic_load(&cached) < 0) {
        __builtin_cpu_init();
        atomic_store(&cached, __builtin_cpu_supports("avx2") ? 1 : 0);
    }
    return atomic_load(&cached);
#else
    return 0;
#endif
}

#ifdef MEMSAVE_X86
#define PICK(name, size)                                                                          \
    ((size) == 2   ? (has_avx2() ? name##16_avx2 : name##16)                                      \
     : (size) == 4 ? (has_avx2() ? name##32_avx2 : name##32)                                      \
     : (size) == 8 ? (has_avx2() ? name##64_avx2 : name##64)                                      \
                   : (range_fn)NULL)
#else
#define PICK(name, size)                                                                          \
    ((size) == 2 ? name##16 : (size) == 4 ? name##32 : (size) == 8 ? name##64 : (range_fn)NULL)
#endif

const char *memsave_isa(void) { return has_avx2() ? "avx2" : "generic"; }

/* Whether the calling thread flushes denormals (x86 MXCSR DAZ or FTZ, ARM64 FPCR FZ), as
 * torch.set_flush_denormal(True) makes it. */
int memsave_flushes_denormals(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned csr;
    __asm__ __volatile__("stmxcsr %0" : "=m"(csr));
    return (csr & 0x8040u) != 0;
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    return (fpcr >> 24) & 1u;
#else
    return 0;
#endif
}

int memsave_relu_pack(const void *x, void *out, uint8_t *bits, int64_t n, int size, uint64_t inf,
                      int nthreads) {
    range_fn fn = PICK(relu_pack, size);
    if (!fn) return -1;
    struct relu_args args = {x, out, bits, inf};
    parallel(fn, &args, n, nthreads);
    return 0;
}

/* Keys of the bounds (NOTE [float classes as integer tests]); without "between" the upper bound
 * is the largest key of the width, above every non-NaN value. */
int memsave_compare_pack(const void *x, uint8_t *bits, int64_t n, int size, uint64_t inf,
                         int between, int64_t low, int64_t high, int nthreads) {
    range_fn fn = PICK(compare_pack, size);
    if (!fn) return -1;
    int64_t top = size == 8 ? INT64_MAX : (int64_t)((UINT64_C(1) << (8 * size - 1)) - 1);
    struct compare_args args = {x, bits, inf, low, between ? high : top};
    parallel(fn, &args, n, nthreads);
    return 0;
}

int memsave_select_bits(const void *grad, const uint8_t *bits, void *out, int64_t n, int size,
                        int invert, int nthreads) {
    range_fn fn = PICK(select_bits, size);
    if (!fn) return -1;
    struct select_args args = {grad, bits, out, invert};
    parallel(fn, &args, n, nthreads);
    return 0;
}

/* Only float (size 4) and double (size 8): 16-bit types multiply in float32 in ATen. */
int memsave_leaky_pack(const void *x, void *out, uint8_t *bits, int64_t n, int size, double slope,
                       int nthreads) {
    if (size != 4 && size != 8) return -1;
#ifdef MEMSAVE_X86
    range_fn fn = size == 4 ? (has_avx2() ? leaky_pack32_avx2 : leaky_pack32)
                            : (has_avx2() ? leaky_pack64_avx2 : leaky_pack64);
#else
    range_fn fn = size == 4 ? leaky_pack32 : leaky_pack64;
#endif
    struct leaky_args args = {x, out, bits, slope};
    parallel(fn, &args, n, nthreads);
    return 0;
}

/* Returns -1 on bad arguments, else 0; *held is set to 1 when elements were left for ATen. */
int memsave_hardtanh_pack(const void *x, void *out, uint8_t *bits, int64_t n, int size, double low,
                          double high, int *held, int nthreads) {
    if (size != 4 && size != 8) return -1;
#ifdef MEMSAVE_X86
    range_fn fn = size == 4 ? (has_avx2() ? hardtanh_pack32_avx2 : hardtanh_pack32)
                            : (has_avx2() ? hardtanh_pack64_avx2 : hardtanh_pack64);
#else
    range_fn fn = size == 4 ? hardtanh_pack32 : hardtanh_pack64;
#endif
    atomic_int any = 0;
    int pos_bound = (low == 0 && !signbit(low)) || (high == 0 && !signbit(high));
    int neg_bound = (low == 0 && signbit(low)) || (high == 0 && signbit(high));
    struct hardtanh_args args = {x, out, bits, low, high, pos_bound, neg_bound, &any};
    parallel(fn, &args, n, nthreads);
    *held = atomic_load(&any);
    return 0;
}

static volatile double unit = 1.0;

int memsave_select_scale(const void *grad, const uint8_t *bits, void *out, int64_t n, int size,
                         double slope, int nthreads) {
    if (size != 4 && size != 8) return -1;
#ifdef MEMSAVE_X86
    range_fn fn = size == 4 ? (has_avx2() ? select_scale32_avx2 : select_scale32)
                            : (has_avx2() ? select_scale64_avx2 : select_scale64);
#else
    range_fn fn = size == 4 ? select_scale32 : select_scale64;
#endif
    struct scale_args args = {grad, bits, out, slope, unit};
    parallel(fn, &args, n, nthreads);
    return 0;
}

static range_fn by_width(int size, range_fn k8, range_fn k16, range_fn k32, range_fn k64) {
    switch (size) {
    case 1: return k8;
    case 2: return k16;
    case 4: return k32;
    case 8: return k64;
    default: return NULL;
    }
}

/* The offset conversions return 0, 1 where to_offsets gave some -1 (a lookup outside its table,
 * or no window element), or -1 for bad arguments. */
int memsave_to_offsets(const int64_t *indices, const int64_t *starts, int64_t planes,
                       int64_t inner, const void *inverse, int64_t inverse_len, void *out,
                       int64_t n, int size, int nthreads) {
    range_fn fn = by_width(size, to_offsets8, to_offsets16, to_offsets32, to_offsets64);
    if (!fn || planes < 1 || inner < 1 || inverse_len < 1) return -1;
    _Atomic int missed = 0;
    struct offsets_args args = {indices, inverse, starts, out, planes, inner, inverse_len, &missed};
    parallel(fn, &args, n, nthreads);
    return atomic_load(&missed);
}

int memsave_to_indices(const void *offsets, int size, const int64_t *table, int64_t table_len,
                       const int64_t *starts, int64_t planes, int64_t inner, int64_t *out,
                       int64_t n, int nthreads) {
    range_fn fn = by_width(size, to_indices8, to_indices16, to_indices32, to_indices64);
    if (!fn || planes < 1 || inner < 1 || table_len < 1) return -1;
    _Atomic int missed = 0;
    struct offsets_args args = {offsets, table, starts, out, planes, inner, table_len, &missed};
    parallel(fn, &args, n, nthreads);
    return atomic_load(&missed);
}

/* ------------------------------------------------------------------------------------------ */
/* Max pooling over non-overlapping 2-wide windows, straight to window offsets.
 *
 * NOTE [2-wide max pooling]: for float32 pooling whose window equals its stride, is 2 along the
 * width and 1 or 2 along height and depth, with no padding or dilation, on contiguous planes,
 * forward writes the maxima and their window offsets in one pass, and backward writes the whole
 * input gradient in one pass, with no int64 indices in between. The results are ATen's bit for
 * bit: its CPU kernels scan a window in (depth, height, width) order from -inf and take an element
 * when `val > max || isnan(val)`, which is what the loops below do starting from the first
 * element; its backward adds each gradient to a zeroed input gradient, and as these windows do not
 * overlap every input element receives at most one `0 + grad` (so -0 becomes +0, as there).
 * Work is split by output rows: a row's maxima need 2 input rows per depth slice. */

struct pool2_args {
    const float *x;      /* forward input, or backward output gradient */
    float *out;          /* forward output, or backward input gradient */
    int8_t *offsets;
    int64_t in_depth, in_height, in_width;
    int64_t out_depth, out_height, out_width;
    int kd, kh;          /* window depth and height, 1 or 2; the width is 2 */
};

/* Scalar forward of outputs [from, to) of one output row, given its input row starts. */
static void pool2_forward_tail(const float *const *rows, int nrows, float *out, int8_t *offsets,
                               int64_t from, int64_t to) {
    for (int64_t o = from; o < to; o++) {
        float best = rows[0][2 * o];
        int k = 0;
        for (int r = 0; r < nrows; r++) {
            for (int w = 0; w < 2; w++) {
                float v = rows[r][2 * o + w];
                if (v > best || v != v) {
                    best = v;
                    k = 2 * r + w;
                }
            }
        }
        out[o] = best;
        offsets[o] = (int8_t)k;
    }
}

/* Row r of the output: its plane, depth and height index, and the input rows of its windows. */
static int pool2_rows(const struct pool2_args *a, const float *base, int64_t r, int64_t stride,
                      const float **rows) {
    int64_t oh = r % a->out_height, rest = r / a->out_height;
    int64_t od = rest % a->out_depth, plane = rest / a->out_depth;
    int n = 0;
    for (int d = 0; d < a->kd; d++) {
        for (int h = 0; h < a->kh; h++) {
            int64_t id = od * a->kd + d, ih = oh * a->kh + h;
            rows[n++] = base + ((plane * a->in_depth + id) * a->in_height + ih) * stride;
        }
    }
    return n;
}

static void pool2_forward(const void *raw, int64_t begin, int64_t end) {
    const struct pool2_args *a = (const struct pool2_args *)raw;
    const int64_t ow = a->out_width;
    for (int64_t r = (begin + ow - 1) / ow; r * ow < end; r++) {
        const float *rows[4];
        int n = pool2_rows(a, a->x, r, a->in_width, rows);
        pool2_forward_tail(rows, n, a->out + r * ow, a->offsets + r * ow, 0, ow);
    }
}

/* Scalar backward of one output row: writes both input columns of each window in every row. */
static void pool2_backward_tail(float *const *rows, int nrows, const float *grad,
                                const int8_t *offsets, int64_t from, int64_t to) {
    for (int64_t o = from; o < to; o++) {
        float g = 0.0f + grad[o];
        for (int r = 0; r < nrows; r++) {
            rows[r][2 * o] = offsets[o] == 2 * r ? g : 0.0f;
            rows[r][2 * o + 1] = offsets[o] == 2 * r + 1 ? g : 0.0f;
        }
    }
}

/* Input elements no window covers (an odd last column, rows or slices past the last window) get
 * a zero gradient, written by the thread that handles the last output row next to them. */
static void pool2_zero_uncovered(const struct pool2_args *a, int64_t r, float *const *rows,
                                 int nrows) {
    const int64_t iw = a->in_width, ih = a->in_height;
    if (iw > 2 * a->out_width) {
        for (int k = 0; k < nrows; k++) memset(rows[k] + 2 * a->out_width, 0,
                                               (size_t)(iw - 2 * a->out_width) * sizeof(float));
    }
    int64_t oh = r % a->out_height, rest = r / a->out_height;
    if (oh != a->out_height - 1) return;
    int64_t od = rest % a->out_depth, plane = rest / a->out_depth;
    int64_t covered_h = a->out_height * a->kh;
    for (int d = 0; d < a->kd; d++) {
        int64_t id = od * a->kd + d;
        float *slice = a->out + (plane * a->in_depth + id) * ih * iw;
        memset(slice + covered_h * iw, 0, (size_t)((ih - covered_h) * iw) * sizeof(float));
    }
    int64_t covered_d = a->out_depth * a->kd;
    if (od == a->out_depth - 1 && covered_d < a->in_depth) {
        float *rest_slices = a->out + (plane * a->in_depth + covered_d) * ih * iw;
        memset(rest_slices, 0, (size_t)((a->in_depth - covered_d) * ih * iw) * sizeof(float));
    }
}

static void pool2_backward(const void *raw, int64_t begin, int64_t end) {
    const struct pool2_args *a = (const struct pool2_args *)raw;
    const int64_t ow = a->out_width;
    for (int64_t r = (begin + ow - 1) / ow; r * ow < end; r++) {
        float *rows[4];
        int n = pool2_rows(a, a->out, r, a->in_width, (const float **)rows);
        pool2_backward_tail(rows, n, a->x + r * ow, a->offsets + r * ow, 0, ow);
        pool2_zero_uncovered(a, r, rows, n);
    }
}

#ifdef MEMSAVE_X86
/* Even and odd elements of 16 consecutive floats. */
AVX2 static void deinterleave(const float *p, __m256 *even, __m256 *odd) {
    __m256 lo = _mm256_loadu_ps(p), hi = _mm256_loadu_ps(p + 8);
    __m256 e = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
    __m256 o = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
}

/* The inverse: 16 consecutive floats from their even and odd elements. */
AVX2 static void interleave(float *p, __m256 even, __m256 odd) {
    __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    _mm256_storeu_ps(p, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(p + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}

AVX2 static void pool2_forward_avx2(const void *raw, int64_t begin, int64_t end) {
    const struct pool2_args *a = (const struct pool2_args *)raw;
    const int64_t ow = a->out_width, vector_end = ow / 8 * 8;
    for (int64_t r = (begin + ow - 1) / ow; r * ow < end; r++) {
        const float *rows[4];
        int n = pool2_rows(a, a->x, r, a->in_width, rows);
        float *out = a->out + r * ow;
        int8_t *offsets = a->offsets + r * ow;
        for (int64_t o = 0; o < vector_end; o += 8) {
            __m256 best, odd;
            deinterleave(rows[0] + 2 * o, &best, &odd);
            __m256i k = _mm256_setzero_si256();
            for (int j = 1; j < 2 * n; j++) {
                __m256 v = odd;
                if (j % 2 == 0) deinterleave(rows[j / 2] + 2 * o, &v, &odd);
                __m256 take = _mm256_or_ps(_mm256_cmp_ps(v, best, _CMP_GT_OQ),
                                           _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                best = _mm256_blendv_ps(best, v, take);
                k = _mm256_castps_si256(_mm256_blendv_ps(
                    _mm256_castsi256_ps(k), _mm256_castsi256_ps(_mm256_set1_epi32(j)), take));
            }
            _mm256_storeu_ps(out + o, best);
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, k);
            for (int l = 0; l < 8; l++) offsets[o + l] = (int8_t)lanes[l];
        }
        pool2_forward_tail(rows, n, out, offsets, vector_end, ow);
    }
}

AVX2 static void pool2_backward_avx2(const void *raw, int64_t begin, int64_t end) {
    const struct pool2_args *a = (const struct pool2_args *)raw;
    const int64_t ow = a->out_width, vector_end = ow / 8 * 8;
    for (int64_t r = (begin + ow - 1) / ow; r * ow < end; r++) {
        float *rows[4];
        int n = pool2_rows(a, a->out, r, a->in_width, (const float **)rows);
        const float *grad = a->x + r * ow;
        const int8_t *offsets = a->offsets + r * ow;
        for (int64_t o = 0; o < vector_end; o += 8) {
            __m256 g = _mm256_add_ps(_mm256_setzero_ps(), _mm256_loadu_ps(grad + o));
            __m256i k = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(offsets + o)));
            for (int row = 0; row < n; row++) {
                __m256 even = _mm256_castsi256_ps(
                    _mm256_cmpeq_epi32(k, _mm256_set1_epi32(2 * row)));
                __m256 odd = _mm256_castsi256_ps(
                    _mm256_cmpeq_epi32(k, _mm256_set1_epi32(2 * row + 1)));
                interleave(rows[row] + 2 * o, _mm256_and_ps(even, g), _mm256_and_ps(odd, g));
            }
        }
        pool2_backward_tail(rows, n, grad, offsets, vector_end, ow);
        pool2_zero_uncovered(a, r, rows, n);
    }
}
#endif

static int pool2_check(int64_t planes, int64_t id, int64_t ih, int64_t iw, int kd, int kh) {
    return planes >= 0 && (kd == 1 || kd == 2) && (kh == 1 || kh == 2) && id >= kd && ih >= kh &&
           iw >= 2;
}

/* Runs fn (its AVX2 variant where the CPU has it) over every output of the pooling. */
static int pool2_run(range_fn fn, range_fn fn_avx2, const float *x, float *out,
                     const int8_t *offsets, int64_t planes, int64_t id, int64_t ih, int64_t iw,
                     int kd, int kh, int nthreads) {
    if (!pool2_check(planes, id, ih, iw, kd, kh)) return -1;
    struct pool2_args args = {x, out, (int8_t *)offsets, id, ih, iw,
                              id / kd, ih / kh, iw / 2, kd, kh};
#ifdef MEMSAVE_X86
    if (has_avx2()) fn = fn_avx2;
#else
    (void)fn_avx2;
#endif
    parallel(fn, &args, planes * args.out_depth * args.out_height * args.out_width, nthreads);
    return 0;
}

#ifndef MEMSAVE_X86
#define pool2_forward_avx2 pool2_forward
#define pool2_backward_avx2 pool2_backward
#endif

/* Shapes: input (planes, id, ih, iw) contiguous; output (planes, id / kd, ih / kh, iw / 2). */
int memsave_max_pool2(const float *x, float *out, int8_t *offsets, int64_t planes, int64_t id,
                      int64_t ih, int64_t iw, int kd, int kh, int nthreads) {
    return pool2_run(pool2_forward, pool2_forward_avx2, x, out, offsets, planes, id, ih, iw, kd,
                     kh, nthreads);
}

int memsave_max_pool2_backward(const float *grad, const int8_t *offsets, float *grad_input,
                               int64_t planes, int64_t id, int64_t ih, int64_t iw, int kd, int kh,
                               int nthreads) {
    return pool2_run(pool2_backward, pool2_backward_avx2, grad, grad_input, offsets, planes, id,
                     ih, iw, kd, kh, nthreads);
}
