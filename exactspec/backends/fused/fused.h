/* exactspec's fused CPU kernels for llama-family models: every layer of a pass over n rows in one call, and the
 * products and attention the lean runtime runs one at a time. This header is what their files share.
 *
 * Built at install as exactspec/backends/_fused (setup.py; optional: a failed build leaves the install working and
 * native.py says why once), loaded with ctypes. It needs AVX2, FMA and F16C; native.py checks the CPU first.
 *
 * What it does that a chain of PyTorch ops does not:
 * - one thread team (PyTorch's OpenMP threads, else threads of its own that persist) runs the whole pass; the
 *   phases of a layer meet at barriers (a short spin, then asleep on a futex), so no thread is forked or joined
 *   per matrix, and Python is not re-entered per op;
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
 *
 * One file per concern, as ggml lays out its kernels:
 * - fused.h (this file): the structures native.py declares, the weight formats (FORMATS, written once), the
 *   quantised rows, the tiles' shapes and tables, the team's shared state and the helpers several files inline;
 * - team.c: the thread team, the CPU's features (which tiles run), the pass's scratch, the integer peak;
 * - formats.c: the formats' table and the structures' sizes native.py checks at load, and the rows' quantisation
 *   to bytes for the integer tiles;
 * - tiles.h: the macros the tile files build their tiles from (prefetch, the blocks' walk, the integer tiles);
 * - tiles_avx2.c, tiles_avx512.c, tiles_vnni.c: the tiles of one instruction set each (VNNI's GEMM tiles too),
 *   static, reached through their tables of function pointers;
 * - tiles_amx.c: AMX's GEMM, written against a tile API with two back ends: the instructions, and a C model of the
 *   tile registers that every CPU can run (EXACTSPEC_TILES=model);
 * - product.c: a matrix's product over its blocks, by the tiles this CPU takes, shared among the team;
 * - attention.c: each row's attention over its own keys;
 * - pass.c: a pass's layers, the norms, RoPE, the cache writes and the activation around the products;
 * - chain.c: a draft model's whole chain of tokens in one call, a one-row pass per token, its LM head and its
 *   choice among the head's rows.
 */
#ifndef EXACTSPEC_FUSED_H
#define EXACTSPEC_FUSED_H

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
    int rope;                             /* the RoPE tables its q and k turn by: ROPE_MAIN, ROPE_LOCAL (gemma 3's
                                           * sliding layers), or ROPE_NONE: not turned (smollm3's NoPE layers) */
    Matrix qkv;                           /* [(heads + 2 kv_heads) head_dim, hidden], with q, k and v's biases */
    Matrix out;                           /* [hidden, heads head_dim] */
    Matrix gate_up;                       /* [2 inter, hidden]: gate rows, then up rows */
    Matrix down;                          /* [hidden, inter] */
} Layer;

enum { ROPE_MAIN, ROPE_LOCAL, ROPE_NONE }; /* Layer.rope: the cache's tables, its local tables, or none */
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
    const float *local_cos, *local_sin; /* the local layers' tables (Layer.rope ROPE_LOCAL), or NULL */
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

/* What the files share and Python does not call: kept out of the library's exported symbols, and reached without
 * the indirection an exported symbol of a shared library takes. */
#define INTERNAL __attribute__((visibility("hidden")))

/* The instruction sets the integer tiles are compiled for. */
#define AVX2_TARGET "avx2,fma,f16c"
#ifndef EXACTSPEC_EMULATED
#define AVX512_TARGET "avx512f,avx512dq,avx2,fma,f16c"
#define VNNI_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c"
#else /* a build whose AVX-512 intrinsics an emulation supplies, for a CPU without it to run those tiles' code (a
       * check, never installed): every tile compiled for AVX2 */
#define AVX512_TARGET AVX2_TARGET
#define VNNI_TARGET AVX2_TARGET
#endif

/* ---------------------------------------------------------------- the weight formats */

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

/* Q3RI: 3-bit weights (q < 8, w = (d sc) q - (dmin mn)) with an integer scale and min per 32 inputs (sc and mn up
 * to 255) under each row's float d and dmin: no GGUF type's, a draft-grade copy's (draft_grade.py), for inputs of
 * any multiple of 32 (a K format's need 256). A matrix's 8 rows are their head, rows_q3r8 (the rows' d and -dmin),
 * then their blocks: each block_q3r8 holds quads 2p and 2p + 1 (p < 3) in bits 0-2 and 3-5 of q[p], quad 6's low 2
 * bits in bits 6-7 of q[0] and quad 7's in q[1]'s, their third bits in bits 6 and 7 of q[2] (tiles.h's QUAD_Q3),
 * then the 8 rows' sc and mn (0.44 bytes a weight, the head aside). */
typedef struct {
    uint8_t q[3][32];
    uint8_t sc[8], mn[8];
} block_q3r8;
typedef struct {
    float d[8], dmin[8]; /* dmin negated, as super_q4k8's */
    block_q3r8 blocks[];
} rows_q3r8;
static_assert(sizeof(block_q3r8) == 112 && sizeof(rows_q3r8) == 64, "block_q3r8: 96 bytes of bits, 16 of scales");

/* How a weight matrix is stored (Matrix.format), each format once, in the order of their numbers: its name here;
 * how exactspec names the weights (native.py); whether its products are integer (each row's inputs quantised to bytes,
 * below); and the bytes of a value (a float format's), of a block of 8 rows x 32 inputs (a blocked format's), of a
 * super-block of 8 rows x 256 inputs (a K format's, its blocks inside), and of the head before each 8 rows' blocks
 * (a row-scaled format's). Q8I and Q8HI: Q8 and Q8H's bytes, multiplied in integers; Q4I, Q4KI (nibbles), Q5I,
 * Q5KI (5 bits), Q6I (6 bits) and Q3RI (3 bits): in integers only. formats.c gives this table to native.py
 * (sd_formats), which checks its own against it value by value at load. */
#define FORMATS(X)                                                                                                 \
    X(F16, "float16", 0, 2, 0, 0, 0)                                                                                  \
    X(Q8, "int8", 0, 0, sizeof(block_q8x8), 0, 0)                                                                     \
    X(F32, "float32", 0, 4, 0, 0, 0)                                                                                  \
    X(BF16, "bfloat16", 0, 2, 0, 0, 0)                                                                                \
    X(Q8H, "int8_group16", 0, 0, sizeof(block_q8x16), 0, 0)                                                           \
    X(Q8I, "int8", 1, 0, sizeof(block_q8x8), 0, 0)                                                                    \
    X(Q8HI, "int8_group16", 1, 0, sizeof(block_q8x16), 0, 0)                                                         \
    X(Q4I, "int4", 1, 0, sizeof(block_q4x8), 0, 0)                                                                    \
    X(Q6I, "int6_k", 1, 0, sizeof(block_q6x8), sizeof(super_q6x8), 0)                                                \
    X(Q4KI, "int4_k", 1, 0, sizeof(block_q4k8), sizeof(super_q4k8), 0)                                               \
    X(Q5I, "int5", 1, 0, sizeof(block_q5x8), 0, 0)                                                                    \
    X(Q5KI, "int5_k", 1, 0, sizeof(block_q5k8), sizeof(super_q5k8), 0)                                               \
    X(Q3RI, "int3_r", 1, 0, sizeof(block_q3r8), 0, sizeof(rows_q3r8))
#define FORMAT_NAME(name, weights, integer, value_bytes, block_bytes, super_bytes, head_bytes) name,
enum { FORMATS(FORMAT_NAME) FORMAT_COUNT };
#define INTEGER(format) ((format) >= Q8I && (format) <= Q3RI) /* the integer formats (the enum's last) */
#define SETS(format) ((format) == Q8HI || (format) == Q6I ? 2 : 1) /* an integer format's sets per 32 inputs */
#define BLOCKED(format) ((format) == Q8 || (format) == Q8H || INTEGER(format))

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

/* Where row `row`'s scalars for block `block` lie in a Quantised's arrays (times its sets). */
static inline int64_t block_of(const Quantised *x, int row, int block) { return (int64_t)block * x->n + row; }

/* OFFSET: what a tile's integer sums start from, times sum(xq): 128 where AVX2 summed a Q8 byte as q - 128, -32 for
 * Q6's offset (-32 times its scale), 0 elsewhere; OFFSET_OF, a format's, for the quantiser (integer_offset). */
#define OFFSET_AVX2_Q8 128
#define OFFSET_AVX2_Q4 0
#define OFFSET_AVX2_Q6 (-32)
#define OFFSET_AVX2_Q5 0
#define OFFSET_AVX2_Q3 0
#define OFFSET_VNNI_Q8 0
#define OFFSET_VNNI_Q4 0
#define OFFSET_VNNI_Q6 (-32)
#define OFFSET_VNNI_Q5 0
#define OFFSET_VNNI_Q3 0
#define OFFSET_OF(ISA, format)                                                                                     \
    ((format) == Q6I ? OFFSET_##ISA##_Q6 : (format) == Q8I || (format) == Q8HI ? OFFSET_##ISA##_Q8 : OFFSET_##ISA##_Q4)

/* ---------------------------------------------------------------- the tiles' shapes and tables
 *
 * Each family of tiles is made (static) in its instruction set's file and reached from product.c through these
 * tables of function pointers, by format and row count: no call crosses a file but through them. */
#define GROUP 4    /* rows a float tile computes at most on AVX2, whose 16 registers hold its accumulators */
#define GROUP512 6 /* on AVX-512, with 32: 6 rows x 4 pairs of outputs accumulate in 24; and an integer row tile's
                    * on either (on AVX2 one tile's shared unpacking outweighs its spills: see product_of) */
#define GEMM_ROWS 12 /* rows a GEMM tile computes at most: 12 sums and 12 accumulators of 16 lanes in 24 of 32
                     * registers (GEMM_MOST: fewer for formats with two sets a block, whose tiles spill past 8) */

/* Float weights (tiles_avx2.c: 8 outputs in tiles of WIDTH[rows]; tiles_avx512.c: 8 at once). */
typedef void (*TileFn)(const void *, const float *, int64_t, int, float[GROUP512][8]);
INTERNAL extern const TileFn WIDE[][GROUP + 1], WIDE512[][GROUP512 + 1];
INTERNAL extern const int WIDTH[GROUP + 1];
/* Q8 and Q8H multiplied in floats, from row j of the block (4 at once on AVX-512). */
typedef void (*Q8Fn)(const void *, int, const float *, int64_t, int, float[GROUP512][8]);
INTERNAL extern const Q8Fn Q8_WIDE[][GROUP + 1], Q8_512[][GROUP512 + 1];
/* The integer formats' row tiles (tiles_avx2.c, tiles_vnni.c) and GEMM tiles (tiles_vnni.c). */
typedef void (*IntegerFn)(const void *, const Quantised *, int, float[GROUP512][8]);
INTERNAL extern const IntegerFn INTEGER_WIDE[][GROUP512 + 1], INTEGER_VNNI[][GROUP512 + 1];
typedef void (*GemmFn)(const void *, int64_t, const Quantised *, int, float[GEMM_ROWS][16]);
INTERNAL extern const GemmFn INTEGER_GEMM[][GEMM_ROWS + 1];
/* AMX's GEMM (tiles_amx.c): up to AMX_ROWS rows by 16 outputs, through the instructions or the tile model
 * (amx_tiles, read once with the team's features by read_amx). */
#define AMX_ROWS 16
enum { AMX_NONE, AMX_HARDWARE, AMX_MODEL };
INTERNAL extern int amx_tiles;
INTERNAL void read_amx(void);
INTERNAL void amx_gemm_tile(int format, const void *w, int64_t next, const Quantised *x, int r0, int rows,
                            float out[AMX_ROWS][16]);

/* ---------------------------------------------------------------- helpers several files inline */

/* The 8 lanes' sum: the order every tile and norm adds a row's lanes in. */
__attribute__((target("avx2,fma,f16c"))) static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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

/* ---------------------------------------------------------------- the thread team (team.c) */

typedef void (*JobFn)(void *arg, int thread, int threads);

#define MAX_THREADS 64 /* the most members a team has */

INTERNAL extern int team_size;           /* the members that take a share of a job */
INTERNAL void read_features(void);       /* which tiles this CPU takes: has_avx512, has_vnni, amx_tiles */
INTERNAL extern int has_avx512, has_vnni; /* which tiles this CPU takes (read with the team) */
INTERNAL extern atomic_int barrier_count, barrier_sense, barrier_sleepers; /* team_barrier's */

/* Wait while *word == value: a short spin (a partner that is running arrives within microseconds), then asleep on
 * the word (a futex on Linux, else yielding), so that a member whose partner another process has descheduled gives
 * its core back instead of spinning through the partner's absence; `sleepers` counts those asleep, for wake. */
INTERNAL void wait_while(atomic_int *word, int value, atomic_int *sleepers);
/* Wake whoever sleeps on `word` (after it changed), where `sleepers` says any do. */
INTERNAL void wake_sleepers(atomic_int *word, atomic_int *sleepers);
#define WAIT_SPINS 1000 /* pauses before a wait sleeps: some 10-50 us */
INTERNAL extern pthread_mutex_t pass_lock; /* one pass (product, attention) at a time uses the team */

/* Every member of the team runs fn(arg, its index, team_size); returns when all have. */
INTERNAL void run_team(JobFn fn, void *arg);

/* A pass's scratch of `floats` floats, or NULL; under pass_lock. */
INTERNAL float *scratch_of(size_t floats);

/* All team_size members meet here; members past the team do not call it. The last to arrive flips the sense and
 * wakes any that fell asleep waiting (wait_while). */
static inline void team_barrier(int threads, int *sense) {
    if (threads == 1) return;
    *sense ^= 1;
    if (atomic_fetch_add(&barrier_count, 1) == threads - 1) {
        atomic_store(&barrier_count, 0);
        atomic_store(&barrier_sense, *sense); /* seq_cst: ordered before the read of the sleepers */
        wake_sleepers(&barrier_sense, &barrier_sleepers);
    } else {
        wait_while(&barrier_sense, !*sense, &barrier_sleepers);
    }
}

/* The share of `count` items (in units of `grain`) of member `thread` of `threads`. */
static inline void share(int count, int grain, int thread, int threads, int *begin, int *end) {
    int units = (count + grain - 1) / grain;
    *begin = (int)((int64_t)units * thread / threads) * grain;
    *end = (int)((int64_t)units * (thread + 1) / threads) * grain;
    if (*end > count) *end = count;
    if (*begin > count) *begin = count;
}

/* ---------------------------------------------------------------- products (product.c) and attention (attention.c) */

enum { STORE, ADD }; /* y = product (+ bias), or y += product (a residual) */

INTERNAL extern atomic_int scratch_failed; /* a product could not have its quantised rows: the pass or product fails */

/* The rows x [n, ldx] quantised per block (Quantised) in the calling thread's scratch (formats.c). */
INTERNAL const Quantised *quantised_rows(const float *x, int64_t ldx, int n, int in, int sets, int start_of);

/* y[r, o0..o1) = x[r] . W[o] (+ bias), stored or added (mode), for the n rows x [n, ldx]: every part of m. */
INTERNAL void product(const Matrix *m, const float *x, int64_t ldx, int n, int o0, int o1, float *y, int64_t ldy,
                      int mode);

/* How a layer's queries score their keys, and which they read. */
typedef struct {
    float scale;   /* q . k times this; 0: 1 / sqrt(head_dim) */
    float softcap; /* scores capped softly at +-softcap (softcap tanh(s / softcap)), or 0 */
    int window;    /* a query reads its last `window` keys only (a sliding window), or 0: all */
} Scoring;

/* The floats of scratch a member needs for attend_rows over at most `max_keys` keys a row. */
INTERNAL int64_t attention_scratch(int max_keys);

/* This member's share of the rows' attention in one layer's cache (attention.c). */
INTERNAL void attend_rows(const Rows *rows, const float *q, int64_t q_stride, float *out, int64_t out_stride,
                          const float *keys, const float *values, int64_t head_stride, int heads, int kv_heads,
                          int hd, const Scoring *how, float *scratch, int max_keys, int thread, int threads);

/* ---------------------------------------------------------------- the pass's layers (pass.c) */

/* One pass: rows through layers [first, end) of a model over a cache, and the scratch its phases share. sd_pass runs
 * one over its rows; sd_draft_chain (chain.c) one of a single row per drafted token, through the same code. */
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

/* The floats of scratch a pass over n rows that attend at most `max_keys` keys needs (pass_scratch lays them out). */
INTERNAL size_t pass_floats(const Model *m, int n, int max_keys);
/* Lay the pass's scratch out in `scratch` (pass_floats of them) for n rows that attend at most `max_keys` keys. */
INTERNAL void pass_scratch(Pass *p, float *scratch, int n, int max_keys);
/* This member's share of the pass's layers; the team meets at barriers (`sense`: this member's barrier sense,
 * carried from one pass to the next within a job). Ends at a barrier: the residual stream is then whole. */
INTERNAL void pass_layers(Pass *p, int thread, int threads, int *sense);
/* y = weight * (x / rms(x)) over `hidden` floats: each row's norm, a layer's and the final one (y may be x). */
__attribute__((target("avx2,fma,f16c"))) INTERNAL void rms_norm_row(const float *x, const float *weight, int hidden,
                                                                    float eps, float *y);

#endif
