/* Included first by tests/test_emulated_avx512.py's build of the C kernels with -DEXACTSPEC_EMULATED: the AVX-512
 * intrinsics their AVX-512 and VNNI tiles call, supplied by SIMDe (Debian's libsimde-dev) on a CPU with AVX2, so
 * that any machine runs those tiles' code; and the few SIMDe 0.7.4 lacks, written here the way the instructions
 * define them. A check build, never installed. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

static inline simde__m512 emulated_cvtepi32_ps(simde__m512i a) { /* rounded to the nearest, as the instruction */
    int32_t in[16];
    float out[16];
    simde_mm512_storeu_si512(in, a);
    for (int i = 0; i < 16; i++) out[i] = (float)in[i];
    return simde_mm512_loadu_ps(out);
}
#define _mm512_cvtepi32_ps emulated_cvtepi32_ps

static inline int emulated_reduce_add_epi32(simde__m512i a) {
    int32_t in[16];
    uint32_t sum = 0;
    simde_mm512_storeu_si512(in, a);
    for (int i = 0; i < 16; i++) sum += (uint32_t)in[i];
    return (int)sum;
}
#define _mm512_reduce_add_epi32 emulated_reduce_add_epi32

static inline simde__m512 emulated_cvtph_ps(__m256i a) {
    float out[16];
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm256_castsi256_si128(a)));
    _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)));
    return simde_mm512_loadu_ps(out);
}
#define _mm512_cvtph_ps emulated_cvtph_ps

static inline simde__m512i emulated_cvtepu16_epi32(__m256i a) {
    uint16_t in[16];
    int32_t out[16];
    _mm256_storeu_si256((__m256i *)in, a);
    for (int i = 0; i < 16; i++) out[i] = in[i];
    return simde_mm512_loadu_si512(out);
}
#define _mm512_cvtepu16_epi32 emulated_cvtepu16_epi32

static inline simde__m512i emulated_cvtepu8_epi32(__m128i a) {
    uint8_t in[16];
    int32_t out[16];
    _mm_storeu_si128((__m128i *)in, a);
    for (int i = 0; i < 16; i++) out[i] = in[i];
    return simde_mm512_loadu_si512(out);
}
#define _mm512_cvtepu8_epi32 emulated_cvtepu8_epi32
