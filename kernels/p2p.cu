// Transfer primitives on their own: move `bytes` from a local buffer into `dst` (a peer's buffer,
// or local) with one primitive, driven by `ctas` CTAs. Used by the primitive self-tests (every
// mode's result checked against torch) and by the peer-bandwidth benchmark (GB/s against the
// number of SMs that drive the transfer).
//
//   mode 0 tile_send_bulk       generic loads -> smem -> TMA bulk copy into dst
//   mode 1 reduce_add_bulk_f32  generic loads -> smem -> TMA reduce-store add (fp32) into dst
//   mode 2 peer_store_v4        16-byte loads -> 16-byte stores into dst
//   mode 3 red_add_v4_f32       16-byte loads -> vector red.add (fp32) into dst
#include <cuda_runtime.h>

#include "kernels/p2p_launch.h"
#include "primitives/comm.cuh"

namespace mk {

constexpr int kStages = 4;  // staging buffers per CTA for the bulk modes

__global__ void p2p_kernel(const P2PLaunch L) {
  extern __shared__ __align__(128) char smem[];
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
      L.mode < 0 || L.mode > 3 || L.ctas < 1 || L.threads < 32)
    return 1;
  const int smem = L.mode < 2 ? kStages * L.chunk_bytes : 0;
  if (cudaFuncSetAttribute(p2p_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess)
    return 3;
  p2p_kernel<<<L.ctas, L.threads, smem, s>>>(L);
  return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

}  // namespace mk
