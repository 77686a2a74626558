// The one typed config object every fused GEMM-family launcher takes (bound to Python as
// mkernel._mkernel_ext.FusedLaunch; filled by mkernel/ops/common.py). Raw addresses and ints only:
// no torch headers on this side.
#pragma once
#include <cstdint>

namespace mk {

struct FusedLaunch {
  // plan (device int32 tables)
  uint64_t tiles = 0, compute_order = 0, comm_tasks = 0;
  int tc = 0, tm = 0, compute_units = 0, comm_units = 0, ctas_per_rank = 0, overlap = 0;
  int tile_config = 0;  // TILE_CONFIG_IDS in mkernel/schedule.py
  // world
  int world_size = 1, rank0 = 0, ranks_here = 1;
  long long timeout_ns = 0;
  uint64_t status = 0;        // CommStatus* (pinned, mapped)
  uint64_t barrier_ptrs = 0;  // [W] addresses of each rank's entry-barrier flags
  // faults (tests)
  int silent_rank = -1, delay_rank = -1;
  long long delay_ns = 0;
  // operands: rank r's tensor at ptr + r * rank_stride elements (emulated world)
  uint64_t a = 0, b = 0, out = 0;
  long long a_rank_stride = 0, b_rank_stride = 0, out_rank_stride = 0;
  int M = 0, N = 0, K = 0;  // the per-rank GEMM this launch computes: [M, K] @ [K, N]
  // op-specific symmetric buffers ([W] address tables), named by the op's module
  uint64_t work_ptrs =
      0;  // data workspace (gemm_rs / gemm_ar: fp32 accumulators; ag_gemm: gathered A)
  uint64_t flag_ptrs = 0;   // data-ready signals
  uint64_t flag2_ptrs = 0;  // second signal pad (gemm_ar: reduced-tile-ready; ag_gemm: consumers)
  int rows_per_rank = 0;    // M / W of the op
  int tiles_per_rank =
      0;               // tiles owned by one rank (gemm_rs / gemm_ar) or chunks per rank (ag_gemm)
  int chunk_rows = 0;  // ag_gemm
  // added for ag_gemm / gemm_ar (device code reads only what its op sets)
  uint64_t work_local = 0;  // host-known address of the first served rank's data workspace
                            // (ag_gemm: its gather buffer, the engine's A; + r*M*K per rank)
  uint64_t aux_ptr = 0;     // op's extra device table (ag_gemm: int32 [W*C] consumers per chunk;
                            // gemm_ar: [W] result addresses in a distributed world, else 0)
  int backoff_ns = 0;       // sleep between polls of a wait (Schedule.backoff_ns)
  uint64_t timeline = 0;    // int64 [ranks_here, ctas_per_rank, 2, timeline_cap, 2] or 0
  int timeline_cap = 0;     // tasks recorded per unit
  int transfer = 0;         // ag_gemm pushes: 0 16-byte stores, 1 TMA bulk copies (inter_sm)
};

}  // namespace mk
