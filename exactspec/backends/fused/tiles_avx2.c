/* The tiles on AVX2 (every CPU the kernels run on; EXACTSPEC_FUSED_AVX2 holds any CPU to them): float weights, Q8
 * and Q8H multiplied in floats, and the integer formats' row tiles; their tables (fused.h) are how product.c calls
 * them. */
#include "fused.h"
#include "tiles.h"

/* Eight weights as floats, per format. */
#define LOAD8_F16(w) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w)))
#define LOAD8_F32(w) _mm256_loadu_ps(w)
#define LOAD8_BF16(w) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w))), 16))

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

/* A row's 4 input bytes at xq, in every 32-bit lane. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256i quad_inputs(const int8_t *xq) {
    int32_t four;
    memcpy(&four, xq, sizeof four);
    return _mm256_set1_epi32(four);
}

#define MADD_ONES(pairs) _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
#define DOT2_AVX2_Q4(sum, w0, w1, x)                                                                               \
    _mm256_add_epi32(sum, MADD_ONES(_mm256_add_epi16(_mm256_maddubs_epi16(w0, quad_inputs(x)),                    \
                                                     _mm256_maddubs_epi16(w1, quad_inputs((x) + 4)))))
#define DOT2_AVX2_Q6 DOT2_AVX2_Q4
#define DOT2_AVX2_Q5 DOT2_AVX2_Q4
#define DOT2_AVX2_Q3 DOT2_AVX2_Q4
#define CENTRED(w) _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80))
#define DOT_AVX2_Q8(sum, w, x)                                                                                     \
    _mm256_add_epi32(sum, MADD_ONES(_mm256_maddubs_epi16(_mm256_abs_epi8(CENTRED(w)),                            \
                                                         _mm256_sign_epi8(quad_inputs(x), CENTRED(w)))))
#define DOT2_AVX2_Q8(sum, w0, w1, x) DOT_AVX2_Q8(DOT_AVX2_Q8(sum, w0, x), w1, (x) + 4)

/* The integer formats' row tiles for 1 to GROUP rows (NAME_R). */
#define TILES_QUAD_AVX2(NAME, BLOCK, SETS, BITS, SCALE)                                                            \
    TILE_QUAD(NAME, AVX2_TARGET, AVX2, BLOCK, SETS, BITS, SCALE, 1)                                                \
    TILE_QUAD(NAME, AVX2_TARGET, AVX2, BLOCK, SETS, BITS, SCALE, 2)                                                \
    TILE_QUAD(NAME, AVX2_TARGET, AVX2, BLOCK, SETS, BITS, SCALE, 3)                                                \
    TILE_QUAD(NAME, AVX2_TARGET, AVX2, BLOCK, SETS, BITS, SCALE, 4)                                                \
    TILE_QUAD(NAME, AVX2_TARGET, AVX2, BLOCK, SETS, BITS, SCALE, 5)                                                \
    TILE_QUAD(NAME, AVX2_TARGET, AVX2, BLOCK, SETS, BITS, SCALE, 6)
INTEGER_TILES(TILES_QUAD_AVX2)

const TileFn WIDE[][GROUP + 1] = {[F16] = {0, f16_1x8, f16_2x4, f16_3x2, f16_4x2},
                                  [F32] = {0, f32_1x8, f32_2x4, f32_3x2, f32_4x2},
                                  [BF16] = {0, bf16_1x8, bf16_2x4, bf16_3x2, bf16_4x2}};
const int WIDTH[GROUP + 1] = {0, 8, 4, 2, 2};
const Q8Fn Q8_WIDE[][GROUP + 1] = {[Q8] = {0, q8_1x8, q8_2x4, q8_3x2, q8_4x2},
                                   [Q8H] = {0, q8h_1x8, q8h_2x4, q8h_3x2, q8h_4x2}};
const IntegerFn INTEGER_WIDE[][GROUP512 + 1] = {[Q8I] = ROW_TILES(q8i), [Q8HI] = ROW_TILES(q8hi),
                                                [Q4I] = ROW_TILES(q4i), [Q6I] = ROW_TILES(q6i),
                                                [Q4KI] = ROW_TILES(q4ki), [Q5I] = ROW_TILES(q5i),
                                                [Q5KI] = ROW_TILES(q5ki), [Q3RI] = ROW_TILES(q3ri)};
