// The host emulation's runtime: fibers for work-items, a cooperative scheduler, barriers, wave-wide
// instructions (ds_bpermute, MFMA 16x16x16), LDS, checked global memory, FP8 conversions, and the C
// entry points the Python side calls (hal_wave64_*). See wave64_host.h and docs/rocm.md ("Emulation").
#define HAL_WAVE64_SIM 1
#include "mini_hip.h"

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace hal_wave64 {
namespace {

constexpr int kWave = 64;
constexpr size_t kLdsBytes = 65536;          // LDS per workgroup on gfx90a / gfx942
constexpr size_t kStackBytes = 256 * 1024;   // per work-item fiber

struct Fiber {
  ucontext_t ctx;
  bool done = false;
  size_t lds_cursor = 0;
};

// One wave's rendezvous point for wave-wide instructions, and the operands the lanes deposit there.
struct Wave {
  int live = kWave;
  int arrived = 0;
  unsigned gen = 0;
  const char* op = nullptr;
  int line = 0;
  u16x4 a[kWave], b[kWave];
  f32x4 c[kWave];
  int v[kWave];
};

struct Launch {
  Invoker invoker = nullptr;
  const char* kernarg = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned bid[3] = {0, 0, 0};
  int nthreads = 0;
  std::vector<std::pair<uintptr_t, size_t>> ranges;
  std::vector<Fiber> fibers;
  std::vector<Wave> waves;
  std::unique_ptr<char[]> stacks;  // uninitialised: pages are touched only as fibers use them
  std::vector<unsigned char> lds;
  size_t lds_high = 0;
  ucontext_t sched;
  int cur = -1;
  int live = 0;
  int bar_arrived = 0;
  unsigned bar_gen = 0;
  unsigned long progress = 0;
  bool failed = false;
  std::string error;
  int schedule = 0;
  std::mt19937 rng;
};

thread_local Launch* g = nullptr;
thread_local std::string last_error;
thread_local size_t last_lds = 0;

std::map<std::string, std::pair<Invoker, size_t>>& registry() {
  static std::map<std::string, std::pair<Invoker, size_t>> r;
  return r;
}

std::string where() {
  char buf[160];
  std::snprintf(buf, sizeof buf, "workgroup (%u, %u, %u), work-item %d (wave %d, lane %d)", g->bid[0], g->bid[1],
                g->bid[2], g->cur, g->cur / kWave, g->cur % kWave);
  return buf;
}

void yield() { swapcontext(&g->fibers[g->cur].ctx, &g->sched); }

[[noreturn]] void fail(const std::string& msg) {
  if (!g->failed) {
    g->failed = true;
    g->error = msg + " [" + where() + "]";
  }
  swapcontext(&g->fibers[g->cur].ctx, &g->sched);  // never resumed
  __builtin_unreachable();
}

void release_barrier() {
  g->bar_arrived = 0;
  g->bar_gen++;
}

// All 64 lanes of the current wave meet at `op` (same instruction, same source line).
void wave_meet(const char* op, int line) {
  Wave& w = g->waves[g->cur / kWave];
  if (w.live != kWave)
    fail(std::string(op) + " executed by a wave in which " + std::to_string(kWave - w.live) +
         " lanes have returned (a wave-wide instruction needs all 64)");
  if (w.arrived == 0) {
    w.op = op;
    w.line = line;
  } else if (w.op != op || w.line != line) {
    fail(std::string("divergent wave: this lane is at ") + op + " (line " + std::to_string(line) +
         ") while other lanes of its wave wait at " + w.op + " (line " + std::to_string(w.line) + ")");
  }
  unsigned gen = w.gen;
  g->progress++;
  if (++w.arrived == kWave) {
    w.arrived = 0;
    w.gen++;
    return;
  }
  while (w.gen == gen) yield();
}

void fiber_main() {
  g->invoker(g->kernarg);
  Fiber& f = g->fibers[g->cur];
  f.done = true;
  g->live--;
  g->progress++;
  Wave& w = g->waves[g->cur / kWave];
  w.live--;
  if (w.arrived > 0) fail(std::string("lane returned while the rest of its wave waits at ") + w.op);
  if (g->bar_arrived > 0 && g->bar_arrived == g->live) release_barrier();
  swapcontext(&f.ctx, &g->sched);
}

std::string deadlock_report() {
  std::string s = "deadlock: no work-item can proceed (" + std::to_string(g->bar_arrived) + " of " +
                  std::to_string(g->live) + " live work-items wait at the workgroup barrier";
  for (size_t i = 0; i < g->waves.size(); ++i) {
    const Wave& w = g->waves[i];
    if (w.arrived > 0)
      s += "; wave " + std::to_string(i) + ": " + std::to_string(w.arrived) + " lanes at " + w.op + " (line " +
           std::to_string(w.line) + ")";
  }
  return s + ")";
}

bool run_workgroup() {
  const int n = g->nthreads;
  g->fibers.assign(n, Fiber{});
  g->waves.assign(n / kWave, Wave{});
  std::fill(g->lds.begin(), g->lds.end(), 0xff);
  g->live = n;
  g->bar_arrived = 0;
  for (int i = 0; i < n; ++i) {
    Fiber& f = g->fibers[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = g->stacks.get() + (size_t)i * kStackBytes;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
  }
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = g->schedule == 1 ? n - 1 - i : i;
  while (g->live > 0) {
    if (g->schedule == 2) std::shuffle(order.begin(), order.end(), g->rng);
    unsigned long before = g->progress;
    for (int i : order) {
      if (g->fibers[i].done) continue;
      g->cur = i;
      swapcontext(&g->sched, &g->fibers[i].ctx);
      if (g->failed) return false;
    }
    if (g->live > 0 && g->progress == before) {
      g->failed = true;
      char buf[96];
      std::snprintf(buf, sizeof buf, " in workgroup (%u, %u, %u)", g->bid[0], g->bid[1], g->bid[2]);
      g->error = deadlock_report() + buf;
      return false;
    }
  }
  return true;
}

// ---- FP8 (gfx942: fnuz encodings; AMD CDNA3 ISA, "FP8 and BF8 conversions") ----
struct F8 {
  int mbits, bias;
};
constexpr F8 kE4m3fnuz{3, 8}, kE5m2fnuz{2, 16};

float f8_decode_fnuz(unsigned byte, F8 f) {
  if (byte == 0x80) return NAN;
  int ebits = 7 - f.mbits;
  int e = (byte >> f.mbits) & ((1 << ebits) - 1), m = byte & ((1 << f.mbits) - 1);
  double v = e == 0 ? std::ldexp((double)m, 1 - f.bias - f.mbits)
                    : std::ldexp((double)((1 << f.mbits) + m), e - f.bias - f.mbits);
  return (float)((byte & 0x80) ? -v : v);
}

// Round to nearest even. The emulation assumes the least favourable hardware behaviour where the
// ISA guide leaves it open: no saturation (a magnitude above the largest finite value becomes the
// NaN byte 0x80) and the sign kept when the magnitude rounds to zero (which fnuz reads as NaN).
// The kernels clamp first and repair the zero case, and the tests check that they do.
unsigned f8_encode_fnuz(float x, F8 f) {
  if (std::isnan(x) || std::isinf(x)) return 0x80;
  double a = std::fabs((double)x);
  unsigned mag = 0;
  if (a > 0) {
    int e;
    std::frexp(a, &e);
    int E = std::max(e - 1, 1 - f.bias);
    double r = std::nearbyint(std::ldexp(a, f.mbits - E));
    double byte = std::ldexp((double)(E + f.bias - 1), f.mbits) + r;
    if (byte > 127) return 0x80;
    mag = (unsigned)byte;
  }
  return (std::signbit(x) ? 0x80u : 0u) | mag;
}

}  // namespace

// ---- device facilities ----
u32 tid() { return (u32)g->cur; }
u32 bid(int dim) { return g->bid[dim]; }

void syncthreads() {
  unsigned gen = g->bar_gen;
  g->progress++;
  if (++g->bar_arrived == g->live) {
    release_barrier();
    return;
  }
  while (g->bar_gen == gen) yield();
}

int bpermute(int byte_addr, int v, int line) {
  Wave& w = g->waves[g->cur / kWave];
  int lane = g->cur % kWave;
  w.v[lane] = v;
  wave_meet("ds_bpermute_b32", line);
  int r = w.v[(byte_addr >> 2) & (kWave - 1)];
  wave_meet("ds_bpermute_b32 (read)", line);
  return r;
}

float bf16_to_f32(u16 h) { return __builtin_bit_cast(float, (u32)h << 16); }

// v_mfma_f32_16x16x16{f16,bf16}: D[i][j] = C[i][j] + sum_k A[i][k] B[k][j] with (AMD CDNA3 ISA
// reference, "Matrix fused multiply-add", 16x16x16 operand layouts):
//   A[i][k] in lane i + 16*(k/4), element k%4;  B[k][j] in lane j + 16*(k/4), element k%4;
//   C[i][j], D[i][j] in lane j + 16*(i/4), element i%4.
// Products are exact in float; the sum runs in k order in float (the hardware's internal order and
// rounding are not specified; any order is within the tests' tolerance).
f32x4 mfma(u16x4 a, u16x4 b, f32x4 c, bool bf16, int line) {
  Wave& w = g->waves[g->cur / kWave];
  int lane = g->cur % kWave;
  w.a[lane] = a;
  w.b[lane] = b;
  w.c[lane] = c;
  const char* op = bf16 ? "v_mfma_f32_16x16x16_bf16" : "v_mfma_f32_16x16x16_f16";
  wave_meet(op, line);
  auto val = [bf16](u16 h) { return bf16 ? bf16_to_f32(h) : f16_to_f32(h); };
  int j = lane % 16;
  f32x4 d;
  for (int e = 0; e < 4; ++e) {
    int i = 4 * (lane / 16) + e;
    float acc = w.c[j + 16 * (i / 4)][i % 4];
    for (int k = 0; k < 16; ++k) acc += val(w.a[i + 16 * (k / 4)][k % 4]) * val(w.b[j + 16 * (k / 4)][k % 4]);
    d[e] = acc;
  }
  wave_meet(bf16 ? "v_mfma_f32_16x16x16_bf16 (read)" : "v_mfma_f32_16x16x16_f16 (read)", line);
  return d;
}

void* lds_alloc(size_t size, size_t align) {
  Fiber& f = g->fibers[g->cur];
  size_t off = (f.lds_cursor + align - 1) / align * align;
  if (off + size > kLdsBytes) fail("LDS overflow: more than 64 KiB of __shared__ data");
  f.lds_cursor = off + size;
  g->lds_high = std::max(g->lds_high, f.lds_cursor);
  return g->lds.data() + off;
}

void check_access(const void* p, size_t size, size_t align, bool write) {
  uintptr_t a = (uintptr_t)p;
  char buf[200];
  if (a % align) {
    std::snprintf(buf, sizeof buf, "misaligned global %s of %zu bytes at %#lx (needs %zu-byte alignment)",
                  write ? "store" : "load", size, (unsigned long)a, align);
    fail(buf);
  }
  for (auto& r : g->ranges)
    if (a >= r.first && a + size <= r.first + r.second) return;
  std::snprintf(buf, sizeof buf, "out-of-bounds global %s of %zu bytes at %#lx (outside every buffer of the launch)",
                write ? "store" : "load", size, (unsigned long)a);
  fail(buf);
}

float f16_to_f32(u16 h) {
  int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  float v;
  if (e == 31) v = m ? NAN : INFINITY;
  else if (e == 0) v = std::ldexp((float)m, -24);
  else v = std::ldexp((float)(1024 + m), e - 25);
  return s ? -v : v;
}

// v_cvt_f16_f32: IEEE round to nearest even, overflow to infinity, NaN stays a (quiet) NaN.
u16 f32_to_f16(float x) {
  u16 sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return sign | 0x7e00;
  double a = std::fabs((double)x);
  if (a == 0) return sign;
  if (std::isinf(x)) return sign | 0x7c00;
  int e;
  std::frexp(a, &e);
  int E = std::max(e - 1, -14);
  double r = std::nearbyint(std::ldexp(a, 10 - E));
  double bits = std::ldexp((double)(E + 14), 10) + r;
  if (bits >= 0x7c00) return sign | 0x7c00;
  return sign | (u16)bits;
}

// v_cvt_pk_f32_fp8 / _bf8: bytes 0,1 (hi = false) or 2,3 (hi = true) of w.
f32x2 cvt_pk_f32_f8(u32 w, bool hi, bool bf8) {
  F8 f = bf8 ? kE5m2fnuz : kE4m3fnuz;
  int sh = hi ? 16 : 0;
  f32x2 r;
  r[0] = f8_decode_fnuz((w >> sh) & 0xff, f);
  r[1] = f8_decode_fnuz((w >> (sh + 8)) & 0xff, f);
  return r;
}

// v_cvt_pk_fp8_f32 / _bf8: a -> byte 0 (2), b -> byte 1 (3) of old for hi = false (true).
u32 cvt_pk_f8_f32(float a, float b, u32 old, bool hi, bool bf8) {
  F8 f = bf8 ? kE5m2fnuz : kE4m3fnuz;
  int sh = hi ? 16 : 0;
  u32 w = old & ~(0xffffu << sh);
  return w | (f8_encode_fnuz(a, f) << sh) | (f8_encode_fnuz(b, f) << (sh + 8));
}

Registrar::Registrar(const char* name, Invoker invoker, size_t kernarg_size) {
  registry()[name] = {invoker, kernarg_size};
}

}  // namespace hal_wave64

using namespace hal_wave64;

extern "C" {

__attribute__((visibility("default"))) const char* hal_wave64_target() {
  return HAL_WAVE64_FNUZ_HW ? "gfx942" : "gfx90a";
}

__attribute__((visibility("default"))) const char* hal_wave64_error() { return last_error.c_str(); }

__attribute__((visibility("default"))) size_t hal_wave64_lds_bytes() { return last_lds; }

__attribute__((visibility("default"))) int hal_wave64_num_kernels() { return (int)registry().size(); }

__attribute__((visibility("default"))) const char* hal_wave64_kernel_name(int i) {
  auto it = registry().begin();
  std::advance(it, i);
  return it->first.c_str();
}

__attribute__((visibility("default"))) long hal_wave64_kernarg_size(const char* name) {
  auto it = registry().find(name);
  return it == registry().end() ? -1 : (long)it->second.second;
}

// Runs `name` over grid[0] x grid[1] x grid[2] workgroups of `block` work-items. `kernarg` holds the
// explicit arguments packed as for hipModuleLaunchKernel; `ranges` lists (address, bytes) pairs of
// every buffer the kernel may touch. schedule: 0 work-items in order, 1 reversed, 2 shuffled (seed).
// Returns 0, or nonzero with hal_wave64_error() describing what went wrong.
__attribute__((visibility("default"))) int hal_wave64_launch(const char* name, const unsigned* grid, unsigned block,
                                                          const void* kernarg, size_t kernarg_size,
                                                          const uint64_t* ranges, int nranges, int schedule,
                                                          unsigned seed) {
  last_error.clear();
  auto it = registry().find(name);
  if (it == registry().end()) {
    last_error = std::string("no kernel named ") + name + " in this emulation library";
    return 1;
  }
  if (kernarg_size != it->second.second) {
    last_error = std::string(name) + ": the launcher packed " + std::to_string(kernarg_size) +
                 " bytes of arguments; the kernel's parameters take " + std::to_string(it->second.second);
    return 2;
  }
  if (block == 0 || block % kWave != 0 || block > 1024) {
    last_error = "block size must be a multiple of 64 up to 1024";
    return 2;
  }
  Launch launch;
  launch.invoker = it->second.first;
  launch.kernarg = static_cast<const char*>(kernarg);
  for (int d = 0; d < 3; ++d) launch.grid[d] = grid[d];
  launch.nthreads = (int)block;
  for (int i = 0; i < nranges; ++i) launch.ranges.emplace_back((uintptr_t)ranges[2 * i], (size_t)ranges[2 * i + 1]);
  launch.stacks.reset(new char[(size_t)block * kStackBytes]);
  launch.lds.resize(kLdsBytes);
  launch.schedule = schedule;
  launch.rng.seed(seed);
  Launch* saved = g;
  g = &launch;
  bool ok = true;
  for (unsigned z = 0; ok && z < grid[2]; ++z)
    for (unsigned y = 0; ok && y < grid[1]; ++y)
      for (unsigned x = 0; ok && x < grid[0]; ++x) {
        launch.bid[0] = x;
        launch.bid[1] = y;
        launch.bid[2] = z;
        ok = run_workgroup();
      }
  g = saved;
  last_lds = launch.lds_high;
  if (!ok) {
    last_error = std::string(name) + ": " + launch.error;
    return 3;
  }
  return 0;
}

}  // extern "C"
