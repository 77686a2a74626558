# %% [markdown]
# # Tutorial 02: write a communication protocol, break it, schedule it
#
# What you will learn:
# 1. how to write a protocol's programs as Python twins (here: a ring all-gather of row chunks)
#    and run them with W virtual ranks in the CPU interpreter, in many random interleavings;
# 2. how that catches the two classic bugs: a signal raised before the data it publishes (a race)
#    and a wait for a signal nobody raises (a deadlock, reported like the GPU's timeout: rank,
#    peer, signal, task);
# 3. how a schedule (here: the tile-order hook of `mkernel.ag_gemm`) changes the order of work
#    and not the result.
#
# Everything runs on the CPU; the fused ops run the same plans on a GPU with
# `World.emulated(..., device="cuda")`.

# %%
import random

import torch

import mkernel
from mkernel.interp import twins
from mkernel.interp.machine import Machine

# %% [markdown]
# ## 1. A ring all-gather, as programs
# Rank r owns rows [r*R, (r+1)*R) of a buffer `x` (R rows, 4 columns). In step s, rank r
# forwards the chunk it holds (its own in step 0, then the one that arrived in step s-1) to rank
# r+1 and raises `ready[r+1][chunk]`; before forwarding a received chunk it waits for that flag and
# consumes it, so the pad is clean for the next call. In a last step it reads the gathered buffer.

# %%
W, R = 4, 2


def ring_step(ctx, step):
    me, nxt = ctx.rank, (ctx.rank + 1) % W
    chunk = (me - step) % W  # the chunk rank `me` holds at this step
    if step > 0:  # it arrived in the previous step
        yield from twins.wait_acquire_reset(ctx, ctx.sig("ready", me, chunk), 1, peer=(me - 1) % W)
    if step == W - 1:  # every chunk is here: use the result
        yield from twins.tile_load(ctx, "x", me, (0, W * R, 0, 4))
        return
    data = yield from twins.tile_load(ctx, "x", me, (chunk * R, R, 0, 4))
    yield from twins.tile_send(ctx, "x", nxt, (chunk * R, R, 0, 4), data)
    yield from twins.signal_set_release(ctx, ctx.sig("ready", nxt, chunk), 1)  # after the data


def run(program, seed):
    x = torch.zeros(W, W * R, 4)
    for r in range(W):
        x[r, r * R : (r + 1) * R] = r + 1  # each rank's own rows
    pads = {"ready": torch.zeros(W, W, dtype=torch.int32)}
    m = Machine(W, pads, {"x": x}, seed=seed)
    for r in range(W):
        m.add_agent(r, "comm", 0, list(range(W)), program)
    m.run()
    return x, pads


want = torch.arange(1, W + 1).repeat_interleave(R)[:, None].expand(W * R, 4).float()
for seed in range(50):  # 50 random interleavings of the ranks
    x, pads = run(ring_step, seed)
    assert all(torch.equal(x[r], want) for r in range(W))
    assert int(pads["ready"].sum()) == 0  # every flag consumed: the pad is clean
print("ring all-gather: correct in 50 interleavings, signal pad back to zero")

# %% [markdown]
# ## 2. Two bugs the interpreter catches
# (a) Signal before send: the next rank may forward or read the chunk before it landed.


# %%
def signal_first(ctx, step):
    me, nxt, chunk = ctx.rank, (ctx.rank + 1) % W, (ctx.rank - step) % W
    if step > 0:
        yield from twins.wait_acquire_reset(ctx, ctx.sig("ready", me, chunk), 1, peer=(me - 1) % W)
    if step == W - 1:
        yield from twins.tile_load(ctx, "x", me, (0, W * R, 0, 4))
        return
    yield from twins.signal_set_release(ctx, ctx.sig("ready", nxt, chunk), 1)  # BUG: too early
    data = yield from twins.tile_load(ctx, "x", me, (chunk * R, R, 0, 4))
    yield from twins.tile_send(ctx, "x", nxt, (chunk * R, R, 0, 4), data)


caught, first = 0, None
for seed in range(20):
    try:
        run(signal_first, seed)
    except mkernel.RaceError as e:
        caught, first = caught + 1, first or e
print(f"signal-before-send: race caught in {caught} of 20 interleavings, e.g.\n  {first}")
assert caught > 0

# %% [markdown]
# (b) A wait nobody satisfies: rank 0 forgets its signal in the last forwarding step. On a GPU this
# wait would run into its deadline; the interpreter sees that no agent can run and names the waiter,
# the peer it waits for and the signal.


# %%
def forgetful(ctx, step):
    if ctx.rank == 0 and step == W - 2:
        chunk = (0 - step) % W
        yield from twins.wait_acquire_reset(ctx, ctx.sig("ready", 0, chunk), 1, peer=W - 1)
        data = yield from twins.tile_load(ctx, "x", 0, (chunk * R, R, 0, 4))
        yield from twins.tile_send(ctx, "x", 1, (chunk * R, R, 0, 4), data)
        return  # BUG: no signal
    yield from ring_step(ctx, step)


try:
    run(forgetful, seed=0)
    raise AssertionError("the missing signal was not caught")
except mkernel.CommTimeout as e:  # DeadlockError is a CommTimeout
    print("missing signal:", e)
    assert (e.rank, e.peer) == (1, 0)

# %% [markdown]
# ## 3. Schedules change the order of work, not the result
# `mkernel.ag_gemm` gathers the A shards and multiplies; by default each rank computes the tiles of
# its own shard first (its rows are there at once), then the others in arrival order. A tile-order
# hook `fn(rank, tiles) -> order` replaces that order. The order lives in the plan:
# `schedule.plan(op, world, a, b)` returns the very plan the call runs, and `plan.compute_order[r]`
# lists rank r's tiles in the order it computes them. Its n compute units split that list (unit c
# takes entries c, c + n, c + 2n, ...) and run side by side, so the order in which tiles *start*
# across units mixes in the interleaving; read the order from the plan, or per unit in the timeline.

# %%
W = 4
world = mkernel.World.emulated(W)
g = torch.Generator().manual_seed(0)
a = torch.randn(W, 128, 64, generator=g).bfloat16()  # per rank [M/W, K]: 8 tiles of 128x128
b = torch.randn(W, 64, 256, generator=g).bfloat16()  # [K, N]
ref = mkernel.reference.ag_gemm(a, b, world).float()


def reversed_order(rank, tiles):
    return list(reversed(range(len(tiles))))


def shuffled(rank, tiles):
    order = list(range(len(tiles)))
    random.Random(rank).shuffle(order)
    return order


orders, timelines = {}, {}
for name, hook in (("default", None), ("reversed", reversed_order), ("shuffled", shuffled)):
    sched = mkernel.Schedule(overlap="inter_sm", sms=4, tile="128x128x64", tile_order=hook, seed=3)
    plan = sched.plan("ag_gemm", world, a, b)
    if hook is not None:  # the plan's order is the hook's, on every rank
        for r in range(W):
            assert plan.compute_order[r].tolist() == list(hook(r, plan.tiles))
    out = mkernel.ag_gemm(a, b, world, sched)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2
    tl = timelines[name] = world.last_timeline
    for u in range(plan.compute_units):  # each unit ran its share of the plan's order, in order
        ran = sorted((s.start, s.task) for s in tl.spans if (s.rank, s.unit) == (0, f"compute{u}"))
        assert [task for _, task in ran] == plan.tasks_of("compute", 0, u)
    orders[name] = plan.compute_order[0].tolist()
    print(f"{name:9s} relative error {err:.1e}; rank 0 computes tiles {orders[name]}")
assert orders["default"][:2] == [0, 1]  # rank 0's own shard (rows 0..127) first
assert orders["reversed"] == list(range(7, -1, -1)) != orders["default"]

# %% [markdown]
# The timeline of rank 0 under the default order and under the reversed hook (whole ranks only:
# `ranks=` picks them, `max_rows=` cuts at a rank boundary). Each compute unit runs every
# `compute_units`-th tile of the order; the comm unit sends rank 0's chunks to its peers.

# %%
for name in ("default", "reversed"):
    text = timelines[name].ascii(64, ranks=[0], legend=name == "default")
    print(f"\n{name}: rank 0\n{text}")
    shown = [line.split()[1] for line in text.splitlines() if line.startswith("r0 ")]
    assert sorted(shown) == sorted({s.unit for s in timelines[name].spans if s.rank == 0})
