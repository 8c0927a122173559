// Writing new tokens into the paged cache: stored = cvt(x / scale), IEEE division, then the
// hardware's round-to-nearest-even saturating conversion (NaN -> 0x7f, +-inf -> +-max finite),
// the semantics hal.fp8.encode_bytes defines. Slots that are negative or past the cache are skipped.
#include "common.cuh"
#include "launch.h"

namespace hal_cuda {

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }

template <Kind K, typename In>
__device__ __forceinline__ void write_row(const In* src, uint8_t* dst, int d, float s) {
  // two elements at a time (head sizes are even)
  for (int i = 2 * (int)threadIdx.x; i < d; i += 2 * (int)blockDim.x) {
    const float x = __fdiv_rn(to_f32(src[i]), s), y = __fdiv_rn(to_f32(src[i + 1]), s);
    if constexpr (Traits<K>::kFp8) {
      *reinterpret_cast<uint16_t*>(dst + i) = f32x2_to_fp8x2<K>(x, y);
    } else if constexpr (Traits<K>::kBf16Math) {
      *reinterpret_cast<uint32_t*>(dst + 2 * i) = pack_bf16x2(x, y);
    } else {
      *reinterpret_cast<uint32_t*>(dst + 2 * i) = pack_f16x2(x, y);
    }
  }
}

// One CTA per (token, KV head); threads stride over the head dim.
template <Kind K, typename In>
__global__ void cache_kv_kernel(const CacheParams p) {
  const int tok = blockIdx.x, h = blockIdx.y;
  const int64_t slot = p.slot_mapping[tok];
  if (slot < 0 || slot >= (int64_t)p.num_blocks * p.block_size) return;
  const int64_t blk = slot / p.block_size, off = slot % p.block_size;
  const float ks = p.k_scale_ptr ? p.k_scale_ptr[h * p.k_scale_stride] : p.k_scale;
  const float vs = p.v_scale_ptr ? p.v_scale_ptr[h * p.v_scale_stride] : p.v_scale;
  write_row<K>(reinterpret_cast<const In*>(p.key) + tok * p.key_stride0 + h * p.key_stride1,
               p.key_cache + blk * p.k_stride0 + h * p.k_head_stride + off * p.k_row, p.head_size, ks);
  write_row<K>(reinterpret_cast<const In*>(p.value) + tok * p.value_stride0 + h * p.value_stride1,
               p.value_cache + blk * p.v_stride0 + h * p.v_head_stride + off * p.v_row, p.head_size, vs);
}

template <Kind K>
static int launch_kind(int input, const CacheParams& p, cudaStream_t stream) {
  const dim3 grid(p.num_tokens, p.num_kv_heads);
  const int threads = p.head_size >= 128 ? 64 : 32;
  switch (input) {
    case 0: cache_kv_kernel<K, __half><<<grid, threads, 0, stream>>>(p); break;
    case 1: cache_kv_kernel<K, __nv_bfloat16><<<grid, threads, 0, stream>>>(p); break;
    case 2: cache_kv_kernel<K, float><<<grid, threads, 0, stream>>>(p); break;
    default: return (int)cudaErrorInvalidValue;
  }
  return (int)cudaGetLastError();
}

// One CTA per token: a row of p.width elements at its slot (token rows p.token_stride bytes apart).
template <Kind K, typename In>
__global__ void cache_rows_kernel(const RowCacheParams p) {
  const int tok = blockIdx.x;
  const int64_t slot = p.slot_mapping[tok];
  if (slot < 0 || slot >= (int64_t)p.num_blocks * p.block_size) return;
  const int64_t blk = slot / p.block_size, off = slot % p.block_size;
  const float s = p.scale_ptr ? *p.scale_ptr : p.scale;
  write_row<K>(reinterpret_cast<const In*>(p.src) + tok * p.src_stride0, p.cache + blk * p.block_stride + off * p.token_stride,
               p.width, s);
}

template <Kind K>
static int launch_rows_kind(int input, const RowCacheParams& p, cudaStream_t stream) {
  const int threads = p.width >= 256 ? 128 : 32;
  switch (input) {
    case 0: cache_rows_kernel<K, __half><<<p.num_tokens, threads, 0, stream>>>(p); break;
    case 1: cache_rows_kernel<K, __nv_bfloat16><<<p.num_tokens, threads, 0, stream>>>(p); break;
    case 2: cache_rows_kernel<K, float><<<p.num_tokens, threads, 0, stream>>>(p); break;
    default: return (int)cudaErrorInvalidValue;
  }
  return (int)cudaGetLastError();
}

int launch_cache_rows(int kind, int input, const RowCacheParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return 0;
  switch (kind) {
    case 0: return launch_rows_kind<Kind::F16>(input, p, stream);
    case 1: return launch_rows_kind<Kind::BF16>(input, p, stream);
    case 2: return launch_rows_kind<Kind::E4M3>(input, p, stream);
    case 3: return launch_rows_kind<Kind::E5M2>(input, p, stream);
    default: return (int)cudaErrorInvalidValue;
  }
}

int launch_cache_kv(int kind, int input, const CacheParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return 0;
  switch (kind) {
    case 0: return launch_kind<Kind::F16>(input, p, stream);
    case 1: return launch_kind<Kind::BF16>(input, p, stream);
    case 2: return launch_kind<Kind::E4M3>(input, p, stream);
    case 3: return launch_kind<Kind::E5M2>(input, p, stream);
    default: return (int)cudaErrorInvalidValue;
  }
}

}  // namespace hal_cuda
