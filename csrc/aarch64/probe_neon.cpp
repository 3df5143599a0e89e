// Configure-time probe: does the compiler accept the neon variant's intrinsics and flags?
#include <arm_neon.h>
int main() {
  const int32x4_t acc = vpadalq_s16(vdupq_n_s32(0), vmull_s8(vdup_n_s8(1), vdup_n_s8(2)));
  const int32x4_t q = vcvtnq_s32_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(0x3c00))));
  return vgetq_lane_s32(acc, 0) + vgetq_lane_s32(q, 0);
}
