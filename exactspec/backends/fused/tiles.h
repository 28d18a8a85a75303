/* The macros the tile files (tiles_avx2.c, tiles_avx512.c, tiles_vnni.c) build their tiles from: how far ahead
 * they prefetch, how a Q8 block's chunks are read, and the integer tiles' two axes and their one body (TILE_QUAD),
 * which AVX2 and AVX512-VNNI instantiate each with its own dot product (DOT2_AVX2_*, DOT2_VNNI_*). */
#ifndef EXACTSPEC_TILES_H
#define EXACTSPEC_TILES_H

#include "fused.h"

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

/* The lines of the chunk PREFETCH_BYTES ahead. */
#define PREFETCH_CHUNK(w, T)                                                                                       \
    for (int line = 0; line < CHUNK * (int)sizeof(T); line += 64)                                                  \
        _mm_prefetch((const char *)(w) + PREFETCH_BYTES + line, _MM_HINT_T0);

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

/* acc + set t of block `block` of quantised row `row`, for 8 outputs: isum, their integer sums over the set
 * (started from the row's OFFSET sum(xq): where the tile summed q - centre, or where the offset is -centre times the
 * scale), times the set's scales d and the row's block scale e. */
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
 * exact (an 11-bit float16 significand times an integer of at most 8 bits), so they are the floats q8_rows gives;
 * R: a row-scaled format's, its block's integer scales and mins times its rows' float d and -dmin (their head).
 * SET_*: acc plus the set, with its offsets (add_set), or with K6's -32 d taken in the integer sums (add_scaled). */
#define SCALES_F32(b, s, k, t) _mm256_loadu_ps((const float *)(b)->d + 8 * (t))
#define OFFSETS_F32(b, s, k, t) _mm256_loadu_ps((const float *)(b)->m + 8 * (t))
#define SCALES_F16(b, s, k, t) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b)->d))
#define OFFSETS_F16(b, s, k, t) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b)->m))
#define SCALES_KM(b, s, k, t) _mm256_mul_ps(BYTES8_U((s)->sc[k]), _mm256_loadu_ps((s)->d))
#define OFFSETS_KM(b, s, k, t) _mm256_mul_ps(BYTES8_U((s)->mn[k]), _mm256_loadu_ps((s)->dmin))
#define SCALES_K6(b, s, k, t) _mm256_mul_ps(BYTES8_S((s)->sc[k][t]), _mm256_loadu_ps((s)->d))
#define OFFSETS_K6(b, s, k, t) _mm256_setzero_ps()
#define SCALES_R(b, s, k, t) _mm256_mul_ps(BYTES8_U((b)->sc), _mm256_loadu_ps((s)->d))
#define OFFSETS_R(b, s, k, t) _mm256_mul_ps(BYTES8_U((b)->mn), _mm256_loadu_ps((s)->dmin))
#define SET_F32(acc, isum, d, m, x, row, block, sets, t) add_set(acc, isum, d, m, x, row, block, sets, t)
#define SET_F16 SET_F32
#define SET_KM SET_F32
#define SET_R SET_F32
#define SET_K6(acc, isum, d, m, x, row, block, sets, t) add_scaled(acc, isum, d, x, row, block)

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
#define ROWS_OF_block_q3r8 rows_q3r8
#define SUPER_R(BLOCK) ROWS_OF_##BLOCK
#define FIRST_R(BLOCK, w) (((const ROWS_OF_##BLOCK *)(w))->blocks)
#define NEXT_R NEXT_FLAT
#define FIRST_F32 FIRST_FLAT
#define FIRST_F16 FIRST_FLAT
#define FIRST_KM FIRST_SUPER
#define FIRST_K6 FIRST_SUPER
#define NEXT_F32 NEXT_FLAT
#define NEXT_F16 NEXT_FLAT
#define NEXT_KM NEXT_SUPER
#define NEXT_K6 NEXT_SUPER

/* p, `next` bytes further: the same place in the next block of 8 weight rows (the GEMM tiles' second block). */
#define AT_NEXT(p, next) ((__typeof__(p))((const char *)(p) + (next)))

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

/* Quad g of a block_q3r8: quads 2p and 2p + 1 (p < 3) in bits 0-2 and 3-5 of q[p]; quad 6's low 2 bits in bits
 * 6-7 of q[0], quad 7's of q[1], and their third bits in bits 6 and 7 of q[2]: 2.4 instructions a quad, where 2 bits
 * and a bit plane apart took 5 and left 3 bits slower than 4 on AVX2. */
#define Q3_PAIRED(b, g)                                                                                            \
    _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b)->q[((g) / 2) % 3]), 3 * ((g) % 2)), \
                     _mm256_set1_epi8(0x07))
#define Q3_SPLIT(b, g)                                                                                             \
    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b)->q[(g) % 2]), 6),  \
                                     _mm256_set1_epi8(0x03)),                                                      \
                    _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b)->q[2]), ((g) - 2) & 7), \
                                     _mm256_set1_epi8(0x04)))
#define QUAD_Q3(b, g) ((g) < 6 ? Q3_PAIRED(b, g) : Q3_SPLIT(b, g))

/* Bits 2k and 2k + 1 of each byte of hi moved to bits 4 and 5, the rest cleared. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256i top_bits(__m256i hi, int k) {
    __m256i moved = k < 3 ? _mm256_slli_epi16(hi, 4 - 2 * k) : _mm256_srli_epi16(hi, 2);
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
}

/* out[r][0..7] for R quantised rows from r0 and the 8 outputs of the quad blocks from w: per set, each row's sums
 * of its quads' products (DOT: maddubs then madd on AVX2, vpdpbusd on AVX512-VNNI, u8 x s8 both), then add_set.
 * maddubs adds pairs of products in int16: 6-bit and 4-bit weights' pairs from two quads add up there too before
 * madd widens them (2 x 2 x 63 x 127 < 2^15); a byte q up to 255 could saturate a pair, so on AVX2 a Q8 byte is taken
 * as q - 128 (its magnitude times the input's sign-corrected byte: at most 2 x 128 x 127), each quad widened alone,
 * and its sums start from 128 sum(xq) (OFFSET). The sums are exact integers, so both give the same bits. */
/* Independent sums a row's set is split among (quads g and g + 1 in chain g / 2 % CHAINS), enough across the R rows
 * that a sum's latency does not stall the next (vpdpbusd: 4 or 5 cycles, 2 a cycle). */
#define CHAINS_AVX2(R, SETS) ((R) <= 3 ? 4 / (SETS) : (R) <= 4 ? 2 : 1) /* 5 and 6 rows: their own rows' sums */
#define CHAINS_VNNI(R, SETS) ((R) <= 3 ? 4 / (SETS) : 2)
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
                __m256i sum[R][CHAINS_##ISA(R, SETS)];                                                                   \
                for (int r = 0; r < R; r++) {                                                                      \
                    for (int c = 0; c < CHAINS_##ISA(R, SETS); c++) sum[r][c] = _mm256_setzero_si256();                  \
                    if (OFFSET_##ISA##_##BITS)                                                                     \
                        sum[r][0] = _mm256_set1_epi32(x->start[block_of(x, r0 + r, block) * SETS + t]);            \
                }                                                                                                  \
                _Pragma("GCC unroll 4") for (int g = t * 8 / SETS; g < (t + 1) * 8 / SETS; g += 2) {               \
                    __m256i quad = QUAD_##BITS(b, g), next = QUAD_##BITS(b, g + 1);                                \
                    for (int r = 0; r < R; r++) {                                                                  \
                        __m256i *chain = &sum[r][g / 2 % CHAINS_##ISA(R, SETS)];                                         \
                        *chain = DOT2_##ISA##_##BITS(*chain, quad, next, xq + 32 * r + 4 * g);                     \
                    }                                                                                              \
                }                                                                                                  \
                for (int r = 0; r < R; r++) {                                                                      \
                    for (int c = 1; c < CHAINS_##ISA(R, SETS); c++) sum[r][0] = _mm256_add_epi32(sum[r][0], sum[r][c]);  \
                    acc[r] = SET_##SCALE(acc[r], sum[r][0], d, m, x, r0 + r, block, SETS, t);                       \
                }                                                                                                  \
            }                                                                                                      \
            NEXT_##SCALE(b, s, block)                                                                              \
        }                                                                                                          \
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r], acc[r]);                                              \
    }
/* An integer format's row tiles for 1 to GROUP512 rows (NAME_R), as INTEGER_WIDE and INTEGER_VNNI list them. */
#define ROW_TILES(NAME) {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6}
static_assert(GROUP512 == 6, "ROW_TILES lists 6 row tiles a format");

/* The integer formats' tiles, each format once: its tiles' name, block, sets of scales a block, bits and scales
 * (row tiles NAME_R and NAMEv_R; GEMM tiles NAMEg_R). */
#define INTEGER_TILES(TILES)                                                                                       \
    TILES(q8i, block_q8x8, 1, Q8, F32)                                                                             \
    TILES(q8hi, block_q8x16, 2, Q8, F32)                                                                           \
    TILES(q4i, block_q4x8, 1, Q4, F16)                                                                             \
    TILES(q4ki, block_q4k8, 1, Q4, KM)                                                                             \
    TILES(q5i, block_q5x8, 1, Q5, F16)                                                                             \
    TILES(q5ki, block_q5k8, 1, Q5, KM)                                                                             \
    TILES(q6i, block_q6x8, 2, Q6, K6)                                                                             \
    TILES(q3ri, block_q3r8, 1, Q3, R)

#endif
