# %% [markdown]
# # Tutorial 06: fused ops across nodes, with rdma puts
#
# What you will learn:
# 1. a world of several nodes: `World.emulated(W, nodes=N)` splits the ranks into N nodes that
#    share no memory; `world.node_of(rank)`;
# 2. the same API runs a hierarchical plan: within a node data moves by NVLink stores, across
#    nodes only by rdma puts (put-with-signal through each rank's ring and host proxy);
# 3. what the interpreter checks: a plan that touches another node's memory is refused, and a
#    proxy that signals before its copy landed is a race.
#
# Runs on a laptop (the CPU interpreter). On one GPU the same plans run as kernels/<op>_nodes.cu
# with a host proxy thread per rank, whose copies share one stream kept out of the launching
# stream's hardware queue (docs/rdma.md "On the GPU").

# %%
import torch

import mkernel
from mkernel.interp import program, rdma

# %% [markdown]
# ## 1. Four ranks on two nodes
# Ranks 0, 1 are node 0 and ranks 2, 3 node 1. Rank r's *rail peers* have its local index on the
# other nodes (rank 0's is rank 2): every cross-node transfer runs along a rail.

# %%
W, N = 4, 2
world = mkernel.World.emulated(W, nodes=N)
print("nodes of ranks", [world.node_of(r) for r in range(W)])

# %% [markdown]
# ## 2. gemm_rs, ag_gemm and gemm_ar, unchanged calls
# gemm_rs reduces each tile within a node first (the owner's rail peer adds its node's partials)
# and puts one node sum across; ag_gemm puts each chunk across once and the rail peer forwards it
# within its node; gemm_ar does both. Each result is checked against the unfused reference.

# %%
g = torch.Generator().manual_seed(0)
for op, rows in (("gemm_rs", W * 32), ("ag_gemm", 24), ("gemm_ar", 40)):
    a = torch.randn(W, rows, 32, generator=g).bfloat16()
    b = torch.randn(W, 32, 48, generator=g).bfloat16()
    out = getattr(mkernel, op)(a, b, world=world)
    ref = getattr(mkernel.reference, op)(a, b, world=world).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 2**-8, (op, err)
    print(f"{op}: relative error {err:.1e} (bf16 rounding)")

plan = mkernel.Schedule().plan("gemm_rs", world, m=W * 32, n=48, k=32 * W)
print(str(plan).splitlines()[0])

# %% [markdown]
# ## 3. What crosses a node
# The plan's tasks name every raise; one on a rank of another node is posted as a put that carries
# the bytes the task wrote (put-with-signal). Count them per rank: each rank's arrival at its rail
# peer, then one node sum per tile it reduces for the rail peer's rows.

# %%
R = W // N
puts = [
    sum(1 for role in ("compute", "comm") for t in plan.roles[role].tasks[r]
        for x in t.raises if x.rank // R != r // R)
    for r in range(W)
]  # fmt: skip
print("puts per rank and call", puts)

# %% [markdown]
# ## 4. The interpreter's checks
# A proxy that raises the signal before its copy has landed: the owner reads its stage slot
# before the bytes are there, a race the interpreter reports with the buffer's name.

# %%
real = program.proxy
program.proxy = lambda ring, count: rdma.proxy(ring, count, signal_early=True)
try:
    a = torch.randn(W, W * 32, 32, generator=g).bfloat16()
    b = torch.randn(W, 32, 48, generator=g).bfloat16()
    mkernel.gemm_rs(a, b, world=mkernel.World.emulated(W, nodes=N))
except mkernel.RaceError as e:
    print("caught while running: RaceError,", str(e).split(": ", 1)[1])
finally:
    program.proxy = real
