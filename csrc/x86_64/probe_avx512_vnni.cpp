// Configure-time probe: does the compiler accept the avx512_vnni variant's intrinsics and flags?
#include <immintrin.h>
int main() {
  const __m512i v = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), _mm512_set1_epi8(2));
  return _mm512_reduce_add_epi32(v);
}
