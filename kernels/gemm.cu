// gemm.cu: the plain local GEMM op, a persistent kernel that drives mk::gemm::Engine.
//
//   grid = min(#SMs, #tiles) CTAs, one per SM; CTA b owns list positions b, b+grid, b+2*grid, ...
//   threads: warpgroup 0 = producer (warp 0 runs Engine::run; warps 1..3 idle), warpgroups 1.. =
//   consumers.
//   Cluster configs (Cfg::CLUSTER = 2): the list holds cluster tiles (CLUSTER vertically adjacent
//   tiles); cluster c owns positions c, c + clusters, ...; its CTA of rank r computes tile row
//   um * CLUSTER + r. grid = CLUSTER * min(#SMs / CLUSTER, #units, clusters that fit at once).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../primitives/gemm/config.cuh"
#include "../primitives/gemm/engine.cuh"
#include "../primitives/host/device.h"
#include "../primitives/host/tensor_map.h"
#include "gemm_args.h"

namespace {

using namespace mk::gemm;

template <class Cfg>
struct GemmKernelParams {
  typename Engine<Cfg>::Params engine;
  void* c;
  long ldc;
  int kind;
  CUtensorMap c_map;  // C as bf16 [M, ldc], box 64 x 64, 128B swizzle (configs with kEpiTma)
  bool use_c_map;
  const int32_t* order;  // [units] or nullptr (a unit is a tile, or a cluster tile)
  int tiles_n, total;    // total = units
};

// Hooks of the plain GEMM: a static task list, no waits, no signals.
template <class Cfg>
struct GemmHooks {
  const GemmKernelParams<Cfg>& p;
  // Nobody waits for a tile of a plain GEMM: no per-tile completion.
  __device__ __forceinline__ bool signals() const { return false; }
  static constexpr bool kDeferAfterStore = true;

  // This CTA's unit slot and the number of slots (CTAs, or clusters).
  __device__ __forceinline__ int slot() const {
    return Cfg::CLUSTER == 1 ? (int)blockIdx.x : (int)cluster_id_x();
  }
  __device__ __forceinline__ int slots() const {
    return Cfg::CLUSTER == 1 ? (int)gridDim.x : (int)num_clusters_x();
  }
  __device__ __forceinline__ int num_tasks() const {
    const int b = slot(), g = slots();
    return b < p.total ? (p.total - b + g - 1) / g : 0;
  }
  __device__ __forceinline__ TileTask task(int i) const {
    const int pos = slot() + i * slots();
    const int id = p.order != nullptr ? __ldg(p.order + pos) : pos;
    const int um = id / p.tiles_n, tn = id - um * p.tiles_n;
    const int r = Cfg::CLUSTER == 1 ? 0 : (int)cluster_ctarank();
    TileTask t;
    t.m0 = (um * Cfg::CLUSTER + r) * Cfg::BM;
    t.n0 = tn * Cfg::BN;
    t.rows = min(Cfg::BM, p.engine.M - t.m0);
    t.cols = min(Cfg::BN, p.engine.N - t.n0);
    if (t.rows <= 0) {  // below M (a cluster's last tile row): load valid rows, store nothing
      t.m0 = um * Cfg::CLUSTER * Cfg::BM;
      t.rows = 0;
    }
    return t;
  }
  __device__ __forceinline__ void before_load(int) const {}
  __device__ __forceinline__ Dest dest(int i) const {
    const TileTask t = task(i);
    const long esize = p.kind == kStoreBF16 ? 2 : 4;  // fp32 for kinds 1..3
    Dest d;
    d.ptr = static_cast<char*>(p.c) + ((long)t.m0 * p.ldc + t.n0) * esize;
    d.ld = p.ldc;
    d.kind = p.kind;
    if (p.use_c_map && t.rows > 0) {
      d.map = &p.c_map;
      d.map_col = t.n0;
      d.map_row = t.m0;
    }
    return d;
  }
  __device__ __forceinline__ void after_store(int) const {}
};

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    gemm_kernel(const __grid_constant__ GemmKernelParams<Cfg> p) {
  extern __shared__ __align__(1024) char smem[];
  using E = Engine<Cfg>;
  GemmHooks<Cfg> hooks{p};
  if constexpr (Cfg::CLUSTER > 1) E::cluster_begin(smem);
  E::run_cta(p.engine, smem, hooks, [] {});  // a plain GEMM: the spare warp idles
  if constexpr (Cfg::CLUSTER > 1) E::cluster_end();
}

int g_last_grid = 0;  // grid of the last launch (diagnostics: gemm_last_grid)

template <class Cfg>
int launch(const GemmArgs& a, cudaStream_t stream, int num_sms) {
  GemmKernelParams<Cfg> p{};
  int e = mk::host::make_tensor_map_bf16_2d(&p.engine.a, a.a, a.M, a.K, a.K, Cfg::BM, 64, 128);
  if (e != mk::host::kTensorMapOk) return kGemmTensorMap;
  e = mk::host::make_tensor_map_bf16_2d(&p.engine.b, a.b, a.K, a.N, a.N, 64, 64, 128);
  if (e != mk::host::kTensorMapOk) return kGemmTensorMap;
  p.engine.M = a.M;
  p.engine.N = a.N;
  p.engine.K = a.K;
  p.c = a.c;
  p.ldc = a.ldc > 0 ? a.ldc : a.N;
  p.kind = a.out_kind;
  p.use_c_map = false;
  if (Cfg::EPI_MODE == kEpiTma && a.out_kind == kStoreBF16 &&
      mk::host::make_tensor_map_bf16_2d(&p.c_map, a.c, a.M, a.N, p.ldc, 64, 64, 128) ==
          mk::host::kTensorMapOk)
    p.use_c_map = true;  // else: row-copy passes or direct stores (misaligned C or ldc)
  p.order = a.tile_order;
  constexpr int kCl = Cfg::CLUSTER;
  const int units_m = (a.M + Cfg::BM * kCl - 1) / (Cfg::BM * kCl);
  p.tiles_n = (a.N + Cfg::BN - 1) / Cfg::BN;
  p.total = units_m * p.tiles_n;

  auto* kernel = gemm_kernel<Cfg>;
  static int max_clusters = 0;  // NOTE: per process; fine for one device kind
  if (max_clusters == 0) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             Cfg::kSmemBytes) != cudaSuccess)
      return kGemmLaunchFailed;
    max_clusters = 1 << 30;
    if (kCl > 1) {  // how many clusters of kCl CTAs fit on the GPU at once
      cudaLaunchConfig_t q{};
      cudaLaunchAttribute at{};
      at.id = cudaLaunchAttributeClusterDimension;
      at.val.clusterDim.x = kCl;
      at.val.clusterDim.y = at.val.clusterDim.z = 1;
      q.gridDim = dim3(kCl * mk::host::num_sms_of_current_device());
      q.blockDim = dim3(Cfg::kThreads);
      q.dynamicSmemBytes = Cfg::kSmemBytes;
      q.attrs = &at;
      q.numAttrs = 1;
      if (cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &q) != cudaSuccess ||
          max_clusters < 1) {
        max_clusters = 0;
        return kGemmLaunchFailed;
      }
    }
  }
  int slots = num_sms / kCl;
  if (slots < 1) slots = 1;
  if (slots > max_clusters) slots = max_clusters;
  if (slots > p.total) slots = p.total;

  cudaLaunchConfig_t lc{};
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = kCl;
  attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  lc.gridDim = dim3(slots * kCl);
  g_last_grid = slots * kCl;
  lc.blockDim = dim3(Cfg::kThreads);
  lc.dynamicSmemBytes = Cfg::kSmemBytes;
  lc.stream = stream;
  lc.attrs = &attr;
  lc.numAttrs = kCl > 1 ? 1 : 0;  // plain launch for single-CTA configs
  if (cudaLaunchKernelEx(&lc, kernel, p) != cudaSuccess) return kGemmLaunchFailed;
  return cudaGetLastError() == cudaSuccess ? kGemmOk : kGemmLaunchFailed;
}

}  // namespace

const char* gemm_status_string(int s) {
  switch (s) {
    case kGemmOk: return "ok";
    case kGemmBadShape: return "M, N and K must be >= 1";
    case kGemmBadAlignment: return "N and K must be multiples of 8 (16-byte TMA strides)";
    case kGemmBadPointer: return "a, b, c must be non-null and a, b 16-byte aligned";
    case kGemmBadConfig: return "unknown GEMM config id";
    case kGemmBadKind:
      return "out_kind must be 0 (bf16), 1 (fp32 reduce-add), 2 (fp32) or 3 (fp32 TMA reduce-add)";
    case kGemmBadLdc: return "ldc must be >= N";
    case kGemmTensorMap: return "could not encode a TMA tensor map (cuTensorMapEncodeTiled)";
    case kGemmLaunchFailed: return "CUDA launch failed";
    default: return "unknown status";
  }
}

int gemm_last_grid() { return g_last_grid; }

int launch_gemm(const GemmArgs& a, cudaStream_t stream) {
  if (a.M < 1 || a.N < 1 || a.K < 1) return kGemmBadShape;
  if (a.N % 8 != 0 || a.K % 8 != 0) return kGemmBadAlignment;
  if (a.a == nullptr || a.b == nullptr || a.c == nullptr ||
      (reinterpret_cast<uintptr_t>(a.a) & 15) || (reinterpret_cast<uintptr_t>(a.b) & 15))
    return kGemmBadPointer;
  if (a.out_kind < 0 || a.out_kind > 3) return kGemmBadKind;
  if (a.ldc != 0 && a.ldc < a.N) return kGemmBadLdc;
  const int num_sms = a.num_sms > 0 ? a.num_sms : mk::host::num_sms_of_current_device();
  if (num_sms < 1) return kGemmLaunchFailed;
  // NOTE: no heuristic here: the caller (mkernel.schedule.pick_tile) picks the config.
  switch (a.config) {
    case Tile128x256x64::kId: return launch<Tile128x256x64>(a, stream, num_sms);
    case Tile128x128x64::kId: return launch<Tile128x128x64>(a, stream, num_sms);
    case Tile64x128x64::kId: return launch<Tile64x128x64>(a, stream, num_sms);
#ifdef MK_GEMM_EXPERIMENTS
    case ExpSkipEpi::kId: return launch<ExpSkipEpi>(a, stream, num_sms);
    case ExpCluster2::kId: return launch<ExpCluster2>(a, stream, num_sms);
    case ExpOverlap::kId: return launch<ExpOverlap>(a, stream, num_sms);
    case ExpFourStages::kId: return launch<ExpFourStages>(a, stream, num_sms);
    case ExpOnePass::kId: return launch<ExpOnePass>(a, stream, num_sms);
#endif
    default: return kGemmBadConfig;
  }
}
