// Host-side facts about the current device that launchers need (plain C++ and CUDA runtime calls).
#pragma once
#include <atomic>
#include <cuda_runtime.h>

namespace hal_cuda {

// Whether the current device runs the sm_90a kernels (prefill_sm90.cuh, mla_sm90.cuh): an sm_90 GPU, and
// sm_90a code in this module (HAL_CUDA_SM90A: CMake saw 90a, and no plain 90 whose cubin the driver
// could load instead, among the archs; elsewhere those kernels' bodies are a trap and are never launched).
inline bool sm90a_kernels_run() {
#ifdef HAL_CUDA_SM90A
  static std::atomic<int> cc[64];  // per device: 0 not asked yet, else major * 10 + minor
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    cudaGetLastError();  // no device: leave no sticky error behind
    return false;
  }
  int known = cc[dev].load(std::memory_order_relaxed);
  if (known == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    known = major * 10 + minor;
    cc[dev].store(known, std::memory_order_relaxed);
  }
  return known == 90;
#else
  return false;
#endif
}

// Opt a kernel into more than 48 KiB of dynamic shared memory, once per device: the attribute belongs to
// the current device's copy of the kernel, so a process that runs the op on a second GPU must set it
// there too (a process-wide once would leave that launch failing). `done` is the caller's: one a kernel.
template <typename Kernel>
inline int allow_dynamic_smem(Kernel kernel, int bytes, std::atomic<int> (&done)[64]) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    cudaGetLastError();
    return (int)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  }
  if (done[dev].load(std::memory_order_acquire)) return 0;
  const int err = (int)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == 0) done[dev].store(1, std::memory_order_release);
  return err;
}

}  // namespace hal_cuda
