// config.cuh: named tile configurations of the GEMM engine, the shared-memory map they imply, and
// config_info, the facts of each compiled config by id. The config heuristic and the tile order
// (L2-friendly grouped rasterisation) live once, in Python: mkernel/schedule.py pick_tile and
// grouped_order; the caller passes the config id and the order it built (kernels/gemm_args.h).
//
// A config is a struct of named constants; the engine takes it as its only template argument.
//   BM x BN x BK   tile of C computed per task, k-slice per pipeline stage (BK = 64: one 128-byte
//                  swizzle span of bf16, so each stage is exactly what TMA writes with 128B swizzle)
//   STAGES         depth of the TMA -> wgmma ring
//   CONSUMERS      consumer warpgroups; each owns 64 rows of the tile (BM = 64 * CONSUMERS)
//   EPI_COLS       columns per epilogue pass through the shared-memory staging tile
//   EPI_OVERLAP    write the staged bf16 passes during the next task's first k-slices
//   EPI_MODE       kEpiStaged (bf16 through staging + bulk copies, fp32 direct), kEpiDirect (all kinds
//                  straight from registers), kEpiSkip (writes nothing: only for timing the epilogue),
//                  kEpiTma (bf16 through two swizzled 64 x 64 buffers + TMA tensor stores; needs
//                  Dest::map, else direct)
//   kProducerRegs / kConsumerRegs   setmaxnreg targets (the caller's template applies them)
//   CLUSTER        CTAs per thread-block cluster along M (1 or 2); with 2, the two CTAs compute
//                  vertically adjacent tiles and share each B slice through one multicast TMA load
#pragma once
#include <cstdint>

#include "primitives/protocol_gen.h"  // tile config ids (mkernel/protocol.py TILE_CONFIG_IDS)

#if defined(__CUDACC__)
#define MK_HD __host__ __device__
#else
#define MK_HD
#endif

namespace mk::gemm {

enum EpiMode : int { kEpiStaged = 0, kEpiDirect = 1, kEpiSkip = 2, kEpiTma = 3 };

// Shared-memory map (bytes from the 1024-aligned base), derived from a config:
//   [A stages: STAGES x BM x BK bf16][B stages: STAGES x BK x BN bf16]
//   [epilogue staging: CONSUMERS x 64 rows x (EPI_COLS*2 + 16) bytes][full[STAGES], empty[STAGES]]
// NOTE: staging rows are padded by 16 bytes so that stmatrix rows of 8 consecutive rows hit distinct
// banks; the bulk copies read each padded row as one contiguous run.
template <class Cfg>
struct SmemMap {
  static constexpr int kABytesPerStage = Cfg::BM * Cfg::BK * 2;  // [BM, BK] bf16
  static constexpr int kBBytesPerStage = Cfg::BK * Cfg::BN * 2;  // [BK, BN] bf16
  static constexpr int kBChunkBytes = Cfg::BK * 128;             // [BK, 64] bf16 chunk
  static constexpr int kStagingStride = Cfg::EPI_COLS * 2 + 16;  // bytes per staged row
  // [64, EPI_COLS] bf16 padded rows; kEpiTma also lays two swizzled [64, 64] boxes over it
  static constexpr int kPaddedBytes = 64 * kStagingStride;
  static constexpr int kStagingBytesPerWG =
      Cfg::EPI_MODE == kEpiTma && kPaddedBytes < 2 * 8192 ? 2 * 8192 : kPaddedBytes;
  static constexpr int kAOffset = 0;
  static constexpr int kBOffset = kAOffset + Cfg::STAGES * kABytesPerStage;
  static constexpr int kStagingOffset = kBOffset + Cfg::STAGES * kBBytesPerStage;
  static constexpr int kBarOffset = kStagingOffset + Cfg::CONSUMERS * kStagingBytesPerWG;
  static constexpr int kBytes = kBarOffset + 2 * Cfg::STAGES * 8;
  static_assert(kABytesPerStage % 1024 == 0 && kBBytesPerStage % 1024 == 0, "1024-B stages");
  static_assert(kStagingBytesPerWG % 16 == 0, "bulk copies need 16-byte aligned rows");
  static_assert(Cfg::EPI_MODE != kEpiTma ||
                    (kStagingOffset % 1024 == 0 && kStagingBytesPerWG % 1024 == 0),
                "swizzled TMA store boxes need 1024-byte alignment");
};

constexpr int kMaxDynamicSmem = 232448;  // 227 KiB per block on sm_90

template <int BM_, int BN_, int STAGES_, int ID_, int REG_P, int REG_C, int EPI_COLS_ = 128,
          int EPI_MODE_ = kEpiStaged, int CLUSTER_ = 1>
struct TileConfig {
  static constexpr int kId = ID_;
  static constexpr int BM = BM_, BN = BN_, BK = 64;
  static constexpr int STAGES = STAGES_;
  static constexpr int CONSUMERS = BM_ / 64;
  static constexpr int EPI_COLS = BN_ < EPI_COLS_ ? BN_ : EPI_COLS_;
  static constexpr int EPI_MODE = EPI_MODE_;
  static constexpr int CLUSTER = CLUSTER_;
  // Staged passes during the next task's first k-slices: measured slower on H200 (it delays the
  // next wgmma issue), so off by default; see docs/gemm_engine.md.
  static constexpr bool EPI_OVERLAP = false;
  static constexpr int kThreads = 128 * (1 + CONSUMERS);
  static constexpr int kProducerRegs = REG_P;
  static constexpr int kConsumerRegs = REG_C;
  static constexpr int kSmemBytes = SmemMap<TileConfig>::kBytes;
  static_assert(BM_ % 64 == 0 && BN_ % 64 == 0 && BN_ <= 256, "wgmma m64nNk16, N <= 256");
  static_assert(kSmemBytes <= kMaxDynamicSmem, "shared memory over the sm_90 limit");
  static_assert(CLUSTER_ == 1 || CLUSTER_ == 2, "clusters of 1 or 2 CTAs");
  static_assert(128 * REG_P + 128 * CONSUMERS * REG_C <= 65536, "register file");
};

// 2 consumer warpgroups, each 64 x 256: the large-problem workhorse. 4 stages; bf16 tiles leave as
// TMA tensor stores of 64 x 64 boxes through two swizzled 8 KiB buffers when the destination has a
// tensor map (Dest::map), else as two 128-column passes of row copies. Measured against 3 stages with
// a one-pass 256-column staging tile (experiment 112, the config before): +0.2% to +4.9% (two runs).
using Tile128x256x64 = TileConfig<128, 256, 4, kTile128x256x64, 24, 240, 128, kEpiTma>;
// 2 consumer warpgroups, each 64 x 128: more tiles for mid-size problems.
using Tile128x128x64 = TileConfig<128, 128, 6, kTile128x128x64, 40, 232>;
// 1 consumer warpgroup, 64 x 128: small M or few tiles.
using Tile64x128x64 = TileConfig<64, 128, 8, kTile64x128x64, 40, 232>;

constexpr int kNumConfigs = 3;

#ifdef MK_GEMM_EXPERIMENTS
// Dev-harness variants (ids >= 100), never picked by the heuristic (mkernel.schedule.pick_tile).
using ExpSkipEpi = TileConfig<128, 256, 4, 102, 24, 240, 128, kEpiSkip>;  // timing only
// Two CTAs per cluster (a 256 x 256 block of C), each loading half of B for both (a third less L2
// traffic): measured no faster than config 0 on H200 (the GPU is power-bound, not L2-bound).
using ExpCluster2 = TileConfig<128, 256, 3, 103, 24, 240, 256, kEpiStaged, 2>;
// The one-pass epilogue of experiment 112 run during the next tile's first k-slice.
struct ExpOverlap : TileConfig<128, 256, 3, 104, 24, 240, 256> {
  static constexpr bool EPI_OVERLAP = true;
};
using ExpFourStages = TileConfig<128, 256, 4, 110, 24, 240, 128>;  // 4 stages, two row-copy passes
using ExpOnePass = TileConfig<128, 256, 3, 112, 24, 240, 256>;     // 3 stages, one 256-column pass
#endif

struct ConfigInfo {
  int id, bm, bn, bk, stages, consumers, threads, smem_bytes, cluster;
};

template <class Cfg>
MK_HD constexpr ConfigInfo info_of() {
  return {Cfg::kId,       Cfg::BM,       Cfg::BN,         Cfg::BK,     Cfg::STAGES,
          Cfg::CONSUMERS, Cfg::kThreads, Cfg::kSmemBytes, Cfg::CLUSTER};
}

MK_HD inline ConfigInfo config_info(int id) {
  switch (id) {
    case 0: return info_of<Tile128x256x64>();
    case 1: return info_of<Tile128x128x64>();
    case 2: return info_of<Tile64x128x64>();
#ifdef MK_GEMM_EXPERIMENTS
    case 102: return info_of<ExpSkipEpi>();
    case 103: return info_of<ExpCluster2>();
    case 104: return info_of<ExpOverlap>();
    case 110: return info_of<ExpFourStages>();
    case 112: return info_of<ExpOnePass>();
#endif
    default: return {-1, 0, 0, 0, 0, 0, 0, 0, 0};
  }
}

}  // namespace mk::gemm
