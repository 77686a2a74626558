# %% [markdown]
# # Tutorial 07: many ops in one launch with `mkernel.TaskGraph`
#
# What you will learn:
# 1. how to build a graph of ops (`rmsnorm`, `linear`, `silu_mul`, `add`, `attention_decode`,
#    `all_reduce`, ...) on bf16 values, compile it and call it;
# 2. what it is cut into: tasks that are tiles of the ops, each waiting only for the tiles it
#    reads (a down-projection tile waits for the SiLU tiles of its rows, not the whole op);
# 3. how the CPU interpreter checks the lowering: a wait the lowering forgot is a RaceError;
# 4. a Llama / Qwen3-shaped decode step (`mkernel.models`), alone and with tensor parallelism
#    over an emulated world, against plain torch; and where a launch's time goes, per node.
#
# Everything runs on the CPU interpreter. With the weights on a GPU, the same `g.compile()` is one
# persistent launch per call (docs/megakernel.md).

# %%
import torch

import mkernel
from mkernel import models
from mkernel.taskgraph.compiled import compile_graph
from mkernel.taskgraph.probe import node_times

bf16 = torch.bfloat16
gen = torch.Generator().manual_seed(0)


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(bf16)


# %% [markdown]
# ## 1. A graph, compiled and called
# An MLP block: y = x + down(silu(gate(norm(x))) * up(norm(x))). Weights are given at build time
# (torch's [out, in] layout); `g.input` declares what each call passes. `k.reference` evaluates
# the same graph op by op in fp32 (each value rounded to bf16 as the tasks store it).

# %%
B, H, F = 8, 64, 96
g = mkernel.TaskGraph()
x = g.input("x", (B, H))
n = g.rmsnorm(x, 1 + 0.1 * randn(H))
gate_up = g.linear(n, randn(2 * F, H, scale=H**-0.5))  # [gate; up] rows: silu_mul splits them
s = g.silu_mul(gate_up)
y = g.linear(s, randn(H, F, scale=F**-0.5), residual=x)
g.output("y", y)
k = g.compile()  # CPU tensors: the CPU interpreter
x_in = randn(B, H)
out = k(x=x_in)["y"]
ref = k.reference(x=x_in)["y"]
err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
print(f"MLP block: relative error {err:.1e} against the op-by-op reference")
assert err < 2.0**-7

# %% [markdown]
# ## 2. Tasks and their dependencies
# Each op is cut into tiles (4 rows x 32 columns in the interpreter); task i is one tile. A task
# depends on exactly the tiles that overlap what it reads: `k.lowered.deps[rank][i]` lists them
# as (rank, task).

# %%
low = k.lowered
ops = [low.nodes[t.node].op for t in low.tasks[0]]
silu = [j for j, op in enumerate(ops) if op == "silu_mul"]
print("tasks per op:", {op: ops.count(op) for op in dict.fromkeys(ops)})
down = ops.index("linear", ops.index("silu_mul"))  # the first down-projection tile
print(f"task {down}: {low.describe(down)}")
print("  waits for:", [low.describe(j) for _, j in low.deps[0][down]])
print(f"  {len(low.deps[0][down])} of the {len(silu)} silu_mul tiles: those of its rows")

# %% [markdown]
# ## 3. A forgotten wait is caught
# `compile_graph(..., drop=)` is a debug hook that removes waits from the plan, as a lowering bug
# would. The interpreter runs the tasks in random interleavings and reports the read of a tile
# that no completed wait covers.

# %%
units = k.plan.compute_units
producer = next(j for j in silu if j % units != down % units)  # a tile another unit writes
broken = compile_graph(g, drop=lambda rank, task, peer, j: task == down and j == producer)
try:
    broken(x=x_in)
except mkernel.RaceError as e:
    print("caught while running: RaceError:", str(e).splitlines()[0][:90])

# %% [markdown]
# On the GPU kernel, norms and SiLUs read by one linear alone are computed by that linear's tasks
# (`fuse`, its default there). The interpreter runs that lowering too:

# %%
fused = compile_graph(g, fuse=True)
print("fused nodes:", [fused.lowered.nodes[i].op for i in fused.lowered.live])
err = ((fused(x=x_in)["y"].float() - ref).abs().max() / ref.abs().max()).item()
print(f"fused: relative error {err:.1e}")
assert err < 2.0**-6  # the fused path rounds in other places (the norm is not stored)

# %% [markdown]
# ## 4. A decode step, alone and tensor-parallel
# `models.decode_graph` builds pre-norm GQA attention over a KV cache and a SwiGLU MLP per layer;
# `models.torch_decode` is the plain fp32 torch step it is checked against. With a World, rank r
# holds its shards (Megatron's split: column-parallel q / gate / up, row-parallel o / down, each
# followed by `all_reduce`); inputs and outputs carry a leading rank dimension.

# %%
cfg = models.DecoderConfig(layers=2)
layers, final = models.random_decoder(cfg, batch=2, seq=16, seed=1)
x_in = randn(2, cfg.hidden)
want = models.torch_decode(cfg, layers, final, x_in, 12)
for world in (None, mkernel.World.emulated(2)):
    step = models.decode_graph(cfg, layers, final, batch=2, length=12, world=world)
    got = step.compile()(x=x_in)["y"].float()
    got = got if world is None else got[1]  # every rank holds the result
    err = ((got - want).abs().max() / want.abs().max()).item()
    where = "one device" if world is None else f"TP over {world.size} emulated ranks"
    print(f"decode step, {where}: relative error {err:.1e} against torch")
    assert err < 2.0**-5  # bf16 values through 2 layers against fp32

# %% [markdown]
# Where a launch's time goes: one traced launch (`Schedule(trace=True)`), per node, how long its
# tasks ran once their inputs were ready and what the node adds to the launch (interpreter ticks
# here, ns on a GPU: `python -m mkernel.taskgraph.probe --trace`).

# %%
step = models.decode_graph(cfg, layers[:1], final, batch=2, length=12)
print(f"{'op':18} {'tasks':>5} {'run':>5} {'adds':>5}")
for row in node_times(step, {"x": x_in}):
    print(f"{row['op']:18} {row['tasks']:5} {row['run_median_ns']:5.0f} {row['adds_ns']:5.0f}")
