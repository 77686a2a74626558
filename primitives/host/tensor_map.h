// tensor_map.h: host helper that encodes a CUtensorMap for a 2D bf16 row-major matrix, getting
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
// swizzle span (when swizzled), box sides in 1..256.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <cstdint>
#include <cstring>

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
  static PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                     cudaEnableDefault, &q);
#else
    cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

inline int make_tensor_map_bf16_2d(CUtensorMap* map, const void* ptr, uint64_t rows, uint64_t cols,
                                   uint64_t row_pitch_elems, uint32_t box_rows, uint32_t box_cols,
                                   int swizzle_bytes) {
  if (rows < 1 || cols < 1 || rows > (1ull << 32) || cols > (1ull << 32)) return kTensorMapBadShape;
  if ((reinterpret_cast<uintptr_t>(ptr) & 15) != 0) return kTensorMapMisalignedPointer;
  if (((row_pitch_elems * 2) & 15) != 0) return kTensorMapMisalignedPitch;
  CUtensorMapSwizzle sw;
  switch (swizzle_bytes) {
    case 0: sw = CU_TENSOR_MAP_SWIZZLE_NONE; break;
    case 32: sw = CU_TENSOR_MAP_SWIZZLE_32B; break;
    case 64: sw = CU_TENSOR_MAP_SWIZZLE_64B; break;
    case 128: sw = CU_TENSOR_MAP_SWIZZLE_128B; break;
    default: return kTensorMapBadSwizzle;
  }
  if (box_rows < 1 || box_rows > 256 || box_cols < 1 || box_cols > 256) return kTensorMapBadBox;
  if (swizzle_bytes != 0 && box_cols * 2 > (uint32_t)swizzle_bytes) return kTensorMapBadBox;
  if (((box_cols * 2) & 15) != 0) return kTensorMapBadBox;
  // NOTE: a call's operands are often the tensors of an earlier call (loops, the caching
  // allocator): the encoded map is a pure function of these inputs, so a small per-thread cache
  // saves the driver call (host time per launch matters for small calls).
  struct Entry {
    const void* ptr;
    uint64_t rows, cols, pitch;
    uint32_t box_rows, box_cols;
    int swizzle;
    CUtensorMap map;
  };
  thread_local Entry cache[64] = {};
  const uintptr_t h = (reinterpret_cast<uintptr_t>(ptr) >> 4) ^ (rows * 31 + cols) ^ box_rows;
  Entry& e = cache[(h ^ (h >> 6) ^ (h >> 12)) & 63];
  if (e.ptr == ptr && e.rows == rows && e.cols == cols && e.pitch == row_pitch_elems &&
      e.box_rows == box_rows && e.box_cols == box_cols && e.swizzle == swizzle_bytes) {
    std::memcpy(map, &e.map, sizeof(CUtensorMap));
    return kTensorMapOk;
  }
  PFN_cuTensorMapEncodeTiled_v12000 encode = get_encode_tiled();
  if (encode == nullptr) return kTensorMapNoDriverEntryPoint;
  cuuint64_t dims[2] = {cols, rows};
  cuuint64_t strides[1] = {row_pitch_elems * 2};  // bytes, for dims 1..rank-1
  cuuint32_t box[2] = {box_cols, box_rows};
  cuuint32_t elem_strides[2] = {1, 1};
  CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims,
                      strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, sw,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return kTensorMapEncodeFailed;
  e = Entry{ptr, rows, cols, row_pitch_elems, box_rows, box_cols, swizzle_bytes, {}};
  std::memcpy(&e.map, map, sizeof(CUtensorMap));
  return kTensorMapOk;
}

}  // namespace mk::host
