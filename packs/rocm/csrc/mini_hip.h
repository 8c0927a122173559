// The few device facilities the rocm pack's kernels use, behind one small API (hal_*), for two builds:
//
//  * device: clang's built-in HIP language mode with -nogpuinc -nogpulib (no ROCm headers, no device
//    libraries); every facility is a __builtin_amdgcn_* builtin (docs/rocm.md, "Build").
//  * host (HAL_WAVE64_SIM): the same kernel sources compiled as C++ for the CPU against wave64_host.h, which
//    emulates a workgroup of wave64 lanes, LDS, barriers, ds_bpermute, MFMA 16x16x16 and the FP8
//    conversions, so the kernels' indexing and reductions run on the CPU (docs/rocm.md, "Emulation").
//
// Kernels use only what is declared here: a facility missing from the emulation cannot creep in.
#pragma once

typedef __UINT8_TYPE__ u8;
typedef __UINT16_TYPE__ u16;
typedef __UINT32_TYPE__ u32;
typedef __UINT64_TYPE__ u64;
typedef __INT32_TYPE__ i32;
typedef __INT64_TYPE__ i64;

typedef float f32x4 __attribute__((ext_vector_type(4)));
typedef float f32x2 __attribute__((ext_vector_type(2)));
typedef u16 u16x4 __attribute__((ext_vector_type(4)));   // four f16 or bf16 bit patterns (MFMA A/B)
typedef u32 u32x2 __attribute__((ext_vector_type(2)));
typedef u32 u32x4 __attribute__((ext_vector_type(4)));

#if defined(HAL_WAVE64_SIM)
#include "wave64_host.h"
#else

#if !defined(__HIP_DEVICE_COMPILE__)
#error "mini_hip.h: compile device code with clang -x hip --cuda-device-only (or define HAL_WAVE64_SIM for the host emulation)"
#endif

typedef _Float16 f16x4 __attribute__((ext_vector_type(4)));
typedef short i16x4 __attribute__((ext_vector_type(4)));  // LLVM 19: the bf16_1k MFMA builtin takes v4i16

#define HAL_DEV __attribute__((device)) inline __attribute__((always_inline))
// Every kernel runs 256 work-items (4 wave64s), and the design assumes at least 4 waves per SIMD
// (4 workgroups per CU) to keep enough loads in flight: the compiler is held to that register budget
// (<= 128 VGPRs + AGPRs); the ISA tests check it did so without spilling (docs/rocm.md, "Resources").
#define HAL_KERNEL(NAME) HAL_KERNEL_WAVES(NAME, 4)
// The MLA code object's compute-bound kernels hold O in registers and a K/V tile in LDS and are
// designed for 2 waves per SIMD (<= 256 VGPRs, <= 32 KiB LDS): they say so with HAL_KERNEL_WAVES(.., 2).
#define HAL_KERNEL_WAVES(NAME, WAVES)                                                           \
  extern "C" __attribute__((global)) __attribute__((amdgpu_flat_work_group_size(256, 256)))   \
  __attribute__((amdgpu_waves_per_eu(WAVES))) void NAME
#define HAL_REGISTER(NAME)
#define HAL_SHARED(TYPE, NAME) __attribute__((shared)) TYPE NAME

#if defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__)
#define HAL_FP8_FNUZ_HW 1   // v_cvt_pk_f32_fp8 / v_cvt_pk_fp8_f32 convert e4m3fnuz / e5m2fnuz
#else
#define HAL_FP8_FNUZ_HW 0   // gfx90a: no FP8 instructions; gfx950: OCP FP8 (software path, see docs)
#endif

HAL_DEV u32 hal_tid() { return __builtin_amdgcn_workitem_id_x(); }
HAL_DEV u32 hal_bid_x() { return __builtin_amdgcn_workgroup_id_x(); }
HAL_DEV u32 hal_bid_y() { return __builtin_amdgcn_workgroup_id_y(); }
HAL_DEV u32 hal_bid_z() { return __builtin_amdgcn_workgroup_id_z(); }

// Workgroup barrier with LDS ordering (s_barrier between release and acquire fences).
HAL_DEV void hal_syncthreads() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

// ds_bpermute_b32: every lane reads `v` of lane (byte_addr / 4) % 64.
HAL_DEV int hal_bpermute(int byte_addr, int v) { return __builtin_amdgcn_ds_bpermute(byte_addr, v); }

// v_mfma_f32_16x16x16_f16 / _bf16 (gfx90a spells them ..16f16 / ..16bf16_1k): D = A * B + C.
HAL_DEV f32x4 hal_mfma_f16(u16x4 a, u16x4 b, f32x4 c) {
  return __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(f16x4, a), __builtin_bit_cast(f16x4, b), c, 0, 0, 0);
}
HAL_DEV f32x4 hal_mfma_bf16(u16x4 a, u16x4 b, f32x4 c) {
  return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(i16x4, a), __builtin_bit_cast(i16x4, b), c, 0, 0, 0);
}

#if HAL_FP8_FNUZ_HW
// v_cvt_pk_f32_fp8 / _bf8: bytes 0,1 (HI = false) or 2,3 (HI = true) of w -> two floats.
template <bool HI> HAL_DEV f32x2 hal_cvt_pk_f32_fp8(u32 w) { return __builtin_amdgcn_cvt_pk_f32_fp8((int)w, HI); }
template <bool HI> HAL_DEV f32x2 hal_cvt_pk_f32_bf8(u32 w) { return __builtin_amdgcn_cvt_pk_f32_bf8((int)w, HI); }
// v_cvt_pk_fp8_f32 / _bf8: a, b -> bytes 0,1 (HI = false) or 2,3 (HI = true) of old.
template <bool HI> HAL_DEV u32 hal_cvt_pk_fp8_f32(float a, float b, u32 old) {
  return (u32)__builtin_amdgcn_cvt_pk_fp8_f32(a, b, (int)old, HI);
}
template <bool HI> HAL_DEV u32 hal_cvt_pk_bf8_f32(float a, float b, u32 old) {
  return (u32)__builtin_amdgcn_cvt_pk_bf8_f32(a, b, (int)old, HI);
}
#endif

HAL_DEV float hal_exp2(float x) { return __builtin_amdgcn_exp2f(x); }  // v_exp_f32
HAL_DEV float hal_f16_to_f32(u16 h) { return (float)__builtin_bit_cast(_Float16, h); }
HAL_DEV u16 hal_f32_to_f16(float x) { return __builtin_bit_cast(u16, (_Float16)x); }  // v_cvt_f16_f32 (RNE)

// Global memory, through one door so the emulation can bounds-check every access.
template <class T> HAL_DEV T hal_ld(const T* p) { return *p; }
template <class T> HAL_DEV void hal_st(T* p, T v) { *p = v; }

#endif  // HAL_WAVE64_SIM

// ---------------------------------------------------------------------------------------------
// Shared by both builds.

HAL_DEV u32 hal_lane() { return hal_tid() & 63u; }
HAL_DEV u32 hal_wave() { return hal_tid() >> 6; }

HAL_DEV float hal_shfl_xor(float v, int mask) {
  int src = (int)(hal_lane() ^ (u32)mask);
  return __builtin_bit_cast(float, hal_bpermute(src << 2, __builtin_bit_cast(int, v)));
}

HAL_DEV float hal_fmaxf(float a, float b) { return a > b ? a : b; }  // -inf aware; no NaN care needed
HAL_DEV float hal_fabsf(float x) { return __builtin_bit_cast(float, __builtin_bit_cast(u32, x) & 0x7fffffffu); }
HAL_DEV bool hal_isnan(float x) { return x != x; }
HAL_DEV float hal_pow2i(int k) { return __builtin_bit_cast(float, (u32)(k + 127) << 23); }  // 2^k, k in [-126, 127]

// LDS accessors: one typed load / store of T at an address aligned to alignof(T) (a memcpy, so the
// host emulation does not type-pun the u16 tile, and the device compiler emits one ds_read/ds_write).
template <class T> HAL_DEV T lds_ld(const void* p) {
  T v;
  __builtin_memcpy(&v, __builtin_assume_aligned(p, alignof(T)), sizeof(T));
  return v;
}
template <class T> HAL_DEV void lds_st(void* p, T v) {
  __builtin_memcpy(__builtin_assume_aligned(p, alignof(T)), &v, sizeof(T));
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_inff();
