// tensor_map_nd.h: host helper that encodes a rank-4 CUtensorMap over a bf16 [B, S, H, D] tensor
// (D innermost; the layout of attention's Q, K, V and O) through primitives/host/tensor_map.h's
// rank-N encoder (nothing links libcuda). Header-only; include from host code.
//
//   CUtensorMap map;
//   int err = mk::host::make_tensor_map_bf16_bshd(&map, ptr, B, S, H, D, box_rows, box_cols);
//   if (err != mk::host::kTensorMapOk) { ... mk::host::tensor_map_error_string(err) ... }
//
// Dimensions, innermost first: {D, H, S, B} with byte strides {2D, 2HD, 2SHD}. NOTE: H is placed
// before S so that the strides grow monotonically; a box is {box_cols, 1, box_rows, 1}: box_rows
// sequence positions of ONE head, which lands in shared memory as [box_rows][box_cols], exactly the
// 2D tile of primitives/host/tensor_map.h (128-byte swizzle on 128-byte rows). TMA coordinates are
// {d0, h, s0, b}. Rows s >= S of a box are zero-filled on loads and dropped by stores, so a tile
// never reaches into the next batch's or head's rows.
// Requirements (checked): ptr 16-byte aligned, 2D a multiple of 16, box_cols * 2 == 128 (the
// 128-byte swizzle span), box_rows in 1..256, sizes >= 1, strides < 2^40.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstring>

#include "../host/tensor_map.h"

namespace mk::host {

inline int make_tensor_map_bf16_bshd(CUtensorMap* map, const void* ptr, uint64_t B, uint64_t S,
                                     uint64_t H, uint64_t D, uint32_t box_rows,
                                     uint32_t box_cols) {
  if (B < 1 || S < 1 || H < 1 || D < 1) return kTensorMapBadShape;
  if (B > (1ull << 32) || S > (1ull << 32) || H > (1ull << 32) || D > (1ull << 32))
    return kTensorMapBadShape;
  if ((reinterpret_cast<uintptr_t>(ptr) & 15) != 0) return kTensorMapMisalignedPointer;
  if (((D * 2) & 15) != 0) return kTensorMapMisalignedPitch;
  const uint64_t stride_h = D * 2, stride_s = stride_h * H, stride_b = stride_s * S;
  if (stride_b >= (1ull << 40)) return kTensorMapBadShape;
  if (box_rows < 1 || box_rows > 256 || box_cols * 2 != 128) return kTensorMapBadBox;
  // The shared rank-N encoder (tensor_map.h): its checks, its per-thread cache of encoded maps.
  const uint64_t dims[4] = {D, H, S, B};
  const uint64_t strides[3] = {stride_h, stride_s, stride_b};  // bytes, for dims 1..3
  const uint32_t box[4] = {box_cols, 1, box_rows, 1};
  return make_tensor_map_bf16_nd(map, ptr, 4, dims, strides, box, 128);
}

// The same [B, S, H, D] view of an fp32 tensor (the backward's dQ accumulator): box {32, 1,
// box_rows, 1}, 32 floats = one 128-byte swizzle span per row.
inline int make_tensor_map_f32_bshd(CUtensorMap* map, const void* ptr, uint64_t B, uint64_t S,
                                    uint64_t H, uint64_t D, uint32_t box_rows) {
  if (B < 1 || S < 1 || H < 1 || D < 1) return kTensorMapBadShape;
  const uint64_t stride_h = D * 4, stride_s = stride_h * H, stride_b = stride_s * S;
  if (stride_b >= (1ull << 40)) return kTensorMapBadShape;
  const uint64_t dims[4] = {D, H, S, B};
  const uint64_t strides[3] = {stride_h, stride_s, stride_b};
  const uint32_t box[4] = {32, 1, box_rows, 1};
  return make_tensor_map_nd(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, ptr, 4, dims, strides, box, 128);
}

}  // namespace mk::host
