/* kvbank — e^x in single precision for the CPU kernels (softmax, SiLU), scalar and 8 lanes of AVX2.
 *
 * x = k ln2 + r with |r| <= ln2/2 (k rounded to nearest by the 1.5 * 2^23 trick, ln2 split in two for an
 * exact product), e^r by the classic degree-6 minimax polynomial of single-precision exp (relative error
 * about 1e-7, at most a couple of ulps), 2^k built in the exponent bits. Arguments are clamped to
 * [-87, 88]: e^-87 is 1.6e-38 (it cannot change a sum that includes e^0 = 1, nor 1 + e^-87) and e^88 is
 * 1.7e38, still finite. glibc's vector expf is only declared under -ffast-math, and GCC -O2 leaves a
 * scalar exp loop of unknown length scalar, hence the explicit AVX2 form. Both forms use the same
 * polynomial; FMA may contract the scalar one, so a machine gives the same result on every path, not the
 * same bits as another machine. */
#ifndef KVB_KERNELS_CPU_VEXP_H
#define KVB_KERNELS_CPU_VEXP_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVB_VEXP_AVX2 1
#else
#define KVB_VEXP_AVX2 0
#endif

#define KVB_EXP_LO (-87.0f)
#define KVB_EXP_HI 88.0f

static inline float kvb__expf(float x) {
    x = x < KVB_EXP_LO ? KVB_EXP_LO : x > KVB_EXP_HI ? KVB_EXP_HI : x;
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float e = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return e * scale;
}

#if KVB_VEXP_AVX2
__attribute__((target("avx2,fma"))) static inline __m256 kvb__expf8(__m256 x) {
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(KVB_EXP_LO)), _mm256_set1_ps(KVB_EXP_HI));
    __m256 k = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic), magic);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(k, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 e = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
}
#endif

#endif
