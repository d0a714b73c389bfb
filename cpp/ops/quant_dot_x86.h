// The x86 kernel body of quant_dot.h, included by quant_dot.cpp once per kernel set inside a target region
// and its own namespace: TALLOW_QDOT_VNNI 0 = AVX2 (maddubs + madd), 1 = AVX2 + 256-bit VNNI (vpdpbusd),
// and for Q4_0 / Q4_1 a 512-bit two-blocks-per-step loop (dot_pairs32).
// Each weight type's group(b, g) unpacks 32 quants of a W block to bytes in one register: u = w + kOffset
// (unsigned, <= 63) or, for the int8-wide types, w itself, multiplied by x with the sign trick (|w| times
// x with w's sign, exact for |w| <= 128); see quant_dot_blocks.h.
// (No include guard on purpose.)

inline __m256i qd_nibbles(const uint8_t* qs) {  // qs[16] -> low nibbles (elements 0..15) | high (16..31)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}
// Byte i = 0xFF where bit i of the 32-bit word at p is set.
inline __m256i qd_bits32(const uint8_t* p) {
  const __m256i sel = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)ld_u32(p)), sel);
  return _mm256_cmpeq_epi8(_mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}
inline __m256i qd_load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i qd_srl16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }
// 0xFF where (byte & bit) != 0.
inline __m256i qd_test(__m256i v, int bit) {
  const __m256i m = _mm256_set1_epi8((char)bit);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, m), m);
}
inline __m256i qd_iq4(__m256i nib) {
  const __m128i t = _mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Values));
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nib);
}

template <class B> struct Vec;
template <> struct Vec<Q4_0B> {
  static __m256i group(const uint8_t* b, int) { return qd_nibbles(b + 2); }
};
template <> struct Vec<Q4_1B> {
  static __m256i group(const uint8_t* b, int) { return qd_nibbles(b + 4); }
};
template <> struct Vec<Q5_0B> {  // nibble | 16 where the bit is set
  static __m256i group(const uint8_t* b, int) {
    return _mm256_or_si256(qd_nibbles(b + 6), _mm256_and_si256(qd_bits32(b + 2), _mm256_set1_epi8(16)));
  }
};
template <> struct Vec<Q5_1B> {
  static __m256i group(const uint8_t* b, int) {
    return _mm256_or_si256(qd_nibbles(b + 8), _mm256_and_si256(qd_bits32(b + 4), _mm256_set1_epi8(16)));
  }
};
template <> struct Vec<Q8_0B> {
  static __m256i group(const uint8_t* b, int) { return qd_load(b + 2); }
};
template <> struct Vec<IQ4_NLB> {
  static __m256i group(const uint8_t* b, int) { return qd_iq4(qd_nibbles(b + 2)); }
};
template <> struct Vec<Q2_KB> {
  static __m256i group(const uint8_t* b, int g) {
    return _mm256_and_si256(qd_srl16(qd_load(b + 16 + 32 * (g >> 2)), 2 * (g & 3)), _mm256_set1_epi8(3));
  }
};
template <> struct Vec<Q3_KB> {  // 2 bits | 4 where hmask bit g is set
  static __m256i group(const uint8_t* b, int g) {
    const __m256i lo = _mm256_and_si256(qd_srl16(qd_load(b + 32 + 32 * (g >> 2)), 2 * (g & 3)), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_and_si256(qd_test(qd_load(b), 1 << g), _mm256_set1_epi8(4)));
  }
};
template <> struct Vec<Q4_KB> {
  static __m256i group(const uint8_t* b, int g) {
    return _mm256_and_si256(qd_srl16(qd_load(b + 16 + 32 * (g >> 1)), 4 * (g & 1)), _mm256_set1_epi8(15));
  }
};
template <> struct Vec<Q5_KB> {
  static __m256i group(const uint8_t* b, int g) {
    const __m256i lo = _mm256_and_si256(qd_srl16(qd_load(b + 48 + 32 * (g >> 1)), 4 * (g & 1)), _mm256_set1_epi8(15));
    return _mm256_or_si256(lo, _mm256_and_si256(qd_test(qd_load(b + 16), 1 << g), _mm256_set1_epi8(16)));
  }
};
template <> struct Vec<Q6_KB> {
  static __m256i group(const uint8_t* b, int g) {
    const int h = g >> 2, j = g & 3;
    const __m256i ql = qd_load(b + 64 * h + 32 * (j & 1));
    const __m256i lo = _mm256_and_si256(qd_srl16(ql, 4 * (j >> 1)), _mm256_set1_epi8(15));
    const __m256i hi = _mm256_and_si256(qd_srl16(qd_load(b + 128 + 32 * h), 2 * j), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
};
template <> struct Vec<IQ4_XSB> {
  static __m256i group(const uint8_t* b, int g) { return qd_iq4(qd_nibbles(b + 8 + 16 * g)); }
};

// The block's f16 d / m / dmin with F16C (one instruction; the portable loader branches on the exponent).
inline float qd_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float qd_hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Sum over 32 bytes of w * x as 8 int32 lanes (lanes 0-3: elements 0-15, 4-7: 16-31). Signed w (kOffset < 0):
// |w| times x with w's sign; unsigned u <= 63: u times x (no int16 saturation in maddubs: 2 * 63 * 127).
template <class B>
inline __m256i qd_dot32(__m256i q, const int8_t* x) {
  __m256i u = q, xs = qd_load(x);
  if constexpr (B::kOffset < 0) u = _mm256_sign_epi8(q, q), xs = _mm256_sign_epi8(xs, q);
#if TALLOW_QDOT_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xs);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, xs), _mm256_set1_epi16(1));
#endif
}
template <class B>
inline __m256i qd_dot32_scaled(__m256i q, const int8_t* x, __m256i s16) {  // 16-bit sub-scales per 16 elements
  __m256i u = q, xs = qd_load(x);
  if constexpr (B::kOffset < 0) u = _mm256_sign_epi8(q, q), xs = _mm256_sign_epi8(xs, q);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, xs), s16);
}

#if TALLOW_QDOT_VNNI
// Two blocks' 32 quants of the 4-bit nibble types without the shuffle port: each block's qs[16] broadcast
// from memory into its half, the high copy shifted right by 4. Only these types take the two-block path:
// measured, Q8_0 and Q5_0 / Q5_1 (their quants joined from two 256-bit groups) were slower on it.
template <class B> struct Pair {
  static constexpr bool kUse = false;
};
template <int kQsAt, int kBytes> struct NibblePair {
  static constexpr bool kUse = true;
  static __m512i group2(const uint8_t* w) {
    const __m512i b0 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kQsAt)));
    const __m512i b = _mm512_mask_broadcast_i32x4(
        b0, 0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kBytes + kQsAt)));
    return _mm512_and_si512(_mm512_srlv_epi64(b, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)), _mm512_set1_epi8(15));
  }
};
template <> struct Pair<Q4_0B> : NibblePair<2, 18> {};
template <> struct Pair<Q4_1B> : NibblePair<4, 20> {};
// Q4_0 / Q4_1, two blocks per step in 512-bit registers (block ib in the low half, ib + 1 in the high).
// The per-block scalar work is vectorized: both blocks' f16 d (and m) converted at once, the scales d * a.d
// and min terms m * a.s (or -kOffset * d * a.s) formed in one 4-lane product, the min terms summed in lanes
// 1 and 3 of a vector across blocks; one horizontal reduction per row. An odd last block: the caller's loop.
template <class B, int MR>
inline int64_t dot_pairs32(const uint8_t* w, const uint8_t* const* act, int64_t nb, __m512* acc, __m128* accm) {
  // Lanes 0..7 take scale lane 0 (block ib's d * a.d), lanes 8..15 scale lane 2 (block ib + 1's).
  const __m512i spread = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  int64_t ib = 0;
  for (; ib + 2 <= nb; ib += 2, w += 2 * B::kBytes) {
    const __m512i q = Pair<B>::group2(w);
    // [d0, m0, d1, m1] (f16 d at byte 0, m at byte 2; Q4_0: lanes 1 / 3 are quant bytes, replaced by d).
    __m128 wdm = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)ld_u32(w)), (int)ld_u32(w + B::kBytes), 1));
    if constexpr (!B::kMin) wdm = _mm_moveldup_ps(wdm);  // [d0, d0, d1, d1]
    for (int m = 0; m < MR; ++m) {
      const Act32* a = reinterpret_cast<const Act32*>(act[m]) + ib;
      // [a0.d, a0.s, a1.d, a1.s]
      const __m128 ads = _mm_castpd_ps(_mm_loadh_pd(_mm_load_sd(reinterpret_cast<const double*>(a)),
                                                    reinterpret_cast<const double*>(a + 1)));
      const __m128 prod = _mm_mul_ps(wdm, ads);
      if constexpr (B::kMin) accm[m] = _mm_mask_add_ps(accm[m], 0xA, accm[m], prod);
      if constexpr (B::kOffset > 0)
        accm[m] = _mm_mask3_fmadd_ps(prod, _mm_set1_ps(-(float)B::kOffset), accm[m], 0xA);
      const __m512i xs = _mm512_inserti64x4(_mm512_castsi256_si512(qd_load(a->q)), qd_load(a[1].q), 1);
      const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xs);
      const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(prod));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[m]);
    }
  }
  return ib;
}
#endif

// out[m] = dot(W row at w, activation row act[m]) for m < MR; nb blocks of W.
template <class B, int MR>
void dot_row(const uint8_t* w, const uint8_t* const* act, int64_t nb, float* out) {
  __m256 acc[MR];
  float accm[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps(), accm[m] = 0.f;
  int64_t ib = 0;
#if TALLOW_QDOT_VNNI
  if constexpr (Pair<B>::kUse) {
    __m512 acc2[MR];
    __m128 accm2[MR];
    for (int m = 0; m < MR; ++m) acc2[m] = _mm512_setzero_ps(), accm2[m] = _mm_setzero_ps();
    ib = dot_pairs32<B, MR>(w, act, nb, acc2, accm2);
    w += ib * B::kBytes;
    for (int m = 0; m < MR; ++m) {
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc2[m]), 1));
      acc[m] = _mm256_add_ps(_mm512_castps512_ps256(acc2[m]), hi);
      const __m128 mm = _mm_add_ps(accm2[m], _mm_movehl_ps(accm2[m], accm2[m]));  // lane 1: both min sums
      accm[m] = _mm_cvtss_f32(_mm_movehdup_ps(mm));
    }
  }
#endif
  for (; ib < nb; ++ib, w += B::kBytes) {
    if constexpr (B::kBlock == 32) {
      const __m256i q = Vec<B>::group(w, 0);
      const float d = qd_f16(w + B::kDAt);
      float c = 0.f;  // weight of the activation block's sum s: the min, or -offset * d
      if constexpr (B::kMin) c = qd_f16(w + B::kMAt);
      if constexpr (B::kOffset > 0) c = -(float)B::kOffset * d;
      for (int m = 0; m < MR; ++m) {
        const Act32* a = reinterpret_cast<const Act32*>(act[m]) + ib;
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qd_dot32<B>(q, a->q)), _mm256_set1_ps(d * a->d), acc[m]);
        if constexpr (B::kMin || B::kOffset > 0) accm[m] += c * a->s;
      }
    } else {
      alignas(32) int16_t sc[16], mn[16];
      B::scales(w, sc, mn);
      float dmin = 0.f;  // mn: the sub-mins (times dmin), or offset * sub-scales (times d)
      const float d = qd_f16(w + B::kDAt);
      if constexpr (B::kMin) dmin = qd_f16(w + B::kMAt);
      if constexpr (B::kOffset > 0) {
        for (int j = 0; j < 16; ++j) mn[j] = (int16_t)(B::kOffset * sc[j]);
        dmin = d;
      }
      const Act256* a[MR];
      __m256i isum[MR];
      for (int m = 0; m < MR; ++m)
        a[m] = reinterpret_cast<const Act256*>(act[m]) + ib, isum[m] = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        const __m256i q = Vec<B>::group(w, g);
        const __m256i s16 = _mm256_set_m128i(_mm_set1_epi16(sc[2 * g + 1]), _mm_set1_epi16(sc[2 * g]));
        for (int m = 0; m < MR; ++m) isum[m] = _mm256_add_epi32(isum[m], qd_dot32_scaled<B>(q, a[m]->q + 32 * g, s16));
      }
      for (int m = 0; m < MR; ++m) {
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(d * a[m]->d), acc[m]);
        if constexpr (B::kMin || B::kOffset > 0) {
          const __m256i mb = _mm256_madd_epi16(qd_load(mn), qd_load(a[m]->bsums));
          acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mb), _mm256_set1_ps(dmin * a[m]->d), acc[m]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = qd_hsum(acc[m]) + accm[m];
}
