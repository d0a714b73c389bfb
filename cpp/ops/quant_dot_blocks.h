// GGUF weight blocks as the quantized dot products see them (quant_dot.h): a block is kGroups groups of 32
// elements; group g holds the integer quants w (signed, |w| <= 128) of elements 32g .. 32g+31, the block's
// value is y = d * sc * w - dmin * mn per 16 elements (sc, mn: small integer sub-scales and sub-mins; 32-element
// types have sc = 1, their min is a float m: y = d * w + m). Scalar parts here (shared by every kernel set);
// the x86 kernels add vector versions of group() (quant_dot_x86.h). Byte layouts: ggml-common.h / dequant.cpp.
// kOffset >= 0: the stored quant is u = w + kOffset in [0, 63], so the vector kernels multiply u (unsigned)
// by x directly and subtract kOffset * sum(x) per block or 16-element sub-block (the activation blocks
// carry those sums); kOffset < 0: w spans int8 (Q8_0, IQ4), the vector group() returns w itself.
// kDAt / kMAt: byte offsets of the f16 d and of the f16 m / dmin (-1: none), for the x86 kernels' F16C loads.
#pragma once
#include <cstdint>
#include <cstring>

#include "core/half.h"

namespace tallow::ops::qdot {

inline float ld_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}
inline uint32_t ld_u32(const uint8_t* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u;
}

// ggml's kvalues_iq4nl: the 16 levels an IQ4 nibble indexes.
alignas(16) inline constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                       1,    13,   25,  38,  53,  69,  89,  113};

// Activation blocks (quant_dot.h).
struct Act32 {
  float d, s;
  int8_t q[32];
};
struct Act256 {
  float d;
  int16_t bsums[16];
  int8_t q[256];
};
static_assert(sizeof(Act32) == 40 && sizeof(Act256) == 292, "activation blocks are packed");

// ---- 32-element types: d(), m() (kMin), group_s(b, w) -------------------------------------------------
// Nibble j of qs[16] (low nibble: element j, high: element j + 16), as in every 32-element 4/5-bit type.
inline void nibbles_s(const uint8_t* qs, int8_t* w, int off) {
  for (int j = 0; j < 16; ++j) w[j] = (int8_t)((qs[j] & 15) - off), w[j + 16] = (int8_t)((qs[j] >> 4) - off);
}
struct Q4_0B {
  static constexpr int kBlock = 32, kBytes = 18, kOffset = 8, kDAt = 0, kMAt = -1;
  static constexpr bool kMin = false;
  static float d(const uint8_t* b) { return ld_f16(b); }
  static void group_s(const uint8_t* b, int, int8_t* w) { nibbles_s(b + 2, w, 8); }
};
struct Q4_1B {
  static constexpr int kBlock = 32, kBytes = 20, kOffset = 0, kDAt = 0, kMAt = 2;
  static constexpr bool kMin = true;
  static float d(const uint8_t* b) { return ld_f16(b); }
  static float m(const uint8_t* b) { return ld_f16(b + 2); }
  static void group_s(const uint8_t* b, int, int8_t* w) { nibbles_s(b + 4, w, 0); }
};
// 5-bit: bit j of qh is element j's 5th bit; the value is (nibble | bit << 4) - off.
inline void five_bits_s(const uint8_t* qh, const uint8_t* qs, int8_t* w, int off) {
  const uint32_t h = ld_u32(qh);
  for (int j = 0; j < 16; ++j) {
    w[j] = (int8_t)(((qs[j] & 15) | (((h >> j) & 1) << 4)) - off);
    w[j + 16] = (int8_t)(((qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4)) - off);
  }
}
struct Q5_0B {
  static constexpr int kBlock = 32, kBytes = 22, kOffset = 16, kDAt = 0, kMAt = -1;
  static constexpr bool kMin = false;
  static float d(const uint8_t* b) { return ld_f16(b); }
  static void group_s(const uint8_t* b, int, int8_t* w) { five_bits_s(b + 2, b + 6, w, 16); }
};
struct Q5_1B {
  static constexpr int kBlock = 32, kBytes = 24, kOffset = 0, kDAt = 0, kMAt = 2;
  static constexpr bool kMin = true;
  static float d(const uint8_t* b) { return ld_f16(b); }
  static float m(const uint8_t* b) { return ld_f16(b + 2); }
  static void group_s(const uint8_t* b, int, int8_t* w) { five_bits_s(b + 4, b + 8, w, 0); }
};
struct Q8_0B {
  static constexpr int kBlock = 32, kBytes = 34, kOffset = -1, kDAt = 0, kMAt = -1;
  static constexpr bool kMin = false;
  static float d(const uint8_t* b) { return ld_f16(b); }
  static void group_s(const uint8_t* b, int, int8_t* w) { std::memcpy(w, b + 2, 32); }
};
struct IQ4_NLB {
  static constexpr int kBlock = 32, kBytes = 18, kOffset = -1, kDAt = 0, kMAt = -1;
  static constexpr bool kMin = false;
  static float d(const uint8_t* b) { return ld_f16(b); }
  static void group_s(const uint8_t* b, int, int8_t* w) {
    for (int j = 0; j < 16; ++j) w[j] = kIq4Values[b[2 + j] & 15], w[j + 16] = kIq4Values[b[2 + j] >> 4];
  }
};

// ---- 256-element types: d(), dmin() (kMin), scales(b, sc[16], mn[16]), group_s(b, g, w) -----------------
// Q4_K / Q5_K: 8 6-bit scales and mins packed in 12 bytes (ggml's get_scale_min_k4), one per 32 elements.
inline void scale_min_k4(const uint8_t* q, int16_t* sc, int16_t* mn) {
  for (int j = 0; j < 8; ++j) {
    int s, m;
    if (j < 4) s = q[j] & 63, m = q[j + 4] & 63;
    else s = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4), m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    sc[2 * j] = sc[2 * j + 1] = (int16_t)s;
    mn[2 * j] = mn[2 * j + 1] = (int16_t)m;
  }
}
struct Q2_KB {  // scales[16] | qs[64] | f16 d | f16 dmin; w = 2 bits, sc / mn = low / high nibble per 16
  static constexpr int kBlock = 256, kBytes = 84, kOffset = 0, kDAt = 80, kMAt = 82;
  static constexpr bool kMin = true;
  static float d(const uint8_t* b) { return ld_f16(b + 80); }
  static float dmin(const uint8_t* b) { return ld_f16(b + 82); }
  static void scales(const uint8_t* b, int16_t* sc, int16_t* mn) {
    for (int j = 0; j < 16; ++j) sc[j] = b[j] & 15, mn[j] = b[j] >> 4;
  }
  static void group_s(const uint8_t* b, int g, int8_t* w) {
    const uint8_t* q = b + 16 + 32 * (g >> 2);
    for (int l = 0; l < 32; ++l) w[l] = (int8_t)((q[l] >> (2 * (g & 3))) & 3);
  }
};
struct Q3_KB {  // hmask[32] | qs[64] | scales[12] | f16 d; w = 2 bits + hmask bit g (clear: -4), sc 6-bit - 32
  static constexpr int kBlock = 256, kBytes = 110, kOffset = 4, kDAt = 108, kMAt = -1;
  static constexpr bool kMin = false;
  static float d(const uint8_t* b) { return ld_f16(b + 108); }
  static void scales(const uint8_t* b, int16_t* sc, int16_t*) {
    const uint8_t* s = b + 96;
    for (int j = 0; j < 16; ++j) {
      const int lo = j < 8 ? (s[j] & 15) : (s[j - 8] >> 4);
      const int hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
      sc[j] = (int16_t)((lo | (hi << 4)) - 32);
    }
  }
  static void group_s(const uint8_t* b, int g, int8_t* w) {
    const uint8_t* q = b + 32 + 32 * (g >> 2);
    for (int l = 0; l < 32; ++l) w[l] = (int8_t)(((q[l] >> (2 * (g & 3))) & 3) - ((b[l] >> g) & 1 ? 0 : 4));
  }
};
struct Q4_KB {  // f16 d | f16 dmin | scales[12] | qs[128]; groups 2p, 2p+1 = low, high nibbles of qs[32p..]
  static constexpr int kBlock = 256, kBytes = 144, kOffset = 0, kDAt = 0, kMAt = 2;
  static constexpr bool kMin = true;
  static float d(const uint8_t* b) { return ld_f16(b); }
  static float dmin(const uint8_t* b) { return ld_f16(b + 2); }
  static void scales(const uint8_t* b, int16_t* sc, int16_t* mn) { scale_min_k4(b + 4, sc, mn); }
  static void group_s(const uint8_t* b, int g, int8_t* w) {
    const uint8_t* q = b + 16 + 32 * (g >> 1);
    for (int l = 0; l < 32; ++l) w[l] = (int8_t)((q[l] >> (4 * (g & 1))) & 15);
  }
};
struct Q5_KB {  // f16 d | f16 dmin | scales[12] | qh[32] | qs[128]; 5th bit of group g: bit g of qh[l]
  static constexpr int kBlock = 256, kBytes = 176, kOffset = 0, kDAt = 0, kMAt = 2;
  static constexpr bool kMin = true;
  static float d(const uint8_t* b) { return ld_f16(b); }
  static float dmin(const uint8_t* b) { return ld_f16(b + 2); }
  static void scales(const uint8_t* b, int16_t* sc, int16_t* mn) { scale_min_k4(b + 4, sc, mn); }
  static void group_s(const uint8_t* b, int g, int8_t* w) {
    const uint8_t* q = b + 48 + 32 * (g >> 1);
    for (int l = 0; l < 32; ++l) w[l] = (int8_t)(((q[l] >> (4 * (g & 1))) & 15) | (((b[16 + l] >> g) & 1) << 4));
  }
};
struct Q6_KB {  // ql[128] | qh[64] | i8 scales[16] | f16 d; group g = 4h + j: nibble of ql[64h + 32(j&1) + l]
                // (low for j < 2), bits 2j.. of qh[32h + l] on top, minus 32
  static constexpr int kBlock = 256, kBytes = 210, kOffset = 32, kDAt = 208, kMAt = -1;
  static constexpr bool kMin = false;
  static float d(const uint8_t* b) { return ld_f16(b + 208); }
  static void scales(const uint8_t* b, int16_t* sc, int16_t*) {
    for (int j = 0; j < 16; ++j) sc[j] = (int8_t)b[192 + j];
  }
  static void group_s(const uint8_t* b, int g, int8_t* w) {
    const int h = g >> 2, j = g & 3;
    const uint8_t* ql = b + 64 * h + 32 * (j & 1);
    const uint8_t* qh = b + 128 + 32 * h;
    for (int l = 0; l < 32; ++l)
      w[l] = (int8_t)((((ql[l] >> (4 * (j >> 1))) & 15) | (((qh[l] >> (2 * j)) & 3) << 4)) - 32);
  }
};
struct IQ4_XSB {  // f16 d | u16 scales_h | scales_l[4] | qs[128]; 6-bit scale per 32 minus 32, IQ4 nibbles
  static constexpr int kBlock = 256, kBytes = 136, kOffset = -1, kDAt = 0, kMAt = -1;
  static constexpr bool kMin = false;
  static float d(const uint8_t* b) { return ld_f16(b); }
  static void scales(const uint8_t* b, int16_t* sc, int16_t*) {
    const unsigned sh = b[2] | (unsigned)b[3] << 8;
    for (int g = 0; g < 8; ++g) {
      const int lo = (b[4 + g / 2] >> (4 * (g & 1))) & 15, hi = (sh >> (2 * g)) & 3;
      sc[2 * g] = sc[2 * g + 1] = (int16_t)((lo | (hi << 4)) - 32);
    }
  }
  static void group_s(const uint8_t* b, int g, int8_t* w) {
    const uint8_t* q = b + 8 + 16 * g;
    for (int j = 0; j < 16; ++j) w[j] = kIq4Values[q[j] & 15], w[j + 16] = kIq4Values[q[j] >> 4];
  }
};

}  // namespace tallow::ops::qdot
