# %% [markdown]
# # Tutorial 01: send, signal, wait — then GEMM+ReduceScatter with two schedules
#
# What you will learn:
# 1. how a rank hands a tile to a peer with the three primitives every fused kernel is made of:
#    `tile_send` (move the data), `signal_set_release` (publish it), `wait_acquire_reset`
#    (consume it);
# 2. how the CPU interpreter runs such programs with virtual ranks and SMs in a random interleaving,
#    and catches a missing wait as a race;
# 3. how one fused op (`mkernel.gemm_rs`) runs under two schedules, intra-SM and inter-SM overlap,
#    without any change to its programs, and what each timeline looks like; and what inter-SM
#    overlap means where an op has communication tasks (`mkernel.ag_gemm`'s all-gather).
#
# Runs on a laptop: everything here uses the CPU interpreter.

# %%
import torch

import mkernel
from mkernel.interp import twins
from mkernel.interp.machine import Machine

# %% [markdown]
# ## 1. Two ranks exchange a tile
# Rank 0 sends a 4x4 tile into rank 1's buffer `x` and raises flag `f[1][0]`. Rank 1 waits for the
# flag (acquire), consumes it (resets it to 0, so the pad is clean for the next call), and copies
# the tile it received into its output rows. Each program is a Python generator: every primitive is
# a point where the interpreter may switch to another agent.

# %%
W = 2
pads = {"f": torch.zeros(W, 1, dtype=torch.int32)}  # a signal pad per rank
bufs = {"x": torch.zeros(W, 8, 4)}  # rows 0..3: landing zone, rows 4..7: output


def sender(ctx, task):
    tile = torch.arange(16.0).reshape(4, 4)
    yield from twins.tile_send(ctx, "x", 1, (0, 4, 0, 4), tile)  # into rank 1's x
    yield from twins.signal_set_release(ctx, ctx.sig("f", 1, 0))  # release: the data first


def receiver(ctx, task):
    yield from twins.wait_acquire_reset(ctx, ctx.sig("f", 1, 0), 1, peer=0)
    tile = yield from twins.tile_load(ctx, "x", 1, (0, 4, 0, 4))
    yield from twins.output_store(ctx, "x", 1, (4, 4, 0, 4), tile, tile=0)


for seed in range(5):  # five interleavings, same result
    pads["f"].zero_()
    bufs["x"].zero_()
    m = Machine(W, pads, bufs, seed=seed)
    m.add_agent(0, "comm", 0, [0], sender)
    m.add_agent(1, "comm", 0, [0], receiver)
    m.run()
    assert torch.equal(bufs["x"][1, 4:], torch.arange(16.0).reshape(4, 4))
    assert int(pads["f"].sum()) == 0
print("exchange: correct in 5 interleavings, signal pad back to 0")

# %% [markdown]
# Drop the wait and the interpreter reports the race, naming rank, task and data:


# %%
def careless_receiver(ctx, task):
    tile = yield from twins.tile_load(ctx, "x", 1, (0, 4, 0, 4))
    yield from twins.output_store(ctx, "x", 1, (4, 4, 0, 4), tile, tile=0)


bufs["x"].zero_()
m = Machine(W, pads, bufs, seed=0)
m.add_agent(0, "comm", 0, [0], sender)
m.add_agent(1, "comm", 0, [0], careless_receiver)
try:
    m.run()
    raise AssertionError("the race was not caught")
except mkernel.RaceError as e:
    print("caught:", e)

# %% [markdown]
# ## 2. GEMM+ReduceScatter, two schedules
# Each rank multiplies its `a [M, K/W]` by `b [K/W, N]`; the sum over ranks is scattered by rows.
# gemm_rs has compute tasks only: the epilogue of a peer's tile stores the fp32 partial into the
# owner's `stage` and raises a flag there; the owner's own tiles wait for those flags and add the
# partials in their epilogue. The reduction is those stores, so there is nothing for a comm role to
# do. With `intra_sm` every CTA (virtual SM) of a rank computes tiles; `inter_sm` sets aside comm
# CTAs, which gemm_rs gives no task: they stay idle (the timeline has no comm rows), and the only
# difference is fewer compute CTAs. The plan says so (`comm tasks per rank`).

# %%
W = 4
world = mkernel.World.emulated(W)  # device="cuda" runs the same op on one GPU
g = torch.Generator().manual_seed(0)
a = torch.randn(W, W * 128, 64, generator=g).bfloat16()
b = torch.randn(W, 64, 256, generator=g).bfloat16()
ref = mkernel.reference.gemm_rs(a, b, world=world).float()

for overlap in ("intra_sm", "inter_sm"):
    sched = mkernel.Schedule(overlap=overlap, sms=4, tile="128x128x64", seed=1)
    plan = sched.plan("gemm_rs", world, a, b)
    comm_tasks = [len(ts) for ts in plan.roles["comm"].tasks]
    assert comm_tasks == [0] * W  # gemm_rs: no comm role, under either overlap
    out = mkernel.gemm_rs(a, b, world=world, schedule=sched)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    if overlap == "intra_sm":
        units = f"{plan.compute_units} CTAs, each with a comm warp"
    else:
        units = f"{plan.compute_units} compute CTAs + {plan.comm_units} comm CTA(s), idle"
    print(f"\n{overlap}: {units}, comm tasks per rank {comm_tasks}")
    print(f"{overlap}: relative error {err:.1e}; timeline of ranks 0 and 1 (digits: task ids)")
    print(world.last_timeline.ascii(64, ranks=[0, 1]))
    world.last_timeline.save_chrome(f"/tmp/mkernel_tutorial01_{overlap}.json")  # ui.perfetto.dev

# %% [markdown]
# ## 3. Comm CTAs with work: AllGather+GEMM
# `ag_gemm` does have a comm role: each rank's shard of `a` is cut into chunks, and comm tasks push
# every chunk into every rank's `gather` buffer, raising `chunk_ready` there; each compute tile
# waits only for the chunks its rows need. Under `inter_sm` those pushes run on the comm CTAs while
# the compute CTAs multiply what has landed: the timeline's `comm` rows.

# %%
a_shard = torch.randn(W, 128, 64, generator=g).bfloat16()  # per rank [M/W, K]
ref = mkernel.reference.ag_gemm(a_shard, b, world=world).float()
sched = mkernel.Schedule(overlap="inter_sm", sms=4, comm_sms=1, tile="128x128x64", seed=1)
plan = sched.plan("ag_gemm", world, a_shard, b)
comm_tasks = [len(ts) for ts in plan.roles["comm"].tasks]
assert all(comm_tasks)
out = mkernel.ag_gemm(a_shard, b, world=world, schedule=sched)
err = ((out.float() - ref).norm() / ref.norm()).item()
assert err < 1e-2, err
print(f"\nag_gemm inter_sm: comm tasks per rank {comm_tasks}; relative error {err:.1e}")
print(world.last_timeline.ascii(64, ranks=[0]))
assert any(s.unit.startswith("comm") for s in world.last_timeline.spans)

# %% [markdown]
# The Chrome traces in /tmp open in ui.perfetto.dev. On a GPU, `World.emulated(4, device="cuda")`
# runs the same plans in one persistent launch.
