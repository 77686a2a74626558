// GEMM + AllReduce over several nodes: the plan of mkernel/ops/gemm_ar.py _make_plan_nodes
// (docs/rdma.md "Hierarchical ops"), R = W / N ranks per node. Tile t (owner o = t % W) is reduced
// in each node n by its reducer (n, local(o)):
//   compute   every rank red.adds its fp32 partial into its node's reducer's acc (tile_flag)
//   SEND      a reducer of another node than o's: acc -> xsend (acc back to zero); the template
//             puts xsend into slot n of o's xrecv (node_part[t, n])
//   FINALIZE  o: acc + the N - 1 node sums (node order from mine) in fp32, one bf16 rounding, into
//             its node's results (own first), acc to zero; the template puts o's result tile
//             into the xout of its rail peers (tile_ready[t] there)
//   FORWARD   a reducer of another node: the result that landed in xout, into its node's results
//   LANDED    waits only
#include "kernels/fused_host.cuh"

namespace mk {

template <class EngineT>
struct GemmARNodes {
  using Engine = EngineT;
  using Layout = spec::gemm_ar_nodes::Layout;
  using Args = FusedArgs<GemmARNodes>;
  static constexpr int kCommSmemBytes = 0;
  static constexpr bool kNodes = true;
  enum Kind { kSend, kFinalize, kForward, kLanded };  // gemm_ar.py SEND ..

  static __device__ gemm::Dest dest(const Args& a, const CtaInfo& cta, const Tile& t) {
    const Layout& l = a.layout;
    const int R = a.rdma.ranks_per_node;
    const int reducer = node_rank(cta.rank, R, t.tag % R);
    return gemm::Dest{l.acc.map(reducer) + (long long)t.m0 * l.n + t.n0, l.n, gemm::kReduceF32};
  }

  // Rank p's result: the symmetric result buffer in a distributed world (copied into out after
  // the kernel: out is no peer's memory), else p's slice of out (gemm_ar.cu out_of).
  static __device__ __nv_bfloat16* out_of(const Layout& l, int p) {
    return l.result.ptrs != nullptr ? l.result.map(p) : l.out.at(p);
  }

  // 8 bf16 (one 16-byte vector) into the results of my node's ranks, mine first.
  static __device__ void store_node(const Layout& l, int me, int R, long long at, uint4 v) {
    for (int j = 0; j < R; ++j) peer_store_v4(out_of(l, node_rank(me, R, (me + j) % R)) + at, v);
  }

  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char*) {
    const Layout& l = a.layout;
    const int kind = args[1];
    if (kind == kLanded) return;
    const int R = a.rdma.ranks_per_node, N = a.common.world_size / R, me = cta.rank;
    const Tile t = load_tile(a.common, args[0]);
    const long long base = (long long)t.m0 * l.n + t.n0;
    const int per_row = t.cols / 8;  // cols % 8 == 0
    float* acc = l.acc.map(me) + base;
    for (int v = team.lane; v < t.rows * per_row; v += team.size) {
      const long long off = (long long)(v / per_row) * l.n + (v % per_row) * 8;
      if (kind == kForward) {
        store_node(l, me, R, base + off,
                   __ldcg(reinterpret_cast<const uint4*>(l.xout.map(me) + base + off)));
        continue;
      }
      float4 x = __ldcg(reinterpret_cast<const float4*>(acc + off));
      float4 y = __ldcg(reinterpret_cast<const float4*>(acc + off + 4));
      __stcg(reinterpret_cast<float4*>(acc + off), make_float4(0.f, 0.f, 0.f, 0.f));
      __stcg(reinterpret_cast<float4*>(acc + off + 4), make_float4(0.f, 0.f, 0.f, 0.f));
      if (kind == kSend) {  // my node's sum, for the put
        float* send = l.xsend.map(me) + base + off;
        __stcg(reinterpret_cast<float4*>(send), x);
        __stcg(reinterpret_cast<float4*>(send + 4), y);
        continue;
      }
      const int node = me / R;
      for (int j = 1; j < N; ++j) {  // FINALIZE: + the other nodes' sums, in node order from mine
        const float* s = l.xrecv.map(me) + (long long)((node + j) % N) * l.m * l.n + base + off;
        const float4 u = __ldcg(reinterpret_cast<const float4*>(s));
        const float4 w = __ldcg(reinterpret_cast<const float4*>(s + 4));
        x = make_float4(x.x + u.x, x.y + u.y, x.z + u.z, x.w + u.w);
        y = make_float4(y.x + w.x, y.y + w.y, y.z + w.z, y.w + w.w);
      }
      store_node(l, me, R, base + off,
                 make_uint4(gemm::pack_bf16x2(x.x, x.y), gemm::pack_bf16x2(x.z, x.w),
                            gemm::pack_bf16x2(y.x, y.y), gemm::pack_bf16x2(y.z, y.w)));
    }
  }

  // SEND: my xsend tile into slot (my node) of the owner's xrecv; FINALIZE: my result tile into
  // the rail peer's xout. Both 2D (the tile's rows of an [*, N] matrix).
  static __device__ rdma::Put put_rect(const Args& a, const CtaInfo& cta, int role, int row,
                                       int dest) {
    rdma::Put p{};
    const int* args = a.common.role[role].args + row * kTaskArgs;
    if (role != kRoleComm || (args[1] != kSend && args[1] != kFinalize)) return p;
    const Layout& l = a.layout;
    const Tile t = load_tile(a.common, args[0]);
    const long long base = (long long)t.m0 * l.n + t.n0;
    const int me = cta.rank, R = a.rdma.ranks_per_node;
    p.rows = t.rows;
    if (args[1] == kSend) {
      p.src = l.xsend.map(me) + base;
      p.dst = l.xrecv.map(dest) + (long long)(me / R) * l.m * l.n + base;
      p.bytes = (unsigned long long)t.cols * sizeof(float);
      p.dst_pitch = p.src_pitch = (unsigned long long)l.n * sizeof(float);
    } else {
      p.src = out_of(l, me) + base;
      p.dst = l.xout.map(dest) + base;
      p.bytes = (unsigned long long)t.cols * sizeof(__nv_bfloat16);
      p.dst_pitch = p.src_pitch = (unsigned long long)l.n * sizeof(__nv_bfloat16);
    }
    return p;
  }

  static bool prepare(const long long*, Args& args) {
    const Layout& l = args.layout;
    args.out_mapped = false;  // the engine reduce-adds fp32; results are the comm role's stores
    return fill_engine_params<Engine>(args.common.ranks_here, args.engine, l.a.base,
                                      l.a.rank_stride, l.b.base, l.b.rank_stride, l.m, l.n,
                                      l.k_local);
  }
};

int launch_gemm_ar_nodes(const long long* rec, cudaStream_t s) {
  return launch_fused<GemmARNodes>(rec, s);
}

}  // namespace mk
