// Configure-time probe: does the compiler accept the dotprod variant's intrinsics and flags?
#include <arm_neon.h>
int main() {
  const int8x16_t one = vdupq_n_s8(1);
  return vgetq_lane_s32(vdotq_laneq_s32(vdotq_s32(vdupq_n_s32(0), one, one), one, one, 3), 0);
}
