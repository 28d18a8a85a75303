/* specdec's fused CPU pass for llama-family models: every layer of a pass over n rows in one call.
 *
 * Built at install as specdec/backends/_fused (setup.py; optional: a failed build leaves the install working and
 * fused.py says why once), loaded with ctypes. It needs AVX2, FMA and F16C; native.py checks the CPU first.
 *
 * What it does that a chain of PyTorch ops does not:
 * - one thread team (PyTorch's OpenMP threads, else threads of its own that persist) runs the whole pass; the
 *   phases of a layer meet at spin barriers, so no thread is forked or joined per matrix, and Python is not
 *   re-entered per op;
 * - weights (float16, float32, bfloat16, or bytes with a scale and offset per 32 or 16 inputs: a GGUF's blocks as
 *   stored) are read once per pass whatever the row
 *   count: each block of 8 weight rows is converted in registers and fed by FMA to every row of the pass while it
 *   sits in L1;
 * - norms, RoPE, the cache writes, attention, SiLU and the residual adds are written around the products.
 *
 * The same tiles and attention serve the lean runtime (backends/lean/, through native.py) one operation at a time:
 * sd_product multiplies rows by a weight matrix held in float32, float16, bfloat16 or int8, and sd_attention runs
 * each row's attention over its own keys.
 *
 * Batch invariance by construction: every value a row computes (a product's output, a norm, an attention output)
 * is reduced by one thread, in one order that depends on nothing but that row: its accumulator sees the same FMAs
 * in the same order whether the tile holds 1 row or 6, and a row's attention runs over its own keys alone. So a
 * row's logits are the same bit for bit alone, in a pass of 17, in a tree or beside other sequences.
 */
#include <immintrin.h>
#include <assert.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t half;

#define MAX_HEAD_DIM 256 /* attend keeps one head's output in registers: 32 of 8 floats */

/* A weight matrix [out, in] as stored for the tiles (below: a float format repacked in blocks of 8 rows, or Q8 or
 * Q8H blocks), each with its own format, and its bias or NULL. in: a multiple of 8 (32 for Q8 and Q8H). A matrix
 * whose rows are stored in two formats (a GGUF's q and k in Q4_K, its v in Q6_K) is a part per format: `rest`, the
 * rows after these (out a multiple of 8 where there is a rest). */
typedef struct Matrix {
    int format, in, out;       /* out: this part's rows */
    const void *weight;
    const float *bias;         /* [out] or NULL */
    const struct Matrix *rest; /* the next part, or NULL */
} Matrix;

typedef struct {
    const float *input_norm, *post_norm;  /* [hidden]: before attention, before the feed-forward block */
    const float *q_norm, *k_norm;         /* [head_dim] or NULL: each head's q and k RMS-normed before RoPE */
    const float *attn_out_norm, *ffn_out_norm; /* [hidden] or NULL: attention's and the feed-forward block's
                                                * outputs RMS-normed before the residual add (gemma's) */
    int window;                           /* the most keys a query attends (a sliding-window layer), or 0: all */
    int local_rope;                       /* its RoPE from the cache's local tables (gemma 3's sliding layers) */
    Matrix qkv;                           /* [(heads + 2 kv_heads) head_dim, hidden], with q, k and v's biases */
    Matrix out;                           /* [hidden, heads head_dim] */
    Matrix gate_up;                       /* [2 inter, hidden]: gate rows, then up rows */
    Matrix down;                          /* [hidden, inter] */
} Layer;

enum { SILU, GELU_TANH }; /* the feed-forward block's activation of gate, times up */

typedef struct {
    int layers, hidden, heads, kv_heads, head_dim, inter, vocab;
    float eps;
    int activation;             /* SILU or GELU_TANH */
    float attn_scale;           /* what q . k is multiplied by: 1 / sqrt(head_dim), or the model's own */
    float attn_softcap;         /* scores capped softly, cap tanh(s / cap), or 0: not */
    Layer *layer;
    const float *final_norm; /* [hidden] */
    Matrix lm_head;          /* [vocab, hidden] */
} Model;

typedef struct {
    float **keys, **values;  /* per layer: the cache's base */
    int64_t head_stride;     /* floats from one kv head to the next (capacity * head_dim) */
    const float *cos, *sin;  /* [capacity, head_dim] */
    const float *local_cos, *local_sin; /* the local layers' tables (Layer.local_rope), or NULL */
} Cache;

typedef struct {
    int n;
    const int32_t *rope;     /* [n] each row's rotary position */
    const int64_t *base;     /* [n] floats from a layer cache's base to the row's sequence */
    const int32_t *column;   /* [n] the cache column its key and value are written to */
    const int32_t *n_keys;   /* [n] how many keys it attends */
    const int32_t *key_cols; /* [n, key_stride] the columns it attends, in order; NULL: columns 0..n_keys-1 */
    int key_stride;
} Rows;

/* ---------------------------------------------------------------- the thread team */

#define MAX_THREADS 64
#define SPINS_BEFORE_SLEEP 4000 /* about 0.2 ms of pause: past it, a member sleeps until the next pass */

typedef void (*JobFn)(void *arg, int thread, int threads);

static int team_size = 1, team_started = 1;
static int has_avx512 = -1; /* set with the team: the tiles for 8 outputs then take AVX-512 */
static int has_vnni = -1;   /* and the integer tiles AVX512-VNNI */
static pthread_t team[MAX_THREADS];
static JobFn job_fn;
static void *job_arg;
static atomic_int job_generation, job_done, sleepers;
static atomic_int barrier_count, barrier_sense;
static pthread_mutex_t team_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t team_wake = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t pass_lock = PTHREAD_MUTEX_INITIALIZER; /* one pass at a time uses the team */

/* PyTorch's OpenMP runtime, where native.py found it (sd_use_openmp): the team is then PyTorch's own threads, so no
 * second set of threads competes for the cores with PyTorch's, which spin for a while after each of its parallel
 * operations (a sampling step, the bulk kernel). */
typedef void (*GompParallel)(void (*)(void *), void *, unsigned, unsigned);
static GompParallel gomp_parallel;
static int (*omp_thread_num)(void), (*omp_num_threads)(void);

/* The team's members meet at team_barrier's spin barrier, cheaper than OpenMP's for a pass's 8 meetings a layer. */
void sd_use_openmp(void *parallel, void *thread_num, void *num_threads) {
    gomp_parallel = (GompParallel)parallel;
    omp_thread_num = (int (*)(void))thread_num;
    omp_num_threads = (int (*)(void))num_threads;
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
        atomic_fetch_add_explicit(&job_done, 1, memory_order_release);
    }
    return NULL;
}

/* Which tiles this CPU takes (SPECDEC_FUSED_AVX2 holds any CPU to the AVX2 tiles); read once. */
static void read_features(void) {
    if (has_avx512 < 0) has_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && !getenv("SPECDEC_FUSED_AVX2");
    if (has_vnni < 0)
        has_vnni = has_avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512vnni");
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
static void run_team(JobFn fn, void *arg) {
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
    while (atomic_load_explicit(&job_done, memory_order_acquire) < team_started - 1) _mm_pause();
}

/* All team_size members meet here; members past the team do not call it. */
static void team_barrier(int threads, int *sense) {
    if (threads == 1) return;
    *sense ^= 1;
    if (atomic_fetch_add(&barrier_count, 1) == threads - 1) {
        atomic_store(&barrier_count, 0);
        atomic_store_explicit(&barrier_sense, *sense, memory_order_release);
    } else {
        while (atomic_load_explicit(&barrier_sense, memory_order_acquire) != *sense) _mm_pause();
    }
}

/* ---------------------------------------------------------------- products with float16 weights */

__attribute__((target("avx2,fma,f16c"))) static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A pair's two sums: the low 8 lanes (one output), then the high 8 (the next), each as sum8 adds them. */
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) static inline void sum8_pair(__m512 v, float *out) {
    out[0] = sum8(_mm512_castps512_ps256(v));
    out[1] = sum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* Float weights (float16, float32 or bfloat16) are repacked (native.py, `repacked`) in blocks of 8 output rows:
 * block b holds rows 8b..8b+7, one 8-wide chunk of `in` after another, each chunk the 8 rows' 8 values (64 values).
 * A block is one sequential stream, however many of its rows a tile reads.
 *
 * out[r][o] = dot(weight row o, x row r) for R rows and O weight rows, `w` pointing at the first one's values in
 * its block's first chunk. Each (r, o) has one accumulator fed in the order of k: the same arithmetic whatever R
 * and O are, and whatever the format (each converts its 8 values to float exactly before the FMA). */
#define CHUNK 64
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096 /* how far ahead of the chunk being read a tile asks the memory for the weights */
#endif
#define GROUP 4    /* rows a tile computes at most: AVX2 has 16 registers */
#define GROUP512 6 /* and AVX-512 32: 6 rows x 4 pairs of outputs accumulate in 24 */

/* Eight weights as floats (AVX2), and two rows' eight each as one register (AVX-512), per format. */
#define LOAD8_F16(w) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w)))
#define LOAD8_F32(w) _mm256_loadu_ps(w)
#define LOAD8_BF16(w) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w))), 16))
#define LOAD16_F16(w) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w)))
#define LOAD16_F32(w) _mm512_loadu_ps(w)
#define LOAD16_BF16(w) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w))), 16))

/* The lines of the chunk PREFETCH_BYTES ahead. */
#define PREFETCH_CHUNK(w, T)                                                                                       \
    for (int line = 0; line < CHUNK * (int)sizeof(T); line += 64)                                                  \
        _mm_prefetch((const char *)(w) + PREFETCH_BYTES + line, _MM_HINT_T0);

#define TILE(NAME, T, LOAD8, R, O)                                                                                 \
    __attribute__((target("avx2,fma,f16c"))) static void NAME##_##R##x##O(const void *weights, const float *x,     \
                                                                         int64_t ldx, int in, float out[GROUP512][8]) { \
        const T *w = (const T *)weights;                                                                           \
        __m256 acc[R][O];                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int o = 0; o < O; o++) acc[r][o] = _mm256_setzero_ps();                                           \
        for (int k = 0; k < in; k += 8, w += CHUNK) {                                                              \
            PREFETCH_CHUNK(w, T)                                                                                   \
            __m256 wv[O];                                                                                          \
            for (int o = 0; o < O; o++) wv[o] = LOAD8(w + 8 * o);                                                  \
            for (int r = 0; r < R; r++) {                                                                          \
                __m256 xv = _mm256_loadu_ps(x + r * ldx + k);                                                      \
                for (int o = 0; o < O; o++) acc[r][o] = _mm256_fmadd_ps(wv[o], xv, acc[r][o]);                     \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int o = 0; o < O; o++) out[r][o] = sum8(acc[r][o]);                                               \
    }
#define TILES(NAME, T, LOAD8) TILE(NAME, T, LOAD8, 1, 8) TILE(NAME, T, LOAD8, 2, 4) TILE(NAME, T, LOAD8, 3, 2) \
    TILE(NAME, T, LOAD8, 4, 2)
TILES(f16, half, LOAD8_F16)
TILES(f32, float, LOAD8_F32)
TILES(bf16, uint16_t, LOAD8_BF16)

/* The same tiles for 8 outputs on AVX-512: a zmm holds a pair of rows' chunk (16 values: row o's 8, then o+1's)
 * and the 8 inputs twice, so each 16-lane FMA is the two 8-lane FMAs the tiles above do for o and o+1, lane for
 * lane: the same bits, half the instructions. */
#define TILE512(NAME, T, LOAD16, R)                                                                                \
    __attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) static void NAME##z_##R(                  \
        const void *weights, const float *x, int64_t ldx, int in, float out[GROUP512][8]) {                        \
        const T *w = (const T *)weights;                                                                           \
        __m512 acc[R][4];                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int o = 0; o < 4; o++) acc[r][o] = _mm512_setzero_ps();                                           \
        for (int k = 0; k < in; k += 8, w += CHUNK) {                                                              \
            PREFETCH_CHUNK(w, T)                                                                                   \
            __m512 wv[4];                                                                                          \
            for (int o = 0; o < 4; o++) wv[o] = LOAD16(w + 16 * o);                                                \
            for (int r = 0; r < R; r++) {                                                                          \
                __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * ldx + k)); /* a load, no shuffle */      \
                for (int o = 0; o < 4; o++) acc[r][o] = _mm512_fmadd_ps(wv[o], xv, acc[r][o]);                     \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int o = 0; o < 4; o++) sum8_pair(acc[r][o], out[r] + 2 * o);                                      \
    }
#define TILES512(NAME, T, LOAD16) TILE512(NAME, T, LOAD16, 1) TILE512(NAME, T, LOAD16, 2) \
    TILE512(NAME, T, LOAD16, 3) TILE512(NAME, T, LOAD16, 4) TILE512(NAME, T, LOAD16, 5) TILE512(NAME, T, LOAD16, 6)
TILES512(f16, half, LOAD16_F16)
TILES512(f32, float, LOAD16_F32)
TILES512(bf16, uint16_t, LOAD16_BF16)

/* Q8: 8-bit weights with a float scale and offset per 32 inputs of a row (w = d q + m: exact for a GGUF's Q4_0,
 * Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K blocks, gguf_file.py `q8_rows`), and Q8H the same with a scale and offset
 * per 16 inputs (Q6_K's), repacked like the float formats in blocks of 8 output rows: the rows' 32 inputs after 32
 * inputs, each a block_q8x8 (block_q8x16). A weight is dequantised by one FMA, exactly as in every tile, then
 * multiplied as a float weight is.
 *
 * block_q8x8: 8 weight rows x 32 inputs as 8 quads, as the integer tiles read them (below): q[g][4r + i] is row r's
 * input 4g + i; row r's weights are d[r] q + m[r]. A float tile reads chunk s (inputs 8s..8s+7) of a row from
 * quads 2s and 2s + 1. block_q8x16: inputs 0-15 take d[0] and m[0], 16-31 d[1] and m[1]. */
typedef struct {
    uint8_t q[8][32];
    float d[8], m[8];
} block_q8x8;
static_assert(sizeof(block_q8x8) == 320, "block_q8x8: 256 bytes of weights, then 8 scales and 8 offsets");

typedef struct {
    uint8_t q[8][32];
    float d[2][8], m[2][8];
} block_q8x16;
static_assert(sizeof(block_q8x16) == 384, "block_q8x16: 256 bytes of weights, then 2 x 8 scales and offsets");

/* Ask the memory for the block PREFETCH_BYTES ahead: its lines. */
#define PREFETCH_BLOCK(b)                                                                                          \
    for (int line = 0; line < (int)sizeof(*(b)); line += 64)                                                      \
        _mm_prefetch((const char *)(b) + PREFETCH_BYTES + line, _MM_HINT_T0);

/* Chunk s's 8 bytes of row j, then of row j + 1, from quads 2s and 2s + 1. */
#define CHUNK_ROWS2(b, s, j)                                                                                       \
    _mm_unpacklo_epi32(_mm_loadl_epi64((const __m128i *)&(b)->q[2 * (s)][4 * (j)]),                              \
                       _mm_loadl_epi64((const __m128i *)&(b)->q[2 * (s) + 1][4 * (j)]))

/* Chunk s's scales (offsets) of a block with SETS sets of 8: the first of row j's. */
#define CHUNK_D(b, s, SETS, j) ((const float *)(b)->d + (s) / (4 / (SETS)) * 8 + (j))
#define CHUNK_M(b, s, SETS, j) ((const float *)(b)->m + (s) / (4 / (SETS)) * 8 + (j))

/* out[r][o] for R rows and O outputs from row j of the block at w. */
#define TILE_Q8(NAME, BLOCK, SETS, R, O)                                                                           \
    __attribute__((target("avx2,fma,f16c"))) static void NAME##_##R##x##O(const void *w, int j, const float *x,   \
                                                                         int64_t ldx, int in, float out[GROUP512][8]) { \
        const BLOCK *b = (const BLOCK *)w;                                                                         \
        __m256 acc[R][O];                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int o = 0; o < O; o++) acc[r][o] = _mm256_setzero_ps();                                           \
        for (int k = 0; k < in; k += 32, b++) {                                                                    \
            PREFETCH_BLOCK(b)                                                                                      \
            for (int s = 0; s < 4; s++) {                                                                          \
                const float *d = CHUNK_D(b, s, SETS, j), *m = CHUNK_M(b, s, SETS, j);                              \
                __m256 wv[O];                                                                                      \
                for (int o = 0; o < O; o++) {                                                                      \
                    __m128i q = CHUNK_ROWS2(b, s, j + o); /* its low 8 bytes: row j + o's */                       \
                    wv[o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_broadcast_ss(d + o), \
                                            _mm256_broadcast_ss(m + o));                                           \
                }                                                                                                  \
                for (int r = 0; r < R; r++) {                                                                      \
                    __m256 xv = _mm256_loadu_ps(x + r * ldx + k + 8 * s);                                          \
                    for (int o = 0; o < O; o++) acc[r][o] = _mm256_fmadd_ps(wv[o], xv, acc[r][o]);                 \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int o = 0; o < O; o++) out[r][o] = sum8(acc[r][o]);                                               \
    }
#define TILES_Q8(NAME, BLOCK, SETS) TILE_Q8(NAME, BLOCK, SETS, 1, 8) TILE_Q8(NAME, BLOCK, SETS, 2, 4)            \
    TILE_Q8(NAME, BLOCK, SETS, 3, 2) TILE_Q8(NAME, BLOCK, SETS, 4, 2)
TILES_Q8(q8, block_q8x8, 1)
TILES_Q8(q8h, block_q8x16, 2)

/* On AVX-512, two pairs of rows (4 outputs) from row j: each zmm the pair's 8 weights of one row, then the other's,
 * dequantised by the pair's d and m in the matching halves; the same bits as the tiles above. */
#define TILE_Q8_512(NAME, BLOCK, SETS, R)                                                                          \
    __attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) static void NAME##z_##R(                            \
        const void *w, int j, const float *x, int64_t ldx, int in, float out[GROUP512][8]) {                       \
        const BLOCK *b = (const BLOCK *)w;                                                                         \
        __m512 acc[R][2];                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int p = 0; p < 2; p++) acc[r][p] = _mm512_setzero_ps();                                           \
        for (int k = 0; k < in; k += 32, b++) {                                                                    \
            __m512 dz[2], mz[2];                                                                                   \
            PREFETCH_BLOCK(b)                                                                                      \
            for (int s = 0; s < 4; s++) {                                                                          \
                if (s % (4 / (SETS)) == 0) /* a new set of scales and offsets */                                   \
                    for (int p = 0; p < 2; p++) {                                                                  \
                        const float *d = CHUNK_D(b, s, SETS, j), *m = CHUNK_M(b, s, SETS, j);                      \
                        dz[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_broadcast_ss(d + 2 * p)),         \
                                                   _mm256_broadcast_ss(d + 2 * p + 1), 1);                         \
                        mz[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_broadcast_ss(m + 2 * p)),         \
                                                   _mm256_broadcast_ss(m + 2 * p + 1), 1);                         \
                    }                                                                                              \
                __m512 wv[2];                                                                                      \
                for (int p = 0; p < 2; p++) {                                                                      \
                    __m128i q = CHUNK_ROWS2(b, s, j + 2 * p); /* two rows' 8 bytes */                                \
                    wv[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), dz[p], mz[p]);           \
                }                                                                                                  \
                for (int r = 0; r < R; r++) {                                                                      \
                    __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * ldx + k + 8 * s));                  \
                    for (int p = 0; p < 2; p++) acc[r][p] = _mm512_fmadd_ps(wv[p], xv, acc[r][p]);                 \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int p = 0; p < 2; p++) sum8_pair(acc[r][p], out[r] + 2 * p);                                      \
    }
#define TILES_Q8_512(NAME, BLOCK, SETS) TILE_Q8_512(NAME, BLOCK, SETS, 1) TILE_Q8_512(NAME, BLOCK, SETS, 2)      \
    TILE_Q8_512(NAME, BLOCK, SETS, 3) TILE_Q8_512(NAME, BLOCK, SETS, 4) TILE_Q8_512(NAME, BLOCK, SETS, 5)        \
    TILE_Q8_512(NAME, BLOCK, SETS, 6)
TILES_Q8_512(q8, block_q8x8, 1)
TILES_Q8_512(q8h, block_q8x16, 2)

/* ---------------------------------------------------------------- integer products over the same blocks
 *
 * Q8I and Q8HI are Q8 and Q8H's bytes multiplied in integers: each row's inputs are quantised per block of 32 to
 * bytes, x ~ e xq with e = max|x| / 127 and xq = x / e rounded to the nearest (ties to even), so that a block's
 * dot product with a weight row's bytes q is an integer, exact in int32 whatever adds it up:
 *     sum_i w_i x_i ~ e (d sum_i q_i xq_i + m sum_i xq_i)
 * per set of a scale d and offset m (32 inputs for Q8I, 16 for Q8HI). Quantising a row needs that row alone, so a
 * row's bits stay the same in any pass; and the integers are exact, so AVX512-VNNI's vpdpbusd (u8 x s8, four
 * products a lane) and AVX2's maddubs (over q - 128 and |q - 128|, which cannot saturate) give the same sums, and
 * one float epilogue, the same instructions lane for lane on both, turns each into the row's accumulator:
 *     acc = fma(float(isum), d e, acc); acc = fma(m, e float(sum xq), acc)
 * llama.cpp quantises activations the same way (per 32 for its Q8_0 and Q8_1); here the error is bounded by the
 * tests against a float32 reference and against llama.cpp on the same file. */

/* The quantised rows, block by block: block k of every row, then block k + 1, so that a tile's rows' bytes and
 * scalars for a block lie together, each row's at a fixed distance from the first's (one pointer for all rows). */
typedef struct {
    const int8_t *q;      /* [in / 32, n, 32] */
    const float *scale;   /* [in / 32, n]: e */
    const float *offset;  /* [in / 32, n, sets]: e float(sum xq) per set */
    const int32_t *start; /* [in / 32, n, sets]: OFFSET sum xq per set, where a tile's integer sums start */
    int in, sets, n;
} Quantised;

/* Row x [in] as bytes per block of 32 (above): q, and per block its scale and per set its sum and offset, block
 * after block `n` rows apart (Quantised). */
__attribute__((target("avx2,fma,f16c"))) static void quantise_row(const float *x, int in, int sets, int n, int start_of,
                                                                  int8_t *q, float *scale, float *offset,
                                                                  int32_t *start) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int k = 0, block = 0; k < in; k += 32, block++) {
        __m256 v[4], most = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + k + 8 * i);
            most = _mm256_max_ps(most, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        float e = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256 by = _mm256_set1_ps(inverse);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], by)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], by));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], by)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], by));
        /* packs interleave the 128-bit lanes: 32-bit groups come out as 0 2 4 6 1 3 5 7 of the inputs' 8 */
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + (int64_t)block * n * 32), packed);
        scale[(int64_t)block * n] = e;
        /* the bytes' sums in 8 lanes of 4 (inputs 4i..4i+3 in lane i), then per set its lanes' */
        __m256i fours = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), packed), _mm256_set1_epi16(1));
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, fours);
        for (int s = 0; s < sets; s++) {
            int32_t total = 0;
            for (int i = s * 8 / sets; i < (s + 1) * 8 / sets; i++) total += lanes[i];
            start[((int64_t)block * n) * sets + s] = start_of * total;
            offset[((int64_t)block * n) * sets + s] = e * (float)total;
        }
    }
}

/* acc + set t of block `block` of quantised row `row`, for 8 outputs: isum, their integer sums over the set
 * (started from the row's OFFSET sum(xq): where the tile summed q - centre, or where the offset is -centre times the
 * scale), times the set's scales d and the row's block scale e. */
static inline int64_t block_of(const Quantised *x, int row, int block) { return (int64_t)block * x->n + row; }

__attribute__((target("avx2,fma,f16c"))) static inline __m256 add_scaled(__m256 acc, __m256i isum, __m256 d,
                                                                        const Quantised *x, int row, int block) {
    __m256 de = _mm256_mul_ps(d, _mm256_set1_ps(x->scale[block_of(x, row, block)]));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), de, acc);
}

/* add_scaled, then the set's offsets m (8) times the row's e sum(xq) over the set. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 add_set(__m256 acc, __m256i isum, __m256 d, __m256 m,
                                                                     const Quantised *x, int row, int block,
                                                                     int sets, int t) {
    acc = add_scaled(acc, isum, d, x, row, block);
    return _mm256_fmadd_ps(m, _mm256_set1_ps(x->offset[block_of(x, row, block) * sets + t]), acc);
}

/* 8 bytes as 8 floats: unsigned (a K-quant's 6-bit scales and mins), signed (Q6_K's scales). */
#define BYTES8_U(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define BYTES8_S(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))

/* A tile's two axes: BITS, how a block holds its weights (Q8: bytes; Q4, Q5, Q6: that many bits: QUAD_*, DOT2_*,
 * OFFSET_*), and SCALE, where their scales are (F32: floats in the block, Q8's; F16: float16s in the block, Q4_0's
 * to Q5_1's; KM: a K-quant's integer scales and mins under a super-block's floats, Q4_K's and Q5_K's; K6: Q6_K's
 * signed integer scales, whose offsets are -32 times them).
 *
 * Set t's scales d (SCALES_*) and offsets m (OFFSETS_*) of the 8 rows of block b (s: its super-block, k its place
 * there), as floats: stored, float16, or a super-block's float d times the block's integer scale, each product
 * exact (an 11-bit float16 significand times an integer of at most 8 bits), so they are the floats q8_rows gives.
 * SET_*: acc plus the set, with its offsets (add_set), or with K6's -32 d taken in the integer sums (add_scaled). */
#define SCALES_F32(b, s, k, t) _mm256_loadu_ps((const float *)(b)->d + 8 * (t))
#define OFFSETS_F32(b, s, k, t) _mm256_loadu_ps((const float *)(b)->m + 8 * (t))
#define SCALES_F16(b, s, k, t) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b)->d))
#define OFFSETS_F16(b, s, k, t) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b)->m))
#define SCALES_KM(b, s, k, t) _mm256_mul_ps(BYTES8_U((s)->sc[k]), _mm256_loadu_ps((s)->d))
#define OFFSETS_KM(b, s, k, t) _mm256_mul_ps(BYTES8_U((s)->mn[k]), _mm256_loadu_ps((s)->dmin))
#define SCALES_K6(b, s, k, t) _mm256_mul_ps(BYTES8_S((s)->sc[k][t]), _mm256_loadu_ps((s)->d))
#define OFFSETS_K6(b, s, k, t) _mm256_setzero_ps()
#define SET_F32(acc, isum, d, m, x, row, block, sets, t) add_set(acc, isum, d, m, x, row, block, sets, t)
#define SET_F16 SET_F32
#define SET_KM SET_F32
#define SET_K6(acc, isum, d, m, x, row, block, sets, t) add_scaled(acc, isum, d, x, row, block)

/* Q4I, Q4KI and Q6I, the integer-only formats (a GGUF's 4-bit and 6-bit blocks), hold a block's 32 inputs as 8
 * quads: quad g (inputs 4g..4g+3) of the 8 rows is 32 bytes, row j's 4 at 4j. One register then holds a quad with a
 * row per 32-bit lane; the row's 4 input bytes, broadcast to every lane, multiply it, and each lane sums one row's
 * products, so a set's sum needs no reduction across lanes.
 *
 * Q4I: 4-bit weights (Q4_0 and Q4_1: q < 16) with a float16 scale and offset per 32 inputs, as the file holds them
 * (Q4_0's offset -8 d is a float16 too): block_q4x8 holds quad 2p in the low nibbles of q[p] and quad 2p + 1 in the
 * high, then the scales and offsets (0.625 bytes a weight, the file's own size). */
typedef struct {
    uint8_t q[4][32];
    uint16_t d[8], m[8];
} block_q4x8;
static_assert(sizeof(block_q4x8) == 160, "block_q4x8: 128 bytes of nibbles, then 8 float16 scales and offsets");

/* The K formats keep a GGUF K-quant's own scales: per 32 (16) inputs each row's integer scale, and per 256 inputs
 * each row's float d, so a weight is (d sc) q + offset as q8_rows has it. A matrix's 8 rows are in/256 super-blocks
 * of 8 rows x 256 inputs, each its 8 blocks' bits, then per block the 8 rows' integer scales, then the rows' floats:
 * a block's loads of 32 bytes then never cross a cache line (super_q4k8: 19 lines; super_q6x8: 26.5, so 32-byte
 * aligned).
 *
 * Q4KI: Q4_K (q < 16, w = (d sc) q - (dmin mn)): each block_q4k8 holds its nibbles as block_q4x8 does; super_q4k8
 * then the 6-bit scales and mins and d and -dmin (0.594 bytes a weight, against the file's 0.5625). */
typedef struct {
    uint8_t q[4][32];
} block_q4k8;
typedef struct {
    block_q4k8 blocks[8];
    uint8_t sc[8][8], mn[8][8]; /* [block][row] */
    float d[8], dmin[8];        /* dmin negated: (-dmin) mn is -(dmin mn), exactly */
} super_q4k8;
static_assert(sizeof(super_q4k8) == 1216, "super_q4k8: 8 x 128 bytes of nibbles, 2 x 64 of scales, 2 x 8 floats");

/* Q6I: Q6_K (q < 64, w = (d sc) (q - 32), sc signed, per 16 inputs): each block_q6x8 holds the low nibbles as
 * block_q4x8 does and the top 2 bits of quad 4h + k in bits 2k and 2k + 1 of hi[h] (h is the set); super_q6x8 then
 * per block and set the 8 rows' scales, and their d. Each offset is -32 times its scale, exactly, and is taken in the
 * integer sums (0.83 bytes a weight, against the file's 0.82). */
typedef struct {
    uint8_t q[4][32], hi[2][32];
} block_q6x8;
typedef struct {
    block_q6x8 blocks[8];
    int8_t sc[8][2][8]; /* [block][set][row] */
    float d[8];
} super_q6x8;
static_assert(sizeof(super_q6x8) == 1696, "super_q6x8: 8 x 192 bytes of bits, 128 of scales, 8 floats");

/* Q5I: 5-bit weights (Q5_0 and Q5_1: q < 32) with a float16 scale and offset per 32 inputs (Q5_0's offset -16 d is a
 * float16 too): block_q5x8 holds the low nibbles as block_q4x8 does, then 32 bytes whose bit g is quad g's fifth
 * bit (byte 4j + c: row j's input 4g + c), then the scales and offsets (0.75 bytes a weight, Q5_1's own size; Q5_0's
 * 0.69). Q5KI: Q5_K as Q4KI holds Q4_K, each block_q5k8 with its fifth bits so (0.72 bytes a weight, against the
 * file's 0.69). */
typedef struct {
    uint8_t q[4][32], hi[32];
    uint16_t d[8], m[8];
} block_q5x8;
static_assert(sizeof(block_q5x8) == 192, "block_q5x8: 128 bytes of nibbles, 32 of fifth bits, 16 float16s");
typedef struct {
    uint8_t q[4][32], hi[32];
} block_q5k8;
typedef struct {
    block_q5k8 blocks[8];
    uint8_t sc[8][8], mn[8][8];
    float d[8], dmin[8];
} super_q5k8;
static_assert(sizeof(super_q5k8) == 1472, "super_q5k8: 8 x 160 bytes of bits, 2 x 64 of scales, 2 x 8 floats");

/* A tile walks the 8 rows at w block by block: b, the block, in s, its super-block (SUPER_*(BLOCK): the block's
 * super-block type, or char where the scales are in the blocks, never read), at place IN_SUPER(i) there; NEXT_*,
 * from block i to block i + 1 (one block on, or the next super-block's first: no division a block). */
#define IN_SUPER(i) ((i) % 8)
#define SUPER_OF_block_q4k8 super_q4k8
#define SUPER_OF_block_q5k8 super_q5k8
#define SUPER_OF_block_q6x8 super_q6x8
#define SUPER_FLAT(BLOCK) char
#define SUPER_SUPER(BLOCK) SUPER_OF_##BLOCK
#define FIRST_FLAT(BLOCK, w) ((const BLOCK *)(w))
#define FIRST_SUPER(BLOCK, w) (((const SUPER_OF_##BLOCK *)(w))->blocks)
#define NEXT_FLAT(b, s, i) (b)++;
#define NEXT_SUPER(b, s, i)                                                                                        \
    if (IN_SUPER((i) + 1))                                                                                         \
        (b)++;                                                                                                     \
    else                                                                                                           \
        (b) = (++(s))->blocks;
#define SUPER_F32 SUPER_FLAT
#define SUPER_F16 SUPER_FLAT
#define SUPER_KM SUPER_SUPER
#define SUPER_K6 SUPER_SUPER
#define FIRST_F32 FIRST_FLAT
#define FIRST_F16 FIRST_FLAT
#define FIRST_KM FIRST_SUPER
#define FIRST_K6 FIRST_SUPER
#define NEXT_F32 NEXT_FLAT
#define NEXT_F16 NEXT_FLAT
#define NEXT_KM NEXT_SUPER
#define NEXT_K6 NEXT_SUPER

/* Quad g of a block_q8x8 or block_q8x16 (block_q4x8, block_q6x8): the 8 rows' 4 weights, a byte each. */
#define QUAD_Q8(b, g) _mm256_loadu_si256((const __m256i *)(b)->q[g])
#define QUAD_Q4(b, g)                                                                                              \
    _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b)->q[(g) / 2]), 4 * ((g) % 2)),     \
                     _mm256_set1_epi8(0x0F))
/* Quad g's fifth bits (bit g of each byte of hi) moved to bit 4, the rest cleared. */
#define FIFTH_BITS(hi, g)                                                                                          \
    _mm256_and_si256((g) < 4 ? _mm256_slli_epi16(hi, (4 - (g)) & 7) : _mm256_srli_epi16(hi, ((g) - 4) & 7),      \
                     _mm256_set1_epi8(0x10))
#define QUAD_Q5(b, g) _mm256_or_si256(QUAD_Q4(b, g), FIFTH_BITS(_mm256_loadu_si256((const __m256i *)(b)->hi), g))
#define QUAD_Q6(b, g) _mm256_or_si256(QUAD_Q4(b, g), top_bits(_mm256_loadu_si256((const __m256i *)(b)->hi[(g) / 4]), (g) % 4))

/* Bits 2k and 2k + 1 of each byte of hi moved to bits 4 and 5, the rest cleared. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256i top_bits(__m256i hi, int k) {
    __m256i moved = k < 3 ? _mm256_slli_epi16(hi, 4 - 2 * k) : _mm256_srli_epi16(hi, 2);
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
}

/* A row's 4 input bytes at xq, in every 32-bit lane. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256i quad_inputs(const int8_t *xq) {
    int32_t four;
    memcpy(&four, xq, sizeof four);
    return _mm256_set1_epi32(four);
}

/* sum + the products of w's bytes (u8) and the 4 bytes at x (s8), broadcast to every lane by the instruction's own
 * memory operand (vpdpbusd m32bcst: compilers broadcast in a register first, an instruction more per quad and row). */
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c"))) static inline __m256i
dpbusd_broadcast(__m256i sum, __m256i w, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(sum) : "v"(w), "m"(*(const int32_t *)x));
    return sum;
}

/* out[r][0..7] for R quantised rows from r0 and the 8 outputs of the quad blocks from w: per set, each row's sums
 * of its quads' products (DOT: maddubs then madd on AVX2, vpdpbusd on AVX512-VNNI, u8 x s8 both), then add_set.
 * maddubs adds pairs of products in int16: 6-bit and 4-bit weights' pairs from two quads add up there too before
 * madd widens them (2 x 2 x 63 x 127 < 2^15); a byte q up to 255 could saturate a pair, so on AVX2 a Q8 byte is taken
 * as q - 128 (its magnitude times the input's sign-corrected byte: at most 2 x 128 x 127), each quad widened alone,
 * and its sums start from 128 sum(xq) (OFFSET). The sums are exact integers, so both give the same bits. */
/* Independent sums a row's set is split among (quads g and g + 1 in chain g / 2 % CHAINS), enough across the R rows
 * that a sum's latency does not stall the next (vpdpbusd: 4 or 5 cycles, 2 a cycle). */
#define CHAINS(R, SETS) ((R) <= 3 ? 4 / (SETS) : 2)
#define MADD_ONES(pairs) _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
#define DOT2_AVX2_Q4(sum, w0, w1, x)                                                                               \
    _mm256_add_epi32(sum, MADD_ONES(_mm256_add_epi16(_mm256_maddubs_epi16(w0, quad_inputs(x)),                    \
                                                     _mm256_maddubs_epi16(w1, quad_inputs((x) + 4)))))
#define DOT2_AVX2_Q6 DOT2_AVX2_Q4
#define DOT2_AVX2_Q5 DOT2_AVX2_Q4
#define CENTRED(w) _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80))
#define DOT_AVX2_Q8(sum, w, x)                                                                                     \
    _mm256_add_epi32(sum, MADD_ONES(_mm256_maddubs_epi16(_mm256_abs_epi8(CENTRED(w)),                            \
                                                         _mm256_sign_epi8(quad_inputs(x), CENTRED(w)))))
#define DOT2_AVX2_Q8(sum, w0, w1, x) DOT_AVX2_Q8(DOT_AVX2_Q8(sum, w0, x), w1, (x) + 4)
#define DOT2_VNNI_Q4(sum, w0, w1, x) dpbusd_broadcast(dpbusd_broadcast(sum, w0, x), w1, (x) + 4)
#define DOT2_VNNI_Q6 DOT2_VNNI_Q4
#define DOT2_VNNI_Q5 DOT2_VNNI_Q4
#define DOT2_VNNI_Q8 DOT2_VNNI_Q4
/* OFFSET: what a tile's integer sums start from, times sum(xq): 128 where AVX2 summed a Q8 byte as q - 128, -32 for
 * Q6's offset (-32 times its scale), 0 elsewhere; OFFSET_OF, a format's, for the quantiser (integer_offset). */
#define OFFSET_AVX2_Q8 128
#define OFFSET_AVX2_Q4 0
#define OFFSET_AVX2_Q6 (-32)
#define OFFSET_AVX2_Q5 0
#define OFFSET_VNNI_Q8 0
#define OFFSET_VNNI_Q4 0
#define OFFSET_VNNI_Q6 (-32)
#define OFFSET_VNNI_Q5 0
#define OFFSET_OF(ISA, format)                                                                                     \
    ((format) == Q6I ? OFFSET_##ISA##_Q6 : (format) == Q8I || (format) == Q8HI ? OFFSET_##ISA##_Q8 : OFFSET_##ISA##_Q4)
#define TILE_QUAD(NAME, TARGET, ISA, BLOCK, SETS, BITS, SCALE, R)                                                    \
    __attribute__((target(TARGET))) static void NAME##_##R(const void *w, const Quantised *x, int r0,              \
                                                           float out[GROUP512][8]) {                               \
        __m256 acc[R];                                                                                             \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                                  \
        const int8_t *xq = x->q + (int64_t)r0 * 32; /* this block's first row's bytes: row r's 32 r further */      \
        const BLOCK *b = FIRST_##SCALE(BLOCK, w);                                                                  \
        __attribute__((unused)) const SUPER_##SCALE(BLOCK) *s = (const SUPER_##SCALE(BLOCK) *)w;                   \
        for (int block = 0; block < x->in / 32; block++, xq += (int64_t)x->n * 32) {                               \
            PREFETCH_BLOCK(b)                                                                                      \
            _Pragma("GCC unroll 2") for (int t = 0; t < SETS; t++) {                                               \
                const __m256 d = SCALES_##SCALE(b, s, IN_SUPER(block), t);                                         \
                __attribute__((unused)) const __m256 m = OFFSETS_##SCALE(b, s, IN_SUPER(block), t); /* K6: none */\
                __m256i sum[R][CHAINS(R, SETS)];                                                                   \
                for (int r = 0; r < R; r++) {                                                                      \
                    for (int c = 0; c < CHAINS(R, SETS); c++) sum[r][c] = _mm256_setzero_si256();                  \
                    if (OFFSET_##ISA##_##BITS)                                                                     \
                        sum[r][0] = _mm256_set1_epi32(x->start[block_of(x, r0 + r, block) * SETS + t]);            \
                }                                                                                                  \
                _Pragma("GCC unroll 4") for (int g = t * 8 / SETS; g < (t + 1) * 8 / SETS; g += 2) {               \
                    __m256i quad = QUAD_##BITS(b, g), next = QUAD_##BITS(b, g + 1);                                \
                    for (int r = 0; r < R; r++) {                                                                  \
                        __m256i *chain = &sum[r][g / 2 % CHAINS(R, SETS)];                                         \
                        *chain = DOT2_##ISA##_##BITS(*chain, quad, next, xq + 32 * r + 4 * g);                     \
                    }                                                                                              \
                }                                                                                                  \
                for (int r = 0; r < R; r++) {                                                                      \
                    for (int c = 1; c < CHAINS(R, SETS); c++) sum[r][0] = _mm256_add_epi32(sum[r][0], sum[r][c]);  \
                    acc[r] = SET_##SCALE(acc[r], sum[r][0], d, m, x, r0 + r, block, SETS, t);                       \
                }                                                                                                  \
            }                                                                                                      \
            NEXT_##SCALE(b, s, block)                                                                              \
        }                                                                                                          \
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r], acc[r]);                                              \
    }
#define AVX2_TARGET "avx2,fma,f16c"
#define VNNI_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c"
#define TILES_QUAD(NAME, BLOCK, SETS, BITS, SCALE)                                                                 \
    TILE_QUAD(NAME, AVX2_TARGET, AVX2, BLOCK, SETS, BITS, SCALE, 1)                                                \
    TILE_QUAD(NAME, AVX2_TARGET, AVX2, BLOCK, SETS, BITS, SCALE, 2)                                                \
    TILE_QUAD(NAME, AVX2_TARGET, AVX2, BLOCK, SETS, BITS, SCALE, 3)                                                \
    TILE_QUAD(NAME, AVX2_TARGET, AVX2, BLOCK, SETS, BITS, SCALE, 4)                                                \
    TILE_QUAD(NAME##v, VNNI_TARGET, VNNI, BLOCK, SETS, BITS, SCALE, 1)                                             \
    TILE_QUAD(NAME##v, VNNI_TARGET, VNNI, BLOCK, SETS, BITS, SCALE, 2)                                             \
    TILE_QUAD(NAME##v, VNNI_TARGET, VNNI, BLOCK, SETS, BITS, SCALE, 3)                                             \
    TILE_QUAD(NAME##v, VNNI_TARGET, VNNI, BLOCK, SETS, BITS, SCALE, 4)                                             \
    TILE_QUAD(NAME##v, VNNI_TARGET, VNNI, BLOCK, SETS, BITS, SCALE, 5)                                             \
    TILE_QUAD(NAME##v, VNNI_TARGET, VNNI, BLOCK, SETS, BITS, SCALE, 6)
/* The integer formats' tiles, each format once: its tiles' name, block, sets of scales a block, bits and scales
 * (row tiles NAME_R and NAMEv_R; GEMM tiles NAMEg_R). */
#define INTEGER_TILES(TILES)                                                                                       \
    TILES(q8i, block_q8x8, 1, Q8, F32)                                                                             \
    TILES(q8hi, block_q8x16, 2, Q8, F32)                                                                           \
    TILES(q4i, block_q4x8, 1, Q4, F16)                                                                             \
    TILES(q4ki, block_q4k8, 1, Q4, KM)                                                                             \
    TILES(q5i, block_q5x8, 1, Q5, F16)                                                                             \
    TILES(q5ki, block_q5k8, 1, Q5, KM)                                                                             \
    TILES(q6i, block_q6x8, 2, Q6, K6)
INTEGER_TILES(TILES_QUAD)

/* The GEMM tile for many rows on AVX512-VNNI: GEMM_ROWS rows by 16 outputs, two blocks of 8 weight rows side by
 * side in each zmm (the block at w in the low half, the block `next` bytes further in the high), so one quad's
 * unpacking and one row's broadcast bytes feed 16 outputs, and a weight block, once in L1, feeds every row of the
 * group. Lane for lane it does the 8-output tiles' work: each lane's integer sums are exact whatever adds them, and
 * its epilogue (add_set's mul and FMAs) is the same float operations in the same order, so a row's bits are the
 * same in this tile, in an 8-output tile, alone or in a pass of any width. */
#define GEMM_PREFETCH 8192 /* bytes ahead a GEMM tile asks for each of its two streams (4096 left them short) */
#define GEMM_ROWS 12 /* rows a GEMM tile computes at most: 12 sums and 12 accumulators of 16 lanes in 24 of 32
                     * registers (GEMM_MOST: fewer for formats with two sets a block, whose tiles spill past 8) */
#define HALVES_I(lo, hi) _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
#define HALVES_F(lo, hi) _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1)
#define LOAD_PAIR(b, next, field) HALVES_I(_mm256_loadu_si256((const __m256i *)(b)->field),                        \
                                           _mm256_loadu_si256((const __m256i *)((const char *)((b)->field) + (next))))
#define QUAD16_Q8(b, next, g) LOAD_PAIR(b, next, q[g])
#define QUAD16_Q4(b, next, g)                                                                                      \
    _mm512_and_si512(_mm512_srli_epi16(LOAD_PAIR(b, next, q[(g) / 2]), 4 * ((g) % 2)), _mm512_set1_epi8(0x0F))
#define FIFTH_BITS16(hi, g)                                                                                        \
    _mm512_and_si512((g) < 4 ? _mm512_slli_epi16(hi, (4 - (g)) & 7) : _mm512_srli_epi16(hi, ((g) - 4) & 7),      \
                     _mm512_set1_epi8(0x10))
#define QUAD16_Q5(b, next, g) _mm512_or_si512(QUAD16_Q4(b, next, g), FIFTH_BITS16(LOAD_PAIR(b, next, hi), g))
#define QUAD16_Q6(b, next, g) _mm512_or_si512(QUAD16_Q4(b, next, g), top_bits16(LOAD_PAIR(b, next, hi[(g) / 4]), (g) % 4))
/* p, `next` bytes further: the same place in the next block of 8 weight rows. */
#define AT_NEXT(p, next) ((__typeof__(p))((const char *)(p) + (next)))
/* A set's scales (offsets) for 16 outputs: each block's SCALES_* (OFFSETS_*), side by side. */
#define SCALES16(SCALE, b, s, k, next, t)                                                                          \
    HALVES_F(SCALES_##SCALE(b, s, k, t), SCALES_##SCALE(AT_NEXT(b, next), AT_NEXT(s, next), k, t))
#define OFFSETS16(SCALE, b, s, k, next, t)                                                                         \
    HALVES_F(OFFSETS_##SCALE(b, s, k, t), OFFSETS_##SCALE(AT_NEXT(b, next), AT_NEXT(s, next), k, t))

/* top_bits for 16 outputs. */
__attribute__((target(VNNI_TARGET))) static inline __m512i top_bits16(__m512i hi, int k) {
    __m512i moved = k < 3 ? _mm512_slli_epi16(hi, 4 - 2 * k) : _mm512_srli_epi16(hi, 2);
    return _mm512_and_si512(moved, _mm512_set1_epi8(0x30));
}

/* sum + the products of w's bytes (u8) and the 4 bytes at x (s8) in every lane (dpbusd_broadcast's, 16 lanes). */
__attribute__((target(VNNI_TARGET))) static inline __m512i dpbusd16(__m512i sum, __m512i w, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(w), "m"(*(const int32_t *)x));
    return sum;
}

/* add_set (add_scaled) on 16 lanes: the same operations, lane for lane; e: the row's block scale, offset: its
 * e sum(xq) over the set. */
__attribute__((target(VNNI_TARGET))) static inline __m512 add_scaled16(__m512 acc, __m512i isum, __m512 d, float e) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(e)), acc);
}
#define SET16_F32(acc, isum, d, m, e, offset) _mm512_fmadd_ps(m, _mm512_set1_ps(offset), add_scaled16(acc, isum, d, e))
#define SET16_F16 SET16_F32
#define SET16_KM SET16_F32
#define SET16_K6(acc, isum, d, m, e, offset) add_scaled16(acc, isum, d, e)

/* Independent sums a row's set is split among: enough across the R rows to cover vpdpbusd's latency. */
#define CHAINS16(R) ((R) <= 2 ? 4 : (R) <= 5 ? 2 : 1)
#define TILE_GEMM(NAME, BLOCK, SETS, BITS, SCALE, R)                                                                \
    __attribute__((target(VNNI_TARGET))) static void NAME##g_##R(const void *w, int64_t next, const Quantised *x, \
                                                                int r0, float out[GEMM_ROWS][16]) {                \
        __m512 acc[R];                                                                                             \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                                  \
        const int8_t *xq = x->q + (int64_t)r0 * 32;                                                                \
        const BLOCK *b = FIRST_##SCALE(BLOCK, w);                                                                  \
        __attribute__((unused)) const SUPER_##SCALE(BLOCK) *s = (const SUPER_##SCALE(BLOCK) *)w;                   \
        for (int block = 0; block < x->in / 32; block++, xq += (int64_t)x->n * 32) {                               \
            const int64_t at = block_of(x, r0, block); /* the rows' scalars for this block: row r's at + r */       \
            const float *e = x->scale + at;                                                                        \
            __attribute__((unused)) const float *offset = x->offset + at * SETS; /* Q6's offsets are in start */ \
            const int32_t *start = x->start + at * SETS;                                                           \
            for (int line = 0; line < (int)sizeof(*b); line += 64) { /* both streams, GEMM_PREFETCH ahead */         \
                _mm_prefetch((const char *)b + GEMM_PREFETCH + line, _MM_HINT_T0);                                 \
                _mm_prefetch((const char *)b + next + GEMM_PREFETCH + line, _MM_HINT_T0);                          \
            }                                                                                                      \
            _Pragma("GCC unroll 2") for (int t = 0; t < SETS; t++) {                                               \
                const __m512 d = SCALES16(SCALE, b, s, IN_SUPER(block), next, t);                                   \
                __attribute__((unused)) const __m512 m = OFFSETS16(SCALE, b, s, IN_SUPER(block), next, t);          \
                __m512i sum[R][CHAINS16(R)];                                                                       \
                for (int r = 0; r < R; r++) {                                                                      \
                    for (int c = 0; c < CHAINS16(R); c++) sum[r][c] = _mm512_setzero_si512();                      \
                    if (OFFSET_VNNI_##BITS) sum[r][0] = _mm512_set1_epi32(start[r * SETS + t]);                    \
                }                                                                                                  \
                _Pragma("GCC unroll 8") for (int g = t * 8 / SETS; g < (t + 1) * 8 / SETS; g++) {                  \
                    __m512i quad = QUAD16_##BITS(b, next, g);                                                      \
                    for (int r = 0; r < R; r++)                                                                    \
                        sum[r][g % CHAINS16(R)] = dpbusd16(sum[r][g % CHAINS16(R)], quad, xq + 32 * r + 4 * g);    \
                }                                                                                                  \
                for (int r = 0; r < R; r++) {                                                                      \
                    for (int c = 1; c < CHAINS16(R); c++) sum[r][0] = _mm512_add_epi32(sum[r][0], sum[r][c]);      \
                    acc[r] = SET16_##SCALE(acc[r], sum[r][0], d, m, e[r], offset[r * SETS + t]);                    \
                }                                                                                                  \
            }                                                                                                      \
            NEXT_##SCALE(b, s, block)                                                                              \
        }                                                                                                          \
        for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);                                              \
    }
#define TILES_GEMM(NAME, BLOCK, SETS, BITS, SCALE)                                                                 \
    TILE_GEMM(NAME, BLOCK, SETS, BITS, SCALE, 1) TILE_GEMM(NAME, BLOCK, SETS, BITS, SCALE, 2)                      \
    TILE_GEMM(NAME, BLOCK, SETS, BITS, SCALE, 3) TILE_GEMM(NAME, BLOCK, SETS, BITS, SCALE, 4)                      \
    TILE_GEMM(NAME, BLOCK, SETS, BITS, SCALE, 5) TILE_GEMM(NAME, BLOCK, SETS, BITS, SCALE, 6)                      \
    TILE_GEMM(NAME, BLOCK, SETS, BITS, SCALE, 7) TILE_GEMM(NAME, BLOCK, SETS, BITS, SCALE, 8)                      \
    TILE_GEMM(NAME, BLOCK, SETS, BITS, SCALE, 9) TILE_GEMM(NAME, BLOCK, SETS, BITS, SCALE, 10)                     \
    TILE_GEMM(NAME, BLOCK, SETS, BITS, SCALE, 11) TILE_GEMM(NAME, BLOCK, SETS, BITS, SCALE, 12)
INTEGER_TILES(TILES_GEMM)
#define GEMM_TILES(NAME) {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8, NAME##_9, NAME##_10, NAME##_11, NAME##_12}

typedef void (*Q8Fn)(const void *, int, const float *, int64_t, int, float[GROUP512][8]);
/* how a weight matrix is stored (Matrix.format); Q8I and Q8HI: Q8 and Q8H's bytes, multiplied in integers; Q4I,
 * Q4KI (nibbles), Q5I, Q5KI (5 bits) and Q6I (6 bits): in integers only */
enum { F16, Q8, F32, BF16, Q8H, Q8I, Q8HI, Q4I, Q6I, Q4KI, Q5I, Q5KI };
static const int VALUE_BYTES[] = {[F16] = 2, [F32] = 4, [BF16] = 2}; /* the float formats' */
static const int BLOCK_BYTES[] = {[Q8] = sizeof(block_q8x8), [Q8H] = sizeof(block_q8x16), [Q8I] = sizeof(block_q8x8),
                                   [Q8HI] = sizeof(block_q8x16), [Q4I] = sizeof(block_q4x8),
                                   [Q6I] = sizeof(block_q6x8), [Q4KI] = sizeof(block_q4k8),
                                   [Q5I] = sizeof(block_q5x8), [Q5KI] = sizeof(block_q5k8)}; /* per 8 rows x 32 */
/* per 8 rows x 256 inputs, the K formats' (their blocks inside) */
static const int SUPER_BYTES[] = {[Q6I] = sizeof(super_q6x8), [Q4KI] = sizeof(super_q4k8),
                                   [Q5KI] = sizeof(super_q5k8)};
static const Q8Fn Q8_WIDE[][GROUP + 1] = {[Q8] = {0, q8_1x8, q8_2x4, q8_3x2, q8_4x2},
                                          [Q8H] = {0, q8h_1x8, q8h_2x4, q8h_3x2, q8h_4x2}};
static const Q8Fn Q8_512[][GROUP512 + 1] = {[Q8] = {0, q8z_1, q8z_2, q8z_3, q8z_4, q8z_5, q8z_6},
                                            [Q8H] = {0, q8hz_1, q8hz_2, q8hz_3, q8hz_4, q8hz_5, q8hz_6}};
#define INTEGER(format) ((format) >= Q8I && (format) <= Q5KI) /* the integer formats (the enum's last) */
#define SETS(format) ((format) == Q8HI || (format) == Q6I ? 2 : 1) /* an integer format's sets per 32 inputs */
#define BLOCKED(format) ((format) == Q8 || (format) == Q8H || INTEGER(format))
typedef void (*IntegerFn)(const void *, const Quantised *, int, float[GROUP512][8]);
static const IntegerFn INTEGER_WIDE[][GROUP + 1] = {[Q8I] = {0, q8i_1, q8i_2, q8i_3, q8i_4},
                                                    [Q8HI] = {0, q8hi_1, q8hi_2, q8hi_3, q8hi_4},
                                                    [Q4I] = {0, q4i_1, q4i_2, q4i_3, q4i_4},
                                                    [Q6I] = {0, q6i_1, q6i_2, q6i_3, q6i_4},
                                                    [Q4KI] = {0, q4ki_1, q4ki_2, q4ki_3, q4ki_4},
                                                    [Q5I] = {0, q5i_1, q5i_2, q5i_3, q5i_4},
                                                    [Q5KI] = {0, q5ki_1, q5ki_2, q5ki_3, q5ki_4}};
static const IntegerFn INTEGER_VNNI[][GROUP512 + 1] = {[Q8I] = {0, q8iv_1, q8iv_2, q8iv_3, q8iv_4, q8iv_5, q8iv_6},
                                                       [Q8HI] = {0, q8hiv_1, q8hiv_2, q8hiv_3, q8hiv_4, q8hiv_5, q8hiv_6},
                                                       [Q4I] = {0, q4iv_1, q4iv_2, q4iv_3, q4iv_4, q4iv_5, q4iv_6},
                                                       [Q6I] = {0, q6iv_1, q6iv_2, q6iv_3, q6iv_4, q6iv_5, q6iv_6},
                                                       [Q4KI] = {0, q4kiv_1, q4kiv_2, q4kiv_3, q4kiv_4, q4kiv_5, q4kiv_6},
                                                       [Q5I] = {0, q5iv_1, q5iv_2, q5iv_3, q5iv_4, q5iv_5, q5iv_6},
                                                       [Q5KI] = {0, q5kiv_1, q5kiv_2, q5kiv_3, q5kiv_4, q5kiv_5, q5kiv_6}};

typedef void (*GemmFn)(const void *, int64_t, const Quantised *, int, float[GEMM_ROWS][16]);
static const int GEMM_MOST[] = {[Q8I] = 12, [Q8HI] = 8, [Q4I] = 12, [Q6I] = 8, [Q4KI] = 12, [Q5I] = 12, [Q5KI] = 12};
/* The fewest rows the GEMM tiles take, per format: fewer stream the weights from memory, where the row tiles' one
 * stream and their more chains per row were measured faster (a pass over 2 rows of the default model cost 1.5x one
 * through the GEMM tiles, 1.04x through the row tiles; 4 and 5 rows of the 1.5B's nibbles 1.16x and 1.25x one
 * through the row tiles, 1.37x and 1.44x through the GEMM tiles); from these counts on (the bytes' measured on a
 * matrix of the default model's LM head's shape, streamed) the GEMM tiles were as fast or faster, by 1.2-1.5x where
 * arithmetic paces a pass. Both give the same bits. */
static const int GEMM_FROM[] = {[Q8I] = 8, [Q8HI] = 6, [Q4I] = 6, [Q6I] = 6, [Q4KI] = 6, [Q5I] = 6, [Q5KI] = 6};
static const GemmFn INTEGER_GEMM[][GEMM_ROWS + 1] = {[Q8I] = GEMM_TILES(q8ig), [Q8HI] = GEMM_TILES(q8hig),
                                                    [Q4I] = GEMM_TILES(q4ig), [Q6I] = GEMM_TILES(q6ig),
                                                    [Q4KI] = GEMM_TILES(q4kig), [Q5I] = GEMM_TILES(q5ig),
                                                    [Q5KI] = GEMM_TILES(q5kig)};

typedef void (*TileFn)(const void *, const float *, int64_t, int, float[GROUP512][8]);
static const TileFn WIDE[][GROUP + 1] = {[F16] = {0, f16_1x8, f16_2x4, f16_3x2, f16_4x2},
                                         [F32] = {0, f32_1x8, f32_2x4, f32_3x2, f32_4x2},
                                         [BF16] = {0, bf16_1x8, bf16_2x4, bf16_3x2, bf16_4x2}};
static const int WIDTH[GROUP + 1] = {0, 8, 4, 2, 2};
static const TileFn WIDE512[][GROUP512 + 1] = {[F16] = {0, f16z_1, f16z_2, f16z_3, f16z_4, f16z_5, f16z_6},
                                               [F32] = {0, f32z_1, f32z_2, f32z_3, f32z_4, f32z_5, f32z_6},
                                               [BF16] = {0, bf16z_1, bf16z_2, bf16z_3, bf16z_4, bf16z_5, bf16z_6}};

enum { STORE, ADD }; /* y = product (+ bias), or y += product (a residual) */

/* out[r][j] for `rows` rows (up to GROUP, or GROUP512 with AVX-512) and the 8 rows of the block at w: in one
 * tile (float weights on AVX-512), else in tiles of `width` rows of the block, one after another. */
static void tile(int format, const void *w, int in, const float *x, int64_t ldx, int rows, float out[GROUP512][8]) {
    if (!BLOCKED(format) && has_avx512) {
        WIDE512[format][rows](w, x, ldx, in, out);
        return;
    }
    float part[GROUP512][8];
    int width = BLOCKED(format) && has_avx512 ? 4 : WIDTH[rows];
    for (int done = 0; done < 8; done += width) {
        if (BLOCKED(format))
            (has_avx512 ? Q8_512[format] : Q8_WIDE[format])[rows](w, done, x, ldx, in, part);
        else
            WIDE[format][rows]((const char *)w + 8 * done * VALUE_BYTES[format], x, ldx, in, part);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < width; j++) out[r][done + j] = part[r][j];
    }
}

/* The bytes of a blocked format's 8 weight rows of `in` inputs: their blocks, or (K formats) super-blocks. */
static int64_t group_bytes(int format, int in) {
    return SUPER_BYTES[format] ? (int64_t)(in / 256) * SUPER_BYTES[format] : (int64_t)(in / 32) * BLOCK_BYTES[format];
}

/* Where the block of weight rows o..o+7 (o a multiple of 8) of a matrix with `in` inputs starts. */
static const void *block_at(int format, const void *w, int64_t o, int in) {
    return BLOCKED(format) ? (const void *)((const char *)w + o / 8 * group_bytes(format, in))
                           : (const void *)((const char *)w + o * in * VALUE_BYTES[format]);
}

static atomic_int scratch_failed; /* a product could not have its quantised rows: the pass or product fails */

/* The rows x [n, ldx] quantised per block (Quantised) in the calling thread's scratch, kept and grown; 0 if it
 * could not be had. */
static const Quantised *quantised_rows(const float *x, int64_t ldx, int n, int in, int sets, int start_of) {
    static _Thread_local Quantised held;
    static _Thread_local void *bytes;
    static _Thread_local size_t capacity;
    size_t blocks = (size_t)n * (in / 32), need = (size_t)n * in + blocks * sizeof(float) * (1 + 2 * sets);
    if (need > capacity) {
        void *grown = realloc(bytes, need);
        if (!grown) return NULL;
        bytes = grown;
        capacity = need;
    }
    float *scale = (float *)bytes, *offset = scale + blocks;
    int32_t *start = (int32_t *)(offset + blocks * sets);
    int8_t *q = (int8_t *)(start + blocks * sets);
    for (int r = 0; r < n; r++)
        quantise_row(x + r * ldx, in, sets, n, start_of, q + (int64_t)r * 32, scale + r, offset + (int64_t)r * sets,
                     start + (int64_t)r * sets);
    held = (Quantised){q, scale, offset, start, in, sets, n};
    return &held;
}

/* The OFFSET of the tiles that multiply an integer format here (the 8-bit formats' differs between AVX2 and VNNI). */
static int integer_offset(int format) { return has_vnni ? OFFSET_OF(VNNI, format) : OFFSET_OF(AVX2, format); }

/* The rows x [n, ldx] as the matrix's integer tiles read them (quantised_rows), or NULL: for a float format, or
 * (scratch_failed then set) when they could not be had. */
static const Quantised *inputs_for(const Matrix *m, const float *x, int64_t ldx, int n) {
    if (!INTEGER(m->format)) return NULL;
    const Quantised *xq = quantised_rows(x, ldx, n, m->in, SETS(m->format), integer_offset(m->format));
    if (!xq) atomic_store(&scratch_failed, 1);
    return xq;
}

/* y rows r0..r0+rows-1, outputs o..o+count-1, from a tile's out (stride floats a row), with the bias, stored or
 * added (mode). */
static void put_tile(const float *out, int stride, int r0, int rows, int o, int count, const float *bias, float *y,
                     int64_t ldy, int mode) {
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < count; j++) {
            float *target = y + (int64_t)(r0 + r) * ldy + o + j;
            float value = out[r * stride + j] + (bias ? bias[o + j] : 0.0f);
            *target = mode == ADD ? *target + value : value;
        }
}

#define GEMM_CHUNK 64 /* rows whose quantised bytes a GEMM's tiles share before the next rows' (they stay in L2) */

/* product_of's pairs of weight blocks (16 outputs) from o0 on AVX512-VNNI, for an integer format, by GEMM tiles
 * of up to GEMM_MOST rows, GEMM_CHUNK rows at a time; the first output it leaves (a last block without its pair)
 * to the row tiles. */
static int integer_gemm(const Matrix *m, const Quantised *xq, int n, int o0, int o1, float *y, int64_t ldy,
                        int mode) {
    int format = m->format, in = m->in, most = GEMM_MOST[format], o = o0;
    int64_t next = group_bytes(format, in); /* from one block of 8 weight rows to the next */
    float out[GEMM_ROWS][16];
    for (int c0 = 0; c0 < n; c0 += GEMM_CHUNK) {
        int c1 = n - c0 < GEMM_CHUNK ? n : c0 + GEMM_CHUNK;
        for (o = o0; o + 8 < o1; o += 16) /* the pair's second block holds a row of the matrix */
            for (int r0 = c0, rows; r0 < c1; r0 += rows) { /* groups of as even a size as the most allows */
                int groups = (c1 - r0 + most - 1) / most;
                rows = (c1 - r0 + groups - 1) / groups;
                INTEGER_GEMM[format][rows](block_at(format, m->weight, o, in), next, xq, r0, out);
                put_tile(&out[0][0], 16, r0, rows, o, o1 - o < 16 ? o1 - o : 16, m->bias, y, ldy, mode);
            }
    }
    return o;
}

/* y[r, o] = x[r] . W[o] (+ bias) for every row r < n and o in [o0, o1) (o0 a multiple of 8): x [n, ldx], or for an
 * integer format xq, inputs_for's rows of x; y [n, ldy]. A block of weight rows is read from memory once, and
 * stays in L1 while every group of rows reads it. */
static void product_of(const Matrix *m, const float *x, const Quantised *xq, int64_t ldx, int n, int o0, int o1,
                       float *y, int64_t ldy, int mode) {
    int format = m->format, in = m->in;
    const void *w = m->weight;
    float out[GROUP512][8];
    if (INTEGER(format) && !xq) return; /* its rows could not be quantised: the pass fails */
    if (xq && has_vnni && n >= GEMM_FROM[format]) o0 = integer_gemm(m, xq, n, o0, o1, y, ldy, mode);
    int group = (INTEGER(format) ? has_vnni : has_avx512) ? GROUP512 : GROUP;
    for (int o = o0; o < o1; o += 8) {
        int count = o1 - o < 8 ? o1 - o : 8; /* a block past the matrix's last row is zero padding */
        for (int r0 = 0; r0 < n; r0 += group) {
            int rows = n - r0 < group ? n - r0 : group;
            if (xq)
                (has_vnni ? INTEGER_VNNI[format] : INTEGER_WIDE[format])[rows](block_at(format, w, o, in), xq, r0, out);
            else
                tile(format, block_at(format, w, o, in), in, x + r0 * ldx, ldx, rows, out);
            put_tile(&out[0][0], 8, r0, rows, o, count, m->bias, y, ldy, mode);
        }
    }
}

/* The rows of a matrix, its parts' together. */
static int outputs_of(const Matrix *m) {
    int outputs = 0;
    for (; m; m = m->rest) outputs += m->out;
    return outputs;
}

/* product_of over outputs o0..o1-1 of a matrix's parts, each part's, the rows quantised for it where its format
 * needs it (and not where this member has none of its outputs). */
static void product(const Matrix *m, const float *x, int64_t ldx, int n, int o0, int o1, float *y, int64_t ldy,
                    int mode) {
    for (int first = 0; m; first += m->out, m = m->rest) { /* first: the part's first output in the matrix */
        int b = o0 > first ? o0 - first : 0, e = o1 - first < m->out ? o1 - first : m->out;
        if (b < e) product_of(m, x, inputs_for(m, x, ldx, n), ldx, n, b, e, y + first, ldy, mode);
    }
}

/* The share of `count` items (in units of `grain`) of member `thread` of `threads`. */
static void share(int count, int grain, int thread, int threads, int *begin, int *end) {
    int units = (count + grain - 1) / grain;
    *begin = (int)((int64_t)units * thread / threads) * grain;
    *end = (int)((int64_t)units * (thread + 1) / threads) * grain;
    if (*end > count) *end = count;
    if (*begin > count) *begin = count;
}

/* ---------------------------------------------------------------- the pass */

typedef struct {
    const Model *m;
    const Cache *cache;
    const Rows *rows;
    float *x;            /* [n, hidden]: embeddings in, the residual stream out */
    int first, end;      /* the layers run */
    /* scratch */
    float *h, *qkv, *attended, *act, *mid, *scores; /* act: gate and up; mid: SiLU(gate) * up, the down's input */
    int64_t scores_stride; /* a member's attention scratch (attention_scratch) */
    int max_keys;          /* the most keys a row attends */
} Pass;

/* The row's sum of squares in 8 lanes, then the lanes as sum8 adds them (and any last n % 8 in order). */
__attribute__((target("avx2,fma,f16c"))) static void rms_norm_row(const float *x, const float *weight, int hidden,
                                                                 float eps, float *y) {
    __m256 squares = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= hidden; i += 8) squares = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), squares);
    float total = sum8(squares);
    for (; i < hidden; i++) total += x[i] * x[i];
    float scale = 1.0f / sqrtf(total / hidden + eps);
    for (i = 0; i < hidden; i++) y[i] = weight[i] * (x[i] * scale);
}

__attribute__((target("avx2,fma,f16c"))) static void rope_row(float *v, const float *cos, const float *sin,
                                                             int head_dim) {
    int half_dim = head_dim / 2;
    for (int i = 0; i < half_dim; i++) {
        float a = v[i], b = v[i + half_dim];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half_dim] = b * cos[i + half_dim] + a * sin[i + half_dim];
    }
}

/* The first n < 8 floats at p in lanes 0..n-1 (the rest 0), and lanes 0..n-1 of v stored there: a row's last part
 * of fewer than 8 through the same lanes as the rest. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256i first_lanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#define LOAD_PART(p, n) _mm256_maskload_ps(p, first_lanes(n))
#define STORE_PART(p, n, v) _mm256_maskstore_ps(p, first_lanes(n), v)

/* e^x in each lane, to about 2 ulp (Cody and Waite's reduction by ln 2 in two parts, then a degree-6 polynomial),
 * the same instructions on every CPU the pass runs on; x is clamped to [-87.3, 88.7]. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* The feed-forward block's gate, activated, times its up, in 8 lanes: SiLU g / (1 + e^-g), or GELU's tanh form
 * g (1 + tanh u) / 2 with u = sqrt(2 / pi) (g + 0.044715 g^3) and tanh u = 1 - 2 / (e^2u + 1). */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 gated8(__m256 g, __m256 up, int activation) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 a;
    if (activation == GELU_TANH) {
        __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f),
                                 _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), _mm256_mul_ps(g, _mm256_mul_ps(g, g)))));
        __m256 tanh_u = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(exp8(_mm256_add_ps(u, u)), one)));
        a = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, tanh_u));
    } else {
        a = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    }
    return _mm256_mul_ps(a, up);
}

/* mid[j] = act(gate[j]) up[j] for j in [b, e), 8 at a time (a last part of fewer through the same lanes). */
__attribute__((target("avx2,fma,f16c"))) static void gate_row(const float *gate, const float *up, float *mid, int b,
                                                             int e, int activation) {
    int j = b;
    for (; j + 8 <= e; j += 8)
        _mm256_storeu_ps(mid + j, gated8(_mm256_loadu_ps(gate + j), _mm256_loadu_ps(up + j), activation));
    if (j < e) STORE_PART(mid + j, e - j, gated8(LOAD_PART(gate + j, e - j), LOAD_PART(up + j, e - j), activation));
}

/* q's dot products with 8 keys of hd floats, in 8 lanes: each key's 8 lanes of products, then the 8 added across
 * in one tree for all 8 ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): a key's sum is the same in any group. */
__attribute__((target("avx2,fma,f16c"))) static __m256 dots8(const float *q, const float *const key[8], int hd) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int i = 0; i < hd; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[j] + i), acc[j]);
    }
    __m256 pairs[4], quads[2];
    for (int j = 0; j < 4; j++) pairs[j] = _mm256_hadd_ps(acc[2 * j], acc[2 * j + 1]);
    for (int j = 0; j < 2; j++) quads[j] = _mm256_hadd_ps(pairs[2 * j], pairs[2 * j + 1]);
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20), _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}

/* How a layer's queries score their keys, and which they read. */
typedef struct {
    float scale;   /* q . k times this; 0: 1 / sqrt(head_dim) */
    float softcap; /* scores capped softly at +-softcap (softcap tanh(s / softcap)), or 0 */
    int window;    /* a query reads its last `window` keys only (a sliding window), or 0: all */
} Scoring;

/* Queries that read the same keys (one kv head's columns, in the same order): a row's heads that share a kv head,
 * of rows that share a sequence. Query i reads keys [first[i], count[i]). */
#define MAX_QUERIES 48        /* queries scored together: their keys and values are read once for all of them */
#define QUERY_SCORES 65536    /* floats of scores a member holds for them (one query's, where its keys are more) */
#define VALUE_BLOCK 32        /* keys whose values every query adds before the next block's (they stay in L1) */
typedef struct {
    const float *q[MAX_QUERIES];
    float *out[MAX_QUERIES];
    int first[MAX_QUERIES], count[MAX_QUERIES];
    int n;
} Queries;

/* sum[0..8 vectors) += s[t] values[t][0..8 vectors) for t in [b, e), in t's order (values: hd floats a key, or
 * the columns `cols` lists). Inlined with a constant `vectors`, the sums stay in registers (a loop over hd's
 * vectors kept them in memory, each add waiting on the store before it). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void add_values(float *sum, const float *s,
                                                                                     const float *values,
                                                                                     const int32_t *cols, int hd,
                                                                                     int b, int e, int vectors) {
    __m256 acc[8];
    for (int j = 0; j < vectors; j++) acc[j] = _mm256_loadu_ps(sum + 8 * j);
    for (int t = b; t < e; t++) {
        const float *v = values + (int64_t)(cols ? cols[t] : t) * hd;
        __m256 weight = _mm256_set1_ps(s[t]);
        for (int j = 0; j < vectors; j++) acc[j] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * j), acc[j]);
    }
    for (int j = 0; j < vectors; j++) _mm256_storeu_ps(sum + 8 * j, acc[j]);
}

/* Each query's attention: softmax(q . k * scale) over its keys (columns first..count-1, or those `cols` lists), in
 * their order, then the weighted sum of the values, in the same order; the same operations for each as if it were
 * alone, so the same bits in any company. A group of 8 keys is read once for every query (a key's dot product is
 * the same in any group: dots8), and a block of values once for every query, whose sums wait in `sums` between
 * blocks (a store and a load: the bits are kept). keys and values: the kv head's columns, hd floats each; scores
 * [n, stride]; sums [n, hd]. */
__attribute__((target("avx2,fma,f16c"))) static void attend(const Queries *qs, const float *keys, const float *values,
                                                           int hd, const int32_t *cols, const Scoring *how,
                                                           float *scores, int64_t stride, float *sums) {
    float scale = how->scale != 0.0f ? how->scale : 1.0f / sqrtf((float)hd), top[MAX_QUERIES], total[MAX_QUERIES];
    static const float nothing[MAX_HEAD_DIM]; /* the keys past the last of a group of 8 */
    int lo = qs->count[0], hi = 0;
    for (int i = 0; i < qs->n; i++) {
        top[i] = -INFINITY;
        total[i] = 0.0f;
        if (qs->first[i] < lo) lo = qs->first[i];
        if (qs->count[i] > hi) hi = qs->count[i];
    }
    __m256 tops[MAX_QUERIES]; /* the scores' greatest, lane by lane, of groups read whole */
    for (int i = 0; i < qs->n; i++) tops[i] = _mm256_set1_ps(-INFINITY);
    for (int t = lo; t < hi; t += 8) {
        const float *key[8];
        for (int j = 0; j < 8; j++) key[j] = t + j < hi ? keys + (int64_t)(cols ? cols[t + j] : t + j) * hd : nothing;
        for (int i = 0; i < qs->n; i++) {
            int b = qs->first[i] > t ? qs->first[i] : t, e = qs->count[i] < t + 8 ? qs->count[i] : t + 8;
            if (b >= e) continue;
            float *s = scores + i * stride;
            __m256 eight = _mm256_mul_ps(dots8(qs->q[i], key, hd), _mm256_set1_ps(scale));
            if (b == t && e == t + 8 && how->softcap == 0.0f) { /* the whole group, as it is */
                _mm256_storeu_ps(s + t, eight);
                tops[i] = _mm256_max_ps(eight, tops[i]); /* a NaN score is passed over, as below */
                continue;
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, eight);
            for (int u = b; u < e; u++) {
                s[u] = how->softcap != 0.0f ? how->softcap * tanhf(lanes[u - t] / how->softcap) : lanes[u - t];
                if (s[u] > top[i]) top[i] = s[u];
            }
        }
    }
    for (int i = 0; i < qs->n; i++) { /* the greatest is the same whatever order finds it */
        float lanes[8];
        _mm256_storeu_ps(lanes, tops[i]);
        for (int j = 0; j < 8; j++)
            if (lanes[j] > top[i]) top[i] = lanes[j];
    }
    for (int i = 0; i < qs->n; i++) {
        float *s = scores + i * stride;
        int t = qs->first[i], count = qs->count[i];
        for (; t + 8 <= count; t += 8)
            _mm256_storeu_ps(s + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(top[i]))));
        if (t < count)
            STORE_PART(s + t, count - t, exp8(_mm256_sub_ps(LOAD_PART(s + t, count - t), _mm256_set1_ps(top[i]))));
        memset(sums + (int64_t)i * hd, 0, hd * sizeof(float));
    }
    for (int t = lo; t < hi; t++) /* each query's total in its keys' order; the queries' sums interleaved */
        for (int i = 0; i < qs->n; i++)
            if (qs->first[i] <= t && t < qs->count[i]) total[i] += scores[i * stride + t];
    for (int block = lo; block < hi; block += VALUE_BLOCK) {
        for (int i = 0; i < qs->n; i++) {
            int b = qs->first[i] > block ? qs->first[i] : block;
            int e = qs->count[i] < block + VALUE_BLOCK ? qs->count[i] : block + VALUE_BLOCK;
            if (b >= e) continue;
            const float *s = scores + i * stride;
            float *sum = sums + (int64_t)i * hd;
            int o = 0;
            for (; o + 64 <= hd; o += 64) add_values(sum + o, s, values + o, cols, hd, b, e, 8);
            for (; o + 32 <= hd; o += 32) add_values(sum + o, s, values + o, cols, hd, b, e, 4);
            for (; o < hd; o += 8) add_values(sum + o, s, values + o, cols, hd, b, e, 1);
        }
    }
    for (int i = 0; i < qs->n; i++)
        for (int j = 0; j < hd / 8; j++)
            _mm256_storeu_ps(qs->out[i] + 8 * j,
                             _mm256_div_ps(_mm256_loadu_ps(sums + (int64_t)i * hd + 8 * j), _mm256_set1_ps(total[i])));
}

/* A query's scores in scratch, for at most `max_keys` keys: their floats, rounded up to 16. */
static int64_t scores_stride(int max_keys) { return (max_keys + 15) / 16 * 16; }

/* The floats a member holds for its queries' scores: QUERY_SCORES, or one query's where its keys are more. */
static int64_t scores_room(int max_keys) {
    return scores_stride(max_keys) > QUERY_SCORES ? scores_stride(max_keys) : QUERY_SCORES;
}

/* The floats of scratch a member needs for attend over at most `max_keys` keys a query: scores, then sums. */
static int64_t attention_scratch(int max_keys) { return scores_room(max_keys) + (int64_t)MAX_QUERIES * MAX_HEAD_DIM; }

/* The row after the last of the group from row r0: up to `most` rows of one sequence, one after another. */
static int group_end(const Rows *rows, int r0, int most) {
    int r1 = r0 + 1;
    while (r1 < rows->n && r1 - r0 < most && rows->base[r1] == rows->base[r0]) r1++;
    return r1;
}

/* This member's share of the rows' attention in one layer's cache (keys, values: its base; head_stride floats from
 * a kv head to the next). Row r's queries are heads x hd floats at q + r q_stride, its outputs go to out + r
 * out_stride. The work comes in items of queries that read the same keys (attend): the heads of one kv head (or a
 * part of them, where the items would be too few for the team) of up to as many rows of one sequence as scratch
 * holds (a row alone where it lists its key columns). Items are dealt round the team. */
static void attend_rows(const Rows *rows, const float *q, int64_t q_stride, float *out, int64_t out_stride,
                        const float *keys, const float *values, int64_t head_stride, int heads, int kv_heads, int hd,
                        const Scoring *how, float *scratch, int max_keys, int thread, int threads) {
    int n = rows->n, ratio = heads / kv_heads;
    int64_t stride = scores_stride(max_keys), room = scores_room(max_keys);
    int per_item = room / stride < MAX_QUERIES ? (int)(room / stride) : MAX_QUERIES; /* at least 1 */
    int group_rows = rows->key_cols ? 1 : per_item / ratio > 0 ? per_item / ratio : 1;
    int parts = (ratio + per_item - 1) / per_item;
    int groups = 0;
    for (int r0 = 0; r0 < n; r0 = group_end(rows, r0, group_rows)) groups++;
    while (parts < ratio && groups * kv_heads * parts < 2 * threads) parts++;
    float *sums = scratch + room;
    int item = 0;
    for (int r0 = 0, r1; r0 < n; r0 = r1) {
        r1 = group_end(rows, r0, group_rows);
        for (int kv = 0; kv < kv_heads; kv++)
            for (int part = 0; part < parts; part++, item++) {
                if (item % threads != thread) continue;
                Queries qs = {.n = 0};
                for (int r = r0; r < r1; r++)
                    for (int head = kv * ratio + part * ratio / parts; head < kv * ratio + (part + 1) * ratio / parts;
                         head++) {
                        int count = rows->n_keys[r];
                        qs.q[qs.n] = q + r * q_stride + head * hd;
                        qs.out[qs.n] = out + r * out_stride + head * hd;
                        qs.count[qs.n] = count;
                        qs.first[qs.n++] = how->window > 0 && count > how->window ? count - how->window : 0;
                    }
                int64_t offset = rows->base[r0] + kv * head_stride;
                const int32_t *cols = rows->key_cols ? rows->key_cols + (int64_t)r0 * rows->key_stride : NULL;
                attend(&qs, keys + offset, values + offset, hd, cols, how, scratch, stride, sums);
            }
    }
}

/* Rows' outputs y [n, hidden] of a block added to the residual stream x, each RMS-normed first where `norm` is
 * given (gemma's); the rows this member adds, as the others do theirs. */
__attribute__((target("avx2,fma,f16c"))) static void add_normed(const float *norm, float *y, float *x, int hidden,
                                                               float eps, int n, int thread, int threads) {
    for (int r = thread; r < n; r += threads) {
        float *out = y + (int64_t)r * hidden, *row = x + (int64_t)r * hidden;
        rms_norm_row(out, norm, hidden, eps, out);
        for (int i = 0; i < hidden; i++) row[i] += out[i];
    }
}

/* A block's output product (outputs [b, e) of this member) added to the residual stream p->x; where the block's
 * output is normed first (`norm`), the product goes to p->h and each row is normed, then added, after the team
 * meets. Ends at a barrier. */
static void residual(const Matrix *matrix, const float *norm, const float *input, int ldx, Pass *p, int b, int e,
                     int thread, int threads, int *sense) {
    int n = p->rows->n, hidden = p->m->hidden;
    product(matrix, input, ldx, n, b, e, norm ? p->h : p->x, hidden, norm ? STORE : ADD);
    team_barrier(threads, sense);
    if (!norm) return;
    add_normed(norm, p->h, p->x, hidden, p->m->eps, n, thread, threads);
    team_barrier(threads, sense);
}

static void pass_job(void *arg, int thread, int threads) {
    Pass *p = (Pass *)arg;
    if (thread >= threads) return;
    const Model *m = p->m;
    const Rows *rows = p->rows;
    int n = rows->n, hidden = m->hidden, hd = m->head_dim, inter = m->inter;
    int q_width = m->heads * hd, qkv_width = (m->heads + 2 * m->kv_heads) * hd;
    int sense = atomic_load(&barrier_sense);
    float *scores = p->scores + (int64_t)thread * p->scores_stride;
    int b, e;
    for (int li = p->first; li < p->end; li++) {
        const Layer *layer = &m->layer[li];
        for (int r = thread; r < n; r += threads)
            rms_norm_row(p->x + (int64_t)r * hidden, layer->input_norm, hidden, m->eps, p->h + (int64_t)r * hidden);
        team_barrier(threads, &sense);
        share(qkv_width, 8, thread, threads, &b, &e);
        product(&layer->qkv, p->h, hidden, n, b, e, p->qkv, qkv_width, STORE);
        team_barrier(threads, &sense);
        const float *cos_table = layer->local_rope ? p->cache->local_cos : p->cache->cos;
        const float *sin_table = layer->local_rope ? p->cache->local_sin : p->cache->sin;
        for (int r = thread; r < n; r += threads) {
            float *row = p->qkv + (int64_t)r * qkv_width;
            const float *cos = cos_table + (int64_t)rows->rope[r] * hd, *sin = sin_table + (int64_t)rows->rope[r] * hd;
            if (layer->q_norm) /* and k_norm: runtime.py sets both or neither */
                for (int head = 0; head < m->heads + m->kv_heads; head++)
                    rms_norm_row(row + head * hd, head < m->heads ? layer->q_norm : layer->k_norm, hd, m->eps,
                                 row + head * hd);
            for (int head = 0; head < m->heads + m->kv_heads; head++) rope_row(row + head * hd, cos, sin, hd);
            for (int kv = 0; kv < m->kv_heads; kv++) {
                int64_t at = rows->base[r] + kv * p->cache->head_stride + (int64_t)rows->column[r] * hd;
                memcpy(p->cache->keys[li] + at, row + q_width + kv * hd, hd * sizeof(float));
                memcpy(p->cache->values[li] + at, row + q_width + (m->kv_heads + kv) * hd, hd * sizeof(float));
            }
        }
        team_barrier(threads, &sense);
        Scoring how = {m->attn_scale, m->attn_softcap, layer->window};
        attend_rows(rows, p->qkv, qkv_width, p->attended, q_width, p->cache->keys[li], p->cache->values[li],
                    p->cache->head_stride, m->heads, m->kv_heads, hd, &how, scores, p->max_keys, thread, threads);
        team_barrier(threads, &sense);
        share(hidden, 8, thread, threads, &b, &e);
        residual(&layer->out, layer->attn_out_norm, p->attended, q_width, p, b, e, thread, threads, &sense);
        for (int r = thread; r < n; r += threads)
            rms_norm_row(p->x + (int64_t)r * hidden, layer->post_norm, hidden, m->eps, p->h + (int64_t)r * hidden);
        team_barrier(threads, &sense);
        share(inter, 8, thread, threads, &b, &e); /* gate and up for the same units, then SiLU(gate) * up */
        product(&layer->gate_up, p->h, hidden, n, b, e, p->act, 2 * inter, STORE);
        product(&layer->gate_up, p->h, hidden, n, inter + b, inter + e, p->act, 2 * inter, STORE);
        for (int r = 0; r < n; r++) {
            const float *row = p->act + (int64_t)r * 2 * inter;
            gate_row(row, row + inter, p->mid + (int64_t)r * inter, b, e, m->activation);
        }
        team_barrier(threads, &sense);
        share(hidden, 8, thread, threads, &b, &e);
        residual(&layer->down, layer->ffn_out_norm, p->mid, inter, p, b, e, thread, threads, &sense);
    }
}

/* ---------------------------------------------------------------- products and attention alone
 *
 * What the lean runtime (backends/lean/) computes with on the CPU, each row as it is alone: a product's rows by the tiles
 * above, a row's attention by attend. So its rows, too, are the same bits in any pass on any CPU. */

typedef struct {
    const Matrix *m;
    const float *x;  /* [n, in] */
    int n;
    float *y;        /* [n, out] */
} Product;

static void product_job(void *arg, int thread, int threads) {
    const Product *p = (const Product *)arg;
    int b, e;
    if (thread >= threads) return;
    share(outputs_of(p->m), 8, thread, threads, &b, &e);
    product(p->m, p->x, p->m->in, p->n, b, e, p->y, outputs_of(p->m), STORE);
}

/* y = x W^T + bias for n rows, the outputs shared among the team. Returns 0, or -1 when scratch could not be had. */
int sd_product(const Matrix *m, const float *x, int n, float *y) {
    Product p = {m, x, n, y};
    pthread_mutex_lock(&pass_lock);
    atomic_store(&scratch_failed, 0);
    run_team(product_job, &p);
    int failed = atomic_load(&scratch_failed);
    pthread_mutex_unlock(&pass_lock);
    return failed ? -1 : 0;
}

typedef struct {
    const Rows *rows;             /* each row's keys: base, n_keys, key_cols */
    int heads, kv_heads, head_dim;
    Scoring how;
    const float *q;               /* [n, heads * head_dim] */
    const float *keys, *values;   /* one layer's cache base */
    int64_t head_stride;          /* floats from one kv head to the next */
    float *out;                   /* [n, heads * head_dim] */
    float *scratch;               /* [threads, attention_scratch(max_keys)] */
    int max_keys;                 /* the most keys a row attends */
} Attention;

static void attention_job(void *arg, int thread, int threads) {
    const Attention *a = (const Attention *)arg;
    if (thread >= threads) return;
    int64_t width = (int64_t)a->heads * a->head_dim;
    attend_rows(a->rows, a->q, width, a->out, width, a->keys, a->values, a->head_stride, a->heads, a->kv_heads,
                a->head_dim, &a->how, a->scratch + thread * attention_scratch(a->max_keys), a->max_keys, thread,
                threads);
}

static float *scratch_of(size_t floats);

/* Each row's attention over its own keys in one layer's cache (the keys and values already written), its scores
 * scaled by `scale` (0: 1 / sqrt(head_dim)), capped softly at `softcap` (0: not), over its last `window` keys (0:
 * all); 0, or -1 when scratch could not be had. */
int sd_attention(const Rows *rows, int heads, int kv_heads, int head_dim, const float *q, const float *keys,
                 const float *values, int64_t head_stride, float *out, float scale, float softcap, int window) {
    int max_keys = 1;
    for (int r = 0; r < rows->n; r++)
        if (rows->n_keys[r] > max_keys) max_keys = rows->n_keys[r];
    Attention a = {rows, heads, kv_heads, head_dim, {scale, softcap, window}, q, keys, values, head_stride, out, NULL,
                   max_keys};
    pthread_mutex_lock(&pass_lock);
    a.scratch = scratch_of((size_t)team_size * attention_scratch(max_keys));
    if (a.scratch) run_team(attention_job, &a);
    pthread_mutex_unlock(&pass_lock);
    return a.scratch ? 0 : -1;
}

/* The sizes of the structures native.py declares with ctypes, in its order (STRUCT_SIZES): Model, Layer, Cache,
 * Rows, Matrix, block_q8x8, block_q8x16, block_q4x8, super_q6x8, super_q4k8, block_q5x8, super_q5k8; at most
 * `count` of them. Returns how many it
 * wrote. */
int sd_struct_sizes(int64_t *sizes, int count) {
    const int64_t known[] = {sizeof(Model), sizeof(Layer), sizeof(Cache), sizeof(Rows), sizeof(Matrix),
                             sizeof(block_q8x8), sizeof(block_q8x16), sizeof(block_q4x8), sizeof(super_q6x8),
                             sizeof(super_q4k8), sizeof(block_q5x8), sizeof(super_q5k8)};
    int written = 0;
    for (; written < count && written < (int)(sizeof(known) / sizeof(known[0])); written++) sizes[written] = known[written];
    return written;
}

/* A pass's scratch: kept and grown, never given back (a fresh allocation of over 128 KiB is a fresh mapping, whose
 * pages fault in again on every pass). Under pass_lock. */
static float *scratch_of(size_t floats) {
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

/* The rows through layers [first, end); x [n, hidden] holds their embeddings, then their residual stream. Returns
 * 0, or -1 when scratch could not be had. */
int sd_pass(const Model *m, const Cache *cache, const Rows *rows, float *x, int first, int end) {
    int n = rows->n, max_keys = 1;
    for (int r = 0; r < n; r++)
        if (rows->n_keys[r] > max_keys) max_keys = rows->n_keys[r];
    int qkv_width = (m->heads + 2 * m->kv_heads) * m->head_dim;
    Pass p = {.m = m, .cache = cache, .rows = rows, .x = x, .first = first, .end = end};
    p.scores_stride = attention_scratch(max_keys);
    p.max_keys = max_keys;
    pthread_mutex_lock(&pass_lock);
    size_t floats = (size_t)n * (m->hidden + qkv_width + m->heads * m->head_dim + 3 * m->inter) +
                    (size_t)team_size * p.scores_stride;
    float *scratch = scratch_of(floats);
    if (!scratch) {
        pthread_mutex_unlock(&pass_lock);
        return -1;
    }
    p.h = scratch;
    p.qkv = p.h + (size_t)n * m->hidden;
    p.attended = p.qkv + (size_t)n * qkv_width;
    p.act = p.attended + (size_t)n * m->heads * m->head_dim;
    p.mid = p.act + (size_t)n * 2 * m->inter;
    p.scores = p.mid + (size_t)n * m->inter;
    atomic_store(&scratch_failed, 0);
    run_team(pass_job, &p);
    int failed = atomic_load(&scratch_failed);
    pthread_mutex_unlock(&pass_lock);
    return failed ? -1 : 0;
}

/* This CPU's integer peak for one thread: multiply-adds of bytes a second, from `rounds` rounds of 12 independent
 * sums in the widest instruction the integer tiles use here (vpdpbusd on 16 lanes with AVX512-VNNI; maddubs, madd
 * and add on 8 lanes with AVX2: 32 products a round of 3). What a pass's arithmetic can reach, beside the
 * bandwidth's floor (specdec.bench.passes). */
__attribute__((target(VNNI_TARGET))) static double vnni_peak(long rounds) {
    __m512i sum[12], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    for (int i = 0; i < 12; i++) sum[i] = _mm512_setzero_si512();
    for (long k = 0; k < rounds; k++) {
        for (int i = 0; i < 12; i++) sum[i] = _mm512_dpbusd_epi32(sum[i], w, x);
        __asm__ volatile("" : "+v"(w), "+v"(x));
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
