// Which K/V bytes each thread of a warp loads into its mma.sync fragments, and the head-dimension
// permutations that make those loads 16-byte contiguous (see decode.cuh).
#pragma once
#include "common.cuh"

namespace hal_cuda {

template <Kind K, int D>
struct Layout {
  static constexpr int kBpe = Traits<K>::kBytes;
  static constexpr int kEpl = 16 / kBpe;             // elements per 16-byte load
  static constexpr int kKbPerChunk = kEpl / 4;       // k-blocks a thread covers per full chunk
  static constexpr int kChunk = 4 * kEpl;            // dims per chunk (4 threads x 16 bytes)
  static constexpr int kFull = D / kChunk;
  static constexpr int kTailKb = (D % kChunk) / 16;  // k-blocks in the last, partial chunk
  static constexpr int kKb = D / 16;                 // k-blocks (QK) per row
  static constexpr int kKWords = kKb * kBpe;         // 32-bit words of one K row per thread
  static constexpr int kNt = D / 8;                  // n8 tiles (PV) per row
  // V piece width in elements: the largest power of two dividing kNt, at most one 16-byte load.
  static constexpr int kW = (kNt % 16 == 0 && kEpl >= 16) ? 16 : (kNt % 8 == 0 && kEpl >= 8) ? 8 : (kNt % 4 == 0) ? 4 : 2;
  static constexpr int kVBytes = kNt * kBpe;         // bytes of one V row per thread
  static constexpr int kVWords = (kVBytes + 3) / 4;
  static_assert(D % 16 == 0, "head size must be a multiple of 16");

  // First of the 4 contiguous dims thread t holds for k-block kb (same map for Q and K).
  static __device__ __forceinline__ int kdim(int t, int kb) {
    const int c = kb / kKbPerChunk, j = kb % kKbPerChunk;
    const int m = c < kFull ? kKbPerChunk : kTailKb;
    return c * kChunk + 4 * m * t + 4 * j;
  }
  // The head dim that output column n (thread group n) of n8 tile nt stands for.
  static __device__ __forceinline__ int vdim(int n, int nt) { return (nt / kW) * (8 * kW) + n * kW + (nt % kW); }

  static __device__ __forceinline__ void load_k_row(const uint8_t* row, int t, uint32_t (&w)[kKWords]) {
#pragma unroll
    for (int c = 0; c < kFull; ++c) load_bytes<16>(row + (c * kChunk + kEpl * t) * kBpe, &w[c * 4]);
    if constexpr (kTailKb > 0) {
      constexpr int bytes = 4 * kTailKb * kBpe;
      const uint8_t* p = row + (kFull * kChunk + 4 * kTailKb * t) * kBpe;
      if constexpr (bytes == 12) {
        load_bytes<4>(p, &w[kFull * 4]);
        load_bytes<4>(p + 4, &w[kFull * 4 + 1]);
        load_bytes<4>(p + 8, &w[kFull * 4 + 2]);
      } else {
        load_bytes<bytes>(p, &w[kFull * 4]);
      }
    }
  }
  static __device__ __forceinline__ void load_v_row(const uint8_t* row, int g, uint32_t (&w)[kVWords]) {
    constexpr int pb = kW * kBpe;  // bytes per piece
#pragma unroll
    for (int i = 0; i < kNt / kW; ++i) {
      const uint8_t* p = row + (i * 8 * kW + g * kW) * kBpe;
      if constexpr (pb >= 4) {
        load_bytes<pb>(p, &w[i * pb / 4]);
      } else {  // 2-byte pieces, two to a word
        uint32_t h;
        load_bytes<2>(p, &h);
        if (i % 2 == 0) w[i / 2] = h; else w[i / 2] |= h << 16;
      }
    }
  }
};

}  // namespace hal_cuda
