// The K / V ring's send, one for the ring attention kernels that move K / V blocks around the ring
// (ring_attention.cu, ring_attention_backward.cu: the same slots, the same send tasks of their
// plans, mkernel/ops/ring_attention.py ring_sends).
#pragma once
#include "kernels/fused_host.cuh"
#include "primitives/bulk_ring.cuh"

namespace mk {

// Task (s, part, row0, rows): those rows of the K and V block held at step s (step 0: the rank's
// own k, v; later: its ring rows of step s) into rank r + 1's ring rows of step s + 1, by TMA
// (lane 0 alone, the op's CommRings ring); the template waits for the stores to land, then raises.
template <class Op>
__device__ __forceinline__ void send_kv_rows(const FusedArgs<Op>& a, const CtaInfo& cta,
                                             const int* args, const Team& team, char* smem) {
  if (team.lane != 0) return;
  const auto& l = a.layout;
  const int s = args[0];
  const long long cols = (long long)l.kv_heads * l.head_dim, block = (long long)l.batch * l.seq;
  const long long src_row = (s == 0 ? 0 : (s - 1) * block) + args[2];
  const long long dst_row = s * block + args[2];
  const long long bytes = (long long)args[3] * cols * 2;
  const int nxt = (cta.rank + 1) % a.common.world_size;
  const __nv_bfloat16* ks = s == 0 ? l.k.at(cta.local_rank) : l.k_ring.map(cta.rank);
  const __nv_bfloat16* vs = s == 0 ? l.v.at(cta.local_rank) : l.v_ring.map(cta.rank);
  Op::with_ring(a, smem, [&](const auto& ring) {
    ring.copy(reinterpret_cast<char*>(l.k_ring.map(nxt) + dst_row * cols),
              reinterpret_cast<const char*>(ks + src_row * cols), bytes, Drain::kStore);
    ring.copy(reinterpret_cast<char*>(l.v_ring.map(nxt) + dst_row * cols),
              reinterpret_cast<const char*>(vs + src_row * cols), bytes, Drain::kStore);
  });
}

}  // namespace mk
