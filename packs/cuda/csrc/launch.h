// Host entry points of the cuda pack's kernels; each returns a cudaError_t as int.
#pragma once
#include <cuda_runtime.h>
#include "params.h"

namespace hal_cuda {

// Head sizes compiled; keep in sync with packs/cuda/pack.py (the pack's declaration).
#define HAL_CUDA_HEAD_SIZES(X) X(64) X(80) X(96) X(112) X(128) X(192) X(256)

int launch_decode_f16(int head_size, const DecodeParams& p, cudaStream_t stream);
int launch_decode_bf16(int head_size, const DecodeParams& p, cudaStream_t stream);
int launch_decode_e4m3(int head_size, const DecodeParams& p, cudaStream_t stream);
int launch_decode_e5m2(int head_size, const DecodeParams& p, cudaStream_t stream);
int decode_ctas_per_sm_f16(int head_size, bool two, bool rows);
int decode_ctas_per_sm_bf16(int head_size, bool two, bool rows);
int decode_ctas_per_sm_e4m3(int head_size, bool two, bool rows);
int decode_ctas_per_sm_e5m2(int head_size, bool two, bool rows);
// Multi-token attention (prefill.cuh); max_query_len sizes the grid (host int: no device read).
int launch_prefill_f16(int head_size, int max_query_len, PrefillParams& p, cudaStream_t stream);
int launch_prefill_bf16(int head_size, int max_query_len, PrefillParams& p, cudaStream_t stream);
int launch_prefill_e4m3(int head_size, int max_query_len, PrefillParams& p, cudaStream_t stream);
int launch_prefill_e5m2(int head_size, int max_query_len, PrefillParams& p, cudaStream_t stream);
// The CuTe kernel (prefill_cute.cuh, sm_90a; built where CMake found CUTLASS: HAL_CUDA_CUTE)
constexpr bool cute_head_size(int d) { return d == 64 || d == 128; }
int launch_prefill_cute_f16(int head_size, int max_query_len, PrefillParams& p, cudaStream_t stream);
int launch_prefill_cute_bf16(int head_size, int max_query_len, PrefillParams& p, cudaStream_t stream);
int launch_prefill_cute_e4m3(int head_size, int max_query_len, PrefillParams& p, cudaStream_t stream);
int launch_prefill_cute_e5m2(int head_size, int max_query_len, PrefillParams& p, cudaStream_t stream);
int launch_reduce(int head_size, const DecodeParams& p, cudaStream_t stream);
// kind: 0 fp16, 1 bf16, 2 e4m3fn, 3 e5m2 cache; input: 0 fp16, 1 bf16, 2 fp32 key/value
int launch_cache_kv(int kind, int input, const CacheParams& p, cudaStream_t stream);

// MLA decode (R = 512, P = 64): row_groups 1, 2 or 4 (16, 32 or 64 rows a CTA); the merge after it
// when num_parts > 1. cache_rows: rows of one width into a paged cache (cache_mla), kind as cache_kv.
int launch_mla_f16(int row_groups, const MLAParams& p, cudaStream_t stream);
int launch_mla_bf16(int row_groups, const MLAParams& p, cudaStream_t stream);
int launch_mla_e4m3(int row_groups, const MLAParams& p, cudaStream_t stream);
int launch_mla_e5m2(int row_groups, const MLAParams& p, cudaStream_t stream);
int launch_mla_reduce(const MLAParams& p, cudaStream_t stream);
// The balanced split's work list (params.work) from the device's seq_lens, before the MLA kernel; at
// most kMlaScheduleTiles row tiles (num_seqs x row_tiles), else the uniform split.
constexpr int kMlaScheduleTiles = 8192;
int launch_mla_schedule(const MLAParams& p, cudaStream_t stream);
int launch_cache_rows(int kind, int input, const RowCacheParams& p, cudaStream_t stream);

}  // namespace hal_cuda
