// FP8 e4m3 ("fn": no infinities, NaN only at S.1111.111) decoding for weight_gemm.cpp, which includes
// it. A byte s.eeee.mmm becomes the float16 s.0eeee.mmm0000000: the same fields under float16's
// exponent bias (15; e4m3's is 7), with float16 subnormals (e = 0) where e4m3 has its own, so the
// float16 value is the e4m3 value times 2^-8 for every finite byte. vcvtph2ps widens it exactly, and a
// multiply by 2^8 (exact) gives the e4m3 value in float32: no table, no gather, no float32 subnormals.
// NaN bytes would decode to 480: weight_gemm.py refuses them when it packs.

#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__)
/* 16 bytes -> 16 float16 bit patterns (AVX2 16-bit lanes: the build has no AVX-512BW) */
static inline __m256i fp8_to_half_bits(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    return _mm256_or_si256(sign, _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
}

static inline void decode_fp8(const uint8_t* row, __m512 w[2]) {  /* a panel row: 32 columns */
    const __m512 two8 = _mm512_set1_ps(256.0f);
    w[0] = _mm512_mul_ps(_mm512_cvtph_ps(fp8_to_half_bits(row)), two8);
    w[1] = _mm512_mul_ps(_mm512_cvtph_ps(fp8_to_half_bits(row + 16)), two8);
}
#else
/* 8 bytes -> 8 float16 bit patterns */
static inline __m128i fp8_to_half_bits(const uint8_t* p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    return _mm_or_si128(sign, _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
}

static inline void decode_fp8(const uint8_t* row, __m256 w[4]) {  /* a panel row: 32 columns */
    const __m256 two8 = _mm256_set1_ps(256.0f);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(_mm256_cvtph_ps(fp8_to_half_bits(row + 8 * j)), two8);
}
#endif
