// Configure-time probe: does the compiler accept the avx2 variant's intrinsics and flags?
#include <immintrin.h>
int main() {
  const __m256i v = _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_set1_epi16(2));
  return _mm256_extract_epi32(v, 0) + _mm_extract_epi16(_mm256_cvtps_ph(_mm256_set1_ps(1.f), 0), 0);
}
