// What one CTA of an MLA decode kernel computes (mla.cuh, mla_narrow.cuh, mla_sm90.cuh): a (sequence,
// row tile, token range), and where its partial results go when the row tile is split.
//
// Two splits of the context: the uniform one (params.work null: a grid of sequences x row tiles x
// partitions of partition_size tokens, planned on the host from the longest sequence) and the
// balanced one (mla_schedule.cu: a work list written on the device from seq_lens, each row tile cut
// into partitions of its own size, one CTA a list entry, the longest first).
#pragma once
#include "merge.cuh"
#include "params.h"

namespace hal_cuda {
namespace mla {

struct Item {
  int seq, q0, qlen, rows;  // the sequence: its first query row, query rows, rows (query rows x heads)
  int r0, L, p0, p1;        // the first row of the tile, the sequence's length, tokens [p0, p1)
  int parts;                // partitions of this row tile (1: the CTA writes the output itself)
  // the partial of sequence row r goes to slot slot_base + r * slot_stride
  int64_t slot_base, slot_stride;
  // the merge of the tile's partitions: slot of (row r0 + i, partition q) = merge_slot0 + i * merge_row
  // + q * merge_part; its counter (params.counters set)
  int64_t merge_slot0, merge_row, merge_part;
  int* counter;
  __device__ bool split() const { return parts > 1; }
  __device__ int64_t slot(int r) const { return slot_base + (int64_t)r * slot_stride; }
};

// This CTA's item (M rows a tile), or false when it has nothing to do (past the work list or past
// the sequence's rows). With the uniform split an item may be empty (p0 >= L): the kernel says so to
// the merge. CTA-uniform.
template <int M>
__device__ __forceinline__ bool mla_item(const MLAParams& p, Item& it) {
  int tile, part;
  if (p.work) {
    const int4 w = p.work[blockIdx.x];
    if (w.x < 0) return false;
    it.seq = w.x, tile = w.y, part = w.z;
  } else {
    it.seq = blockIdx.x, tile = blockIdx.y, part = blockIdx.z;
  }
  it.q0 = it.seq, it.qlen = 1;
  if (p.query_start_loc) it.q0 = p.query_start_loc[it.seq], it.qlen = p.query_start_loc[it.seq + 1] - it.q0;
  it.rows = it.qlen * p.num_heads;
  it.r0 = tile * M;
  if (it.r0 >= it.rows) return false;
  it.L = p.seq_lens[it.seq];
  const int64_t u = (int64_t)it.seq * p.row_tiles + tile;
  it.counter = p.counters ? p.counters + u : nullptr;
  if (p.work) {
    const int4 tp = p.tile_parts[u];  // {first slot, partitions, partition size, 0}
    it.parts = tp.y;
    it.p0 = part * tp.z;
    it.p1 = it.parts > 1 ? min(it.p0 + tp.z, it.L) : it.L;
    it.slot_base = ((int64_t)tp.x + part) * M - it.r0, it.slot_stride = 1;
    it.merge_slot0 = (int64_t)tp.x * M, it.merge_row = 1, it.merge_part = M;
  } else {
    it.parts = p.num_parts;
    it.p0 = part * p.partition_size;
    it.p1 = min(it.p0 + p.partition_size, it.L);
    const int64_t first = (int64_t)it.q0 * p.num_heads;
    it.slot_base = first * p.num_parts + part, it.slot_stride = p.num_parts;
    it.merge_slot0 = (first + it.r0) * p.num_parts, it.merge_row = p.num_parts, it.merge_part = 1;
  }
  return true;
}

// A split row tile with counters: the last of its partitions to finish merges them (no reduce
// launch). Called by every thread of the CTA once its partials are written.
template <int M>
__device__ void merge_if_last(const MLAParams& p, const Item& it, float* scratch) {
  if (!last_to_arrive(it.counter, it.parts)) return;
  const float cs = p.ckv_scale_ptr ? *p.ckv_scale_ptr : p.ckv_scale;
  const MergeOut dst{p.out, (int64_t)it.q0 * p.out_stride0, p.out_stride0, p.out_stride1, it.r0, p.num_heads,
                     p.q_is_bf16 != 0};
  merge_partitions<512>(p.part_out, p.part_ml, it.merge_slot0, it.merge_row, it.merge_part, min(M, it.rows - it.r0),
                        0, it.parts, cs, dst, scratch);
}

}  // namespace mla
}  // namespace hal_cuda
