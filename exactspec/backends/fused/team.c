/* The thread team that runs every pass, product and attention (PyTorch's OpenMP threads, else threads of its own
 * that persist), the CPU's features that pick the tiles, the scratch a pass holds, and the integer peak probe. */
#include "fused.h"

/* ---------------------------------------------------------------- the thread team */

#define SPINS_BEFORE_SLEEP 4000 /* about 0.2 ms of pause: past it, a member sleeps until the next pass */

static int team_started = 1;
int team_size = 1;
int has_avx512 = -1; /* set with the team: the tiles for 8 outputs then take AVX-512 */
int has_vnni = -1;   /* and the integer tiles AVX512-VNNI */
static pthread_t team[MAX_THREADS];
static JobFn job_fn;
static void *job_arg;
static atomic_int job_generation, job_done, sleepers, done_sleepers;
atomic_int barrier_count, barrier_sense, barrier_sleepers;
static pthread_mutex_t team_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t team_wake = PTHREAD_COND_INITIALIZER;
pthread_mutex_t pass_lock = PTHREAD_MUTEX_INITIALIZER; /* one pass at a time uses the team */

/* PyTorch's OpenMP runtime, where native.py found it (sd_use_openmp): the team is then PyTorch's own threads, so no
 * second set of threads competes for the cores with PyTorch's, which spin for a while after each of its parallel
 * operations (a sampling step, the bulk kernel). */
typedef void (*GompParallel)(void (*)(void *), void *, unsigned, unsigned);
static GompParallel gomp_parallel;
static int (*omp_thread_num)(void), (*omp_num_threads)(void);

/* The team's members meet at team_barrier, cheaper than OpenMP's barrier for a pass's 8 meetings a layer. */
void sd_use_openmp(void *parallel, void *thread_num, void *num_threads) {
    gomp_parallel = (GompParallel)parallel;
    omp_thread_num = (int (*)(void))thread_num;
    omp_num_threads = (int (*)(void))num_threads;
}

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
static void sleep_on(atomic_int *word, int value) { syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0); }
static void wake_all(atomic_int *word) { syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0); }
#else
#include <sched.h>
static void sleep_on(atomic_int *word, int value) { (void)word, (void)value, sched_yield(); }
static void wake_all(atomic_int *word) { (void)word; }
#endif

/* Registered as a sleeper before sleeping, and the kernel sleeps only while the word still holds `value`: a waker
 * that changed the word (seq_cst) then reads the sleepers either finds this one registered, or this one finds the
 * word changed and does not sleep. */
void wait_while(atomic_int *word, int value, atomic_int *sleepers) {
    for (int spins = 0; atomic_load_explicit(word, memory_order_acquire) == value; spins++) {
        if (spins < WAIT_SPINS) {
            _mm_pause();
            continue;
        }
        atomic_fetch_add(sleepers, 1);
        if (atomic_load(word) == value) sleep_on(word, value);
        atomic_fetch_sub(sleepers, 1);
    }
}

void wake_sleepers(atomic_int *word, atomic_int *sleepers) {
    if (atomic_load(sleepers) > 0) wake_all(word);
}

static void *team_member(void *index_ptr) {
    int index = (int)(intptr_t)index_ptr, seen = atomic_load(&job_generation);
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&job_generation, memory_order_acquire) == seen) {
            if (++spins < SPINS_BEFORE_SLEEP) {
                _mm_pause();
                continue;
            }
            pthread_mutex_lock(&team_lock);
            atomic_fetch_add(&sleepers, 1);
            while (atomic_load(&job_generation) == seen) pthread_cond_wait(&team_wake, &team_lock);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&team_lock);
        }
        seen = atomic_load(&job_generation);
        job_fn(job_arg, index, team_size);
        atomic_fetch_add(&job_done, 1);
        wake_sleepers(&job_done, &done_sleepers);
    }
    return NULL;
}

/* Which tiles this CPU takes (EXACTSPEC_FUSED_AVX2 holds any CPU to the AVX2 tiles); read once. */
void read_features(void) {
#ifdef EXACTSPEC_EMULATED
    if (has_avx512 < 0) has_avx512 = has_vnni = !getenv("EXACTSPEC_FUSED_AVX2"); /* the emulation's */
#endif
    if (has_avx512 < 0) has_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && !getenv("EXACTSPEC_FUSED_AVX2");
    if (has_vnni < 0)
        has_vnni = has_avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512vnni");
    static pthread_once_t amx_read = PTHREAD_ONCE_INIT;
    pthread_once(&amx_read, read_amx);
}

int sd_set_threads(int threads) {
    read_features();
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    pthread_mutex_lock(&pass_lock);
    if (gomp_parallel) { /* PyTorch's threads are the team */
        team_size = threads;
        pthread_mutex_unlock(&pass_lock);
        return team_size;
    }
    while (team_started < threads) { /* members are only ever added */
        if (pthread_create(&team[team_started], NULL, team_member, (void *)(intptr_t)team_started) != 0) break;
        team_started++;
    }
    team_size = threads < team_started ? threads : team_started;
    pthread_mutex_unlock(&pass_lock);
    return team_size;
}

typedef struct {
    JobFn fn;
    void *arg;
} OpenmpJob;

static void openmp_member(void *job_ptr) {
    OpenmpJob *job = (OpenmpJob *)job_ptr;
    job->fn(job->arg, omp_thread_num(), omp_num_threads());
}

/* Members beyond team_size run the job too, and return at once (their index says they have no share). */
void run_team(JobFn fn, void *arg) {
    if (gomp_parallel) {
        OpenmpJob job = {fn, arg};
        gomp_parallel(openmp_member, &job, (unsigned)team_size, 0);
        return;
    }
    job_fn = fn;
    job_arg = arg;
    atomic_store(&job_done, 0);
    atomic_fetch_add(&job_generation, 1); /* seq_cst: ordered before the read of sleepers */
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&team_lock);
        pthread_cond_broadcast(&team_wake);
        pthread_mutex_unlock(&team_lock);
    }
    fn(arg, 0, team_size);
    for (int done; (done = atomic_load(&job_done)) < team_started - 1;) wait_while(&job_done, done, &done_sleepers);
}

/* A pass's scratch: kept and grown, never given back (a fresh allocation of over 128 KiB is a fresh mapping, whose
 * pages fault in again on every pass). Under pass_lock. */
float *scratch_of(size_t floats) {
    static float *scratch;
    static size_t held;
    if (floats > held) {
        float *grown = realloc(scratch, floats * sizeof(float));
        if (!grown) return NULL;
        scratch = grown;
        held = floats;
    }
    return scratch;
}

/* This CPU's integer peak for one thread: multiply-adds of bytes a second, from `rounds` rounds of 12 independent
 * sums in the widest instruction the integer tiles use here (vpdpbusd on 16 lanes with AVX512-VNNI; maddubs, madd
 * and add on 8 lanes with AVX2: 32 products a round of 3). What a pass's arithmetic can reach, beside the
 * bandwidth's floor (exactspec.bench.passes). */
__attribute__((target(VNNI_TARGET))) static double vnni_peak(long rounds) {
    __m512i sum[12], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    for (int i = 0; i < 12; i++) sum[i] = _mm512_setzero_si512();
    for (long k = 0; k < rounds; k++) {
        for (int i = 0; i < 12; i++) sum[i] = _mm512_dpbusd_epi32(sum[i], w, x);
#ifndef EXACTSPEC_EMULATED /* the emulation's registers are memory */
        __asm__ volatile("" : "+v"(w), "+v"(x));
#endif
    }
    int32_t total = 0;
    for (int i = 0; i < 12; i++) total += _mm512_reduce_add_epi32(sum[i]);
    __asm__ volatile("" ::"r"(total));
    return (double)rounds * 12 * 64;
}

__attribute__((target(AVX2_TARGET))) static double avx2_peak(long rounds) {
    __m256i sum[12], w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < 12; i++) sum[i] = _mm256_setzero_si256();
    for (long k = 0; k < rounds; k++) {
        for (int i = 0; i < 12; i++)
            sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
        __asm__ volatile("" : "+v"(w), "+v"(x));
    }
    int32_t lanes[8] = {0};
    for (int i = 1; i < 12; i++) sum[0] = _mm256_add_epi32(sum[0], sum[i]);
    _mm256_storeu_si256((__m256i *)lanes, sum[0]);
    __asm__ volatile("" ::"r"(lanes[0]));
    return (double)rounds * 12 * 32;
}

/* The multiply-adds the integer tiles' widest instruction does in `rounds` rounds on this thread (time it around
 * the call); which instruction: 1 vpdpbusd (AVX512-VNNI), 0 maddubs (AVX2). */
double sd_integer_peak(long rounds, int *vnni) {
    read_features();
    *vnni = has_vnni;
    return has_vnni ? vnni_peak(rounds) : avx2_peak(rounds);
}
