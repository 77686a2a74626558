// epilogue.cuh: how a consumer warpgroup writes its 64 x BN fp32 accumulator tile to a destination.
//
// Destination kinds (Dest::kind):
//   kStoreBF16   = 0: C[r][c] = bf16(acc)                 (element type bf16)
//   kReduceF32   = 1: C[r][c] += acc, atomically (.sys)  (element type fp32; several GPUs may add)
//   kStoreF32    = 2: C[r][c] = acc                      (element type fp32)
//   kReduceF32Bulk = 3: C[r][c] += acc by TMA reduce-store (cp.reduce.async.bulk .add.f32) at the
//                    destination's memory: same result as kind 1, one bulk op per row instead of
//                    BN/2 atomics per thread (element type fp32)
//   kStoreF32Bulk = 4: C[r][c] = acc by bulk copies (cp.async.bulk) of staged fp32 rows, the path
//                    of kind 3 without the add (gemm_rs: a partial into its owner's stage slot)
// Dest::ptr is the address of the tile's element (0,0), Dest::ld the row pitch in ELEMENTS; it may be
// a peer GPU's memory (NVLink), so no tensor map is used for destinations.
//
// Paths:
//   * staged (kind 0 when ptr and ld*2 are 16-byte aligned and the valid column count is a multiple
//     of 8): the warpgroup writes EPI_COLS columns at a time into its padded shared-memory staging
//     tile with stmatrix, fences the async proxy, and threads 0..63 each issue one non-tensor bulk copy
//     (cp.async.bulk.global.shared::cta) per row. The copies join each thread's bulk group; the caller
//     must bulk_wait_all() in threads 0..63 before it tells anybody the data landed.
//   * staged reduce (kind 3 when ptr and ld*4 are 16-byte aligned and the valid column count is a
//     multiple of 4): EPI_COLS/2 fp32 columns per pass through the same staging tile (st.shared.v2),
//     then one bulk reduce-add per row from threads 0..63; same completion rule as the bf16 path.
//   * TMA tensor store (configs with EPI_MODE kEpiTma, kind 0 with Dest::map; dev experiment 111):
//     64 x 64 boxes through two swizzled buffers, one cp.async.bulk.tensor store each; the map's
//     bounds clip the tile.
//   * direct (everything else; kind 3 falls back to kind 1's atomics): vector st.global /
//     red.global.add.v2.f32 straight from registers, scalar where alignment or clipping forbids a pair. Visibility: caller's named barrier, then
//     __threadfence_system() in the signalling thread.
// Every path writes only rows < rows_valid and columns < cols_valid of the tile.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>

#include "mbarrier.cuh"
#include "tma.cuh"

namespace mk::gemm {

enum DestKind : int {
  kStoreBF16 = 0,
  kReduceF32 = 1,
  kStoreF32 = 2,
  kReduceF32Bulk = 3,
  kStoreF32Bulk = 4,
};

struct Dest {
  void* ptr;  // element (0,0) of the tile's destination
  long ld;    // row pitch in elements
  int kind;   // DestKind
  // Optional (configs with EPI_MODE kEpiTma, kind 0): a tensor map of the destination (bf16, box
  // 64 x 64, 128-byte swizzle) and the {column, row} of element (0,0) in it; TMA clips to its bounds.
  const CUtensorMap* map = nullptr;
  int map_col = 0, map_row = 0;
  // Optional: fp32 tiles added into the accumulator (in registers) before any store path: tiles
  // add_from + s * add_stride for s in [0, add_count), s != add_skip, with the same row pitch `ld`
  // (gemm_rs: the partials peers left in the owner's staging slots). Read with ld.global.cg: other
  // GPUs wrote them during this launch, after the hooks' wait.
  const float* add_from = nullptr;
  long add_stride = 0;
  int add_count = 0, add_skip = -1;
};

// TMA tensor store of one box, shared (swizzled as the map says) -> global; joins the bulk group.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* smem_src, int c0,
                                             int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(smem_src)), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low address) = lo
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, uint32_t r0, uint32_t r1,
                                            uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

__device__ __forceinline__ void st_shared_f32x2(uint32_t smem_addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(smem_addr), "f"(a), "f"(b) : "memory");
}


// BN: tile width (accumulator has BN/2 floats per thread); EPI_COLS: columns per staged pass.
template <int BN, int EPI_COLS>
struct WarpgroupEpilogue {
  static constexpr int kRegs = BN / 2;
  static constexpr int kStagingStride = EPI_COLS * 2 + 16;  // bytes, see SmemMap
  static_assert(BN % EPI_COLS == 0 && EPI_COLS % 16 == 0, "passes of whole 16-column blocks");

  __device__ __forceinline__ static bool staged_ok(const Dest& d, int cols_valid) {
    return d.kind == kStoreBF16 && (reinterpret_cast<uintptr_t>(d.ptr) & 15) == 0 &&
           ((d.ld * 2) & 15) == 0 && (cols_valid & 7) == 0;
  }

  static constexpr int kPasses = BN / EPI_COLS;
  static constexpr int kPacked = BN / 4;  // packed[m] = bf16x2(acc[2m], acc[2m+1])

  __device__ __forceinline__ static void pack(const float (&acc)[kRegs],
                                              uint32_t (&packed)[kPacked]) {
#pragma unroll
    for (int m = 0; m < kPacked; ++m) packed[m] = pack_bf16x2(acc[2 * m], acc[2 * m + 1]);
  }

  // One staged pass (columns PASS*EPI_COLS ..), all 128 threads of the warpgroup. `d.ptr` already
  // points at this warpgroup's first row. wg_bar: a named-barrier id private to this warpgroup.
  // Safe to run while this warpgroup's wgmmas are in flight: it touches only `packed` and staging.
  template <int PASS>
  __device__ static void store_staged_pass(const uint32_t (&packed)[kPacked], char* staging,
                                           const Dest& d, int rows_valid, int cols_valid,
                                           int wg_bar) {
    const int lt = threadIdx.x % 128, warp = lt / 32, lane = lt % 32;
    // stmatrix row address of this lane: matrices (rows 0-7 | 8-15) x (cols j | j+1) of its warp.
    const int st_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
    const uint32_t st_base = smem_u32(staging) + st_row * kStagingStride + ((lane >> 4) & 1) * 16;
    // The staging tile may still be read by the previous pass's (or tile's) bulk copies.
    if (lt < 64) bulk_wait_read();
    named_barrier_sync(wg_bar, 128);
#pragma unroll
    for (int jj = 0; jj < EPI_COLS / 16; ++jj) {
      const int j = PASS * (EPI_COLS / 8) + 2 * jj;  // first 8-column group of this stmatrix
      stmatrix_x4(st_base + jj * 32, packed[2 * j], packed[2 * j + 1], packed[2 * j + 2],
                  packed[2 * j + 3]);
    }
    fence_proxy_async_smem();
    named_barrier_sync(wg_bar, 128);
    if (lt < 64) {
      const int c0 = PASS * EPI_COLS;
      if (lt < rows_valid && c0 < cols_valid) {
        const int ncols = (cols_valid - c0) < EPI_COLS ? (cols_valid - c0) : EPI_COLS;
        tile_send_bulk(static_cast<__nv_bfloat16*>(d.ptr) + (long)lt * d.ld + c0,
                       staging + lt * kStagingStride, (uint32_t)ncols * 2u);
      }
      bulk_commit();
    }
  }

  // Pass number `pass` (run-time) of kPasses; dispatches to the compile-time pass.
  __device__ __forceinline__ static void store_staged_pass_rt(int pass,
                                                              const uint32_t (&packed)[kPacked],
                                                              char* staging, const Dest& d,
                                                              int rows_valid, int cols_valid,
                                                              int wg_bar) {
    static_assert(kPasses >= 1 && kPasses <= 4, "1..4 passes");
    if (pass == 0) store_staged_pass<0>(packed, staging, d, rows_valid, cols_valid, wg_bar);
    if constexpr (kPasses > 1)
      if (pass == 1) store_staged_pass<1>(packed, staging, d, rows_valid, cols_valid, wg_bar);
    if constexpr (kPasses > 2)
      if (pass == 2) store_staged_pass<2>(packed, staging, d, rows_valid, cols_valid, wg_bar);
    if constexpr (kPasses > 3)
      if (pass == 3) store_staged_pass<3>(packed, staging, d, rows_valid, cols_valid, wg_bar);
  }

  static constexpr int kF32Cols = EPI_COLS / 2;  // fp32 columns per staged pass (same row bytes)
  static constexpr int kF32Passes = BN / kF32Cols;

  __device__ __forceinline__ static bool staged_reduce_ok(const Dest& d, int cols_valid) {
    return (d.kind == kReduceF32Bulk || d.kind == kStoreF32Bulk) &&
           (reinterpret_cast<uintptr_t>(d.ptr) & 15) == 0 &&
           ((d.ld * 4) & 15) == 0 && (cols_valid & 3) == 0;
  }

  // One fp32 pass (columns PASS*kF32Cols ..) reduce-added into the destination by bulk TMA, all 128
  // threads of the warpgroup. Accumulator layout (wgmma m64nN, fp32): thread (warp w, lane l) holds
  // rows 16w + l/4 (+8) and columns 8j + 2(l%4) (+1) in acc[4j + 2h + {0,1}].
  template <int PASS>
  __device__ static void reduce_staged_pass(const float (&acc)[kRegs], char* staging, const Dest& d,
                                            int rows_valid, int cols_valid, int wg_bar) {
    const int lt = threadIdx.x % 128, warp = lt / 32, lane = lt % 32;
    const int r_base = warp * 16 + lane / 4, c_base = 2 * (lane % 4);
    const uint32_t base = smem_u32(staging);
    if (lt < 64) bulk_wait_read();  // the staging tile may still be read by earlier bulk ops
    named_barrier_sync(wg_bar, 128);
#pragma unroll
    for (int jj = 0; jj < kF32Cols / 8; ++jj) {
      const int j = PASS * (kF32Cols / 8) + jj;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        st_shared_f32x2(base + (r_base + 8 * h) * kStagingStride + (8 * jj + c_base) * 4,
                        acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
    fence_proxy_async_smem();
    named_barrier_sync(wg_bar, 128);
    if (lt < 64) {
      const int c0 = PASS * kF32Cols;
      if (lt < rows_valid && c0 < cols_valid) {
        const int ncols = (cols_valid - c0) < kF32Cols ? (cols_valid - c0) : kF32Cols;
        float* dst = static_cast<float*>(d.ptr) + (long)lt * d.ld + c0;
        const float* src = reinterpret_cast<const float*>(staging + lt * kStagingStride);
        if (d.kind == kStoreF32Bulk) {
          tile_send_bulk(dst, src, (uint32_t)ncols * 4u);
        } else {
          reduce_add_bulk_f32(dst, src, (uint32_t)ncols * 4u);
        }
      }
      bulk_commit();
    }
  }

  __device__ static void reduce_staged(const float (&acc)[kRegs], char* staging, const Dest& d,
                                       int rows_valid, int cols_valid, int wg_bar) {
    static_assert(kF32Passes >= 1 && kF32Passes <= 4, "1..4 passes");
    reduce_staged_pass<0>(acc, staging, d, rows_valid, cols_valid, wg_bar);
    if constexpr (kF32Passes > 1)
      reduce_staged_pass<1>(acc, staging, d, rows_valid, cols_valid, wg_bar);
    if constexpr (kF32Passes > 2)
      reduce_staged_pass<2>(acc, staging, d, rows_valid, cols_valid, wg_bar);
    if constexpr (kF32Passes > 3)
      reduce_staged_pass<3>(acc, staging, d, rows_valid, cols_valid, wg_bar);
  }

  // kEpiTma, full tiles only (64 valid rows, BN valid columns: a box is never clipped by the tile,
  // only by the map): the warpgroup's 64 x BN bf16 tile as BN/64 boxes of 64 x 64 through two 8 KiB
  // buffers in the 128-byte swizzled layout (16-byte chunk c of row r at chunk c ^ (r % 8):
  // stmatrix without bank conflicts, no padding), one TMA tensor store per box from thread 0. A buffer is reused once
  // the store two boxes back has read it (wait_group.read 1), so boxes overlap their stores.
  __device__ static void store_tma(const uint32_t (&packed)[kPacked], char* staging, const Dest& d,
                                   int wg_bar) {
    const int lt = threadIdx.x % 128, warp = lt / 32, lane = lt % 32;
    const int row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
    const int half = (lane >> 4) & 1;  // second 8-column group of the stmatrix.x4
#pragma unroll
    for (int box = 0; box < BN / 64; ++box) {
      char* buf = staging + (box & 1) * 8192;
      if (lt == 0) {
        // box 0: the previous tile's stores (either path, anywhere in the staging tile) have read
        // it; box 2, 3: the store of box - 2 has read this buffer.
        if (box == 0) bulk_wait_read();
        if (box >= 2) bulk_wait_read_n<1>();
      }
      named_barrier_sync(wg_bar, 128);
      const uint32_t row_base = smem_u32(buf) + row * 128;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = box * 8 + 2 * jj;  // first 8-column group (of the tile) of this stmatrix
        const int chunk = 2 * jj + half;
        stmatrix_x4(row_base + ((chunk ^ (row & 7)) << 4), packed[2 * j], packed[2 * j + 1],
                    packed[2 * j + 2], packed[2 * j + 3]);
      }
      fence_proxy_async_smem();
      named_barrier_sync(wg_bar, 128);
      if (lt == 0) {
        tma_store_2d(d.map, buf, d.map_col + 64 * box, d.map_row);
        bulk_commit();
      }
    }
  }

  // Calls f(r, c, v0, v1) for every pair of accumulators this thread holds inside rows_valid x
  // cols_valid: rows r, columns c and c + 1 of the warpgroup's tile (wgmma m64nN fp32 layout).
  template <class F>
  __device__ __forceinline__ static void for_each_pair(const float (&acc)[kRegs], int rows_valid,
                                                       int cols_valid, F&& f) {
    const int lt = threadIdx.x % 128, warp = lt / 32, lane = lt % 32;
    const int r_base = warp * 16 + lane / 4, c_base = 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r_base + 8 * h, c = 8 * j + c_base;
        if (r < rows_valid && c < cols_valid) f(r, c, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      }
    }
  }

  // Dest::add_* tiles into the accumulator, elementwise, only rows_valid x cols_valid (all 128
  // threads of the warpgroup; each reads the fp32 pairs it holds, 8-byte loads where aligned).
  __device__ static void add_tiles(float (&acc)[kRegs], const Dest& d, int rows_valid,
                                   int cols_valid) {
    const int lt = threadIdx.x % 128, warp = lt / 32, lane = lt % 32;
    const int r_base = warp * 16 + lane / 4, c_base = 2 * (lane % 4);
    for (int s = 0; s < d.add_count; ++s) {
      if (s == d.add_skip) continue;
      const float* src = d.add_from + s * d.add_stride;
      const bool vec = (reinterpret_cast<uintptr_t>(src) & 7) == 0 && (d.ld & 1) == 0;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = r_base + 8 * h, c = 8 * j + c_base;
          if (r >= rows_valid || c >= cols_valid) continue;
          const float* p = src + (long)r * d.ld + c;
          float* a = &acc[4 * j + 2 * h];
          if (vec && c + 1 < cols_valid) {
            const float2 v = __ldcg(reinterpret_cast<const float2*>(p));
            a[0] += v.x;
            a[1] += v.y;
          } else {
            a[0] += __ldcg(p);
            if (c + 1 < cols_valid) a[1] += __ldcg(p + 1);
          }
        }
      }
    }
  }

  // All 128 threads of the warpgroup; any kind, any alignment.
  __device__ static void store_direct(const float (&acc)[kRegs], const Dest& d, int rows_valid,
                                      int cols_valid) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(d.ptr);
    if (d.kind == kStoreBF16) {
      const bool vec = (base & 3) == 0 && (d.ld & 1) == 0;
      __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(d.ptr);
      for_each_pair(acc, rows_valid, cols_valid, [&](int r, int c, float v0, float v1) {
        __nv_bfloat16* p = out + (long)r * d.ld + c;
        if (vec && c + 1 < cols_valid) {
          *reinterpret_cast<uint32_t*>(p) = pack_bf16x2(v0, v1);
        } else {
          p[0] = __float2bfloat16_rn(v0);
          if (c + 1 < cols_valid) p[1] = __float2bfloat16_rn(v1);
        }
      });
    } else {
      const bool vec = (base & 7) == 0 && (d.ld & 1) == 0;
      const bool reduce = d.kind == kReduceF32 || d.kind == kReduceF32Bulk;
      float* out = reinterpret_cast<float*>(d.ptr);
      for_each_pair(acc, rows_valid, cols_valid, [&](int r, int c, float v0, float v1) {
        float* p = out + (long)r * d.ld + c;
        const bool pair = c + 1 < cols_valid;
        if (reduce) {
          if (vec && pair) {
            red_add_v2_f32_sys(p, v0, v1);
          } else {
            red_add_f32_sys(p, v0);
            if (pair) red_add_f32_sys(p + 1, v1);
          }
        } else {
          if (vec && pair) {
            *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
          } else {
            p[0] = v0;
            if (pair) p[1] = v1;
          }
        }
      });
    }
  }
};

}  // namespace mk::gemm
