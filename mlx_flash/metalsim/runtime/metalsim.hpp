// metalsim kernel-side runtime: the subset of the Metal Shading Language
// standard library that metalsim supports, written for clang on a CPU.
//
// Kept lean on purpose (no C++ standard library): every kernel variant
// compiles against it. Address-space qualifiers are removed by the source
// rewriter (rewrite.py) before the kernel reaches clang, threadgroup arrays
// are turned into references into the threadgroup's shared arena, and vector
// constructors/casts are rewritten to msim::vctor<V>(...).
#pragma once
#include "msim_abi.h"

#define METAL_FUNC inline __attribute__((always_inline))
#define MSIM_INL static inline __attribute__((always_inline))
#define MLX_MTL_PRAGMA_UNROLL _Pragma("clang loop unroll(full)")
#define MSIM_BARRIER_FENCE() __asm__ __volatile__("" ::: "memory")

// ---------------------------------------------------------------------------
// Scalar and vector types
// ---------------------------------------------------------------------------
typedef _Float16 half;
typedef __bf16 bfloat;
typedef half float16_t;
// The Metal language version the kernel is compiled for (310 = Metal 3.1, macOS 14). Before
// Metal 3.1 there is no native bfloat: bfloat16_t is then MLX's portable 16-bit struct (MLX up
// to 0.29, the last release for macOS 13.5), emulated by msim::bf16 below.
#ifndef MSIM_METAL_VERSION
#define MSIM_METAL_VERSION 310
#endif
#define __METAL_VERSION__ MSIM_METAL_VERSION
#if MSIM_METAL_VERSION >= 310
#define __HAVE_BFLOAT__ 1
typedef bfloat bfloat16_t;
#endif
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

template <class T, int N>
using vec = T __attribute__((ext_vector_type(N)));

// Conversion helpers clang may call for half/bfloat (normally supplied by
// compiler-rt, which -nostdlib kernels do not link). Round to nearest even.
#define MSIM_RTLIB extern "C" __attribute__((weak, visibility("hidden"), used))
namespace msim_rtlib {
static inline float u2f(unsigned u) { return __builtin_bit_cast(float, u); }
static inline unsigned f2u(float f) { return __builtin_bit_cast(unsigned, f); }
static inline unsigned short f2bf(float f) {
  unsigned u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);  // quiet NaN
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline unsigned short f2h(float f) {
  unsigned x = f2u(f), sign = x & 0x80000000u;
  x ^= sign;
  unsigned o;
  if (x >= (127u + 16u) << 23) {
    o = x > (255u << 23) ? 0x7e00u : 0x7c00u;
  } else if (x < (113u << 23)) {
    float magic = u2f(((127u - 15u) + (23u - 10u) + 1u) << 23);
    o = f2u(u2f(x) + magic) - f2u(magic);
  } else {
    unsigned odd = (x >> 13) & 1u;
    x += ((unsigned)(15 - 127) << 23) + 0xfffu + odd;
    o = x >> 13;
  }
  return (unsigned short)(o | (sign >> 16));
}
static inline float h2f(unsigned short h) {
  unsigned o = (unsigned)(h & 0x7fffu) << 13, e = o & (0x7c00u << 13);
  o += (127u - 15u) << 23;
  if (e == (0x7c00u << 13)) o += (128u - 16u) << 23;
  else if (e == 0) { o += 1u << 23; o = f2u(u2f(o) - u2f(113u << 23)); }
  return u2f(o | ((unsigned)(h & 0x8000u) << 16));
}
}  // namespace msim_rtlib
MSIM_RTLIB __bf16 __truncsfbf2(float f) { return __builtin_bit_cast(__bf16, msim_rtlib::f2bf(f)); }
MSIM_RTLIB __bf16 __truncdfbf2(double d) { return __truncsfbf2((float)d); }
MSIM_RTLIB _Float16 __truncsfhf2(float f) { return __builtin_bit_cast(_Float16, msim_rtlib::f2h(f)); }
MSIM_RTLIB _Float16 __truncdfhf2(double d) { return __truncsfhf2((float)d); }
MSIM_RTLIB float __extendhfsf2(_Float16 h) { return msim_rtlib::h2f(__builtin_bit_cast(unsigned short, h)); }
MSIM_RTLIB float __gnu_h2f_ieee(unsigned short h) { return msim_rtlib::h2f(h); }
MSIM_RTLIB unsigned short __gnu_f2h_ieee(float f) { return msim_rtlib::f2h(f); }

#define MSIM_VEC(T)                 \
  typedef vec<T, 2> T##2;           \
  typedef vec<T, 3> T##3;           \
  typedef vec<T, 4> T##4;           \
  typedef vec<T, 2> packed_##T##2;  \
  typedef vec<T, 4> packed_##T##4;
MSIM_VEC(float)
MSIM_VEC(half)
MSIM_VEC(bfloat)
MSIM_VEC(int)
MSIM_VEC(uint)
MSIM_VEC(short)
MSIM_VEC(ushort)
MSIM_VEC(char)
MSIM_VEC(uchar)
MSIM_VEC(long)
MSIM_VEC(ulong)
MSIM_VEC(bool)
#undef MSIM_VEC

namespace msim {

template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { typedef T type; };
template <bool B, class T = void> using enable_if_t = typename enable_if<B, T>::type;
template <class A, class B> struct is_same { static constexpr bool value = false; };
template <class A> struct is_same<A, A> { static constexpr bool value = true; };
template <class T> struct identity { typedef T type; };
template <class T> struct remove_cv { typedef T type; };
template <class T> struct remove_cv<const T> { typedef T type; };
template <class T> struct remove_cv<volatile T> { typedef T type; };
template <class T> struct remove_cv<const volatile T> { typedef T type; };
template <class T> struct remove_ref { typedef T type; };
template <class T> struct remove_ref<T&> { typedef T type; };
template <class T> T&& declval();

// vinfo<V>: element type and lane count of a vector (1 for scalars).
template <class V> struct vinfo {
  static constexpr int n = 1;
  static constexpr bool is_vec = false;
  typedef V elem;
};
template <class T, int N> struct vinfo<vec<T, N>> {
  static constexpr int n = N;
  static constexpr bool is_vec = true;
  typedef T elem;
};
template <class V> constexpr bool is_vec_v = vinfo<typename remove_cv<V>::type>::is_vec;

template <class T> struct is_float_scalar { static constexpr bool value = false; };
template <> struct is_float_scalar<float> { static constexpr bool value = true; };
template <> struct is_float_scalar<half> { static constexpr bool value = true; };
template <> struct is_float_scalar<bfloat> { static constexpr bool value = true; };
template <> struct is_float_scalar<double> { static constexpr bool value = true; };

// The i-th lane of a vector, or the scalar itself.
template <class X>
MSIM_INL auto lane_of(const X& x, int i) {
  if constexpr (is_vec_v<X>) return x[i]; else return x;
}

// Vector construction with Metal's rules: a scalar splats, a vector of the
// same length converts element-wise, several scalars/vectors are
// concatenated (float4(a.xy, b, c)).
template <class V, class A>
MSIM_INL void vput(V& r, int& k, const A& a) {
  typedef typename vinfo<V>::elem E;
  if constexpr (is_vec_v<A>) {
    for (int i = 0; i < vinfo<A>::n; ++i) r[k++] = (E)a[i];
  } else {
    r[k++] = (E)a;
  }
}
template <class V, class... A>
MSIM_INL V vctor(const A&... a) {
  typedef typename vinfo<V>::elem E;
  if constexpr (!is_vec_v<V>) {
    static_assert(sizeof...(A) == 1, "metalsim: scalar construction takes one argument");
    return (V)(a, ...);
  } else if constexpr (sizeof...(A) == 0) {
    return V(0);
  } else if constexpr (sizeof...(A) == 1 && (!is_vec_v<A> && ...)) {
    return V((E)(a, ...));
  } else if constexpr (sizeof...(A) == 1) {
    typedef typename remove_cv<typename remove_ref<decltype((a, ...))>::type>::type Src;
    static_assert(vinfo<Src>::n == vinfo<V>::n, "metalsim: vector conversion between different lengths");
    return __builtin_convertvector((a, ...), V);
  } else {
    V r;
    int k = 0;
    (vput(r, k, a), ...);
    return r;
  }
}

}  // namespace msim

// ---------------------------------------------------------------------------
// Limits and constants
// ---------------------------------------------------------------------------
#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define HUGE_VALF (__builtin_huge_valf())
#define HUGE_VALH ((half)__builtin_inff())
#define MAXFLOAT 0x1.fffffep+127f
#define FLT_MAX 0x1.fffffep+127f
#define FLT_MIN 0x1p-126f
#define FLT_EPSILON 0x1p-23f
#define HALF_MAX ((half)65504.0f)
#define HALF_MIN ((half)0x1p-14f)
#define HALF_EPSILON ((half)0x1p-10f)
#define BFLOAT_MAX ((bfloat)0x1.fep+127f)
#define INT_MAX 2147483647
#define INT_MIN (-2147483647 - 1)
#define UINT_MAX 4294967295u
#define SHRT_MAX 32767
#define SHRT_MIN (-32768)
#define USHRT_MAX 65535
#define CHAR_BIT 8
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#define M_E_H ((half)M_E_F)
#define M_LOG2E_H ((half)M_LOG2E_F)
#define M_LN2_H ((half)M_LN2_F)
#define M_PI_H ((half)M_PI_F)

namespace metal {

template <class T> struct numeric_limits;
#define MSIM_INT_LIMITS(T, LO, HI)                                  \
  template <> struct numeric_limits<T> {                            \
    static constexpr bool is_specialized = true;                    \
    static constexpr bool is_integer = true;                        \
    static constexpr T min() { return (T)(LO); }                    \
    static constexpr T max() { return (T)(HI); }                    \
    static constexpr T lowest() { return (T)(LO); }                 \
  };
MSIM_INT_LIMITS(bool, 0, 1)
MSIM_INT_LIMITS(char, -128, 127)
MSIM_INT_LIMITS(signed char, -128, 127)
MSIM_INT_LIMITS(unsigned char, 0, 255)
MSIM_INT_LIMITS(short, -32768, 32767)
MSIM_INT_LIMITS(unsigned short, 0, 65535)
MSIM_INT_LIMITS(int, -2147483647 - 1, 2147483647)
MSIM_INT_LIMITS(unsigned int, 0, 4294967295u)
MSIM_INT_LIMITS(long, -9223372036854775807L - 1, 9223372036854775807L)
MSIM_INT_LIMITS(unsigned long, 0, 18446744073709551615UL)
MSIM_INT_LIMITS(long long, -9223372036854775807LL - 1, 9223372036854775807LL)
MSIM_INT_LIMITS(unsigned long long, 0, 18446744073709551615ULL)
#undef MSIM_INT_LIMITS
#define MSIM_FLOAT_LIMITS(T, MIN, MAX, EPS, DMIN)                         \
  template <> struct numeric_limits<T> {                                   \
    static constexpr bool is_specialized = true;                           \
    static constexpr bool is_integer = false;                              \
    static constexpr bool has_infinity = true;                             \
    static constexpr bool has_quiet_NaN = true;                            \
    static constexpr T min() { return (T)(MIN); }                          \
    static constexpr T max() { return (T)(MAX); }                          \
    static constexpr T lowest() { return (T)(-(MAX)); }                    \
    static constexpr T epsilon() { return (T)(EPS); }                      \
    static constexpr T denorm_min() { return (T)(DMIN); }                  \
    static constexpr T infinity() { return (T)__builtin_inff(); }          \
    static constexpr T quiet_NaN() { return (T)__builtin_nanf(""); }       \
    static constexpr T signaling_NaN() { return (T)__builtin_nansf(""); }  \
  };
MSIM_FLOAT_LIMITS(float, 0x1p-126f, 0x1.fffffep+127f, 0x1p-23f, 0x1p-149f)
MSIM_FLOAT_LIMITS(half, 0x1p-14f, 65504.0f, 0x1p-10f, 0x1p-24f)
MSIM_FLOAT_LIMITS(bfloat, 0x1p-126f, 0x1.fep+127f, 0x1p-7f, 0x1p-133f)
#undef MSIM_FLOAT_LIMITS

// ---------------------------------------------------------------------------
// <metal_type_traits> (the subset MLX's headers use), on clang's builtins.
// ---------------------------------------------------------------------------
// Metal's types are also reachable as metal::float4, metal::vec<T, N>, ...
using ::vec; using ::half; using ::bfloat; using ::uint; using ::ushort; using ::uchar;
using ::ulong;
#define MSIM_VEC_USING(T) using ::T##2; using ::T##3; using ::T##4;
MSIM_VEC_USING(float) MSIM_VEC_USING(half) MSIM_VEC_USING(bfloat) MSIM_VEC_USING(int)
MSIM_VEC_USING(uint) MSIM_VEC_USING(short) MSIM_VEC_USING(ushort) MSIM_VEC_USING(char)
MSIM_VEC_USING(uchar) MSIM_VEC_USING(long) MSIM_VEC_USING(ulong) MSIM_VEC_USING(bool)
#undef MSIM_VEC_USING

template <class T, T v> struct integral_constant {
  static constexpr T value = v;
  typedef T value_type;
  constexpr operator T() const { return v; }
};
template <bool B> using bool_constant = integral_constant<bool, B>;
// Metal's internal (`#pragma METAL internals`) logical traits, used by MLX's atomic.h.
template <class... B> struct _disjunction : integral_constant<bool, (B::value || ...)> {};
template <class... B> struct _conjunction : integral_constant<bool, (B::value && ...)> {};
// One address space on the CPU: nothing to remove.
template <class T> struct remove_addrspace { typedef T type; };
template <class T> using remove_addrspace_t = T;
typedef integral_constant<bool, true> true_type;
typedef integral_constant<bool, false> false_type;
using msim::enable_if;
using msim::enable_if_t;
using msim::is_same;
template <class A, class B> constexpr bool is_same_v = msim::is_same<A, B>::value;
template <bool B, class T, class F> struct conditional { typedef T type; };
template <class T, class F> struct conditional<false, T, F> { typedef F type; };
template <bool B, class T, class F> using conditional_t = typename conditional<B, T, F>::type;
template <class T> using remove_cv_t = typename msim::remove_cv<T>::type;
template <class T> struct remove_reference { typedef typename msim::remove_ref<T>::type type; };
template <class T> using remove_reference_t = typename msim::remove_ref<T>::type;
template <class T> struct remove_cv : msim::remove_cv<T> {};
template <class F, class T> struct is_convertible : integral_constant<bool, __is_convertible_to(F, T)> {};
template <class F, class T> constexpr bool is_convertible_v = __is_convertible_to(F, T);
template <class T> struct is_floating_point
    : integral_constant<bool, msim::is_float_scalar<typename msim::remove_cv<T>::type>::value> {};
template <class T> constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T> struct is_integral : integral_constant<bool, __is_integral(T)> {};
template <class T> constexpr bool is_integral_v = __is_integral(T);
template <class T> struct is_signed : integral_constant<bool, __is_signed(T)> {};
template <class T> constexpr bool is_signed_v = __is_signed(T);
template <class T> struct is_unsigned : integral_constant<bool, __is_unsigned(T)> {};
template <class T> constexpr bool is_unsigned_v = __is_unsigned(T);
template <class T> constexpr bool is_arithmetic_v = __is_arithmetic(T) || msim::is_float_scalar<T>::value;
template <class T> constexpr bool is_pointer_v = __is_pointer(T);
template <class T> constexpr bool is_scalar_v = __is_scalar(T);
template <class T> struct make_unsigned { typedef __make_unsigned(T) type; };
template <class T> using make_unsigned_t = __make_unsigned(T);
template <class T> struct make_signed { typedef __make_signed(T) type; };
template <class T> using make_signed_t = __make_signed(T);
template <class T> struct is_vector : integral_constant<bool, msim::is_vec_v<T>> {};
template <class T> constexpr bool is_vector_v = msim::is_vec_v<T>;

// ---------------------------------------------------------------------------
// Bit casts
// ---------------------------------------------------------------------------
template <class T, class U>
MSIM_INL T as_type(const U& x) {
  static_assert(sizeof(T) == sizeof(U), "metalsim: as_type between types of different size");
  return __builtin_bit_cast(T, x);
}

// ---------------------------------------------------------------------------
// Math (metal::, metal::fast::, metal::precise::). Floating functions compute
// in float and round back to half/bfloat; vectors apply lane by lane.
// ---------------------------------------------------------------------------
#define MSIM_F1(name, expr)                                                  \
  MSIM_INL float name(float x) { return (expr); }                           \
  MSIM_INL half name(half h) { return (half)name((float)h); }               \
  MSIM_INL bfloat name(bfloat h) { return (bfloat)name((float)h); }         \
  template <class V, class = msim::enable_if_t<msim::is_vec_v<V>>>          \
  MSIM_INL V name(V v) {                                                     \
    V r;                                                                     \
    for (int i = 0; i < msim::vinfo<V>::n; ++i) r[i] = name(v[i]);           \
    return r;                                                                \
  }

MSIM_F1(exp, __builtin_expf(x))
MSIM_F1(exp2, __builtin_exp2f(x))
MSIM_F1(exp10, __builtin_powf(10.0f, x))
MSIM_F1(log, __builtin_logf(x))
MSIM_F1(log2, __builtin_log2f(x))
MSIM_F1(log10, __builtin_log10f(x))
MSIM_F1(sqrt, __builtin_sqrtf(x))
MSIM_F1(rsqrt, 1.0f / __builtin_sqrtf(x))
MSIM_F1(cbrt, __builtin_cbrtf(x))
MSIM_F1(sin, __builtin_sinf(x))
MSIM_F1(cos, __builtin_cosf(x))
MSIM_F1(tan, __builtin_tanf(x))
MSIM_F1(asin, __builtin_asinf(x))
MSIM_F1(acos, __builtin_acosf(x))
MSIM_F1(atan, __builtin_atanf(x))
MSIM_F1(sinh, __builtin_sinhf(x))
MSIM_F1(cosh, __builtin_coshf(x))
MSIM_F1(tanh, __builtin_tanhf(x))
MSIM_F1(asinh, __builtin_asinhf(x))
MSIM_F1(acosh, __builtin_acoshf(x))
MSIM_F1(atanh, __builtin_atanhf(x))
MSIM_F1(floor, __builtin_floorf(x))
MSIM_F1(ceil, __builtin_ceilf(x))
MSIM_F1(round, __builtin_roundf(x))
MSIM_F1(rint, __builtin_rintf(x))
MSIM_F1(trunc, __builtin_truncf(x))
MSIM_F1(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
MSIM_F1(fabs, __builtin_fabsf(x))
MSIM_F1(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
MSIM_F1(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f))
MSIM_F1(sinpi, __builtin_sinf(x * M_PI_F))
MSIM_F1(cospi, __builtin_cosf(x * M_PI_F))
MSIM_F1(tanpi, __builtin_tanf(x * M_PI_F))

// abs: floating and integer
MSIM_INL float abs(float x) { return __builtin_fabsf(x); }
MSIM_INL half abs(half x) { return (half)__builtin_fabsf((float)x); }
MSIM_INL bfloat abs(bfloat x) { return (bfloat)__builtin_fabsf((float)x); }
MSIM_INL int abs(int x) { return x < 0 ? -x : x; }
MSIM_INL short abs(short x) { return (short)(x < 0 ? -x : x); }
MSIM_INL char abs(char x) { return (char)(x < 0 ? -x : x); }
MSIM_INL long abs(long x) { return x < 0 ? -x : x; }
MSIM_INL uint abs(uint x) { return x; }
MSIM_INL ushort abs(ushort x) { return x; }
MSIM_INL uchar abs(uchar x) { return x; }
template <class V, class = msim::enable_if_t<msim::is_vec_v<V>>>
MSIM_INL V abs(V v) {
  V r;
  for (int i = 0; i < msim::vinfo<V>::n; ++i) r[i] = abs(v[i]);
  return r;
}

// Result type of an element-wise binary/ternary function: the vector type if
// any argument is a vector, the common scalar type otherwise (same type in,
// same type out: max(short, short) is a short).
template <class A, class B, class = void> struct bin_result {
  typedef decltype(msim::declval<A>() + msim::declval<B>()) type;
};
template <class A> struct bin_result<A, A> { typedef A type; };
template <class A, class B>
struct bin_result<A, B, msim::enable_if_t<msim::is_vec_v<A> && !msim::is_same<A, B>::value>> {
  typedef A type;
};
template <class A, class B>
struct bin_result<A, B, msim::enable_if_t<!msim::is_vec_v<A> && msim::is_vec_v<B>>> {
  typedef B type;
};

namespace detail {
template <class T> MSIM_INL T fmax1(T a, T b) {
  if constexpr (msim::is_float_scalar<T>::value) {
    if (a != a) return b;
    if (b != b) return a;
  }
  return a > b ? a : b;
}
template <class T> MSIM_INL T fmin1(T a, T b) {
  if constexpr (msim::is_float_scalar<T>::value) {
    if (a != a) return b;
    if (b != b) return a;
  }
  return a < b ? a : b;
}
}  // namespace detail

#define MSIM_F2(name, body)                                                   \
  template <class A, class B, class R = typename bin_result<A, B>::type>     \
  MSIM_INL R name(A a_, B b_) {                                               \
    if constexpr (msim::is_vec_v<R>) {                                        \
      R r;                                                                    \
      typedef typename msim::vinfo<R>::elem E;                                \
      for (int i = 0; i < msim::vinfo<R>::n; ++i) {                           \
        E a = (E)msim::lane_of(a_, i), b = (E)msim::lane_of(b_, i);           \
        r[i] = (E)(body);                                                     \
      }                                                                       \
      return r;                                                               \
    } else {                                                                  \
      typedef R E;                                                            \
      E a = (E)a_, b = (E)b_;                                                 \
      return (E)(body);                                                       \
    }                                                                         \
  }
MSIM_F2(max, detail::fmax1<E>(a, b))
MSIM_F2(min, detail::fmin1<E>(a, b))
MSIM_F2(fmax, detail::fmax1<E>(a, b))
MSIM_F2(fmin, detail::fmin1<E>(a, b))
MSIM_F2(pow, __builtin_powf((float)a, (float)b))
MSIM_F2(powr, __builtin_powf((float)a, (float)b))
MSIM_F2(atan2, __builtin_atan2f((float)a, (float)b))
MSIM_F2(fmod, __builtin_fmodf((float)a, (float)b))
MSIM_F2(copysign, __builtin_copysignf((float)a, (float)b))
MSIM_F2(fdim, (float)a > (float)b ? (float)a - (float)b : 0.0f)
MSIM_F2(step, (float)b < (float)a ? 0.0f : 1.0f)
MSIM_F2(hypot, __builtin_sqrtf((float)a * (float)a + (float)b * (float)b))
MSIM_F2(absdiff, a > b ? a - b : b - a)
MSIM_F2(divide, (float)a / (float)b)
#undef MSIM_F2

#define MSIM_F3(name, body)                                                       \
  template <class A, class B, class C,                                            \
            class R = typename bin_result<typename bin_result<A, B>::type, C>::type> \
  MSIM_INL R name(A a_, B b_, C c_) {                                             \
    if constexpr (msim::is_vec_v<R>) {                                            \
      R r;                                                                        \
      typedef typename msim::vinfo<R>::elem E;                                    \
      for (int i = 0; i < msim::vinfo<R>::n; ++i) {                               \
        E a = (E)msim::lane_of(a_, i), b = (E)msim::lane_of(b_, i),               \
          c = (E)msim::lane_of(c_, i);                                            \
        r[i] = (E)(body);                                                         \
      }                                                                           \
      return r;                                                                   \
    } else {                                                                      \
      typedef R E;                                                                \
      E a = (E)a_, b = (E)b_, c = (E)c_;                                          \
      return (E)(body);                                                           \
    }                                                                             \
  }
MSIM_F3(fma, __builtin_fmaf((float)a, (float)b, (float)c))
MSIM_F3(mad, (float)a * (float)b + (float)c)
MSIM_F3(clamp, detail::fmin1<E>(detail::fmax1<E>(a, b), c))
MSIM_F3(mix, (float)a + ((float)b - (float)a) * (float)c)
MSIM_F3(max3, detail::fmax1<E>(detail::fmax1<E>(a, b), c))
MSIM_F3(min3, detail::fmin1<E>(detail::fmin1<E>(a, b), c))
MSIM_F3(fmax3, detail::fmax1<E>(detail::fmax1<E>(a, b), c))
MSIM_F3(fmin3, detail::fmin1<E>(detail::fmin1<E>(a, b), c))
MSIM_F3(median3, detail::fmax1<E>(detail::fmin1<E>(a, b), detail::fmin1<E>(detail::fmax1<E>(a, b), c)))
MSIM_F3(smoothstep, ([](float e0, float e1, float x) {
          float t = __builtin_fminf(__builtin_fmaxf((x - e0) / (e1 - e0), 0.0f), 1.0f);
          return t * t * (3.0f - 2.0f * t);
        })((float)a, (float)b, (float)c))
#undef MSIM_F3

MSIM_INL float recip(float x) { return 1.0f / x; }
MSIM_INL half recip(half x) { return (half)(1.0f / (float)x); }

// select(a, b, c): c ? b : a, lane by lane.
template <class T, class C>
MSIM_INL T select(T a, T b, C c) {
  if constexpr (msim::is_vec_v<T>) {
    T r;
    for (int i = 0; i < msim::vinfo<T>::n; ++i) r[i] = msim::lane_of(c, i) ? b[i] : a[i];
    return r;
  } else {
    return c ? b : a;
  }
}

// Classification
template <class T> MSIM_INL auto isnan(T x) {
  if constexpr (msim::is_vec_v<T>) {
    vec<bool, msim::vinfo<T>::n> r;
    for (int i = 0; i < msim::vinfo<T>::n; ++i) r[i] = x[i] != x[i];
    return r;
  } else {
    return x != x;
  }
}
template <class T> MSIM_INL auto isinf(T x) {
  if constexpr (msim::is_vec_v<T>) {
    vec<bool, msim::vinfo<T>::n> r;
    for (int i = 0; i < msim::vinfo<T>::n; ++i) r[i] = __builtin_isinf((float)x[i]);
    return r;
  } else {
    return (bool)__builtin_isinf((float)x);
  }
}
template <class T> MSIM_INL auto isfinite(T x) {
  if constexpr (msim::is_vec_v<T>) {
    vec<bool, msim::vinfo<T>::n> r;
    for (int i = 0; i < msim::vinfo<T>::n; ++i) r[i] = __builtin_isfinite((float)x[i]);
    return r;
  } else {
    return (bool)__builtin_isfinite((float)x);
  }
}
template <class T> MSIM_INL auto signbit(T x) {
  if constexpr (msim::is_vec_v<T>) {
    vec<bool, msim::vinfo<T>::n> r;
    for (int i = 0; i < msim::vinfo<T>::n; ++i) r[i] = __builtin_signbit((float)x[i]);
    return r;
  } else {
    return (bool)__builtin_signbit((float)x);
  }
}
template <class T> MSIM_INL bool all(T v) {
  if constexpr (msim::is_vec_v<T>) {
    for (int i = 0; i < msim::vinfo<T>::n; ++i)
      if (!v[i]) return false;
    return true;
  } else {
    return (bool)v;
  }
}
template <class T> MSIM_INL bool any(T v) {
  if constexpr (msim::is_vec_v<T>) {
    for (int i = 0; i < msim::vinfo<T>::n; ++i)
      if (v[i]) return true;
    return false;
  } else {
    return (bool)v;
  }
}

// Geometric
template <class V> MSIM_INL typename msim::vinfo<V>::elem dot(V a, V b) {
  float s = 0.0f;
  for (int i = 0; i < msim::vinfo<V>::n; ++i) s += (float)a[i] * (float)b[i];
  return (typename msim::vinfo<V>::elem)s;
}
template <class V> MSIM_INL typename msim::vinfo<V>::elem length(V a) {
  return (typename msim::vinfo<V>::elem)__builtin_sqrtf((float)dot(a, a));
}
template <class V> MSIM_INL typename msim::vinfo<V>::elem length_squared(V a) { return dot(a, a); }
template <class V> MSIM_INL typename msim::vinfo<V>::elem distance(V a, V b) { return length(a - b); }
template <class V> MSIM_INL V normalize(V a) {
  return a * (typename msim::vinfo<V>::elem)(1.0f / (float)length(a));
}
template <class V> MSIM_INL V cross(V a, V b) {
  return V{a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x};
}

// Integer
template <class T> MSIM_INL T popcount(T x) {
  if constexpr (msim::is_vec_v<T>) {
    T r;
    for (int i = 0; i < msim::vinfo<T>::n; ++i) r[i] = popcount(x[i]);
    return r;
  } else if constexpr (sizeof(T) == 8) {
    return (T)__builtin_popcountll((unsigned long long)x);
  } else {
    return (T)__builtin_popcount((unsigned)x & (unsigned)((1ull << (8 * sizeof(T))) - 1));
  }
}
template <class T> MSIM_INL T clz(T x) {
  if constexpr (sizeof(T) == 8) return x ? (T)__builtin_clzll((unsigned long long)x) : (T)64;
  else {
    unsigned v = (unsigned)x & (unsigned)((1ull << (8 * sizeof(T))) - 1);
    return v ? (T)(__builtin_clz(v) - (32 - 8 * (int)sizeof(T))) : (T)(8 * sizeof(T));
  }
}
template <class T> MSIM_INL T ctz(T x) {
  if constexpr (sizeof(T) == 8) return x ? (T)__builtin_ctzll((unsigned long long)x) : (T)64;
  else {
    unsigned v = (unsigned)x & (unsigned)((1ull << (8 * sizeof(T))) - 1);
    return v ? (T)__builtin_ctz(v) : (T)(8 * sizeof(T));
  }
}
MSIM_INL int mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
MSIM_INL uint mulhi(uint a, uint b) { return (uint)(((unsigned long long)a * b) >> 32); }

#if MSIM_METAL_VERSION < 310
}  // namespace metal
// ---------------------------------------------------------------------------
// bfloat16_t before Metal 3.1: a 16-bit struct holding the upper half of a
// float, as MLX's bf16.h defined it for macOS 13 (MLX <= 0.29). Conversions
// round to nearest even; bf16 op bf16 computes in float and rounds back;
// bf16 op float/half gives float; bf16 op integer gives bf16.
// ---------------------------------------------------------------------------
namespace msim {
struct bf16 {
  unsigned short bits_;
  struct from_bits_t {};
  bf16() = default;
  constexpr bf16(unsigned short b, from_bits_t) : bits_(b) {}
  template <class T, class = enable_if_t<!is_same<T, bf16>::value && __is_convertible_to(T, float)>>
  bf16(T x) : bits_(msim_rtlib::f2bf(static_cast<float>(x))) {}
  template <class T, class = enable_if_t<!is_same<T, bf16>::value && __is_convertible_to(float, T)>>
  operator T() const { return static_cast<T>(msim_rtlib::u2f((unsigned)bits_ << 16)); }
};
MSIM_INL float bf2f(bf16 x) { return msim_rtlib::u2f((unsigned)x.bits_ << 16); }
// The operators live in msim so that argument-dependent lookup finds them from templates.
constexpr msim::bf16 operator-(msim::bf16 x) {  // flips the sign bit, as float negation does
  return msim::bf16((unsigned short)(x.bits_ ^ 0x8000u), msim::bf16::from_bits_t{});
}
#define MSIM_BF_BIN(op)                                                                            \
  MSIM_INL msim::bf16 operator op(msim::bf16 a, msim::bf16 b) { return msim::bf16(msim::bf2f(a) op msim::bf2f(b)); } \
  MSIM_INL float operator op(msim::bf16 a, float b) { return msim::bf2f(a) op b; }                 \
  MSIM_INL float operator op(float a, msim::bf16 b) { return a op msim::bf2f(b); }                 \
  MSIM_INL float operator op(msim::bf16 a, half b) { return msim::bf2f(a) op (float)b; }           \
  MSIM_INL float operator op(half a, msim::bf16 b) { return (float)a op msim::bf2f(b); }           \
  MSIM_BF_INT(op, int) MSIM_BF_INT(op, uint) MSIM_BF_INT(op, long) MSIM_BF_INT(op, ulong)
#define MSIM_BF_INT(op, I)                                                                         \
  MSIM_INL msim::bf16 operator op(msim::bf16 a, I b) { return msim::bf16(msim::bf2f(a) op (float)b); } \
  MSIM_INL msim::bf16 operator op(I a, msim::bf16 b) { return msim::bf16((float)a op msim::bf2f(b)); }
MSIM_BF_BIN(+) MSIM_BF_BIN(-) MSIM_BF_BIN(*) MSIM_BF_BIN(/)
#undef MSIM_BF_INT
#define MSIM_BF_INT(op, I)                                                                         \
  MSIM_INL bool operator op(msim::bf16 a, I b) { return msim::bf2f(a) op (float)b; }               \
  MSIM_INL bool operator op(I a, msim::bf16 b) { return (float)a op msim::bf2f(b); }
#define MSIM_BF_CMP(op)                                                                            \
  MSIM_INL bool operator op(msim::bf16 a, msim::bf16 b) { return msim::bf2f(a) op msim::bf2f(b); } \
  MSIM_BF_INT(op, float) MSIM_BF_INT(op, half) MSIM_BF_INT(op, int) MSIM_BF_INT(op, uint)          \
  MSIM_BF_INT(op, long) MSIM_BF_INT(op, ulong)
MSIM_BF_CMP(<) MSIM_BF_CMP(>) MSIM_BF_CMP(<=) MSIM_BF_CMP(>=) MSIM_BF_CMP(==) MSIM_BF_CMP(!=)
#undef MSIM_BF_INT
#undef MSIM_BF_CMP
#undef MSIM_BF_BIN
#define MSIM_BF_ASSIGN1(op, I)                                                                     \
  MSIM_INL msim::bf16& operator op##=(msim::bf16& a, I b) { a = msim::bf16(msim::bf2f(a) op (float)b); return a; } \
  MSIM_INL I& operator op##=(I& a, msim::bf16 b) { a = (I)((float)a op msim::bf2f(b)); return a; }
#define MSIM_BF_ASSIGN(op)                                                                         \
  MSIM_INL msim::bf16& operator op##=(msim::bf16& a, msim::bf16 b) { a = msim::bf16(msim::bf2f(a) op msim::bf2f(b)); return a; } \
  MSIM_BF_ASSIGN1(op, float) MSIM_BF_ASSIGN1(op, half) MSIM_BF_ASSIGN1(op, short)                  \
  MSIM_BF_ASSIGN1(op, int) MSIM_BF_ASSIGN1(op, long) MSIM_BF_ASSIGN1(op, ushort)                   \
  MSIM_BF_ASSIGN1(op, uint) MSIM_BF_ASSIGN1(op, ulong)
MSIM_BF_ASSIGN(+) MSIM_BF_ASSIGN(-) MSIM_BF_ASSIGN(*) MSIM_BF_ASSIGN(/)
#undef MSIM_BF_ASSIGN
#undef MSIM_BF_ASSIGN1
}  // namespace msim
typedef msim::bf16 bfloat16_t;
namespace metal {
template <> struct numeric_limits<msim::bf16> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_integer = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
#define MSIM_BF_BITS(name, b) \
  static constexpr msim::bf16 name() { return msim::bf16((unsigned short)(b), msim::bf16::from_bits_t{}); }
  MSIM_BF_BITS(min, 0x0080) MSIM_BF_BITS(max, 0x7F7F) MSIM_BF_BITS(lowest, 0xFF7F)
  MSIM_BF_BITS(epsilon, 0x3C00) MSIM_BF_BITS(denorm_min, 0x0001) MSIM_BF_BITS(infinity, 0x7F80)
  MSIM_BF_BITS(quiet_NaN, 0x7FC0) MSIM_BF_BITS(signaling_NaN, 0x7F81)
#undef MSIM_BF_BITS
};
// Math on bfloat16_t: computed in float, rounded back (what MLX's bf16_math.h provides).
#define MSIM_BF_F1(name) MSIM_INL bfloat16_t name(bfloat16_t x) { return bfloat16_t(name(msim::bf2f(x))); }
MSIM_BF_F1(exp) MSIM_BF_F1(exp2) MSIM_BF_F1(exp10) MSIM_BF_F1(log) MSIM_BF_F1(log2)
MSIM_BF_F1(log10) MSIM_BF_F1(sqrt) MSIM_BF_F1(rsqrt) MSIM_BF_F1(cbrt) MSIM_BF_F1(sin) MSIM_BF_F1(cos)
MSIM_BF_F1(tan) MSIM_BF_F1(asin) MSIM_BF_F1(acos) MSIM_BF_F1(atan) MSIM_BF_F1(sinh) MSIM_BF_F1(cosh)
MSIM_BF_F1(tanh) MSIM_BF_F1(asinh) MSIM_BF_F1(acosh) MSIM_BF_F1(atanh)
MSIM_BF_F1(floor) MSIM_BF_F1(ceil) MSIM_BF_F1(round) MSIM_BF_F1(rint) MSIM_BF_F1(trunc)
MSIM_BF_F1(fract) MSIM_BF_F1(fabs) MSIM_BF_F1(abs) MSIM_BF_F1(saturate) MSIM_BF_F1(sign)
#undef MSIM_BF_F1
MSIM_INL bool isnan(bfloat16_t x) { return x != x; }
MSIM_INL bool isinf(bfloat16_t x) { return __builtin_isinf(msim::bf2f(x)); }
MSIM_INL bool isfinite(bfloat16_t x) { return __builtin_isfinite(msim::bf2f(x)); }
#endif  // MSIM_METAL_VERSION < 310

namespace fast {
using metal::abs; using metal::acos; using metal::asin; using metal::atan; using metal::atan2;
using metal::ceil; using metal::clamp; using metal::cos; using metal::cosh; using metal::divide;
using metal::exp; using metal::exp10; using metal::exp2; using metal::fabs; using metal::floor;
using metal::fma; using metal::fmax; using metal::fmin; using metal::fmod; using metal::fract;
using metal::log; using metal::log10; using metal::log2; using metal::max; using metal::min;
using metal::pow; using metal::powr; using metal::rint; using metal::round; using metal::rsqrt;
using metal::saturate; using metal::sign; using metal::sin; using metal::sinh; using metal::sqrt;
using metal::tan; using metal::tanh; using metal::trunc; using metal::max3; using metal::min3;
using metal::fmax3; using metal::fmin3; using metal::recip; using metal::normalize;
using metal::length; using metal::distance; using metal::sinpi; using metal::cospi;
using metal::tanpi; using metal::median3;
}  // namespace fast
namespace precise {
using namespace metal::fast;
}

// ---------------------------------------------------------------------------
// Barriers
// ---------------------------------------------------------------------------
enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
MSIM_INL mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((unsigned)a | (unsigned)b); }
MSIM_INL mem_flags operator&(mem_flags a, mem_flags b) { return (mem_flags)((unsigned)a & (unsigned)b); }

// A real synchronisation point: the fiber leaves and comes back once every
// live thread of the threadgroup has arrived. The asm clobbers keep the
// optimiser from moving memory accesses across it.
MSIM_INL void threadgroup_barrier(mem_flags = mem_flags::mem_none) {
  MSIM_BARRIER_FENCE();
  msim_rt_barrier();
  MSIM_BARRIER_FENCE();
}

enum memory_order {
  memory_order_relaxed = __ATOMIC_RELAXED,
  memory_order_acquire = __ATOMIC_ACQUIRE,
  memory_order_release = __ATOMIC_RELEASE,
  memory_order_acq_rel = __ATOMIC_ACQ_REL,
  memory_order_seq_cst = __ATOMIC_SEQ_CST,
};
enum class thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };
MSIM_INL void atomic_thread_fence(mem_flags, memory_order = memory_order_seq_cst,
                                  thread_scope = thread_scope::thread_scope_device) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

// ---------------------------------------------------------------------------
// SIMD-group functions (width 32). Each is a collective: the lanes' values
// are exchanged through msim_coll slots pointing into the lanes' stacks.
// ---------------------------------------------------------------------------
namespace detail {
template <class T> MSIM_INL T& in_of(msim_coll* const* s, int l) { return *(T*)s[l]->p[0]; }
template <class T> MSIM_INL T& out_of(msim_coll* const* s, int l) { return *(T*)s[l]->p[1]; }

struct OpSum { template <class T> static T f(T a, T b) { return a + b; } };
struct OpProd { template <class T> static T f(T a, T b) { return a * b; } };
struct OpMax { template <class T> static T f(T a, T b) { return metal::max(a, b); } };
struct OpMin { template <class T> static T f(T a, T b) { return metal::min(a, b); } };
struct OpAnd { template <class T> static T f(T a, T b) { return a & b; } };
struct OpOr { template <class T> static T f(T a, T b) { return a | b; } };
struct OpXor { template <class T> static T f(T a, T b) { return a ^ b; } };

// Reduction over the active lanes of each group of `W` lanes (32: simd, 4: quad).
template <class T, class Op, int W>
void coll_reduce(msim_coll* const* s, unsigned mask) {
  for (int g = 0; g < 32; g += W) {
    unsigned gm = (mask >> g) & (W >= 32 ? 0xffffffffu : ((1u << (W & 31)) - 1));
    if (!gm) continue;
    T acc = in_of<T>(s, g + __builtin_ctz(gm));
    for (unsigned m = gm & (gm - 1); m; m &= m - 1) acc = Op::f(acc, in_of<T>(s, g + __builtin_ctz(m)));
    for (unsigned m = gm; m; m &= m - 1) out_of<T>(s, g + __builtin_ctz(m)) = acc;
  }
}
// Prefix scans over active lanes in lane order.
template <class T, class Op, bool Inclusive>
void coll_scan(msim_coll* const* s, unsigned mask) {
  bool first = true;
  T acc{};
  for (unsigned m = mask; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    T v = in_of<T>(s, l);
    if (Inclusive) {
      acc = first ? v : Op::f(acc, v);
      out_of<T>(s, l) = acc;
    } else {
      out_of<T>(s, l) = first ? (T)(msim::is_same<Op, OpProd>::value ? 1 : 0) : acc;
      acc = first ? v : Op::f(acc, v);
    }
    first = false;
  }
}
// Shuffles: each lane reads lane src(l) of its group; u[0] is the lane's
// argument, u[1] the mode. Reading an inactive lane yields zero; shuffle
// up/down keep the lane's own value when the source is outside the group.
enum { SH_IDX, SH_XOR, SH_UP, SH_DOWN, SH_ROT_DOWN, SH_ROT_UP };
template <class T, int W>
void coll_shuffle(msim_coll* const* s, unsigned mask) {
  T tmp[32];
  for (unsigned m = mask; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    int g = l & ~(W - 1), i = l - g;
    long arg = (long)s[l]->u[0];
    long src;
    bool keep = false;
    switch ((int)s[l]->u[1]) {
      case SH_IDX: src = arg; break;
      case SH_XOR: src = i ^ arg; break;
      case SH_UP: src = i - arg; keep = src < 0; break;
      case SH_DOWN: src = i + arg; keep = src >= W; break;
      case SH_ROT_DOWN: src = (i + arg) % W; break;
      default: src = ((i - arg) % W + W) % W; break;
    }
    if (keep) tmp[l] = in_of<T>(s, l);
    else if (src < 0 || src >= W || !((mask >> (g + src)) & 1)) tmp[l] = T{};
    else tmp[l] = in_of<T>(s, (int)(g + src));
  }
  for (unsigned m = mask; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    out_of<T>(s, l) = tmp[l];
  }
}
template <class T>
void coll_bcast_first(msim_coll* const* s, unsigned mask) {
  T v = in_of<T>(s, __builtin_ctz(mask));
  for (unsigned m = mask; m; m &= m - 1) out_of<T>(s, __builtin_ctz(m)) = v;
}
inline void coll_ballot(msim_coll* const* s, unsigned mask) {
  unsigned long long bits = 0;
  for (unsigned m = mask; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    if (in_of<bool>(s, l)) bits |= 1ull << l;
  }
  for (unsigned m = mask; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    out_of<unsigned long long>(s, l) = bits;
    s[l]->u[3] = mask;
  }
}
inline void coll_noop(msim_coll* const*, unsigned) {}

template <class T>
MSIM_INL T run_coll(msim_coll_fn fn, T x, uint64_t a0 = 0, uint64_t a1 = 0) {
  T r;
  msim_coll c;
  c.fn = fn;
  c.p[0] = &x;
  c.p[1] = &r;
  c.u[0] = a0;
  c.u[1] = a1;
  MSIM_BARRIER_FENCE();
  msim_rt_collective(&c);
  MSIM_BARRIER_FENCE();
  return r;
}
}  // namespace detail

#define MSIM_SIMD_RED(name, Op, W) \
  template <class T> MSIM_INL T name(T x) { return detail::run_coll<T>(&detail::coll_reduce<T, detail::Op, W>, x); }
MSIM_SIMD_RED(simd_sum, OpSum, 32)
MSIM_SIMD_RED(simd_product, OpProd, 32)
MSIM_SIMD_RED(simd_max, OpMax, 32)
MSIM_SIMD_RED(simd_min, OpMin, 32)
MSIM_SIMD_RED(simd_and, OpAnd, 32)
MSIM_SIMD_RED(simd_or, OpOr, 32)
MSIM_SIMD_RED(simd_xor, OpXor, 32)
MSIM_SIMD_RED(quad_sum, OpSum, 4)
MSIM_SIMD_RED(quad_product, OpProd, 4)
MSIM_SIMD_RED(quad_max, OpMax, 4)
MSIM_SIMD_RED(quad_min, OpMin, 4)
MSIM_SIMD_RED(quad_and, OpAnd, 4)
MSIM_SIMD_RED(quad_or, OpOr, 4)
MSIM_SIMD_RED(quad_xor, OpXor, 4)
#undef MSIM_SIMD_RED

template <class T> MSIM_INL T simd_prefix_inclusive_sum(T x) { return detail::run_coll<T>(&detail::coll_scan<T, detail::OpSum, true>, x); }
template <class T> MSIM_INL T simd_prefix_exclusive_sum(T x) { return detail::run_coll<T>(&detail::coll_scan<T, detail::OpSum, false>, x); }
template <class T> MSIM_INL T simd_prefix_inclusive_product(T x) { return detail::run_coll<T>(&detail::coll_scan<T, detail::OpProd, true>, x); }
template <class T> MSIM_INL T simd_prefix_exclusive_product(T x) { return detail::run_coll<T>(&detail::coll_scan<T, detail::OpProd, false>, x); }

#define MSIM_SHUF(name, mode, W)                                                     \
  template <class T> MSIM_INL T name(T x, ushort a) {                                \
    return detail::run_coll<T>(&detail::coll_shuffle<T, W>, x, a, detail::mode);     \
  }
MSIM_SHUF(simd_shuffle, SH_IDX, 32)
MSIM_SHUF(simd_broadcast, SH_IDX, 32)
MSIM_SHUF(simd_shuffle_xor, SH_XOR, 32)
MSIM_SHUF(simd_shuffle_up, SH_UP, 32)
MSIM_SHUF(simd_shuffle_down, SH_DOWN, 32)
MSIM_SHUF(simd_shuffle_rotate_down, SH_ROT_DOWN, 32)
MSIM_SHUF(simd_shuffle_rotate_up, SH_ROT_UP, 32)
// simd_shuffle_and_fill_{up,down}(data, filling, delta[, modulo]): lanes whose
// source falls outside their group of `modulo` lanes read `filling` from the
// lane delta positions away instead.
namespace detail {
template <class T, bool Up>
void coll_shuffle_fill(msim_coll* const* s, unsigned mask) {
  T tmp[32];
  for (unsigned m = mask; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    long delta = (long)s[l]->u[0], mod = (long)s[l]->u[1];
    long g = l - l % mod, i = l % mod;
    long src = Up ? i - delta : i + delta;
    bool fill = src < 0 || src >= mod;
    long lane = fill ? (Up ? g + src + mod : g + src - mod) : g + src;
    if (lane < 0 || lane >= 32 || !((mask >> lane) & 1)) tmp[l] = T{};
    else tmp[l] = fill ? *(T*)s[lane]->p[2] : in_of<T>(s, (int)lane);
  }
  for (unsigned m = mask; m; m &= m - 1) out_of<T>(s, __builtin_ctz(m)) = tmp[__builtin_ctz(m)];
}
template <class T, bool Up>
MSIM_INL T shuffle_fill(T x, T filling, ushort delta, ushort modulo) {
  T r;
  msim_coll c;
  c.fn = &coll_shuffle_fill<T, Up>;
  c.p[0] = &x;
  c.p[1] = &r;
  c.p[2] = &filling;
  c.u[0] = delta;
  c.u[1] = modulo;
  MSIM_BARRIER_FENCE();
  msim_rt_collective(&c);
  MSIM_BARRIER_FENCE();
  return r;
}
}  // namespace detail
template <class T> MSIM_INL T simd_shuffle_and_fill_up(T x, T filling, ushort delta, ushort modulo = 32) {
  return detail::shuffle_fill<T, true>(x, filling, delta, modulo);
}
template <class T> MSIM_INL T simd_shuffle_and_fill_down(T x, T filling, ushort delta, ushort modulo = 32) {
  return detail::shuffle_fill<T, false>(x, filling, delta, modulo);
}
MSIM_SHUF(quad_shuffle, SH_IDX, 4)
MSIM_SHUF(quad_broadcast, SH_IDX, 4)
MSIM_SHUF(quad_shuffle_xor, SH_XOR, 4)
MSIM_SHUF(quad_shuffle_up, SH_UP, 4)
MSIM_SHUF(quad_shuffle_down, SH_DOWN, 4)
MSIM_SHUF(quad_shuffle_rotate_down, SH_ROT_DOWN, 4)
MSIM_SHUF(quad_shuffle_rotate_up, SH_ROT_UP, 4)
#undef MSIM_SHUF

template <class T> MSIM_INL T simd_broadcast_first(T x) {
  return detail::run_coll<T>(&detail::coll_bcast_first<T>, x);
}

struct simd_vote {
  typedef uint64_t vote_t;
  vote_t v;
  vote_t active;
  explicit constexpr operator vote_t() const { return v; }
  bool all() const { return v == active; }
  bool any() const { return v != 0; }
};
MSIM_INL simd_vote simd_ballot(bool x) {
  unsigned long long r;
  msim_coll c;
  c.fn = &detail::coll_ballot;
  c.p[0] = &x;
  c.p[1] = &r;
  MSIM_BARRIER_FENCE();
  msim_rt_collective(&c);
  MSIM_BARRIER_FENCE();
  return simd_vote{r, (unsigned long long)c.u[3]};
}
MSIM_INL simd_vote simd_active_threads_mask() { return simd_ballot(true); }
MSIM_INL bool simd_all(bool x) { return simd_ballot(x).all(); }
MSIM_INL bool simd_any(bool x) { return simd_ballot(x).any(); }
MSIM_INL bool simd_is_first() {
  simd_vote v = simd_ballot(true);
  return (unsigned)__builtin_ctzll(v.v) == msim_rt_lane();
}
MSIM_INL bool quad_all(bool x) {
  unsigned long long b = simd_ballot(x).v;
  unsigned long long a = simd_active_threads_mask().v;
  unsigned sh = msim_rt_lane() & ~3u;
  return ((b >> sh) & 15) == ((a >> sh) & 15);
}
MSIM_INL bool quad_any(bool x) {
  unsigned long long b = simd_ballot(x).v;
  return ((b >> (msim_rt_lane() & ~3u)) & 15) != 0;
}

MSIM_INL void simdgroup_barrier(mem_flags = mem_flags::mem_none) {
  msim_coll c;
  c.fn = &detail::coll_noop;
  MSIM_BARRIER_FENCE();
  msim_rt_collective(&c);
  MSIM_BARRIER_FENCE();
}

// ---------------------------------------------------------------------------
// simdgroup_matrix<T, 8, 8>. Each lane owns two elements (thread_elements()),
// laid out as on Apple GPUs: lane l holds row (l/16)*4 + (l/2)%4, columns
// x and x+1 with x = ((l/4)&2)*2 + (l%2)*2. Load, store and multiply are
// collectives executed once per simdgroup by the last lane to arrive.
// ---------------------------------------------------------------------------
namespace detail {
MSIM_INL int sgm_row(int l) { return (l / 16) * 4 + (l / 2) % 4; }
MSIM_INL int sgm_col(int l) { return ((l / 4) & 2) * 2 + (l % 2) * 2; }
}  // namespace detail

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "metalsim: only 8x8 simdgroup matrices are supported");
  typedef T value_type;
  vec<T, 2> e;
  simdgroup_matrix() = default;
  // Metal: simdgroup_matrix(T d) builds a diagonal matrix.
  explicit simdgroup_matrix(T d) {
    int l = (int)msim_rt_lane();
    int y = detail::sgm_row(l), x = detail::sgm_col(l);
    e[0] = y == x ? d : (T)0;
    e[1] = y == x + 1 ? d : (T)0;
  }
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int C, int R>
MSIM_INL simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, C, R> m;
  m.e = vec<T, 2>(v);
  return m;
}

namespace detail {
// slots: p[0] = lane's matrix, p[1] = lane's pointer object (raw or checked);
// u[0] = elements per row, u[1] = origin.x (column), u[2] = origin.y (row),
// u[3] = transpose.
template <class T, class P>
void coll_sgm_load(msim_coll* const* s, unsigned mask) {
  for (unsigned m = mask; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    auto& mat = *(simdgroup_matrix<T, 8, 8>*)s[l]->p[0];
    const P& src = *(const P*)s[l]->p[1];
    long epr = (long)s[l]->u[0], ox = (long)s[l]->u[1], oy = (long)s[l]->u[2];
    bool tr = s[l]->u[3] != 0;
    int y = sgm_row(l), x = sgm_col(l);
    for (int k = 0; k < 2; ++k) {
      long r = y, c = x + k;
      long idx = tr ? (oy + c) * epr + ox + r : (oy + r) * epr + ox + c;
      mat.e[k] = (T)src[idx];
    }
  }
}
template <class T, class P>
void coll_sgm_store(msim_coll* const* s, unsigned mask) {
  for (unsigned m = mask; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    const auto& mat = *(const simdgroup_matrix<T, 8, 8>*)s[l]->p[0];
    const P& dst = *(const P*)s[l]->p[1];
    long epr = (long)s[l]->u[0], ox = (long)s[l]->u[1], oy = (long)s[l]->u[2];
    bool tr = s[l]->u[3] != 0;
    int y = sgm_row(l), x = sgm_col(l);
    for (int k = 0; k < 2; ++k) {
      long r = y, c = x + k;
      long idx = tr ? (oy + c) * epr + ox + r : (oy + r) * epr + ox + c;
      dst[idx] = mat.e[k];
    }
  }
}
template <class T>
MSIM_INL void sgm_gather(float* out, msim_coll* const* s, unsigned mask, int which) {
  for (int i = 0; i < 64; ++i) out[i] = 0.0f;
  for (unsigned m = mask; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    const auto& mat = *(const simdgroup_matrix<T, 8, 8>*)s[l]->p[which];
    int o = sgm_row(l) * 8 + sgm_col(l);
    out[o] = (float)mat.e[0];
    out[o + 1] = (float)mat.e[1];
  }
}
// D = A * B (+ C); p[0..3] = D, A, B, C. Accumulates in float and rounds the
// result to D's element type.
template <class TD, class TA, class TB, class TC, bool Acc>
void coll_sgm_mma(msim_coll* const* s, unsigned mask) {
  float A[64], B[64], D[64];
  sgm_gather<TA>(A, s, mask, 1);
  sgm_gather<TB>(B, s, mask, 2);
  if (Acc) sgm_gather<TC>(D, s, mask, 3);
  else
    for (int i = 0; i < 64; ++i) D[i] = 0.0f;
  typedef float f8 __attribute__((ext_vector_type(8)));
  f8 Bv[8], Dv[8];
  __builtin_memcpy(Bv, B, sizeof Bv);
  __builtin_memcpy(Dv, D, sizeof Dv);
  for (int i = 0; i < 8; ++i)
    for (int k = 0; k < 8; ++k) Dv[i] += A[i * 8 + k] * Bv[k];
  __builtin_memcpy(D, Dv, sizeof Dv);
  for (unsigned m = mask; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    auto& mat = *(simdgroup_matrix<TD, 8, 8>*)s[l]->p[0];
    int o = sgm_row(l) * 8 + sgm_col(l);
    mat.e[0] = (TD)D[o];
    mat.e[1] = (TD)D[o + 1];
  }
}
}  // namespace detail

template <class T, int C, int R, class P, class O = ulong2>
MSIM_INL void simdgroup_load(simdgroup_matrix<T, C, R>& d, P src, ulong elements_per_row = C,
                             O matrix_origin = O(0), bool transpose_matrix = false) {
  msim_coll c;
  c.fn = &detail::coll_sgm_load<T, P>;
  c.p[0] = &d;
  c.p[1] = &src;
  c.u[0] = elements_per_row;
  c.u[1] = matrix_origin.x;
  c.u[2] = matrix_origin.y;
  c.u[3] = transpose_matrix;
  MSIM_BARRIER_FENCE();
  msim_rt_collective(&c);
  MSIM_BARRIER_FENCE();
}
template <class T, int C, int R, class P, class O = ulong2>
MSIM_INL void simdgroup_store(const simdgroup_matrix<T, C, R>& a, P dst, ulong elements_per_row = C,
                              O matrix_origin = O(0), bool transpose_matrix = false) {
  msim_coll c;
  c.fn = &detail::coll_sgm_store<T, P>;
  c.p[0] = (void*)&a;
  c.p[1] = &dst;
  c.u[0] = elements_per_row;
  c.u[1] = matrix_origin.x;
  c.u[2] = matrix_origin.y;
  c.u[3] = transpose_matrix;
  MSIM_BARRIER_FENCE();
  msim_rt_collective(&c);
  MSIM_BARRIER_FENCE();
}
template <class TD, class TA, class TB, class TC>
MSIM_INL void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                            const simdgroup_matrix<TB, 8, 8>& b,
                                            const simdgroup_matrix<TC, 8, 8>& c) {
  simdgroup_matrix<TD, 8, 8> r;
  msim_coll k;
  k.fn = &detail::coll_sgm_mma<TD, TA, TB, TC, true>;
  k.p[0] = &r;
  k.p[1] = (void*)&a;
  k.p[2] = (void*)&b;
  k.p[3] = (void*)&c;
  MSIM_BARRIER_FENCE();
  msim_rt_collective(&k);
  MSIM_BARRIER_FENCE();
  d = r;
}
template <class TD, class TA, class TB>
MSIM_INL void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                 const simdgroup_matrix<TB, 8, 8>& b) {
  simdgroup_matrix<TD, 8, 8> r;
  msim_coll k;
  k.fn = &detail::coll_sgm_mma<TD, TA, TB, TD, false>;
  k.p[0] = &r;
  k.p[1] = (void*)&a;
  k.p[2] = (void*)&b;
  k.p[3] = nullptr;
  MSIM_BARRIER_FENCE();
  msim_rt_collective(&k);
  MSIM_BARRIER_FENCE();
  d = r;
}

// ---------------------------------------------------------------------------
// Atomics (device and threadgroup memory). Threadgroups run concurrently on
// several OS threads, so these are real atomic operations.
// ---------------------------------------------------------------------------
template <class T>
struct atomic {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "metalsim: atomic of unsupported size");
  alignas(sizeof(T)) T v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;

namespace detail {
template <class T> struct atomic_bits { typedef unsigned type; };
template <> struct atomic_bits<long> { typedef unsigned long type; };
template <> struct atomic_bits<ulong> { typedef unsigned long type; };
template <class T, class F>
MSIM_INL T atomic_rmw_cas(atomic<T>* o, F f) {
  typedef typename atomic_bits<T>::type B;
  B* p = (B*)&o->v;
  B old = __atomic_load_n(p, __ATOMIC_RELAXED);
  for (;;) {
    T ov = __builtin_bit_cast(T, old);
    B nw = __builtin_bit_cast(B, (T)f(ov));
    if (__atomic_compare_exchange_n(p, &old, nw, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return ov;
  }
}
template <class P> MSIM_INL auto raw_ptr(P p) { return &*p; }
template <class T> MSIM_INL T* raw_ptr(T* p) { return p; }
}  // namespace detail

#define MSIM_ATOMIC_RMW(name, intop, fexpr)                                                 \
  template <class P, class V>                                                              \
  MSIM_INL auto name(P obj, V val, memory_order = memory_order_relaxed) {                  \
    auto* o = detail::raw_ptr(obj);                                                        \
    typedef typename msim::remove_cv<decltype(o->v)>::type T;                              \
    T x = (T)val;                                                                          \
    if constexpr (msim::is_float_scalar<T>::value) {                                       \
      return detail::atomic_rmw_cas<T>((atomic<T>*)o, [x](T a) { return fexpr; });         \
    } else {                                                                               \
      return (T)intop((T*)&o->v, x, __ATOMIC_SEQ_CST);                                     \
    }                                                                                      \
  }
MSIM_ATOMIC_RMW(atomic_fetch_add_explicit, __atomic_fetch_add, a + x)
MSIM_ATOMIC_RMW(atomic_fetch_sub_explicit, __atomic_fetch_sub, a - x)
MSIM_ATOMIC_RMW(atomic_fetch_and_explicit, __atomic_fetch_and, a)
MSIM_ATOMIC_RMW(atomic_fetch_or_explicit, __atomic_fetch_or, a)
MSIM_ATOMIC_RMW(atomic_fetch_xor_explicit, __atomic_fetch_xor, a)
MSIM_ATOMIC_RMW(atomic_fetch_min_explicit, __atomic_fetch_min, detail::fmin1<T>(a, x))
MSIM_ATOMIC_RMW(atomic_fetch_max_explicit, __atomic_fetch_max, detail::fmax1<T>(a, x))
#undef MSIM_ATOMIC_RMW

template <class P, class V>
MSIM_INL void atomic_store_explicit(P obj, V val, memory_order = memory_order_relaxed) {
  auto* o = detail::raw_ptr(obj);
  typedef typename msim::remove_cv<decltype(o->v)>::type T;
  T x = (T)val;
  __atomic_store((T*)&o->v, &x, __ATOMIC_SEQ_CST);
}
template <class P>
MSIM_INL auto atomic_load_explicit(P obj, memory_order = memory_order_relaxed) {
  auto* o = detail::raw_ptr(obj);
  typedef typename msim::remove_cv<decltype(o->v)>::type T;
  T x;
  __atomic_load((T*)&o->v, &x, __ATOMIC_SEQ_CST);
  return x;
}
template <class P, class V>
MSIM_INL auto atomic_exchange_explicit(P obj, V val, memory_order = memory_order_relaxed) {
  auto* o = detail::raw_ptr(obj);
  typedef typename msim::remove_cv<decltype(o->v)>::type T;
  T x = (T)val, r;
  __atomic_exchange((T*)&o->v, &x, &r, __ATOMIC_SEQ_CST);
  return r;
}
template <class P, class E, class V>
MSIM_INL bool atomic_compare_exchange_weak_explicit(P obj, E* expected, V desired, memory_order = memory_order_relaxed,
                                                    memory_order = memory_order_relaxed) {
  auto* o = detail::raw_ptr(obj);
  typedef typename msim::remove_cv<decltype(o->v)>::type T;
  T d = (T)desired;
  return __atomic_compare_exchange((T*)&o->v, (T*)detail::raw_ptr(expected), &d, false, __ATOMIC_SEQ_CST,
                                   __ATOMIC_SEQ_CST);
}
template <class P, class E, class V>
MSIM_INL bool atomic_compare_exchange_strong_explicit(P obj, E* expected, V desired,
                                                      memory_order a = memory_order_relaxed,
                                                      memory_order b = memory_order_relaxed) {
  return atomic_compare_exchange_weak_explicit(obj, expected, desired, a, b);
}

}  // namespace metal

using namespace metal;

// ---------------------------------------------------------------------------
// Checked pointers (bounds-check mode): device buffers and threadgroup
// arrays become these wrappers; an out-of-bounds access is reported to the
// runtime (which turns it into a Python exception) and redirected to a
// scratch slot so the process keeps running.
// ---------------------------------------------------------------------------
namespace msim {
alignas(64) inline char scratch_[256];

// Offsets are integers; excluding class types keeps `p - q` on the
// pointer difference below.
template <class I> using offset_t = enable_if_t<!__is_class(I)>;

template <class T> struct dptr;

// Checked pointer to const T: holds the bounds and does the checks. dptr<T>
// (T not const) derives from it so that, as with raw pointers, a
// `const device T*` parameter of a function template (dptr<const T>)
// deduces T from a dptr<float> argument (deduction accepts a derived class),
// and dptr<T> converts to dptr<const T>.
template <class T>
struct dptr<const T> {
  const T* p;
  char* base;       // allocation start
  long long lo_b;   // valid byte range [lo_b, hi_b) relative to base
  long long hi_b;
  const char* name;
  int is_tg;

  dptr() : p(nullptr), base(nullptr), lo_b(0), hi_b(0), name("?"), is_tg(0) {}
  dptr(decltype(nullptr)) : dptr() {}
  // From a raw pointer (e.g. &tile[i][j]): no bounds known, never reported.
  dptr(const T* raw)
      : p(raw), base(nullptr), lo_b(-(1LL << 62)), hi_b(1LL << 62), name("?"), is_tg(0) {}
  dptr(const T* p_, const void* base_, long long lo, long long hi, const char* n, int tg = 0)
      : p(p_), base((char*)base_), lo_b(lo), hi_b(hi), name(n), is_tg(tg) {}

  const T* check(const T* q) const {
    long long off = (long long)((const char*)q - base);
    if (__builtin_expect(off < lo_b || off + (long long)sizeof(T) > hi_b, 0)) {
      long long sz = (long long)sizeof(T);
      long long idx = off >= 0 ? off / sz : -((-off + sz - 1) / sz);
      msim_rt_oob(name, idx, lo_b / sz, hi_b / sz, is_tg);
      return (const T*)scratch_;
    }
    return q;
  }
  const T* get() const { return p; }
  // The only conversion to a raw pointer, dptr<T> included: a second one (to
  // T*) would make `if (p)`, `p < q` and `p == nullptr` ambiguous.
  operator const T*() const { return p; }
  const T& operator*() const { return *check(p); }
  const T* operator->() const { return check(p); }
  template <class I>
  const T& operator[](I i) const { return *check(p + (long long)i); }
  template <class I, class = offset_t<I>> dptr operator+(I i) const { dptr r = *this; r.p += (long long)i; return r; }
  template <class I, class = offset_t<I>> dptr operator-(I i) const { dptr r = *this; r.p -= (long long)i; return r; }
  long long operator-(const dptr& o) const { return p - o.p; }
  template <class I> dptr& operator+=(I i) { p += (long long)i; return *this; }
  template <class I> dptr& operator-=(I i) { p -= (long long)i; return *this; }
  dptr& operator++() { ++p; return *this; }
  dptr& operator--() { --p; return *this; }
  dptr operator++(int) { dptr r = *this; ++p; return r; }
  dptr operator--(int) { dptr r = *this; --p; return r; }
};

// Checked pointer to mutable T: the same pointer, with mutable access.
template <class T>
struct dptr : dptr<const T> {
  typedef dptr<const T> cdptr;
  dptr() = default;
  dptr(decltype(nullptr)) {}
  dptr(T* raw) : cdptr(raw) {}
  dptr(T* p_, const void* base_, long long lo, long long hi, const char* n, int tg = 0)
      : cdptr(p_, base_, lo, hi, n, tg) {}

  T* get() const { return const_cast<T*>(this->p); }
  T& operator*() const { return const_cast<T&>(cdptr::operator*()); }
  T* operator->() const { return const_cast<T*>(cdptr::operator->()); }
  template <class I>
  T& operator[](I i) const { return const_cast<T&>(cdptr::operator[](i)); }
  template <class I, class = offset_t<I>> dptr operator+(I i) const { dptr r = *this; r.p += (long long)i; return r; }
  template <class I, class = offset_t<I>> dptr operator-(I i) const { dptr r = *this; r.p -= (long long)i; return r; }
  long long operator-(const cdptr& o) const { return this->p - o.p; }
  template <class I> dptr& operator+=(I i) { this->p += (long long)i; return *this; }
  template <class I> dptr& operator-=(I i) { this->p -= (long long)i; return *this; }
  dptr& operator++() { ++this->p; return *this; }
  dptr& operator--() { --this->p; return *this; }
  dptr operator++(int) { dptr r = *this; ++this->p; return r; }
  dptr operator--(int) { dptr r = *this; --this->p; return r; }
};
template <class I, class T, class = offset_t<I>> dptr<T> operator+(I i, const dptr<T>& d) { return d + i; }

// Pointer casts that keep the bounds (reinterpret_cast<device float4*>(p)).
template <class U, class T>
MSIM_INL dptr<U> ptr_cast(const dptr<T>& d) { return dptr<U>((U*)d.p, d.base, d.lo_b, d.hi_b, d.name, d.is_tg); }
template <class U, class T>
MSIM_INL U* ptr_cast(T* p) { return (U*)p; }

// Threadgroup array views for bounds-check mode: tg_view<float[4][8]>
// checks every subscript against its dimension. A 1-D view is a checked
// pointer over its N elements, so it passes to `threadgroup T*` and
// `const threadgroup T*` parameters, function templates' included.
template <class A> struct tg_view;
template <class T, unsigned long N>
struct tg_view<T[N]> : dptr<T> {
  tg_view(T* p_, const char* n) : dptr<T>(p_, p_, 0, (long long)(N * sizeof(T)), n, 1) {}
};
template <class T, unsigned long N, unsigned long M>
struct tg_view<T[N][M]> {
  T* p;
  const char* name;
  operator T*() const { return p; }
  tg_view<T[M]> operator[](long long i) const {
    if (i < 0 || i >= N) {
      msim_rt_oob(name, i, 0, N, 1);
      return tg_view<T[M]>{(T*)scratch_, name};
    }
    return tg_view<T[M]>{p + i * M, name};
  }
};
template <class T, unsigned long N, unsigned long M, unsigned long K>
struct tg_view<T[N][M][K]> {
  T* p;
  const char* name;
  tg_view<T[M][K]> operator[](long long i) const {
    if (i < 0 || i >= N) {
      msim_rt_oob(name, i, 0, N, 1);
      return tg_view<T[M][K]>{(T*)scratch_, name};
    }
    return tg_view<T[M][K]>{p + i * M * K, name};
  }
};
template <class A> struct tg_elem { typedef A type; };
template <class T, unsigned long N> struct tg_elem<T[N]> { typedef typename tg_elem<T>::type type; };
// Threadgroup declarations: `threadgroup float a[4][8];` becomes
// `auto& a = msim::tg_ref<float[4][8]>(msim_rt_tg_alloc(...));` (or
// `auto a = msim::tg_check<float[4][8]>(..., "a")` in bounds-check mode).
template <class A>
MSIM_INL A& tg_ref(void* mem) { return *(A*)mem; }
template <class A>
MSIM_INL tg_view<A> tg_check(void* mem, const char* name) {
  return tg_view<A>{(typename tg_elem<A>::type*)mem, name};
}
MSIM_INL void* tg_alloc(int site, unsigned long size, unsigned long align) {
  return msim_rt_tg_alloc(site, size, align < 16 ? 16 : align);
}
}  // namespace msim

// ---------------------------------------------------------------------------
// What MLX's bf16_math.h and logging.h declare (includes.py skips them: they
// wrap Metal compiler intrinsics and address-space overloads).
// ---------------------------------------------------------------------------
namespace mlx {
struct os_log {
  constexpr os_log(const char*, const char*) {}
  template <typename... Args> void log_debug(const char*, Args...) const {}
};
}  // namespace mlx

#ifndef MSIM_MLX_UTILS
// ---------------------------------------------------------------------------
// Subset of MLX's kernels/utils.h that custom kernels commonly use.
// ---------------------------------------------------------------------------
template <typename U>
struct Limits {
  static constexpr U max = metal::numeric_limits<U>::max();
  static constexpr U min = metal::numeric_limits<U>::min();
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = metal::numeric_limits<U>::min();
};
#define MSIM_FLOAT_LIMIT(T)                                           \
  template <> struct Limits<T> {                                     \
    static constexpr T max = metal::numeric_limits<T>::infinity();   \
    static constexpr T min = -metal::numeric_limits<T>::infinity();  \
    static constexpr T finite_max = metal::numeric_limits<T>::max(); \
    static constexpr T finite_min = -metal::numeric_limits<T>::max();\
  };
MSIM_FLOAT_LIMIT(float)
MSIM_FLOAT_LIMIT(half)
MSIM_FLOAT_LIMIT(bfloat)
#if MSIM_METAL_VERSION < 310
MSIM_FLOAT_LIMIT(bfloat16_t)
#endif
#undef MSIM_FLOAT_LIMIT

template <typename T, typename U>
inline T ceildiv(T N, U M) {
  return (N + M - 1) / M;
}
template <typename IdxT = int64_t, class S, class St>
METAL_FUNC IdxT elem_to_loc(IdxT elem, S shape, St strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}
#endif  // MSIM_MLX_UTILS
