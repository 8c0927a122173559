// Launch parameters shared by the host launcher and the kernels (plain data, no torch types).
#pragma once
#include <cstdint>
#include <vector_types.h>  // int4

namespace hal_cuda {

struct DecodeParams {
  void* out;                    // [num_seqs, num_heads, D], query dtype; strides in elements
  const void* query;            // [num_seqs, num_heads, D], fp16 or bf16
  const uint8_t* key_cache;     // [num_blocks, num_kv_heads, block_size, D] through its strides
  const uint8_t* value_cache;
  const int* block_tables;      // [num_seqs, bt_stride0] int32
  const int* seq_lens;          // [num_seqs] int32
  // [num_seqs + 1] int32 or null. Set (a multi-token call): sequence i's one query row is row
  // query_start_loc[i], and sequences of any other row count are skipped (the prefill kernel's).
  const int* query_start_loc;
  const float* alibi;           // [num_heads] or null
  const float* k_scale_ptr;     // [num_kv_heads] (stride 1), 0-d (stride 0), or null: use k_scale
  const float* v_scale_ptr;
  float* part_out;              // [num_seqs, num_heads, num_parts, D] fp32 (split only)
  float* part_ml;               // [num_seqs, num_heads, num_parts, 2] (max in log2 units, sum)
  // [num_seqs * num_kv_heads * head_tiles] int32, zero before the launch and left zero after it, or
  // null. Set: the last CTA of a split row merges its partitions (no reduce launch; not with warp rows).
  int* counters;
  int64_t q_stride0, q_stride1, out_stride0, out_stride1;
  int64_t k_stride0, v_stride0;  // bytes between blocks
  int64_t k_head_stride, k_row, v_head_stride, v_row;  // bytes between KV heads / token rows (NHD views too)
  int64_t bt_stride0;
  float scale, k_scale, v_scale, soft_cap;  // soft_cap <= 0: off
  int k_scale_stride, v_scale_stride;
  int num_seqs, num_heads, num_kv_heads, gqa, head_tiles;
  int block_size, block_shift;  // block_size is a power of two
  int partition_size, num_parts, window;  // window <= 0: off
  int q_is_bf16;                // query/out dtype: 1 bf16, 0 fp16
  int warp_rows;                // 1: each warp serves its own (sequence, KV head); grid x = rows / 4
};

// Multi-token paged attention (prefill.cuh): rows of sequence i are query rows query_start_loc[i] ..
// query_start_loc[i+1]-1 at positions seq_lens[i] - q_len + t (bottom-right aligned).
struct PrefillParams {
  void* out;                    // [total_q, num_heads, D], query dtype; strides in elements
  const void* query;            // [total_q, num_heads, D], fp16 or bf16, 16-byte aligned rows
  const uint8_t* key_cache;     // [num_blocks, num_kv_heads, block_size, D] through its strides
  const uint8_t* value_cache;
  const int* block_tables;      // [num_seqs, bt_stride0] int32
  const int* seq_lens;          // [num_seqs] int32, the whole context including the new tokens
  const int* query_start_loc;   // [num_seqs + 1] int32
  const float* alibi;           // [num_heads] or null
  const float* k_scale_ptr;     // [num_kv_heads] (stride 1), 0-d (stride 0), or null: use k_scale
  const float* v_scale_ptr;
  int64_t q_stride0, q_stride1, out_stride0, out_stride1;
  int64_t k_stride0, v_stride0;  // bytes between blocks
  int64_t k_head_stride, k_row, v_head_stride, v_row;  // bytes between KV heads / token rows
  int64_t bt_stride0;
  float scale, k_scale, v_scale, soft_cap;  // soft_cap <= 0: off
  int k_scale_stride, v_scale_stride;
  int num_seqs, num_heads, num_kv_heads, gqa;
  int block_size, block_shift;  // block_size is a power of two
  int window, causal, q_is_bf16;  // window <= 0: off
  int row_tiles;                // CTAs a (sequence, KV head): ceil(max_query_len * gqa / rows a CTA)
  int min_rows;                 // sequences with fewer query rows are skipped (2: decode takes 1-row ones)
  int wgmma;                    // 2: the CuTe kernel (prefill_cute.cuh), 1: prefill_sm90.cuh, 0: mma.sync; each
                                // where it can run, else the next one down (prefill_launch.inc)
};

struct CacheParams {
  const void* key;              // [num_tokens, num_kv_heads, D]; strides in elements
  const void* value;
  uint8_t* key_cache;
  uint8_t* value_cache;
  const int64_t* slot_mapping;
  const float* k_scale_ptr;
  const float* v_scale_ptr;
  int64_t key_stride0, key_stride1, value_stride0, value_stride1;
  int64_t k_stride0, v_stride0;  // bytes between cache blocks
  int64_t k_head_stride, k_row, v_head_stride, v_row;  // bytes between KV heads / token rows
  float k_scale, v_scale;
  int k_scale_stride, v_scale_stride;
  int num_tokens, num_kv_heads, head_size, block_size, num_blocks;
};

// MLA decode (absorbed form): every query head attends one shared latent (R = 512, also the value)
// and a rotary part (P = 64) per token; rows of a sequence are (query token, head) pairs, heads fastest.
struct MLAParams {
  void* out;                    // [total_q, num_heads, 512], query dtype; strides in elements
  const void* q_nope;           // [total_q, num_heads, 512], fp16 or bf16, 16-byte aligned rows
  const void* q_pe;             // [total_q, num_heads, 64], the query's dtype
  const uint8_t* ckv;           // latent cache; strides in bytes (views into a combined cache work)
  const uint8_t* kpe;           // rotary cache, 16-bit (the query's dtype)
  const int* block_tables;      // [num_seqs, bt_stride0] int32
  const int* seq_lens;          // [num_seqs] int32
  const int* query_start_loc;   // [num_seqs + 1] or null (one row per sequence)
  const float* ckv_scale_ptr;   // 0-d device scale or null: use ckv_scale
  const float* kpe_scale_ptr;
  // Partials of split row tiles (fp32; the max in log2 units and the sum): a uniform split (work null)
  // [total_q, num_heads, num_parts, 512 | 2]; the work list [sched_slots * tile_rows, 512 | 2]
  float* part_out;
  float* part_ml;
  // [num_seqs * row_tiles] int32, zero before the launch and left zero after it, or null. Set: the
  // last CTA of a split row tile merges its partitions (mla.cuh; the sm_90a kernel leaves it to the
  // reduce launch).
  int* counters;
  // The balanced split (mla_schedule.cu), or null for the uniform one (partition_size, num_parts; a
  // grid of num_seqs x row_tiles x num_parts). work [sched_cap]: a CTA's {sequence, row tile,
  // partition, 0}, sequence -1 for none; tile_parts [num_seqs * row_tiles]: a row tile's {first
  // partial slot, partitions (0: no rows), partition size in tokens, 0}. Written by the schedule
  // launch before the kernel (graph-safe: from the device's seq_lens).
  int4* work;
  int4* tile_parts;
  // [num_seqs * row_tiles] or null (a plan's): the row tiles' block counts the list was made for; the
  // schedule launch keeps the list where they are unchanged (INT_MIN at first: never)
  int* sched_seen;
  int64_t qn_stride0, qn_stride1, qp_stride0, qp_stride1, out_stride0, out_stride1;
  int64_t ckv_block_stride, ckv_token_stride, kpe_block_stride, kpe_token_stride;
  int64_t bt_stride0;
  float scale, ckv_scale, kpe_scale;
  int num_seqs, num_heads, total_q, block_size, block_shift;
  int partition_size, num_parts, row_tiles, q_is_bf16;
  int tile_rows;       // rows a CTA: 16, 32 or 64
  int merge_rows;      // the work list's reduce: rows a CTA (1-4; mla_reduce.cu)
  // the balanced split: CTAs a wave (one an SM), most CTAs and partial slots (host-sized workspace),
  // a CTA's fixed cost in 64-token blocks (the cost model of mla_schedule.cu)
  int sched_ctas, sched_cap, sched_slots, sched_overhead;
  // 0: mla.cuh; 1: the row tile's own kernel: mla_sm90.cuh for 64-row tiles (where it can run: an
  // sm_90 GPU, sm_90a code), mla_narrow.cuh for 16-row tiles
  int kernel;
};

// Writing rows of one width into a paged cache whose token rows may be strided (cache_mla).
struct RowCacheParams {
  const void* src;              // [num_tokens, width]; src_stride0 in elements
  uint8_t* cache;               // block_stride / token_stride in bytes
  const int64_t* slot_mapping;
  const float* scale_ptr;
  int64_t src_stride0, block_stride, token_stride;
  float scale;
  int num_tokens, width, block_size, num_blocks;
};

}  // namespace hal_cuda
