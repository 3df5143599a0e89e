// Configure-time probe: does the compiler accept the mma variant's builtins and flags?
#include <altivec.h>
int main() {
  __vector_quad acc;
  __builtin_mma_xxsetaccz(&acc);
  const __vector unsigned char one = vec_splats((unsigned char)1);
  __builtin_mma_xvi8ger4pp(&acc, one, one);
  __vector signed int r[4];
  __builtin_mma_disassemble_acc(r, &acc);
  return vec_extract(r[0], 0) - 4;
}
