/*
 * exp16 (16 lanes at once) against exp_neg (one value) of daemon/engine/native/decode-attention.h, bit
 * for bit: every 17th float in [−100, 0] and in [0, 1] (scores less their maximum are ≤ 0; +0 is the
 * maximum's own), each of the 16 lanes in turn. Prints {"path", "checked", "differ"} as JSON. Built
 * by test/shards/native-attention.test.ts once for this CPU (-march=native) and once for baseline
 * x86-64 (no AVX2: the generic vector path).
 */
#include <stdio.h>
#include "../../../daemon/engine/native/decode-attention.h"

int main (void) {
  const uint32_t ranges[2][2] = { { 0x80000000u, 0xC2C80000u }, { 0x00000000u, 0x3F800000u } };
  long checked = 0, differ = 0;
  float x[16], lanes[16];
  for (int g = 0; g < 2; g++) {
    for (uint64_t u = ranges[g][0]; u <= (uint64_t)ranges[g][1]; u += 17 * 16) {
      for (int i = 0; i < 16; i++) { const uint32_t b = (uint32_t)(u + 17 * (uint64_t)i); memcpy(&x[i], &b, sizeof b); }
      store16(lanes, exp16(load16(x)));
      for (int i = 0; i < 16; i++) {
        const float one = exp_neg(x[i]);
        if (memcmp(&one, &lanes[i], sizeof one) != 0) differ++;
        checked++;
      }
    }
  }
#if defined(__AVX512F__)
  const char *path = "avx512";
#elif defined(__AVX2__)
  const char *path = "avx2";
#else
  const char *path = "generic";
#endif
  printf("{\"path\":\"%s\",\"checked\":%ld,\"differ\":%ld}\n", path, checked, differ);
  return 0;
}
