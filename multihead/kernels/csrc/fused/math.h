// exp and tanh for the fused kernel's softmax, in forms the compiler vectorizes (std::exp and
// std::tanh are a libm call per element): exp of a non-positive float or double, and exp,
// tanh and an approximate reciprocal over whole vectors of floats.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "../simd.h"

namespace {

// exp for x <= 0 that the compiler vectorizes (std::exp is a libm call per element).
// exp(x) = 2^n exp(r) with n = round(x / ln2) and |r| <= ln2 / 2, Cephes' degree-6 polynomial
// for exp(r) (under 2 ulp). n is rounded by adding 1.5 * 2^23, which leaves n in the low bits
// of the sum: no float-int conversions, and 2^n is one shift of those bits. Inputs below -87
// (and -inf, NaN) give exactly 0, so hidden keys weigh exactly nothing.

constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: x + kRound rounds x to an integer

inline float exp_nonpositive(float x) {
  const bool dead = !(x > -87.0f);
  x = dead ? -87.0f : x;
  const float t = x * 1.44269504088896341f + kRound;
  const float n = t - kRound;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &t, sizeof(bits));
  bits = (bits + 127) << 23;  // the low bits of t hold n; shifting drops kRound's own bits
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return dead ? 0.0f : y * two_n;
}

inline double exp_nonpositive(double x) { return x > -745.0 ? std::exp(x) : 0.0; }

template <typename T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// exp_nonpositive for a vector of floats: the same steps, lane by lane
inline VF exp_vec(VF x) {
  const VF floor_x = VF{} - 87.0f;
  const VI dead = !(x > floor_x);
  x = dead ? floor_x : x;
  const VF t = x * 1.44269504088896341f + kRound;
  const VF n = t - kRound;
  VF r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const VF z = r * r;
  VF p = VF{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * z + r + 1.0f;
  VI bits;
  std::memcpy(&bits, &t, sizeof(bits));
  bits = (bits + 127) << 23;
  VF two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return dead ? VF{} : p * two_n;
}

// 1 / d for d in [1, 2]: the hardware estimate refined by one Newton step (within an ulp or
// two of the quotient; a division costs several times as much)
inline VF reciprocal(VF d) {
#if defined(__AVX512F__)
  VF r;
  const __m512 estimate = _mm512_rcp14_ps(reinterpret_cast<const __m512&>(d));
  std::memcpy(&r, &estimate, sizeof(r));
  return r * (2.0f - d * r);
#else
  return 1.0f / d;
#endif
}

// tanh for a vector of floats (Cephes' tanhf, under 2 ulp): x + x^3 P(x^2) for |x| < 0.625,
// else 2 / (1 + e) - 1 with e = exp(-2|x|), which has no cancellation there; the sign is put
// back by its bit. The exp is computed only for vectors with a lane past 0.625: a soft cap
// sits well above most scores (Gemma's 50), so most vectors take the polynomial alone.
// NaN stays NaN (it takes the polynomial).
inline VF tanh_vec(VF x) {
  VI bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const VI sign = bits & static_cast<int32_t>(0x80000000u);
  const VI abs_bits = bits & 0x7fffffff;
  VF a;
  std::memcpy(&a, &abs_bits, sizeof(a));
  const VF z = a * a;
  VF p = VF{} - 5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  VF r = a + a * z * p;
  const VI large = a >= 0.625f;
  if (any_lane(large)) {
    const VF e = exp_vec(-2.0f * a);
    r = large ? 2.0f * reciprocal(1.0f + e) - 1.0f : r;
  }
  VI r_bits;
  std::memcpy(&r_bits, &r, sizeof(r_bits));
  r_bits |= sign;
  std::memcpy(&r, &r_bits, sizeof(r));
  return r;
}

}  // namespace
