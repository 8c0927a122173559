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

// D(64 x 32, fp32) = A(64 x 16, shared, K-major) * B(16 x 32, shared, K-major) + (kAcc ? D : 0)
// (MLA decode's S; the first k16 step of a product passes kAcc = false instead of zeroing D)
template <bool kBf16, bool kAcc>
__device__ __forceinline__ void wgmma_ss_n32(float (&d)[16], uint64_t a, uint64_t b) {
#ifdef HAL_WGMMA
  if constexpr (kBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " HAL_WG_DSTR16 ", %16, %17, p, 1, 1, 0, 0;\n}"
                 : HAL_WG_D16 : "l"(a), "l"(b), "n"(kAcc ? 1 : 0));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 " HAL_WG_DSTR16 ", %16, %17, p, 1, 1, 0, 0;\n}"
                 : HAL_WG_D16 : "l"(a), "l"(b), "n"(kAcc ? 1 : 0));
  }
#endif
}
// Keeps the compiler from moving accesses to accumulators across an in-flight wgmma.
template <int N> __device__ __forceinline__ void wg_pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define HAL_WG_D128 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define HAL_WG_DSTR128 "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" "}"

// D(64 x 256, fp32) += A(64 x 16, registers: the mma.sync m16k16 fragment of each warp's 16 rows)
//                      * B(16 x 256, shared; kTransB: MN-major, else K-major). One instruction for all 128
// accumulators a thread: ptxas may sink register writes of a later wgmma's accumulators past an earlier
// wgmma of the same stage, and then serializes every wgmma of the kernel (C7514).
template <bool kBf16, bool kTransB>
__device__ __forceinline__ void wgmma_rs_n256(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {
#ifdef HAL_WGMMA
  if constexpr (kBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " HAL_WG_DSTR128
                 ", {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}"
                 : HAL_WG_D128 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(kTransB ? 1 : 0));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 " HAL_WG_DSTR128
                 ", {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}"
                 : HAL_WG_D128 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(kTransB ? 1 : 0));
  }
#endif
}

// D(64 x 256, fp32) += A(64 x 16, shared, K-major) * B(16 x 256, shared; kTransB: MN-major, else K-major)
template <bool kBf16, bool kTransB>
__device__ __forceinline__ void wgmma_ss_n256(float (&d)[128], uint64_t a, uint64_t b) {
#ifdef HAL_WGMMA
  if constexpr (kBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " HAL_WG_DSTR128
                 ", %128, %129, p, 1, 1, 0, %131;\n}"
                 : HAL_WG_D128 : "l"(a), "l"(b), "r"(1), "n"(kTransB ? 1 : 0));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 " HAL_WG_DSTR128
                 ", %128, %129, p, 1, 1, 0, %131;\n}"
                 : HAL_WG_D128 : "l"(a), "l"(b), "r"(1), "n"(kTransB ? 1 : 0));
  }
#endif
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
#undef HAL_WG_D128
#undef HAL_WG_DSTR128

}  // namespace hal_cuda
