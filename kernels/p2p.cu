// Transfer primitives on their own: move `bytes` from a local buffer into `dst` (a peer's buffer,
// or local) with one primitive, driven by `ctas` CTAs. Used by the primitive self-tests (every
// mode's result checked against torch) and by the peer-bandwidth benchmark (GB/s against the
// number of SMs that drive the transfer).
//
//   mode 0 tile_send_bulk       generic loads -> smem -> TMA bulk copy into dst
//   mode 1 reduce_add_bulk_f32  generic loads -> smem -> TMA reduce-store add (fp32) into dst
//   mode 2 peer_store_v4        16-byte loads -> 16-byte stores into dst
//   mode 3 red_add_v4_f32       16-byte loads -> vector red.add (fp32) into dst
//   mode 4 send_from_smem       tiles already in shared memory (an epilogue's) -> bulk stores, up
//                               to kRingStages in flight: CTA b fills its kRingStages buffers once
//                               from src chunks b * kRingStages + i, then its j-th chunk of dst
//                               (chunk b + j * ctas) gets buffer j % kRingStages
//   mode 5 ring_copy            BulkRing: bulk loads -> bulk stores, one thread (dst = src)
//   mode 6 ring_reduce_bf16     BulkRing: bulk loads -> bf16 reduce-stores (dst += src)
//   mode 7 ring_reduce_f32      BulkRing: bulk loads -> fp32 reduce-stores (dst += src)
// Modes 5-7 give each CTA one contiguous range of whole chunks (moved by two copies).
#include <cuda_runtime.h>

#include "kernels/p2p_launch.h"
#include "primitives/bulk_ring.cuh"
#include "primitives/comm.cuh"

namespace mk {

constexpr int kStages = 4;      // staging buffers per CTA for modes 0, 1
constexpr int kRingStages = 8;  // modes 4-7
constexpr int kRingStores = 4;  // modes 5-7: stores in flight (the other buffers load)

__device__ void send_from_smem(const P2PLaunch& L, char* smem) {
  const long long chunks = (L.bytes + L.chunk_bytes - 1) / L.chunk_bytes;
  const char* src = reinterpret_cast<const char*>(L.src);
  auto size_of = [&](long long c) {
    return (int)min((long long)L.chunk_bytes, L.bytes - c * L.chunk_bytes);
  };
  for (int i = 0; i < kRingStages; ++i) {  // the "epilogue": this CTA's tiles, once
    const long long c = (long long)blockIdx.x * kRingStages + i;
    if (c >= chunks) break;
    const uint4* s = reinterpret_cast<const uint4*>(src + c * L.chunk_bytes);
    uint4* d = reinterpret_cast<uint4*>(smem + i * L.chunk_bytes);
    for (int v = threadIdx.x; v < size_of(c) / 16; v += blockDim.x) d[v] = s[v];
  }
  fence_proxy_async_smem();
  __syncthreads();
  if (threadIdx.x != 0) return;
  char* dst = reinterpret_cast<char*>(L.dst);
  long long j = 0;
  for (long long c = blockIdx.x; c < chunks; c += gridDim.x, ++j) {
    const int i = (int)(j % kRingStages);
    const long long from = (long long)blockIdx.x * kRingStages + i;  // clipped like the fill
    const int n = min(size_of(c), from < chunks ? size_of(from) : 0);
    bulk_wait_read_n<kRingStages - 1>();  // as an epilogue would before rewriting a buffer
    if (n > 0) tile_send_bulk(dst + c * L.chunk_bytes, smem + i * L.chunk_bytes, n);
    bulk_commit();
  }
  bulk_wait_all();
}

__device__ void ring_copy(const P2PLaunch& L, char* smem) {
  if (threadIdx.x != 0) return;
  const long long chunks = (L.bytes + L.chunk_bytes - 1) / L.chunk_bytes;
  const long long per = (chunks + gridDim.x - 1) / gridDim.x;
  const long long off = min((long long)blockIdx.x * per * L.chunk_bytes, L.bytes);
  const long long bytes = min(per * L.chunk_bytes, L.bytes - off);
  BulkRing<kRingStages, kRingStores> ring{
      smem, reinterpret_cast<uint64_t*>(smem + kRingStages * L.chunk_bytes), L.chunk_bytes};
  ring.init();
  const Drain drain = L.mode == 5   ? Drain::kStore
                      : L.mode == 6 ? Drain::kReduceAddBf16
                                    : Drain::kReduceAddF32;
  // two copies (the first of an odd number of chunks, when it can), so the second starts
  // mid-ring: the self-tests cover buffer and phase bookkeeping across copies
  const long long first = min(bytes, (per / 2 | 1) * (long long)L.chunk_bytes);
  char* dst = reinterpret_cast<char*>(L.dst) + off;
  const char* src = reinterpret_cast<const char*>(L.src) + off;
  if (first > 0) ring.copy(dst, src, first, drain);
  if (bytes > first) ring.copy(dst + first, src + first, bytes - first, drain);
  ring.landed();
}

__global__ void p2p_kernel(const P2PLaunch L) {
  extern __shared__ __align__(128) char smem[];
  if (L.mode == 4) return send_from_smem(L, smem);
  if (L.mode >= 5) return ring_copy(L, smem);
  const long long chunks = (L.bytes + L.chunk_bytes - 1) / L.chunk_bytes;
  const char* src = reinterpret_cast<const char*>(L.src);
  char* dst = reinterpret_cast<char*>(L.dst);
  int buf = 0;
  for (long long c = blockIdx.x; c < chunks; c += gridDim.x, buf = (buf + 1) % kStages) {
    const long long off = c * L.chunk_bytes;
    const int n = (int)min((long long)L.chunk_bytes, L.bytes - off);
    const uint4* s = reinterpret_cast<const uint4*>(src + off);
    if (L.mode == 2) {
      copy_v4_team(reinterpret_cast<uint4*>(dst + off), s, n / 16, threadIdx.x, blockDim.x);
      continue;
    }
    if (L.mode == 3) {
      for (int v = threadIdx.x; v < n / 16; v += blockDim.x) {
        const uint4 x = s[v];
        red_add_v4_f32(reinterpret_cast<float*>(dst + off) + 4 * v,
                       make_float4(__uint_as_float(x.x), __uint_as_float(x.y), __uint_as_float(x.z),
                                   __uint_as_float(x.w)));
      }
      continue;
    }
    char* stage = smem + buf * L.chunk_bytes;
    if (threadIdx.x == 0) bulk_wait_read_n<kStages - 1>();  // the op that used this buffer last
    __syncthreads();
    for (int v = threadIdx.x; v < n / 16; v += blockDim.x)
      reinterpret_cast<uint4*>(stage)[v] = s[v];
    fence_proxy_async_smem();
    __syncthreads();
    if (threadIdx.x == 0) {
      if (L.mode == 0) {
        tile_send_bulk(dst + off, stage, n);
      } else {
        reduce_add_bulk_f32(reinterpret_cast<float*>(dst + off), reinterpret_cast<float*>(stage),
                            n);
      }
      bulk_commit();
    }
  }
  if (threadIdx.x == 0) bulk_wait_all();
}

int launch_p2p(const P2PLaunch& L, cudaStream_t s) {
  if (L.bytes <= 0 || L.bytes % 16 || L.src % 16 || L.dst % 16 || L.chunk_bytes % 16 ||
      L.mode < 0 || L.mode > 7 || L.ctas < 1 || L.threads < 32 || L.chunk_bytes < 16)
    return 1;
  const int smem = L.mode < 2    ? kStages * L.chunk_bytes
                   : L.mode == 4 ? kRingStages * L.chunk_bytes
                   : L.mode >= 5 ? kRingStages * L.chunk_bytes + 8 * kRingStages
                                 : 0;
  if (smem > 227 * 1024) return 1;
  if (cudaFuncSetAttribute(p2p_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess)
    return 3;
  p2p_kernel<<<L.ctas, L.threads, smem, s>>>(L);
  return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

}  // namespace mk
