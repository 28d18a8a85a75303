/* The integer formats' tiles on AVX512-VNNI: the row tiles for up to GROUP512 rows (TILE_QUAD with vpdpbusd), and
 * the GEMM tiles for many rows by 16 outputs; their tables (fused.h) are how product.c calls them. */
#include "fused.h"
#include "tiles.h"

/* sum + the products of w's bytes (u8) and the 4 bytes at x (s8), broadcast to every lane by the instruction's own
 * memory operand (vpdpbusd m32bcst: compilers broadcast in a register first, an instruction more per quad and row). */
__attribute__((target(VNNI_TARGET))) static inline __m256i
dpbusd_broadcast(__m256i sum, __m256i w, const int8_t *x) {
#ifndef EXACTSPEC_EMULATED
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(sum) : "v"(w), "m"(*(const int32_t *)x));
    return sum;
#else
    int32_t four;
    memcpy(&four, x, 4);
    return _mm256_dpbusd_epi32(sum, w, _mm256_set1_epi32(four));
#endif
}

#define DOT2_VNNI_Q4(sum, w0, w1, x) dpbusd_broadcast(dpbusd_broadcast(sum, w0, x), w1, (x) + 4)
#define DOT2_VNNI_Q6 DOT2_VNNI_Q4
#define DOT2_VNNI_Q5 DOT2_VNNI_Q4
#define DOT2_VNNI_Q3 DOT2_VNNI_Q4
#define DOT2_VNNI_Q8 DOT2_VNNI_Q4

/* The integer formats' row tiles for 1 to GROUP512 rows (NAMEv_R). */
#define TILES_QUAD_VNNI(NAME, BLOCK, SETS, BITS, SCALE)                                                            \
    TILE_QUAD(NAME##v, VNNI_TARGET, VNNI, BLOCK, SETS, BITS, SCALE, 1)                                             \
    TILE_QUAD(NAME##v, VNNI_TARGET, VNNI, BLOCK, SETS, BITS, SCALE, 2)                                             \
    TILE_QUAD(NAME##v, VNNI_TARGET, VNNI, BLOCK, SETS, BITS, SCALE, 3)                                             \
    TILE_QUAD(NAME##v, VNNI_TARGET, VNNI, BLOCK, SETS, BITS, SCALE, 4)                                             \
    TILE_QUAD(NAME##v, VNNI_TARGET, VNNI, BLOCK, SETS, BITS, SCALE, 5)                                             \
    TILE_QUAD(NAME##v, VNNI_TARGET, VNNI, BLOCK, SETS, BITS, SCALE, 6)
INTEGER_TILES(TILES_QUAD_VNNI)

/* The GEMM tile for many rows on AVX512-VNNI: GEMM_ROWS rows by 16 outputs, two blocks of 8 weight rows side by
 * side in each zmm (the block at w in the low half, the block `next` bytes further in the high), so one quad's
 * unpacking and one row's broadcast bytes feed 16 outputs, and a weight block, once in L1, feeds every row of the
 * group. Lane for lane it does the 8-output tiles' work: each lane's integer sums are exact whatever adds them, and
 * its epilogue (add_set's mul and FMAs) is the same float operations in the same order, so a row's bits are the
 * same in this tile, in an 8-output tile, alone or in a pass of any width. */
#define GEMM_PREFETCH 8192 /* bytes ahead a GEMM tile asks for each of its two streams (4096 left them short) */
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
#define Q3_PAIRED16(b, next, g)                                                                                    \
    _mm512_and_si512(_mm512_srli_epi16(LOAD_PAIR(b, next, q[((g) / 2) % 3]), 3 * ((g) % 2)), _mm512_set1_epi8(0x07))
#define Q3_SPLIT16(b, next, g)                                                                                     \
    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(LOAD_PAIR(b, next, q[(g) % 2]), 6), _mm512_set1_epi8(0x03)),  \
                    _mm512_and_si512(_mm512_srli_epi16(LOAD_PAIR(b, next, q[2]), ((g) - 2) & 7), _mm512_set1_epi8(0x04)))
#define QUAD16_Q3(b, next, g) ((g) < 6 ? Q3_PAIRED16(b, next, g) : Q3_SPLIT16(b, next, g))
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
#ifndef EXACTSPEC_EMULATED
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(w), "m"(*(const int32_t *)x));
    return sum;
#else
    int32_t four;
    memcpy(&four, x, 4);
    return _mm512_dpbusd_epi32(sum, w, _mm512_set1_epi32(four));
#endif
}

/* add_set (add_scaled) on 16 lanes: the same operations, lane for lane; e: the row's block scale, offset: its
 * e sum(xq) over the set. */
__attribute__((target(VNNI_TARGET))) static inline __m512 add_scaled16(__m512 acc, __m512i isum, __m512 d, float e) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(e)), acc);
}
#define SET16_F32(acc, isum, d, m, e, offset) _mm512_fmadd_ps(m, _mm512_set1_ps(offset), add_scaled16(acc, isum, d, e))
#define SET16_F16 SET16_F32
#define SET16_KM SET16_F32
#define SET16_R SET16_F32
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

const IntegerFn INTEGER_VNNI[][GROUP512 + 1] = {[Q8I] = ROW_TILES(q8iv), [Q8HI] = ROW_TILES(q8hiv),
                                                [Q4I] = ROW_TILES(q4iv), [Q6I] = ROW_TILES(q6iv),
                                                [Q4KI] = ROW_TILES(q4kiv), [Q5I] = ROW_TILES(q5iv),
                                                [Q5KI] = ROW_TILES(q5kiv), [Q3RI] = ROW_TILES(q3riv)};

const GemmFn INTEGER_GEMM[][GEMM_ROWS + 1] = {[Q8I] = GEMM_TILES(q8ig), [Q8HI] = GEMM_TILES(q8hig),
                                             [Q4I] = GEMM_TILES(q4ig), [Q6I] = GEMM_TILES(q6ig),
                                             [Q4KI] = GEMM_TILES(q4kig), [Q5I] = GEMM_TILES(q5ig),
                                             [Q5KI] = GEMM_TILES(q5kig), [Q3RI] = GEMM_TILES(q3rig)};
