// Configure-time probe: does the compiler accept the vsx variant's intrinsics and flags?
#include <altivec.h>
int main() {
  const __vector signed int acc = vec_msum(vec_splats((signed char)1), vec_splats((unsigned char)2), vec_splats(0));
  const __vector signed int q = vec_cts(vec_rint(vec_splats(1.5f)), 0);
  return vec_extract(acc, 0) + vec_extract(q, 0);
}
