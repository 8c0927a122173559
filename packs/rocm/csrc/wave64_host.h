// Host emulation of the device facilities in mini_hip.h (included by it when HAL_WAVE64_SIM is defined).
//
// A launch runs workgroups one after another. A workgroup is 256 fibers (one per work-item, each on its
// own stack) scheduled cooperatively by wave64_host.cpp; a fiber runs until it reaches a synchronisation
// point. What is emulated, and the ISA facts each piece relies on, is documented in docs/rocm.md
// ("Emulation"); in short:
//   * hal_syncthreads(): s_barrier; every live work-item of the workgroup must arrive. Work-items that
//     returned no longer count (as waves that ended do on the hardware).
//   * hal_bpermute() and hal_mfma_*(): wave-wide instructions. All 64 lanes of the wave must reach the
//     same call; a lane that has returned, or lanes at different instructions, is an error (on the
//     hardware such code computes with lanes whose operands the program never set).
//   * LDS: one arena per workgroup, filled with 0xff bytes (NaN floats, -1 ints) before each
//     workgroup, so a read of LDS nobody wrote in this workgroup shows up as NaN or garbage.
//   * Global memory: every hal_ld / hal_st is checked against the buffers the launch registered and
//     against the access's natural alignment; a stray access stops the launch with its address.
//   * FP8: v_cvt_pk_f32_fp8/bf8 and v_cvt_pk_fp8/bf8_f32 with gfx942's fnuz encodings.
#pragma once

#include <cstddef>
#include <cstring>
#include <tuple>

#define HAL_DEV inline
#define HAL_KERNEL(NAME) extern "C" void NAME
#define HAL_KERNEL_WAVES(NAME, WAVES) HAL_KERNEL(NAME)
#define HAL_REGISTER(NAME) \
  static ::hal_wave64::Registrar hal_registrar_##NAME(#NAME, &::hal_wave64::invoke<&NAME>, ::hal_wave64::kernarg_size(&NAME));
#define HAL_SHARED(TYPE, NAME) TYPE& NAME = *static_cast<TYPE*>(::hal_wave64::lds_alloc(sizeof(TYPE), alignof(TYPE)))

#if !defined(HAL_WAVE64_FNUZ_HW)
#error "define HAL_WAVE64_FNUZ_HW=1 to emulate gfx942 (hardware fnuz FP8) or 0 to emulate gfx90a"
#endif
#define HAL_FP8_FNUZ_HW HAL_WAVE64_FNUZ_HW

namespace hal_wave64 {

u32 tid();
u32 bid(int dim);
void syncthreads();
int bpermute(int byte_addr, int v, int line);
f32x4 mfma(u16x4 a, u16x4 b, f32x4 c, bool bf16, int line);
void* lds_alloc(size_t size, size_t align);
void check_access(const void* p, size_t size, size_t align, bool write);

float f16_to_f32(u16 h);
u16 f32_to_f16(float x);
f32x2 cvt_pk_f32_f8(u32 w, bool hi, bool bf8);
u32 cvt_pk_f8_f32(float a, float b, u32 old, bool hi, bool bf8);

using Invoker = void (*)(const char* kernarg);
struct Registrar {
  Registrar(const char* name, Invoker invoker, size_t kernarg_size);
};

// Kernel arguments are unpacked from the byte buffer the Python launcher packed, with the AMDGPU
// kernarg rule (each argument at the next multiple of its natural alignment, in order).
template <class T> T read_arg(const char* buf, size_t& off) {
  off = (off + alignof(T) - 1) / alignof(T) * alignof(T);
  T v;
  std::memcpy(&v, buf + off, sizeof(T));
  off += sizeof(T);
  return v;
}
template <class... A> void call_packed(void (*f)(A...), const char* buf) {
  size_t off = 0;
  std::tuple<A...> args{read_arg<A>(buf, off)...};  // braced init: evaluated left to right
  std::apply(f, args);
}
template <class... A> size_t kernarg_size(void (*)(A...)) {
  size_t off = 0;
  ((off = (off + alignof(A) - 1) / alignof(A) * alignof(A) + sizeof(A)), ...);
  return off;
}
template <auto F> void invoke(const char* buf) { call_packed(F, buf); }

}  // namespace hal_wave64

HAL_DEV u32 hal_tid() { return hal_wave64::tid(); }
HAL_DEV u32 hal_bid_x() { return hal_wave64::bid(0); }
HAL_DEV u32 hal_bid_y() { return hal_wave64::bid(1); }
HAL_DEV u32 hal_bid_z() { return hal_wave64::bid(2); }
HAL_DEV void hal_syncthreads() { hal_wave64::syncthreads(); }
// The call's source line goes with wave-wide instructions, so lanes at different calls are caught.
HAL_DEV int hal_bpermute(int byte_addr, int v, int line = __builtin_LINE()) { return hal_wave64::bpermute(byte_addr, v, line); }
HAL_DEV f32x4 hal_mfma_f16(u16x4 a, u16x4 b, f32x4 c, int line = __builtin_LINE()) { return hal_wave64::mfma(a, b, c, false, line); }
HAL_DEV f32x4 hal_mfma_bf16(u16x4 a, u16x4 b, f32x4 c, int line = __builtin_LINE()) { return hal_wave64::mfma(a, b, c, true, line); }
#if HAL_FP8_FNUZ_HW
template <bool HI> HAL_DEV f32x2 hal_cvt_pk_f32_fp8(u32 w) { return hal_wave64::cvt_pk_f32_f8(w, HI, false); }
template <bool HI> HAL_DEV f32x2 hal_cvt_pk_f32_bf8(u32 w) { return hal_wave64::cvt_pk_f32_f8(w, HI, true); }
template <bool HI> HAL_DEV u32 hal_cvt_pk_fp8_f32(float a, float b, u32 old) { return hal_wave64::cvt_pk_f8_f32(a, b, old, HI, false); }
template <bool HI> HAL_DEV u32 hal_cvt_pk_bf8_f32(float a, float b, u32 old) { return hal_wave64::cvt_pk_f8_f32(a, b, old, HI, true); }
#endif
HAL_DEV float hal_exp2(float x) { return __builtin_exp2f(x); }
HAL_DEV float hal_f16_to_f32(u16 h) { return hal_wave64::f16_to_f32(h); }
HAL_DEV u16 hal_f32_to_f16(float x) { return hal_wave64::f32_to_f16(x); }

template <class T> HAL_DEV T hal_ld(const T* p) {
  hal_wave64::check_access(p, sizeof(T), alignof(T), false);
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <class T> HAL_DEV void hal_st(T* p, T v) {
  hal_wave64::check_access(p, sizeof(T), alignof(T), true);
  std::memcpy(p, &v, sizeof(T));
}
