/* The tiles for 8 outputs on AVX-512 (F and DQ): float weights, and Q8 and Q8H multiplied in floats, each the AVX2
 * tiles' FMAs lane for lane (tiles_avx2.c), two rows' outputs to a register; their tables (fused.h) are how
 * product.c calls them. */
#include "fused.h"
#include "tiles.h"

/* A pair's two sums: the low 8 lanes (one output), then the high 8 (the next), each as sum8 adds them. */
__attribute__((target(AVX512_TARGET))) static inline void sum8_pair(__m512 v, float *out) {
    out[0] = sum8(_mm512_castps512_ps256(v));
    out[1] = sum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* Two rows' eight weights each as one register, per format. */
#define LOAD16_F16(w) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w)))
#define LOAD16_F32(w) _mm512_loadu_ps(w)
#define LOAD16_BF16(w) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w))), 16))

/* The same tiles for 8 outputs on AVX-512: a zmm holds a pair of rows' chunk (16 values: row o's 8, then o+1's)
 * and the 8 inputs twice, so each 16-lane FMA is the two 8-lane FMAs the tiles above do for o and o+1, lane for
 * lane: the same bits, half the instructions. */
#define TILE512(NAME, T, LOAD16, R)                                                                                \
    __attribute__((target(AVX512_TARGET))) static void NAME##z_##R(                  \
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

/* On AVX-512, two pairs of rows (4 outputs) from row j: each zmm the pair's 8 weights of one row, then the other's,
 * dequantised by the pair's d and m in the matching halves; the same bits as the tiles above. */
#define TILE_Q8_512(NAME, BLOCK, SETS, R)                                                                          \
    __attribute__((target(AVX512_TARGET))) static void NAME##z_##R(                            \
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

const TileFn WIDE512[][GROUP512 + 1] = {[F16] = {0, f16z_1, f16z_2, f16z_3, f16z_4, f16z_5, f16z_6},
                                        [F32] = {0, f32z_1, f32z_2, f32z_3, f32z_4, f32z_5, f32z_6},
                                        [BF16] = {0, bf16z_1, bf16z_2, bf16z_3, bf16z_4, bf16z_5, bf16z_6}};
const Q8Fn Q8_512[][GROUP512 + 1] = {[Q8] = {0, q8z_1, q8z_2, q8z_3, q8z_4, q8z_5, q8z_6},
                                     [Q8H] = {0, q8hz_1, q8hz_2, q8hz_3, q8hz_4, q8hz_5, q8hz_6}};
