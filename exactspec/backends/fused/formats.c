/* The weight formats as native.py checks them at load (their table, sd_formats, and the structures' sizes,
 * sd_struct_sizes), and each row's inputs quantised to bytes per block of 32 for the integer tiles. */
#include "fused.h"

/* FORMATS' integer column is INTEGER()'s, which the product code tests. */
#define SAME_INTEGER(name, weights, integer, value_bytes, block_bytes, super_bytes, head_bytes)                    \
    static_assert(INTEGER(name) == (integer), #name ": INTEGER() and FORMATS differ");
FORMATS(SAME_INTEGER)

/* A format as native.py reads it (native._FormatRow). */
typedef struct {
    const char *name, *weights; /* its enum's name; exactspec's name for the weights */
    int number, integer, value_bytes, block_bytes, super_bytes, head_bytes;
} FormatRow;

#define FORMAT_ROW(name, weights, integer, value_bytes, block_bytes, super_bytes, head_bytes)                      \
    {#name, weights, name, integer, value_bytes, block_bytes, super_bytes, head_bytes},
static const FormatRow FORMAT_ROWS[] = {FORMATS(FORMAT_ROW)};

/* The weight formats (FORMATS), in the order of their numbers: *rows points at them; returns how many. */
int sd_formats(const FormatRow **rows) {
    *rows = FORMAT_ROWS;
    return FORMAT_COUNT;
}

/* The sizes of the structures native.py declares with ctypes, in its order (STRUCT_SIZES): Model, Layer, Cache,
 * Rows, Matrix; at most `count` of them (the blocks' sizes are in sd_formats' table). Returns how many it wrote. */
int sd_struct_sizes(int64_t *sizes, int count) {
    const int64_t known[] = {sizeof(Model), sizeof(Layer), sizeof(Cache), sizeof(Rows), sizeof(Matrix)};
    int written = 0;
    for (; written < count && written < (int)(sizeof(known) / sizeof(known[0])); written++) sizes[written] = known[written];
    return written;
}

/* Row x [in] as bytes per block of 32 (fused.h): q, and per block its scale and per set its sum and offset, block
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

/* The rows x [n, ldx] quantised per block (Quantised) in the calling thread's scratch, kept and grown; 0 if it
 * could not be had. */
const Quantised *quantised_rows(const float *x, int64_t ldx, int n, int in, int sets, int start_of) {
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
