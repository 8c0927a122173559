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

}  // namespace hal_cuda
