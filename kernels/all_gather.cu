// AllGather (standalone): out[r] = cat over ranks q of x_q, on every rank r. The op of
// tutorials/03_author_a_fused_op.py; protocol and picture in mkernel/ops/all_gather.py.
//
// The plan's comm tasks carry (kind, chunk, dest): a push copies own chunk `chunk` into rank dest's
// result with 16-byte stores (the template then raises landed[me][chunk] there); a wait task moves
// nothing (its wait is the task). There is no compute: the op runs on the comm-only engine
// (templates/no_compute.cuh), whose CTAs hold no GEMM registers or shared memory.
#include "kernels/fused_host.cuh"

namespace mk {

struct AllGather {
  using Engine = NoCompute<384>;  // 384 threads: the same comm team as a GEMM engine's CTA
  using Layout = spec::all_gather::Layout;
  using Args = FusedArgs<AllGather>;
  static constexpr int kCommSmemBytes = 0;
  static constexpr int kPush = 0;

  static __device__ Engine::Dest dest(const Args&, const CtaInfo&, const Tile&) {
    return {};  // never called: no compute tasks
  }

  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char*) {
    if (args[0] != kPush) return;
    const Layout& l = a.layout;
    const int chunk = args[1], dest = args[2];
    const int r0 = chunk * l.chunk_rows, rows = min(l.chunk_rows, l.rows - r0);
    const __nv_bfloat16* src = l.x.at(cta.local_rank) + (long long)r0 * l.cols;
    __nv_bfloat16* result = l.result.ptrs != nullptr ? l.result.map(dest) : l.out.at(dest);
    __nv_bfloat16* dst = result + ((long long)cta.rank * l.rows + r0) * l.cols;
    copy_v4_team(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src),
                 (long long)rows * l.cols / 8, team.lane, team.size);
  }

  static bool prepare(const long long*, Args&) { return true; }  // no engine params, no maps
};

int launch_all_gather(const long long* rec, cudaStream_t s) {
  return launch_persistent<AllGather>(rec, s);  // one engine: no tile config to dispatch on
}

}  // namespace mk
