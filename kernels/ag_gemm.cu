// AllGather + GEMM: out[r] = all_gather(A) @ B_r, with A's shards pushed chunk by chunk.
//
// Protocol (the plan's tables, mkernel/ops/ag_gemm.py): every rank's shard [Ms, K] is cut into C
// chunks of CR rows (the last one may be short); global chunk g = src * C + c. Rank r's comm tasks
// push (g, p) = one own chunk into rank p's gather buffer, chunk-major (own copy first, then r+1,
// ...); the template raises chunk_ready[g] on p once the copy landed. Before the engine loads a
// compute tile the template waits for every chunk its rows overlap; chunk_ready is a counted pad
// (every tile over chunk g consumes it; the last one resets flag and counter).
//
//   W = 2, C = 2; gather rows on each rank: [ s0c0 s0c1 | s1c0 s1c1 ]
//   rank 0 comm:    s0c0 -> r0, r1; s0c1 -> r0, r1           (chunk_ready[0], [1] on each)
//   rank 1 comm:    s1c0 -> r1, r0; s1c1 -> r1, r0           (chunk_ready[2], [3] on each)
//   rank 0 compute: tiles of rows s0 (wait chunk_ready[0..1]), then rows s1 (wait [2..3])
#include "kernels/ag_gemm.cuh"

namespace mk {

template <class EngineT>
struct AgGemm : AgGemmMoves<EngineT> {
  using Layout = spec::ag_gemm::Layout;
  using Args = FusedArgs<AgGemm>;

  // Task (g, p): own chunk g (of src = this rank) into rank p's gather buffer.
  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char* smem) {
    const Layout& l = a.layout;
    const ChunkSpan c = chunk_span(args[0], cta.rank, l.chunks, l.chunk_rows, l.ms);
    const __nv_bfloat16* src = l.a.at(cta.local_rank) + (long long)c.shard_row * l.k;
    __nv_bfloat16* dst = l.gather.map(args[1]) + (long long)c.gather_row * l.k;
    AgGemm::move_rows(a, team, smem, src, dst, c.rows);
  }
};

int launch_ag_gemm(const long long* rec, cudaStream_t s) { return launch_fused<AgGemm>(rec, s); }

}  // namespace mk
