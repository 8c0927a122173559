// Hopper (sm_90a) warpgroup MMA: shared-memory matrix descriptors for the no-swizzle ("interleaved")
// layout, wgmma.mma_async m64n64k16 with A from shared memory or from registers, and the fences.
//
// Layout used for every operand tile here: rows of 8 16-bit elements (16 bytes) grouped in 8 x 8
// "core matrices" of 128 contiguous bytes; element (r, c) of a tile with D columns lives at
//   ((r / 8) * (D / 8) + c / 8) * 64 + (r % 8) * 8 + c % 8      (16-bit elements).
// A 16-byte chunk (8 columns of one row) is contiguous, so cp.async and the FP8 widening write whole
// chunks. Read as a K-major operand (rows = M or N, columns = K) the descriptor's leading byte offset
// (next 8 columns) is 128 and the stride byte offset (next 8 rows) D / 8 * 128; read as an MN-major
// B operand (rows = K, columns = N: V in O += P V) they swap: LBO = D / 8 * 128 (next 8 rows of K),
// SBO = 128 (next 8 columns of N).
#pragma once
#include <cstdint>

namespace hal_cuda {

__host__ __device__ constexpr int cm_offset(int r, int chunk, int d) {  // 16-bit elements
  return ((r >> 3) * (d >> 3) + chunk) * 64 + (r & 7) * 8;
}

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HAL_WGMMA 1
#endif

__device__ __forceinline__ uint64_t wg_desc(const void* smem, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}

__device__ __forceinline__ void wg_fence() {
#ifdef HAL_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#ifdef HAL_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void wg_wait() {
#ifdef HAL_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to wgmma's async proxy.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef HAL_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

#define HAL_WG_D                                                                                       \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),      \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define HAL_WG_DSTR                                                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// D(64 x 64, fp32) += A(64 x 16, shared, K-major) * B(16 x 64, shared, K-major)
template <bool kBf16>
__device__ __forceinline__ void wgmma_ss(float (&d)[32], uint64_t a, uint64_t b) {
#ifdef HAL_WGMMA
  if constexpr (kBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " HAL_WG_DSTR ", %32, %33, p, 1, 1, 0, 0;\n}"
                 : HAL_WG_D : "l"(a), "l"(b), "r"(1));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " HAL_WG_DSTR ", %32, %33, p, 1, 1, 0, 0;\n}"
                 : HAL_WG_D : "l"(a), "l"(b), "r"(1));
  }
#endif
}

// D(64 x 64, fp32) += A(64 x 16, registers: the mma.sync m16k16 fragment of each warp's 16 rows)
//                     * B(16 x 64, shared; kTransB: MN-major, else K-major)
template <bool kBf16, bool kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
#ifdef HAL_WGMMA
  if constexpr (kBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " HAL_WG_DSTR
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}"
                 : HAL_WG_D : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(kTransB ? 1 : 0));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " HAL_WG_DSTR
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}"
                 : HAL_WG_D : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(kTransB ? 1 : 0));
  }
#endif
}

#define HAL_WG_D16                                                                                     \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),      \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define HAL_WG_DSTR16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"

// D(64 x 32, fp32) += A(64 x 16, shared, K-major) * B(16 x 32, shared, K-major) (MLA decode's S)
template <bool kBf16>
__device__ __forceinline__ void wgmma_ss_n32(float (&d)[16], uint64_t a, uint64_t b) {
#ifdef HAL_WGMMA
  if constexpr (kBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " HAL_WG_DSTR16 ", %16, %17, p, 1, 1, 0, 0;\n}"
                 : HAL_WG_D16 : "l"(a), "l"(b), "r"(1));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 " HAL_WG_DSTR16 ", %16, %17, p, 1, 1, 0, 0;\n}"
                 : HAL_WG_D16 : "l"(a), "l"(b), "r"(1));
  }
#endif
}
// Keeps the compiler from moving accesses to accumulators across an in-flight wgmma.
template <int N> __device__ __forceinline__ void wg_pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Keeps registers that an in-flight wgmma reads (its A operand) live, and unmoved, until this point.
template <int N> __device__ __forceinline__ void wg_pin_regs(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

#undef HAL_WG_D
#undef HAL_WG_DSTR
#undef HAL_WG_D16
#undef HAL_WG_DSTR16

}  // namespace hal_cuda
