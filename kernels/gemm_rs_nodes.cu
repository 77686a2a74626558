// GEMM + ReduceScatter over several nodes: the plan of mkernel/ops/gemm_rs.py _make_plan_nodes
// (docs/rdma.md "Hierarchical ops"), R = W / N ranks per node, rank r = (node r / R, local r % R).
//
// What rank `me` does with its partial of a tile of owner o (gemm_rs.py _kind):
//   to owner     o in my node: fp32 partial into my slot of o's stage (bulk copies, NVLink)
//   to agg       o in another node: into my slot of the stage of o's rail peer in my node
//   aggregate    I am o's rail peer: my partial + my node peers' (R - 1 slots of my stage) in
//                fp32 into my xsend, then an rdma put of it into o's stage (the template posts it
//                with the task's raise node_part[u, my node]: put-with-signal, put_rect below)
//   own          my partial + R - 1 node peers' partials + N - 1 node sums: R + N - 2 consecutive
//                slots of my stage (stage_slot), added in the epilogue before the one bf16 store
// No memory of another node is touched: the entry barrier spans the node (kNodes), and every
// byte or flag that crosses goes through the rank's ring to the host proxy.
#include "kernels/gemm_rs.cuh"

namespace mk {

// gemm_rs.py stage_slot (tested against it): the slot of reducer me's stage that src's
// contribution to a tile of owner (me or me's rail peer) lands in.
MK_HD inline int rs_stage_slot(int R, int N, int me, int src, int owner) {
  const int node = me / R, src_node = src / R;
  if (src_node != node) return (R - 1) + ((src_node - node) % N + N) % N - 1;  // a node sum
  const int lo = ((src - me) % R + R) % R, mo = ((owner / R - node) % N + N) % N;
  return mo == 0 ? lo - 1 : (R - 1) + (N - 1) + (mo - 1) * (R - 1) + lo - 1;
}

template <class EngineT>
struct GemmRSNodes {
  using Engine = EngineT;
  using Layout = spec::gemm_rs_nodes::Layout;
  using Args = FusedArgs<GemmRSNodes>;
  static constexpr int kCommSmemBytes = 0;
  static constexpr bool kNodes = true;
  enum Kind { kToOwner, kToAgg, kAggregate, kOwn };  // gemm_rs.py TO_OWNER ..

  static __device__ int kind(int R, int me, int o) {
    if (o == me) return kOwn;
    if (o / R == me / R) return kToOwner;
    return o % R == me % R ? kAggregate : kToAgg;
  }

  static __device__ gemm::Dest dest(const Args& a, const CtaInfo& cta, const Tile& t) {
    const Layout& l = a.layout;
    const int R = a.rdma.ranks_per_node, N = a.common.world_size / R, me = cta.rank, o = t.tag;
    const long long slot = (long long)l.rows_per_rank * l.n;  // elements per stage slot
    const int row0 = t.m0 - o * l.rows_per_rank;
    const long long off = (long long)row0 * l.n + t.n0;
    const int k = kind(R, me, o);
    if (k == kToOwner || k == kToAgg) {
      const int reducer = k == kToOwner ? o : node_rank(me, R, o % R);
      float* to = l.stage.map(reducer) + rs_stage_slot(R, N, reducer, me, o) * slot + off;
      return gemm::Dest{to, l.n, gemm::kStoreF32Bulk};
    }
    float* stage = l.stage.map(me);
    if (k == kAggregate) {  // my node's sum, in fp32, into my xsend slot of o's node
      gemm::Dest d{l.xsend.map(me) + (o / R) * slot + off, l.n, gemm::kStoreF32Bulk};
      if (R > 1) {
        const int first = rs_stage_slot(R, N, me, node_rank(me, R, (me + 1) % R), o);
        d.add_from = stage + first * slot + off;
        d.add_stride = slot;
        d.add_count = R - 1;
      }
      return d;
    }
    gemm::Dest d =
        bf16_out_dest(a, cta.local_rank, l.out.at(cta.local_rank) + off, l.n, row0, t.n0);
    d.add_from = stage + off;  // slots 0 .. R + N - 3: node peers' partials, then node sums
    d.add_stride = slot;
    d.add_count = R + N - 2;
    return d;
  }

  // The bytes of an aggregate's put: its xsend tile into the owner's stage slot of my node.
  // The comm role's tasks (the rail arrivals) carry none.
  static __device__ rdma::Put put_rect(const Args& a, const CtaInfo& cta, int role, int row,
                                       int dest) {
    rdma::Put p{};
    if (role != kRoleCompute) return p;
    const Layout& l = a.layout;
    const Tile t = load_tile(a.common, task_id(a.common, kRoleCompute, row));
    const int R = a.rdma.ranks_per_node, N = a.common.world_size / R, me = cta.rank;
    const long long slot = (long long)l.rows_per_rank * l.n;
    const long long off = (long long)(t.m0 - t.tag * l.rows_per_rank) * l.n + t.n0;
    p.src = l.xsend.map(me) + (t.tag / R) * slot + off;
    p.dst = l.stage.map(dest) + rs_stage_slot(R, N, dest, me, dest) * slot + off;
    p.rows = t.rows;
    p.bytes = (unsigned long long)t.cols * sizeof(float);
    p.dst_pitch = p.src_pitch = (unsigned long long)l.n * sizeof(float);
    return p;
  }

  // No comm data movement: the comm role only arrives at the rail peers (raises, as puts).
  static __device__ void comm_move(const Args&, const CtaInfo&, const int*, const Team&, char*) {}

  static bool prepare(const long long*, Args& args) { return prepare_rs<Engine>(args); }
};

int launch_gemm_rs_nodes(const long long* rec, cudaStream_t s) {
  return launch_fused<GemmRSNodes>(rec, s);
}

}  // namespace mk
