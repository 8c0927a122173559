// pybind11 surface of the cuda pack: launchers that take device pointers (as integers), strides and
// torch's current stream; every CUDA error becomes a RuntimeError with CUDA's own message.
#include <pybind11/pybind11.h>
#include <stdexcept>
#include <string>
#include "arch.h"
#include "launch.h"

namespace py = pybind11;
using namespace hal_cuda;

static void check(int err, const char* what) {
  if (err != 0) {
    throw std::runtime_error(std::string("hal cuda pack: ") + what + " failed: CUDA error " + std::to_string(err) +
                             " (" + cudaGetErrorString(static_cast<cudaError_t>(err)) + ")");
  }
}

template <typename T>
static T* ptr(std::uintptr_t v) { return reinterpret_cast<T*>(v); }

// log2 of a power-of-two block size (the kernels shift, never divide)
static int block_shift(int block_size) {
  int shift = 0;
  while ((1 << shift) < block_size) ++shift;
  if ((1 << shift) != block_size) throw std::invalid_argument("block_size must be a power of two");
  return shift;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "hal cuda pack kernels (paged decode and multi-token attention, partition reduce, cache_kv, MLA decode, cache rows)";
  m.def("device_count", [] {
    int count = 0;
    int err = (int)cudaGetDeviceCount(&count);
    return py::make_tuple(count, err, std::string(cudaGetErrorString((cudaError_t)err)));
  });
  // whether the current device runs the sm_90a kernels (multi-token and MLA) when they are asked for
  m.def("prefill_wgmma", [] { return sm90a_kernels_run(); });
  m.def("head_sizes", [] {
    py::list l;
#define HAL_ITEM(D) l.append(D);
    HAL_CUDA_HEAD_SIZES(HAL_ITEM)
#undef HAL_ITEM
    return l;
  });
  // resident CTAs per SM of the decode kernel for (cache kind, head size, two head tiles, warp rows) on
  // the current device; -1 where the head size is not compiled or the query failed
  m.def("decode_ctas_per_sm", [](int kind, int head_size, bool two, bool rows) {
    switch (kind) {
      case 0: return decode_ctas_per_sm_f16(head_size, two, rows);
      case 1: return decode_ctas_per_sm_bf16(head_size, two, rows);
      case 2: return decode_ctas_per_sm_e4m3(head_size, two, rows);
      case 3: return decode_ctas_per_sm_e5m2(head_size, two, rows);
      default: return -1;
    }
  });
  // kind: 0 fp16, 1 bf16, 2 e4m3fn, 3 e5m2 cache
  m.def("paged_attention",
        [](int kind, int head_size, std::uintptr_t out, std::uintptr_t query, std::uintptr_t key_cache,
           std::uintptr_t value_cache, std::uintptr_t block_tables, std::uintptr_t seq_lens, std::uintptr_t alibi,
           std::uintptr_t k_scale_ptr, std::uintptr_t v_scale_ptr, std::uintptr_t part_out, std::uintptr_t part_ml,
           std::uintptr_t counters, int64_t q_stride0, int64_t q_stride1, int64_t out_stride0, int64_t out_stride1, int64_t k_stride0,
           int64_t v_stride0, int64_t bt_stride0, float scale, float k_scale, float v_scale, float soft_cap,
           int k_scale_stride, int v_scale_stride, int num_seqs, int num_heads, int num_kv_heads, int head_tiles,
           int block_size, int partition_size, int num_parts, int window, int q_is_bf16, int warp_rows,
           int64_t k_head_stride, int64_t k_row, int64_t v_head_stride, int64_t v_row, std::uintptr_t query_start_loc,
           std::uintptr_t stream) {
          DecodeParams p{};
          p.out = ptr<void>(out);
          p.query = ptr<const void>(query);
          p.key_cache = ptr<const uint8_t>(key_cache);
          p.value_cache = ptr<const uint8_t>(value_cache);
          p.block_tables = ptr<const int>(block_tables);
          p.seq_lens = ptr<const int>(seq_lens);
          p.query_start_loc = ptr<const int>(query_start_loc);
          p.alibi = ptr<const float>(alibi);
          p.k_scale_ptr = ptr<const float>(k_scale_ptr);
          p.v_scale_ptr = ptr<const float>(v_scale_ptr);
          p.part_out = ptr<float>(part_out);
          p.part_ml = ptr<float>(part_ml);
          p.counters = ptr<int>(counters);
          p.q_stride0 = q_stride0; p.q_stride1 = q_stride1; p.out_stride0 = out_stride0; p.out_stride1 = out_stride1;
          p.k_stride0 = k_stride0; p.v_stride0 = v_stride0; p.bt_stride0 = bt_stride0;
          p.k_head_stride = k_head_stride; p.k_row = k_row; p.v_head_stride = v_head_stride; p.v_row = v_row;
          p.scale = scale; p.k_scale = k_scale; p.v_scale = v_scale; p.soft_cap = soft_cap;
          p.k_scale_stride = k_scale_stride; p.v_scale_stride = v_scale_stride;
          p.num_seqs = num_seqs; p.num_heads = num_heads; p.num_kv_heads = num_kv_heads;
          p.gqa = num_heads / num_kv_heads; p.head_tiles = head_tiles;
          p.block_size = block_size;
          p.block_shift = block_shift(block_size);
          p.partition_size = partition_size; p.num_parts = num_parts; p.window = window; p.q_is_bf16 = q_is_bf16;
          p.warp_rows = warp_rows;
          if (warp_rows && head_tiles * 8 < p.gqa) {
            throw std::invalid_argument("warp_rows=1 needs one 8-head tile per CTA (head_tiles * 8 >= " +
                                        std::to_string(p.gqa) + " query heads per KV head); got head_tiles=" +
                                        std::to_string(head_tiles));
          }
          if (num_seqs == 0) return;
          auto s = reinterpret_cast<cudaStream_t>(stream);
          int err;
          {
            py::gil_scoped_release nogil;
            switch (kind) {
              case 0: err = launch_decode_f16(head_size, p, s); break;
              case 1: err = launch_decode_bf16(head_size, p, s); break;
              case 2: err = launch_decode_e4m3(head_size, p, s); break;
              case 3: err = launch_decode_e5m2(head_size, p, s); break;
              default: err = (int)cudaErrorInvalidValue;
            }
            // the merge: in the kernel where the call brought counters (not with warp rows), else a second launch
            if (err == 0 && num_parts > 1 && (!p.counters || warp_rows)) err = launch_reduce(head_size, p, s);
          }
          check(err, "paged_attention");
        });
  // multi-token attention (prefill.cuh); kind as paged_attention. Sequences with fewer than min_rows
  // query rows are left to the decode kernel (a mixed call launches both).
  m.def("prefill",
        [](int kind, int head_size, std::uintptr_t out, std::uintptr_t query, std::uintptr_t key_cache,
           std::uintptr_t value_cache, std::uintptr_t block_tables, std::uintptr_t seq_lens,
           std::uintptr_t query_start_loc, std::uintptr_t alibi, std::uintptr_t k_scale_ptr, std::uintptr_t v_scale_ptr,
           int64_t q_stride0, int64_t q_stride1, int64_t out_stride0, int64_t out_stride1, int64_t k_stride0,
           int64_t v_stride0, int64_t bt_stride0, float scale, float k_scale, float v_scale, float soft_cap,
           int k_scale_stride, int v_scale_stride, int num_seqs, int num_heads, int num_kv_heads, int block_size,
           int window, int causal, int q_is_bf16, int max_query_len, int min_rows, int64_t k_head_stride,
           int64_t k_row, int64_t v_head_stride, int64_t v_row, int wgmma, std::uintptr_t stream) {
          PrefillParams p{};
          p.out = ptr<void>(out); p.query = ptr<const void>(query);
          p.key_cache = ptr<const uint8_t>(key_cache); p.value_cache = ptr<const uint8_t>(value_cache);
          p.block_tables = ptr<const int>(block_tables); p.seq_lens = ptr<const int>(seq_lens);
          p.query_start_loc = ptr<const int>(query_start_loc); p.alibi = ptr<const float>(alibi);
          p.k_scale_ptr = ptr<const float>(k_scale_ptr); p.v_scale_ptr = ptr<const float>(v_scale_ptr);
          p.q_stride0 = q_stride0; p.q_stride1 = q_stride1; p.out_stride0 = out_stride0; p.out_stride1 = out_stride1;
          p.k_stride0 = k_stride0; p.v_stride0 = v_stride0; p.bt_stride0 = bt_stride0;
          p.k_head_stride = k_head_stride; p.k_row = k_row; p.v_head_stride = v_head_stride; p.v_row = v_row;
          p.scale = scale; p.k_scale = k_scale; p.v_scale = v_scale; p.soft_cap = soft_cap;
          p.k_scale_stride = k_scale_stride; p.v_scale_stride = v_scale_stride;
          p.num_seqs = num_seqs; p.num_heads = num_heads; p.num_kv_heads = num_kv_heads;
          p.gqa = num_heads / num_kv_heads; p.block_size = block_size;
          p.block_shift = block_shift(block_size);
          if (query_start_loc == 0) throw std::invalid_argument("prefill needs query_start_loc");
          p.window = window; p.causal = causal; p.q_is_bf16 = q_is_bf16; p.min_rows = min_rows;
          p.wgmma = wgmma;
          if (num_seqs == 0 || max_query_len <= 0) return;
          auto s = reinterpret_cast<cudaStream_t>(stream);
          int err;
          {
            py::gil_scoped_release nogil;
            switch (kind) {
              case 0: err = launch_prefill_f16(head_size, max_query_len, p, s); break;
              case 1: err = launch_prefill_bf16(head_size, max_query_len, p, s); break;
              case 2: err = launch_prefill_e4m3(head_size, max_query_len, p, s); break;
              case 3: err = launch_prefill_e5m2(head_size, max_query_len, p, s); break;
              default: err = (int)cudaErrorInvalidValue;
            }
          }
          check(err, "paged_attention (multi-token)");
        });
  m.def("cache_kv",
        [](int kind, int input, std::uintptr_t key, std::uintptr_t value, std::uintptr_t key_cache,
           std::uintptr_t value_cache, std::uintptr_t slot_mapping, std::uintptr_t k_scale_ptr,
           std::uintptr_t v_scale_ptr, int64_t key_stride0, int64_t key_stride1, int64_t value_stride0,
           int64_t value_stride1, int64_t k_stride0, int64_t v_stride0, float k_scale, float v_scale,
           int k_scale_stride, int v_scale_stride, int num_tokens, int num_kv_heads, int head_size, int block_size,
           int num_blocks, int64_t k_head_stride, int64_t k_row, int64_t v_head_stride, int64_t v_row,
           std::uintptr_t stream) {
          CacheParams p{};
          p.key = ptr<const void>(key); p.value = ptr<const void>(value);
          p.key_cache = ptr<uint8_t>(key_cache); p.value_cache = ptr<uint8_t>(value_cache);
          p.slot_mapping = ptr<const int64_t>(slot_mapping);
          p.k_scale_ptr = ptr<const float>(k_scale_ptr); p.v_scale_ptr = ptr<const float>(v_scale_ptr);
          p.key_stride0 = key_stride0; p.key_stride1 = key_stride1;
          p.value_stride0 = value_stride0; p.value_stride1 = value_stride1;
          p.k_stride0 = k_stride0; p.v_stride0 = v_stride0;
          p.k_head_stride = k_head_stride; p.k_row = k_row; p.v_head_stride = v_head_stride; p.v_row = v_row;
          p.k_scale = k_scale; p.v_scale = v_scale; p.k_scale_stride = k_scale_stride; p.v_scale_stride = v_scale_stride;
          p.num_tokens = num_tokens; p.num_kv_heads = num_kv_heads; p.head_size = head_size;
          p.block_size = block_size; p.num_blocks = num_blocks;
          int err;
          {
            py::gil_scoped_release nogil;
            err = launch_cache_kv(kind, input, p, reinterpret_cast<cudaStream_t>(stream));
          }
          check(err, "cache_kv");
        });
  // MLA decode (R = 512, P = 64); kind: the latent cache's, as paged_attention
  m.def("mla_decode",
        [](int kind, int row_groups, std::uintptr_t out, std::uintptr_t q_nope, std::uintptr_t q_pe, std::uintptr_t ckv,
           std::uintptr_t kpe, std::uintptr_t block_tables, std::uintptr_t seq_lens, std::uintptr_t query_start_loc,
           std::uintptr_t ckv_scale_ptr, std::uintptr_t kpe_scale_ptr, std::uintptr_t part_out, std::uintptr_t part_ml,
           std::uintptr_t counters, int64_t qn_stride0, int64_t qn_stride1, int64_t qp_stride0, int64_t qp_stride1, int64_t out_stride0,
           int64_t out_stride1, int64_t ckv_block_stride, int64_t ckv_token_stride, int64_t kpe_block_stride,
           int64_t kpe_token_stride, int64_t bt_stride0, float scale, float ckv_scale, float kpe_scale, int num_seqs,
           int num_heads, int total_q, int block_size, int partition_size, int num_parts, int row_tiles, int q_is_bf16,
           int wgmma, std::uintptr_t stream) {
          MLAParams p{};
          p.out = ptr<void>(out); p.q_nope = ptr<const void>(q_nope); p.q_pe = ptr<const void>(q_pe);
          p.ckv = ptr<const uint8_t>(ckv); p.kpe = ptr<const uint8_t>(kpe);
          p.block_tables = ptr<const int>(block_tables); p.seq_lens = ptr<const int>(seq_lens);
          p.query_start_loc = ptr<const int>(query_start_loc);
          p.ckv_scale_ptr = ptr<const float>(ckv_scale_ptr); p.kpe_scale_ptr = ptr<const float>(kpe_scale_ptr);
          p.part_out = ptr<float>(part_out); p.part_ml = ptr<float>(part_ml);
          // the merge: in mla.cuh where the call brought counters; the sm_90a kernel leaves it to the reduce launch
          const bool wg = row_groups == 4 && wgmma && sm90a_kernels_run();
          p.counters = wg ? nullptr : ptr<int>(counters);
          p.qn_stride0 = qn_stride0; p.qn_stride1 = qn_stride1; p.qp_stride0 = qp_stride0; p.qp_stride1 = qp_stride1;
          p.out_stride0 = out_stride0; p.out_stride1 = out_stride1;
          p.ckv_block_stride = ckv_block_stride; p.ckv_token_stride = ckv_token_stride;
          p.kpe_block_stride = kpe_block_stride; p.kpe_token_stride = kpe_token_stride; p.bt_stride0 = bt_stride0;
          p.scale = scale; p.ckv_scale = ckv_scale; p.kpe_scale = kpe_scale;
          p.num_seqs = num_seqs; p.num_heads = num_heads; p.total_q = total_q; p.block_size = block_size;
          p.block_shift = block_shift(block_size);
          if (partition_size % 64 != 0) throw std::invalid_argument("partition_size must be a multiple of 64");
          p.partition_size = partition_size; p.num_parts = num_parts; p.row_tiles = row_tiles; p.q_is_bf16 = q_is_bf16;
          p.wgmma = wgmma;
          if (num_seqs == 0 || total_q == 0) return;
          auto s = reinterpret_cast<cudaStream_t>(stream);
          int err;
          {
            py::gil_scoped_release nogil;
            switch (kind) {
              case 0: err = launch_mla_f16(row_groups, p, s); break;
              case 1: err = launch_mla_bf16(row_groups, p, s); break;
              case 2: err = launch_mla_e4m3(row_groups, p, s); break;
              case 3: err = launch_mla_e5m2(row_groups, p, s); break;
              default: err = (int)cudaErrorInvalidValue;
            }
            if (err == 0 && num_parts > 1 && !p.counters) err = launch_mla_reduce(p, s);
          }
          check(err, "mla_decode");
        });
  m.def("cache_rows",
        [](int kind, int input, std::uintptr_t src, std::uintptr_t cache, std::uintptr_t slot_mapping,
           std::uintptr_t scale_ptr, int64_t src_stride0, int64_t block_stride, int64_t token_stride, float scale,
           int num_tokens, int width, int block_size, int num_blocks, std::uintptr_t stream) {
          RowCacheParams p{};
          p.src = ptr<const void>(src); p.cache = ptr<uint8_t>(cache); p.slot_mapping = ptr<const int64_t>(slot_mapping);
          p.scale_ptr = ptr<const float>(scale_ptr); p.src_stride0 = src_stride0; p.block_stride = block_stride;
          p.token_stride = token_stride; p.scale = scale; p.num_tokens = num_tokens; p.width = width;
          p.block_size = block_size; p.num_blocks = num_blocks;
          int err;
          {
            py::gil_scoped_release nogil;
            err = launch_cache_rows(kind, input, p, reinterpret_cast<cudaStream_t>(stream));
          }
          check(err, "cache_rows");
        });
}
