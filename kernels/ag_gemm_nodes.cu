// AllGather + GEMM over several nodes: the plan of mkernel/ops/ag_gemm.py _make_plan_nodes
// (docs/rdma.md "Hierarchical ops"), R = W / N ranks per node. Comm task kinds (args[2]):
//   ARRIVE   my call began: raises rail_ready on my rail peers (puts of no bytes)
//   PUT      own chunk g to rail peer q: nothing moves here; the template posts the put of
//            put_rect (a's rows -> q's gather) carrying chunk_ready[g] on q
//   PUSH     own chunk g into node peer p's gather (or my own): as the one-node kernel
//   FORWARD  a rail peer's chunk g, landed in my gather, into node peer p's gather
// The compute role is the one-node kernel's: tiles wait for the chunks their rows need.
#include "kernels/ag_gemm.cuh"

namespace mk {

template <class EngineT>
struct AgGemmNodes : AgGemmMoves<EngineT> {
  using Layout = spec::ag_gemm_nodes::Layout;
  using Args = FusedArgs<AgGemmNodes>;
  static constexpr bool kNodes = true;
  enum Kind { kPush, kPut, kForward, kArrive };  // ag_gemm.py PUSH ..

  // Chunk g of its source shard (g / chunks: me for a push, a rail peer for a forward).
  static __device__ ChunkSpan span_of(const Layout& l, int g) {
    return chunk_span(g, g / l.chunks, l.chunks, l.chunk_rows, l.ms);
  }

  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char* smem) {
    const Layout& l = a.layout;
    const int kind = args[2];
    if (kind != kPush && kind != kForward) return;  // arrivals and puts: the template's raises
    const ChunkSpan c = span_of(l, args[0]);
    const __nv_bfloat16* src = kind == kPush
                                   ? l.a.at(cta.local_rank) + (long long)c.shard_row * l.k
                                   : l.gather.map(cta.rank) + (long long)c.gather_row * l.k;
    __nv_bfloat16* dst = l.gather.map(args[1]) + (long long)c.gather_row * l.k;
    AgGemmNodes::move_rows(a, team, smem, src, dst, c.rows);
  }

  // A PUT task's bytes: my chunk's rows of a into the same rows of the rail peer's gather (one
  // contiguous run). Arrivals carry none.
  static __device__ rdma::Put put_rect(const Args& a, const CtaInfo& cta, int role, int row,
                                       int dest) {
    rdma::Put p{};
    const int* args = a.common.role[role].args + row * kTaskArgs;
    if (role != kRoleComm || args[2] != kPut) return p;
    const Layout& l = a.layout;
    const ChunkSpan c = span_of(l, args[0]);
    p.src = l.a.at(cta.local_rank) + (long long)c.shard_row * l.k;
    p.dst = l.gather.map(dest) + (long long)c.gather_row * l.k;
    p.bytes = (unsigned long long)c.rows * l.k * sizeof(__nv_bfloat16);
    return p;
  }
};

int launch_ag_gemm_nodes(const long long* rec, cudaStream_t s) {
  return launch_fused<AgGemmNodes>(rec, s);
}

}  // namespace mk
