# %% [markdown]
# # Tutorial 04: ring attention on the CPU interpreter
#
# What you will learn, on `ring_attention` (forward; issue 12):
# 1. the two sequence layouts, and what each rank holds;
# 2. the ring as a plan: which K/V blocks each rank forwards, which (q tile, K/V tile) pairs it
#    computes, and how a causal mask removes tasks (and whole sends) from the tables;
# 3. running it in the interpreter (W = 4, both layouts, causal) against the unfused reference;
# 4. a protocol mistake the interpreter catches: a compute task that reads its slot without
#    waiting for the block to land;
# 5. the backward (issue 13): autograd through `ring_attention`, dK / dV partials on the ring.
#
# The plan printed here is the one the GPU runs too: on a GPU world the same call launches
# kernels/ring_attention.cu (the attention engine on the persistent template), which reads these
# tables; this tutorial stays on the CPU.

# %%
import copy
import dataclasses
import textwrap

import torch

import mkernel
from mkernel.interp.program import run_plan
from mkernel.ops import common
from mkernel.ops import ring_attention as ra
from mkernel.protocol import encode

W, B, S, HQ, HKV, D = 4, 1, 20, 4, 2, 64  # S_local = 20: not a multiple of the 16-row q tile

# %% [markdown]
# ## 1. Layouts
# "contiguous": rank r holds positions [r S, (r+1) S). "zigzag": the sequence in 2W chunks, rank r
# holds chunks r and 2W-1-r: one early, one late, so causal work is the same on every rank.

# %%
for layout in ("contiguous", "zigzag"):
    spans = []
    for r in range(W):
        p = ra.positions(r, W, S, layout == "zigzag")
        halves = [p] if layout == "contiguous" else [p[: S // 2], p[S // 2 :]]
        spans.append(" + ".join(f"{int(h[0])}..{int(h[-1])}" for h in halves))
    print(f"{layout:10s}: " + " | ".join(f"r{r} {s}" for r, s in enumerate(spans)))

# %% [markdown]
# ## 2. The ring as a plan
# At step s rank r holds the K/V block of rank (r - s) mod W (its own at step 0, else slot s - 1 of
# its W - 1 slots) and forwards it to slot s of rank r+1, in `parts` comm tasks that each add 1 to
# `landed[s+1]` there; every reader of a slot waits for `landed[s] == parts`. Each q tile has a
# chain of compute tasks, one per (step, K/V chunk) it sees, the masked diagonal first. All of a
# tile's tasks run on one unit (rows u, u + units, ... of the table are unit u's; empty tasks pad
# the shorter units), back to back while their blocks should have landed (`ra.chain_order`, with
# the cost model's arrival estimate; here, on the CPU, 1.5 steps, so some tiles are left and
# resumed); while a tile is left its online-softmax state waits in the `state` workspace, where
# the same unit left it (no signal needed). With a causal mask a contiguous ring
# never wraps: rank r needs only ranks 0..r, so the last rank sends nothing and rank 0 computes
# one step; zigzag gives every rank the same number of compute tasks.

# %%
world = mkernel.World.emulated(W)
g = torch.Generator().manual_seed(0)
q = torch.randn(W, B, S, HQ, D, generator=g).bfloat16()
k = torch.randn(W, B, S, HKV, D, generator=g).bfloat16()
v = torch.randn(W, B, S, HKV, D, generator=g).bfloat16()


def plan_of(causal: bool, layout: str):
    """The plan a call with these inputs runs (the default scale 1 / sqrt(D): its fp32 bits)."""
    shapes = ra.shapes(q, k, v, world, causal, layout)
    shapes.setdefault("scale_bits", ra.scale_bits(D**-0.5))
    return mkernel.Schedule().plan("ring_attention", world, **shapes)


def real(plan, rank: int):
    """Rank ``rank``'s compute tasks that are not empty pads."""
    return [t for t in plan.roles["compute"].tasks[rank] if plan.tiles[t.args[0]].rows]


for layout in ("contiguous", "zigzag"):
    plan = plan_of(True, layout)
    sends = plan.extra["sends"]
    tasks = [len(real(plan, r)) for r in range(W)]
    print(f"causal {layout}: sends per rank (steps) {sends}; compute tasks per rank {tasks}")
units, parts = plan.compute_units, plan.extra["parts"]
print(f"zigzag rank 1, unit 0 (of {units}); a block in {parts} comm task(s); unit 0's rows:")
for t in plan.roles["compute"].tasks[1][::units]:
    tile = plan.tiles[t.args[0]]
    if not tile.rows:  # an empty task: the unit is done
        break
    key, step, diag, first, last = ra.unpack_tag(tile.tag)
    flags = " ".join(n for n, f in (("diag", diag), ("first", first), ("last", last)) if f)
    waits = [(w.pad, w.index, w.value, w.consumers) for w in t.waits]
    print(f"  task {t.id}: q tile {key}, rows {tile.m0}.., step {step} {flags}; waits {waits}")

# %% [markdown]
# ## 3. Run it, checked against the unfused reference
# The reference gathers the whole sequence and runs fp32 softmax attention; ours merges one K/V
# tile at a time by log-sum-exp (online softmax, fp32 state) and rounds once to bf16, so the two
# differ by at most a bf16 rounding of the output.

# %%
for layout in ("contiguous", "zigzag"):
    out, lse = ra.ring_attention(q, k, v, world, causal=True, layout=layout)
    ref_out, ref_lse = mkernel.reference.ring_attention(q, k, v, world, True, None, layout)
    err = ((out.float() - ref_out.float()).abs() / (ref_out.float().abs() + 1e-3)).max().item()
    lse_err = (lse - ref_lse).abs().max().item()
    assert err < 2**-7 and lse_err < 1e-4
    pads = sum(int(p.abs().sum()) for p in world.signal_pads().values())
    print(f"{layout}: out within {err:.1e} (relative), lse within {lse_err:.1e}; pads {pads}")

# %% [markdown]
# ## 4. A mistake, caught
# Drop the `landed` wait of rank 1's step-1 compute tasks (the tables stay consistent enough to
# run). Nothing then orders rank 0's bulk copy into the slot before rank 1's reads of it.

# %%
plan = plan_of(False, "contiguous")
tasks = {role: copy.deepcopy(t.tasks) for role, t in plan.roles.items()}
for task in tasks["compute"][1]:
    if ra.unpack_tag(plan.tiles[task.args[0]].tag)[1] == 1 and task.waits:  # step 1
        task.waits = tuple(w for w in task.waits if w.pad != "landed")
roles = {r: encode(plan.spec, plan.sizes, t) for r, t in tasks.items()}  # the tables again
broken = dataclasses.replace(plan, roles=roles)
out = torch.full_like(q, float("nan"))
lse = torch.full((W, B, HQ, S), float("nan"))
scratch = mkernel.World.emulated(W)  # the broken run leaves flags behind: not on `world`
ws = common.workspace(scratch, broken)
bufs = ra.operands(broken, q, k, v, out, lse) | {n: b.local for n, b in ws.items() if b}
try:
    run_plan(scratch, broken, bufs, ra.twins_of(broken), 0, lambda r: ra.outputs(broken, r))
except mkernel.RaceError as e:
    where = "on the K/V slot" if "_ring[" in str(e) else "elsewhere (unexpected)"
    print("caught while running:", type(e).__name__, where)
    print(textwrap.indent(textwrap.fill(str(e), 96, subsequent_indent="  "), "  "))

# %% [markdown]
# ## 5. Backward (issue 13)
# `ring_attention` is differentiable: `out.backward(g)` runs `ring_attention_backward`. The K/V
# blocks travel the same ring; each rank reduce-adds its fp32 dK / dV contributions into a slot of
# the block it holds, and the comm role sends that partial on with the block; its last holder
# sends the sum home in bf16 (a row task of its compute units), and the block's owner stores dk,
# dv. dQ stays local.

# %%
from mkernel.ops import ring_attention_backward as rb  # noqa: E402

leaves = [x.clone().requires_grad_() for x in (q, k, v)]
out, lse = ra.ring_attention(*leaves, world, causal=True, layout="zigzag")
dout = torch.randn(out.shape, generator=g).bfloat16()
out.backward(dout)
ref = mkernel.reference.ring_attention_backward(
    dout, q, k, v, out, lse, world, True, None, "zigzag"
)
for name, leaf, want in zip("qkv", leaves, ref, strict=True):
    err = (leaf.grad.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < 2**-6, (name, err)  # ours uses the bf16 out for delta, the reference fp32
pads = sum(int(p.abs().sum()) for p in world.signal_pads().values())
shapes = rb.shapes(dout, q, k, v, out, lse, world, True, "contiguous")
plan = mkernel.Schedule().plan("ring_attention_backward", world, **shapes)


def sent(r: int) -> list[int]:
    """Steps whose partial rank r sends: on to the next holder (comm tasks, GRAD) or home to the
    block's owner (compute-role row tasks, HOME), in row parts."""
    on = {t.args[0] for t in plan.roles["comm"].tasks[r] if t.args[1] == rb.GRAD}
    tags = [plan.tiles[t.args[0]].tag for t in plan.roles["compute"].tasks[r]]
    home = {ra.unpack_tag(x)[1] for x in tags if x & rb.AUX and ra.unpack_tag(x)[0] == rb.HOME}
    return sorted(on | home)


sends = [sent(r) for r in range(world.size)]
print(f"backward: d{{q,k,v}} match the reference (autograd, fp32); pads {pads}")
print(f"  causal contiguous plan: grad sends per rank (steps) {sends}")
