// grouped_gemm.cu: the grouped GEMM op (MoE experts), a persistent kernel that drives
// mk::gemm::Engine<Cfg, /*kGroupedB=*/true, kGatherA> over tiles whose group sizes live only on the
// device; with a_rows, A's rows are gathered by index (MoE rows straight from the tokens).
//
//   launch 1: tile_prefix_kernel, one CTA: tile_prefix[g] = sum over groups < g of
//             ceil(rows_g / BM) * tiles_n (a block scan; G may be any size)
//   launch 2: grid = #SMs CTAs; CTA b computes tile ids b, b + grid, ... < tile_prefix[G]; a tile
//             id finds its group by binary search in tile_prefix, then (m-tile, n-tile) m-major:
//
//     group:   0         1     2 (no rows)  3
//     tiles:  [0 1 2 3 | 4 5 | ----------- | 6 7 8 9]  (tiles_n = 2: m-tile 0 -> ids 0, 1; ...)
//
// NOTE: the group sizes are never read on the host (no synchronize per call, CUDA-graph safe): the
// grid is sized for the GPU, and CTAs beyond the tile count exit at once.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../primitives/gemm/config.cuh"
#include "../primitives/gemm/engine.cuh"
#include "../primitives/host/device.h"
#include "../primitives/host/tensor_map.h"
#include "grouped_gemm_args.h"

namespace {

using namespace mk::gemm;

// Rows [lo, hi) of group g, clamped so that any offsets stay inside A and C.
struct GroupRows {
  int lo, hi;
};
__device__ __forceinline__ GroupRows group_rows(const int32_t* offsets, int g, int M) {
  const int lo = min(max(offsets[g], 0), M);
  const int hi = min(max(offsets[g + 1], lo), M);
  return {lo, hi};
}

constexpr int kPrefixThreads = 1024;

// tile_prefix[0..G]: exclusive prefix of each group's tile count (one CTA; thread t sums a
// contiguous chunk of groups, then a block scan of the chunk sums).
__global__ void __launch_bounds__(kPrefixThreads)
    tile_prefix_kernel(const int32_t* offsets, int G, int M, int bm, int tiles_n,
                       int32_t* tile_prefix) {
  __shared__ int sums[kPrefixThreads];
  const int t = threadIdx.x;
  const int per = (G + kPrefixThreads - 1) / kPrefixThreads;
  const int g0 = min(t * per, G), g1 = min(g0 + per, G);
  int own = 0;
  for (int g = g0; g < g1; ++g) {
    const GroupRows r = group_rows(offsets, g, M);
    own += (r.hi - r.lo + bm - 1) / bm * tiles_n;
  }
  sums[t] = own;
  __syncthreads();
  for (int d = 1; d < kPrefixThreads; d *= 2) {  // inclusive Hillis-Steele scan
    const int v = t >= d ? sums[t - d] : 0;
    __syncthreads();
    sums[t] += v;
    __syncthreads();
  }
  int run = sums[t] - own;  // exclusive: tiles of the groups before g0
  for (int g = g0; g < g1; ++g) {
    tile_prefix[g] = run;
    const GroupRows r = group_rows(offsets, g, M);
    run += (r.hi - r.lo + bm - 1) / bm * tiles_n;
  }
  if (t == kPrefixThreads - 1) tile_prefix[G] = sums[t];
}

template <class Cfg, bool kGather>
struct GroupedKernelParams {
  typename Engine<Cfg, true, kGather>::Params engine;  // a: [M, K] (or gathered); b: [G, K, N]
  void* c;
  int kind;           // kStoreBF16 or kStoreF32
  CUtensorMap c_map;  // C as bf16 [M, N], box 64 x 64, 128B swizzle (configs with kEpiTma)
  bool use_c_map;
  const int32_t* offsets;      // [G + 1]
  const int32_t* tile_prefix;  // [G + 1], written by tile_prefix_kernel
  int G, tiles_n;
};

// Hooks of the grouped GEMM: tasks from the device's tile prefix, no waits, no signals.
template <class Cfg, bool kGather>
struct GroupedHooks {
  const GroupedKernelParams<Cfg, kGather>& p;
  int total;  // tile_prefix[G]
  __device__ __forceinline__ bool signals() const { return false; }
  static constexpr bool kDeferAfterStore = true;

  __device__ __forceinline__ int num_tasks() const {
    const int b = blockIdx.x, g = gridDim.x;
    return b < total ? (total - b + g - 1) / g : 0;
  }
  __device__ __forceinline__ TileTask task(int i) const {
    const int id = blockIdx.x + i * gridDim.x;
    int lo = 0, hi = p.G;  // tile_prefix[lo] <= id < tile_prefix[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (__ldg(p.tile_prefix + mid) <= id) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const int local = id - __ldg(p.tile_prefix + lo);
    const int tm = local / p.tiles_n, tn = local - tm * p.tiles_n;
    const GroupRows r = group_rows(p.offsets, lo, p.engine.M);
    TileTask t;
    t.m0 = r.lo + tm * Cfg::BM;
    t.n0 = tn * Cfg::BN;
    t.rows = min(Cfg::BM, r.hi - t.m0);
    t.cols = min(Cfg::BN, p.engine.N - t.n0);
    t.group = lo;
    return t;
  }
  __device__ __forceinline__ void before_load(int) const {}
  __device__ __forceinline__ Dest dest(int i) const {
    const TileTask t = task(i);
    Dest d;
    const long esize = p.kind == kStoreBF16 ? 2 : 4;
    d.ptr = static_cast<char*>(p.c) + ((long)t.m0 * p.engine.N + t.n0) * esize;
    d.ld = p.engine.N;
    d.kind = p.kind;
    if (p.use_c_map) {
      d.map = &p.c_map;
      d.map_col = t.n0;
      d.map_row = t.m0;
    }
    return d;
  }
  __device__ __forceinline__ void after_store(int) const {}
};

template <class Cfg, bool kGather>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ GroupedKernelParams<Cfg, kGather> p) {
  extern __shared__ __align__(1024) char smem[];
  GroupedHooks<Cfg, kGather> hooks{p, __ldg(p.tile_prefix + p.G)};
  if (hooks.num_tasks() == 0) return;  // the whole CTA: no barrier is ever used
  Engine<Cfg, true, kGather>::run_cta(p.engine, smem, hooks, [] {});
}

template <class Cfg, bool kGather>
int launch(const GroupedGemmArgs& a, cudaStream_t stream, int num_sms) {
  GroupedKernelParams<Cfg, kGather> p{};
  using mk::host::kTensorMapOk;
  if ((!kGather && mk::host::make_tensor_map_bf16_2d(&p.engine.a, a.a, a.M, a.K, a.K, Cfg::BM, 64,
                                                     128) != kTensorMapOk) ||
      mk::host::make_tensor_map_bf16_3d(&p.engine.b, a.b, a.G, a.K, a.N, a.N, (uint64_t)a.K * a.N,
                                        64, 64, 128) != kTensorMapOk)
    return kGroupedTensorMap;
  p.engine.a_src = a.a;
  p.engine.a_rows = a.a_rows;
  p.engine.lda = a.K;
  p.engine.a_src_rows = a.a_src_rows;
  p.engine.M = a.M;
  p.engine.N = a.N;
  p.engine.K = a.K;
  p.c = a.c;
  p.kind = a.out_kind;
  p.use_c_map = Cfg::EPI_MODE == kEpiTma && a.out_kind == kStoreBF16 &&
                mk::host::make_tensor_map_bf16_2d(&p.c_map, a.c, a.M, a.N, a.N, 64, 64, 128) ==
                    kTensorMapOk;  // else: row-copy passes
  p.offsets = a.offsets;
  p.tile_prefix = a.workspace;
  p.G = a.G;
  p.tiles_n = (a.N + Cfg::BN - 1) / Cfg::BN;

  auto* kernel = grouped_gemm_kernel<Cfg, kGather>;
  static bool attr_set = false;  // NOTE: per process; fine for one device kind
  if (!attr_set) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             Engine<Cfg, true, kGather>::kSmemBytes) != cudaSuccess)
      return kGroupedLaunchFailed;
    attr_set = true;
  }
  tile_prefix_kernel<<<1, kPrefixThreads, 0, stream>>>(a.offsets, a.G, a.M, Cfg::BM, p.tiles_n,
                                                       a.workspace);
  kernel<<<num_sms, Cfg::kThreads, Engine<Cfg, true, kGather>::kSmemBytes, stream>>>(p);
  return cudaGetLastError() == cudaSuccess ? kGroupedOk : kGroupedLaunchFailed;
}

}  // namespace

const char* grouped_gemm_status_string(int s) {
  switch (s) {
    case kGroupedOk: return "ok";
    case kGroupedBadShape: return "N, K and G must be >= 1 and M >= 0";
    case kGroupedBadAlignment: return "N and K must be multiples of 8 (16-byte TMA strides)";
    case kGroupedBadPointer:
      return "a, b, c, offsets, workspace must be non-null and a, b, c 16-byte aligned";
    case kGroupedBadConfig: return "unknown GEMM config id, or a clustered config";
    case kGroupedTensorMap: return "could not encode a TMA tensor map (cuTensorMapEncodeTiled)";
    case kGroupedLaunchFailed: return "CUDA launch failed";
    case kGroupedBadKind: return "out_kind must be 0 (bf16 store) or 2 (fp32 store)";
    default: return "unknown status";
  }
}

int launch_grouped_gemm(const GroupedGemmArgs& a, cudaStream_t stream) {
  if (a.M < 0 || a.N < 1 || a.K < 1 || a.G < 1) return kGroupedBadShape;
  if (a.N % 8 != 0 || a.K % 8 != 0) return kGroupedBadAlignment;
  const auto misaligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) != 0; };
  if (a.a == nullptr || a.b == nullptr || a.c == nullptr || a.offsets == nullptr ||
      a.workspace == nullptr || misaligned(a.a) || misaligned(a.b) || misaligned(a.c))
    return kGroupedBadPointer;
  if (a.out_kind != kStoreBF16 && a.out_kind != kStoreF32) return kGroupedBadKind;
  if (a.a_rows != nullptr && a.a_src_rows < 1) return kGroupedBadShape;
  if (a.M == 0) return kGroupedOk;  // no rows: nothing to compute or write
  const int num_sms = a.num_sms > 0 ? a.num_sms : mk::host::num_sms_of_current_device();
  if (num_sms < 1) return kGroupedLaunchFailed;
  const bool gather = a.a_rows != nullptr;
  switch (a.config) {
    case Tile128x256x64::kId:
      return gather ? launch<Tile128x256x64, true>(a, stream, num_sms)
                    : launch<Tile128x256x64, false>(a, stream, num_sms);
    case Tile128x128x64::kId:
      return gather ? launch<Tile128x128x64, true>(a, stream, num_sms)
                    : launch<Tile128x128x64, false>(a, stream, num_sms);
    case Tile64x128x64::kId:
      return gather ? launch<Tile64x128x64, true>(a, stream, num_sms)
                    : launch<Tile64x128x64, false>(a, stream, num_sms);
    default: return kGroupedBadConfig;
  }
}
