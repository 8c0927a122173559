// pybind11 surface of the cuda pack: launchers that take device pointers (as integers), strides and
// torch's current stream; every CUDA error becomes a RuntimeError with CUDA's own message.
//
// Each launcher exists twice (def_launch): `name(args..., stream)` launches once (the one-shot call);
// `name_prepare(args...)` returns a Prepared launch, whose `run` takes only what changes from layer to
// layer (tensor pointers, scales, the stream). A plan (hal.plan) makes it once, so each layer's run
// crosses pybind11 with 10 arguments instead of 30-40 and fills no Python argument list.
#include <pybind11/pybind11.h>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
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

// What a layer brings to a prepared launch: up to five tensors (in the op's order: launch.py's
// PER_LAYER), and two scales. A scale planned as a tensor (its pointer set when the plan was made)
// takes the layer's pointer; a float scale takes the layer's value.
struct Layer {
  std::uintptr_t t[5];
  std::uintptr_t scale_ptr[2];
  float scale[2];
};

static void set_scale(const float*& p, float& v, std::uintptr_t layer_ptr, float layer_value) {
  if (p) p = ptr<const float>(layer_ptr);
  else v = layer_value;
}

// A layer's pointers into decode or prefill parameters: out, query, key_cache, value_cache; k_scale, v_scale.
template <class P>
void take_attention(P& p, const Layer& l) {
  p.out = ptr<void>(l.t[0]); p.query = ptr<const void>(l.t[1]);
  p.key_cache = ptr<const uint8_t>(l.t[2]); p.value_cache = ptr<const uint8_t>(l.t[3]);
  set_scale(p.k_scale_ptr, p.k_scale, l.scale_ptr[0], l.scale[0]);
  set_scale(p.v_scale_ptr, p.v_scale, l.scale_ptr[1], l.scale[1]);
}

struct DecodeLaunch {
  static constexpr const char* what = "paged_attention";
  int kind, head_size;
  DecodeParams p;
  void take(const Layer& l) { take_attention(p, l); }
  int launch(cudaStream_t s) const {
    if (p.num_seqs == 0) return 0;
    int err;
    switch (kind) {
      case 0: err = launch_decode_f16(head_size, p, s); break;
      case 1: err = launch_decode_bf16(head_size, p, s); break;
      case 2: err = launch_decode_e4m3(head_size, p, s); break;
      case 3: err = launch_decode_e5m2(head_size, p, s); break;
      default: err = (int)cudaErrorInvalidValue;
    }
    // the merge: in the kernel where the call brought counters (not with warp rows), else a second launch
    if (err == 0 && p.num_parts > 1 && (!p.counters || p.warp_rows)) err = launch_reduce(head_size, p, s);
    return err;
  }
};

struct PrefillLaunch {
  static constexpr const char* what = "paged_attention (multi-token)";
  int kind, head_size, max_query_len;
  PrefillParams p;
  void take(const Layer& l) { take_attention(p, l); }
  int launch(cudaStream_t s) {
    if (p.num_seqs == 0 || max_query_len <= 0) return 0;
    switch (kind) {
      case 0: return launch_prefill_f16(head_size, max_query_len, p, s);
      case 1: return launch_prefill_bf16(head_size, max_query_len, p, s);
      case 2: return launch_prefill_e4m3(head_size, max_query_len, p, s);
      case 3: return launch_prefill_e5m2(head_size, max_query_len, p, s);
      default: return (int)cudaErrorInvalidValue;
    }
  }
};

struct CacheKVLaunch {
  static constexpr const char* what = "cache_kv";
  int kind, input;
  CacheParams p;
  void take(const Layer& l) {  // key, value, key_cache, value_cache; k_scale, v_scale
    p.key = ptr<const void>(l.t[0]); p.value = ptr<const void>(l.t[1]);
    p.key_cache = ptr<uint8_t>(l.t[2]); p.value_cache = ptr<uint8_t>(l.t[3]);
    set_scale(p.k_scale_ptr, p.k_scale, l.scale_ptr[0], l.scale[0]);
    set_scale(p.v_scale_ptr, p.v_scale, l.scale_ptr[1], l.scale[1]);
  }
  int launch(cudaStream_t s) const { return launch_cache_kv(kind, input, p, s); }
};

struct MLALaunch {
  static constexpr const char* what = "mla_decode";
  int kind, row_groups;
  MLAParams p;
  void take(const Layer& l) {  // out, q_nope, q_pe, ckv_cache, kpe_cache; ckv_scale, kpe_scale
    p.out = ptr<void>(l.t[0]); p.q_nope = ptr<const void>(l.t[1]); p.q_pe = ptr<const void>(l.t[2]);
    p.ckv = ptr<const uint8_t>(l.t[3]); p.kpe = ptr<const uint8_t>(l.t[4]);
    set_scale(p.ckv_scale_ptr, p.ckv_scale, l.scale_ptr[0], l.scale[0]);
    set_scale(p.kpe_scale_ptr, p.kpe_scale, l.scale_ptr[1], l.scale[1]);
  }
  int launch(cudaStream_t s) const {
    if (p.num_seqs == 0 || p.total_q == 0) return 0;
    int err = p.work ? launch_mla_schedule(p, s) : 0;
    if (err != 0) return err;
    switch (kind) {
      case 0: err = launch_mla_f16(row_groups, p, s); break;
      case 1: err = launch_mla_bf16(row_groups, p, s); break;
      case 2: err = launch_mla_e4m3(row_groups, p, s); break;
      case 3: err = launch_mla_e5m2(row_groups, p, s); break;
      default: err = (int)cudaErrorInvalidValue;
    }
    if (err == 0 && (p.work || p.num_parts > 1) && !p.counters) err = launch_mla_reduce(p, s);
    return err;
  }
};

// A plan's launches in order, each with the parameters of the planned call; run() gives each the
// layer's tensors and scales and launches it on the given stream.
class Prepared {
 public:
  template <typename L>
  void add(L l) {
    // each run fills a copy: a plan may run on two host threads at once (the GIL is released here)
    steps_.push_back([l](const Layer& layer, cudaStream_t s) {
      L c = l;
      c.take(layer);
      return std::make_pair(c.launch(s), L::what);
    });
  }
  void extend(const Prepared& other) { steps_.insert(steps_.end(), other.steps_.begin(), other.steps_.end()); }
  size_t size() const { return steps_.size(); }
  void run(const Layer& layer, cudaStream_t s) const {
    std::pair<int, const char*> r{0, ""};
    {
      py::gil_scoped_release nogil;
      for (const auto& step : steps_) {
        r = step(layer, s);
        if (r.first != 0) break;
      }
    }
    check(r.first, r.second);
  }

 private:
  std::vector<std::function<std::pair<int, const char*>(const Layer&, cudaStream_t)>> steps_;
};

// `name(args..., stream)` (one launch) and `name_prepare(args...)` (a Prepared of that launch), both
// from `make(args...)`, which builds the launch from the binding's arguments.
template <typename L, typename... A>
static void def_launch(py::module_& m, const char* name, L (*make)(A...), const char* doc) {
  m.def(name, [make](A... a, std::uintptr_t stream) {
    L l = make(a...);
    int err;
    {
      py::gil_scoped_release nogil;
      err = l.launch(reinterpret_cast<cudaStream_t>(stream));
    }
    check(err, L::what);
  }, doc);
  m.def((std::string(name) + "_prepare").c_str(), [make](A... a) {
    Prepared p;
    p.add(make(a...));
    return p;
  }, "the same arguments but the stream: a Prepared launch (see Prepared.run)");
}

// kind (of a cache): 0 fp16, 1 bf16, 2 e4m3fn, 3 e5m2
static DecodeLaunch make_decode(
    int kind, int head_size, std::uintptr_t out, std::uintptr_t query, std::uintptr_t key_cache,
    std::uintptr_t value_cache, std::uintptr_t block_tables, std::uintptr_t seq_lens, std::uintptr_t alibi,
    std::uintptr_t k_scale_ptr, std::uintptr_t v_scale_ptr, std::uintptr_t part_out, std::uintptr_t part_ml,
    std::uintptr_t counters, int64_t q_stride0, int64_t q_stride1, int64_t out_stride0, int64_t out_stride1,
    int64_t k_stride0, int64_t v_stride0, int64_t bt_stride0, float scale, float k_scale, float v_scale,
    float soft_cap, int k_scale_stride, int v_scale_stride, int num_seqs, int num_heads, int num_kv_heads,
    int head_tiles, int block_size, int partition_size, int num_parts, int window, int q_is_bf16, int warp_rows,
    int64_t k_head_stride, int64_t k_row, int64_t v_head_stride, int64_t v_row, std::uintptr_t query_start_loc) {
  DecodeLaunch l{kind, head_size, {}};
  DecodeParams& p = l.p;
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
  return l;
}

// multi-token attention (prefill.cuh); kind as paged_attention. Sequences with fewer than min_rows
// query rows are left to the decode kernel (a mixed call launches both).
static PrefillLaunch make_prefill(
    int kind, int head_size, std::uintptr_t out, std::uintptr_t query, std::uintptr_t key_cache,
    std::uintptr_t value_cache, std::uintptr_t block_tables, std::uintptr_t seq_lens,
    std::uintptr_t query_start_loc, std::uintptr_t alibi, std::uintptr_t k_scale_ptr, std::uintptr_t v_scale_ptr,
    int64_t q_stride0, int64_t q_stride1, int64_t out_stride0, int64_t out_stride1, int64_t k_stride0,
    int64_t v_stride0, int64_t bt_stride0, float scale, float k_scale, float v_scale, float soft_cap,
    int k_scale_stride, int v_scale_stride, int num_seqs, int num_heads, int num_kv_heads, int block_size,
    int window, int causal, int q_is_bf16, int max_query_len, int min_rows, int64_t k_head_stride,
    int64_t k_row, int64_t v_head_stride, int64_t v_row, int wgmma) {
  PrefillLaunch l{kind, head_size, max_query_len, {}};
  PrefillParams& p = l.p;
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
  return l;
}

// kind as paged_attention; input: the dtype of key/value
static CacheKVLaunch make_cache_kv(
    int kind, int input, std::uintptr_t key, std::uintptr_t value, std::uintptr_t key_cache,
    std::uintptr_t value_cache, std::uintptr_t slot_mapping, std::uintptr_t k_scale_ptr,
    std::uintptr_t v_scale_ptr, int64_t key_stride0, int64_t key_stride1, int64_t value_stride0,
    int64_t value_stride1, int64_t k_stride0, int64_t v_stride0, float k_scale, float v_scale,
    int k_scale_stride, int v_scale_stride, int num_tokens, int num_kv_heads, int head_size, int block_size,
    int num_blocks, int64_t k_head_stride, int64_t k_row, int64_t v_head_stride, int64_t v_row) {
  CacheKVLaunch l{kind, input, {}};
  CacheParams& p = l.p;
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
  return l;
}

// MLA decode (R = 512, P = 64); kind: the latent cache's, as paged_attention
static MLALaunch make_mla(
    int kind, int row_groups, std::uintptr_t out, std::uintptr_t q_nope, std::uintptr_t q_pe, std::uintptr_t ckv,
    std::uintptr_t kpe, std::uintptr_t block_tables, std::uintptr_t seq_lens, std::uintptr_t query_start_loc,
    std::uintptr_t ckv_scale_ptr, std::uintptr_t kpe_scale_ptr, std::uintptr_t part_out, std::uintptr_t part_ml,
    std::uintptr_t counters, std::uintptr_t work, std::uintptr_t tile_parts, std::uintptr_t sched_seen,
    int64_t qn_stride0, int64_t qn_stride1, int64_t qp_stride0, int64_t qp_stride1,
    int64_t out_stride0, int64_t out_stride1, int64_t ckv_block_stride, int64_t ckv_token_stride,
    int64_t kpe_block_stride, int64_t kpe_token_stride, int64_t bt_stride0, float scale, float ckv_scale,
    float kpe_scale, int num_seqs, int num_heads, int total_q, int block_size, int partition_size, int num_parts,
    int row_tiles, int q_is_bf16, int kernel, int sched_ctas, int sched_cap, int sched_slots, int sched_overhead) {
  MLALaunch l{kind, row_groups, {}};
  MLAParams& p = l.p;
  p.out = ptr<void>(out); p.q_nope = ptr<const void>(q_nope); p.q_pe = ptr<const void>(q_pe);
  p.ckv = ptr<const uint8_t>(ckv); p.kpe = ptr<const uint8_t>(kpe);
  p.block_tables = ptr<const int>(block_tables); p.seq_lens = ptr<const int>(seq_lens);
  p.query_start_loc = ptr<const int>(query_start_loc);
  p.ckv_scale_ptr = ptr<const float>(ckv_scale_ptr); p.kpe_scale_ptr = ptr<const float>(kpe_scale_ptr);
  p.part_out = ptr<float>(part_out); p.part_ml = ptr<float>(part_ml);
  // the merge: in mla.cuh where the call brought counters; the sm_90a kernel leaves it to the reduce launch
  const bool wg = row_groups == 4 && kernel && sm90a_kernels_run();
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
  p.kernel = kernel;
  p.tile_rows = 16 * row_groups;
  p.merge_rows = (int64_t)num_seqs * row_tiles * p.tile_rows >= 2048 ? 4 : 1;  // (mla_reduce.cu)
  // the balanced split: a work list of sched_cap entries, sched_slots partial slots of tile_rows rows
  p.work = ptr<int4>(work); p.tile_parts = ptr<int4>(tile_parts); p.sched_seen = ptr<int>(sched_seen);
  if ((p.work == nullptr) != (p.tile_parts == nullptr))
    throw std::invalid_argument(std::string("mla_decode: work and tile_parts must both be set or both be 0; got work ") +
                                (work ? "set" : "0") + ", tile_parts " + (tile_parts ? "set" : "0"));
  if (p.work && (num_seqs * row_tiles > kMlaScheduleTiles || sched_cap < num_seqs * row_tiles || sched_ctas < 1 ||
                 sched_slots < 0 || sched_overhead < 0))
    throw std::invalid_argument("mla_decode: the balanced split needs num_seqs x row_tiles <= " +
                                std::to_string(kMlaScheduleTiles) + " and <= sched_cap, sched_ctas >= 1, sched_slots >= 0 "
                                "and sched_overhead >= 0; got num_seqs " + std::to_string(num_seqs) + " x row_tiles " +
                                std::to_string(row_tiles) + ", sched_cap " + std::to_string(sched_cap) + ", sched_ctas " +
                                std::to_string(sched_ctas) + ", sched_slots " + std::to_string(sched_slots) +
                                ", sched_overhead " + std::to_string(sched_overhead));
  p.sched_ctas = sched_ctas; p.sched_cap = sched_cap; p.sched_slots = sched_slots; p.sched_overhead = sched_overhead;
  return l;
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
  py::class_<Prepared>(m, "Prepared", "a plan's launches, made once by the *_prepare functions")
      .def("extend", &Prepared::extend, "append another Prepared's launches (run after this one's)")
      .def("__len__", &Prepared::size)
      .def("run",
           [](const Prepared& self, std::uintptr_t t0, std::uintptr_t t1, std::uintptr_t t2, std::uintptr_t t3,
              std::uintptr_t t4, std::uintptr_t scale_ptr0, std::uintptr_t scale_ptr1, float scale0, float scale1,
              std::uintptr_t stream) {
             const Layer layer{{t0, t1, t2, t3, t4}, {scale_ptr0, scale_ptr1}, {scale0, scale1}};
             self.run(layer, reinterpret_cast<cudaStream_t>(stream));
           },
           "one layer: its tensors' pointers in the op's order (0 past the op's count), its two scales as "
           "(pointer, pointer, value, value) (a scale planned as a tensor reads its pointer, a float its value), "
           "the stream");
  def_launch(m, "paged_attention", &make_decode, "decode (decode.cuh), then the reduce launch of a split context "
             "that brought no counters");
  def_launch(m, "prefill", &make_prefill, "multi-token attention (prefill.cuh / prefill_sm90.cuh)");
  def_launch(m, "cache_kv", &make_cache_kv, "write K/V rows into a paged cache (cache_kv.cu)");
  def_launch(m, "mla_decode", &make_mla, "MLA decode (mla.cuh / mla_sm90.cuh), then its reduce where needed");
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
