// tensor_map.h: host helpers that encode CUtensorMaps for bf16 tensors (a 2D row-major matrix, a
// batch of them in 3D, or any rank up to 5 with explicit strides), getting
// cuTensorMapEncodeTiled from the driver through the runtime's entry-point query, so that nothing
// links libcuda. Header-only; include from host code (.cu or .cpp compiled with the CUDA runtime).
//
//   CUtensorMap map;
//   int err = mk::host::make_tensor_map_bf16_2d(&map, ptr, rows, cols, row_pitch_elems,
//                                               box_rows, box_cols, /*swizzle_bytes=*/128);
//   if (err != mk::host::kTensorMapOk) { ... mk::host::tensor_map_error_string(err) ... }
//
// The map addresses element (row, col) at ptr + row * row_pitch + col. Box coordinates passed to the
// TMA load are {col, row}. Out-of-bounds box elements are zero-filled (OOB_FILL_NONE).
// Requirements (checked): ptr 16-byte aligned, row_pitch * 2 a multiple of 16, box_cols * 2 <= the
// swizzle span (when swizzled), box sides in 1..256. make_tensor_map_bf16_3d (a batch of matrices,
// coordinates {col, row, batch}) and make_tensor_map_bf16_nd (dims innermost first, byte strides of
// the outer dims) check the same and share one per-thread cache of encoded maps; so does
// make_tensor_map_nd, the same for bf16 or fp32 elements.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <cstdint>
#include <cstring>

#include "primitives/host/driver_entry.h"

namespace mk::host {

enum TensorMapError : int {
  kTensorMapOk = 0,
  kTensorMapNoDriverEntryPoint = 1,  // the driver does not export cuTensorMapEncodeTiled
  kTensorMapMisalignedPointer = 2,   // base pointer not 16-byte aligned
  kTensorMapMisalignedPitch = 3,     // row pitch in bytes not a multiple of 16
  kTensorMapBadBox = 4,              // box sides out of range or wider than the swizzle span
  kTensorMapBadSwizzle = 5,          // swizzle_bytes not in {0, 32, 64, 128}
  kTensorMapEncodeFailed = 6,        // cuTensorMapEncodeTiled returned an error
  kTensorMapBadShape = 7,            // rows/cols < 1 or beyond 2^32
};

inline const char* tensor_map_error_string(int e) {
  switch (e) {
    case kTensorMapOk: return "ok";
    case kTensorMapNoDriverEntryPoint: return "cuTensorMapEncodeTiled not found in the driver";
    case kTensorMapMisalignedPointer: return "tensor base pointer is not 16-byte aligned";
    case kTensorMapMisalignedPitch: return "row pitch (bytes) is not a multiple of 16";
    case kTensorMapBadBox: return "box sides must be 1..256 and fit the swizzle span";
    case kTensorMapBadSwizzle: return "swizzle must be 0, 32, 64 or 128 bytes";
    case kTensorMapEncodeFailed: return "cuTensorMapEncodeTiled failed";
    case kTensorMapBadShape: return "matrix sides must be in 1..2^32";
    default: return "unknown tensor-map error";
  }
}

inline PFN_cuTensorMapEncodeTiled_v12000 get_encode_tiled() {
  static const auto fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(
      driver_entry_point("cuTensorMapEncodeTiled"));
  return fn;
}

// Rank-N tensor map of bf16 or fp32 elements (N in 1..5): dims[0] is the contiguous dimension;
// strides_bytes[i] is the pitch of dimension i+1 in bytes (a multiple of 16); box[i] in 1..256
// elements; OOB zero fill (loads) / dropped (stores, reduce-stores).
inline int make_tensor_map_nd(CUtensorMap* map, CUtensorMapDataType dtype, const void* ptr,
                              int rank, const uint64_t* dims, const uint64_t* strides_bytes,
                              const uint32_t* box, int swizzle_bytes) {
  int elem_bytes;
  switch (dtype) {
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: elem_bytes = 2; break;
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32: elem_bytes = 4; break;
    default: return kTensorMapBadShape;
  }
  constexpr int kMaxRank = 5;
  if (rank < 1 || rank > kMaxRank) return kTensorMapBadShape;
  for (int i = 0; i < rank; ++i)
    if (dims[i] < 1 || dims[i] > (1ull << 32)) return kTensorMapBadShape;
  if ((reinterpret_cast<uintptr_t>(ptr) & 15) != 0) return kTensorMapMisalignedPointer;
  for (int i = 0; i + 1 < rank; ++i)
    if ((strides_bytes[i] & 15) != 0) return kTensorMapMisalignedPitch;
  CUtensorMapSwizzle sw;
  switch (swizzle_bytes) {
    case 0: sw = CU_TENSOR_MAP_SWIZZLE_NONE; break;
    case 32: sw = CU_TENSOR_MAP_SWIZZLE_32B; break;
    case 64: sw = CU_TENSOR_MAP_SWIZZLE_64B; break;
    case 128: sw = CU_TENSOR_MAP_SWIZZLE_128B; break;
    default: return kTensorMapBadSwizzle;
  }
  for (int i = 0; i < rank; ++i)
    if (box[i] < 1 || box[i] > 256) return kTensorMapBadBox;
  if (swizzle_bytes != 0 && box[0] * elem_bytes > (uint32_t)swizzle_bytes) return kTensorMapBadBox;
  if (((box[0] * elem_bytes) & 15) != 0) return kTensorMapBadBox;
  // NOTE: a call's operands are often the tensors of an earlier call (loops, the caching
  // allocator): the encoded map is a pure function of these inputs, so a small per-thread cache
  // saves the driver call (host time per launch matters for small calls).
  struct Entry {
    const void* ptr;
    int rank, swizzle, dtype;
    uint64_t dims[kMaxRank], strides[kMaxRank];
    uint32_t box[kMaxRank];
    CUtensorMap map;
  };
  thread_local Entry cache[64] = {};
  uintptr_t h = (reinterpret_cast<uintptr_t>(ptr) >> 4) ^ (uintptr_t)rank;
  for (int i = 0; i < rank; ++i) h = h * 31 + dims[i] * 7 + box[i];
  Entry& e = cache[(h ^ (h >> 6) ^ (h >> 12)) & 63];
  bool hit = e.ptr == ptr && e.rank == rank && e.swizzle == swizzle_bytes && e.dtype == (int)dtype;
  for (int i = 0; hit && i < rank; ++i)
    hit = e.dims[i] == dims[i] && e.box[i] == box[i] && (i + 1 == rank || e.strides[i] == strides_bytes[i]);
  if (hit) {
    std::memcpy(map, &e.map, sizeof(CUtensorMap));
    return kTensorMapOk;
  }
  PFN_cuTensorMapEncodeTiled_v12000 encode = get_encode_tiled();
  if (encode == nullptr) return kTensorMapNoDriverEntryPoint;
  cuuint64_t cu_dims[kMaxRank], cu_strides[kMaxRank];
  cuuint32_t cu_box[kMaxRank], elem_strides[kMaxRank];
  for (int i = 0; i < rank; ++i) {
    cu_dims[i] = dims[i];
    cu_strides[i] = i + 1 < rank ? strides_bytes[i] : 0;
    cu_box[i] = box[i];
    elem_strides[i] = 1;
  }
  CUresult r = encode(map, dtype, (cuuint32_t)rank,
                      const_cast<void*>(ptr), cu_dims, cu_strides, cu_box, elem_strides,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, sw, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return kTensorMapEncodeFailed;
  e = Entry{};
  e.ptr = ptr;
  e.rank = rank;
  e.swizzle = swizzle_bytes;
  e.dtype = (int)dtype;
  for (int i = 0; i < rank; ++i) {
    e.dims[i] = dims[i];
    e.strides[i] = i + 1 < rank ? strides_bytes[i] : 0;
    e.box[i] = box[i];
  }
  std::memcpy(&e.map, map, sizeof(CUtensorMap));
  return kTensorMapOk;
}

inline int make_tensor_map_bf16_nd(CUtensorMap* map, const void* ptr, int rank,
                                   const uint64_t* dims, const uint64_t* strides_bytes,
                                   const uint32_t* box, int swizzle_bytes) {
  return make_tensor_map_nd(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, ptr, rank, dims, strides_bytes,
                            box, swizzle_bytes);
}

inline int make_tensor_map_bf16_2d(CUtensorMap* map, const void* ptr, uint64_t rows, uint64_t cols,
                                   uint64_t row_pitch_elems, uint32_t box_rows, uint32_t box_cols,
                                   int swizzle_bytes) {
  const uint64_t dims[2] = {cols, rows};
  const uint64_t strides[1] = {row_pitch_elems * 2};
  const uint32_t box[2] = {box_cols, box_rows};
  return make_tensor_map_bf16_nd(map, ptr, 2, dims, strides, box, swizzle_bytes);
}

// A batch of `batches` row-major matrices [rows, cols], matrix b at ptr + b * batch_pitch_elems:
// coordinates {col, row, batch}; the box is box_rows x box_cols of one matrix.
inline int make_tensor_map_bf16_3d(CUtensorMap* map, const void* ptr, uint64_t batches,
                                   uint64_t rows, uint64_t cols, uint64_t row_pitch_elems,
                                   uint64_t batch_pitch_elems, uint32_t box_rows,
                                   uint32_t box_cols, int swizzle_bytes) {
  const uint64_t dims[3] = {cols, rows, batches};
  const uint64_t strides[2] = {row_pitch_elems * 2, batch_pitch_elems * 2};
  const uint32_t box[3] = {box_cols, box_rows, 1};
  return make_tensor_map_bf16_nd(map, ptr, 3, dims, strides, box, swizzle_bytes);
}

}  // namespace mk::host
