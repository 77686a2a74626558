# %% [markdown]
# # Tutorial 05: a tiny MoE layer with expert parallelism
#
# What you will learn:
# 1. the two fused MoE ops: `moe_dispatch_gemm` (each token goes to the ranks of its experts, once
#    per rank, and is multiplied there by w1) and `moe_gemm_combine` (each expert row times w2 goes
#    back to its token's rank, which sums its slots weighted);
# 2. how the rows are laid out: counts, then prefix sums, give every row its place before any
#    data moves (`expert_offsets`, `src`);
# 3. the layout phase: how many tasks a rank runs depends on the routing, so the plan only holds
#    room (`Capacity`) and the op's layout twin makes the tasks at the start of every call.
#
# Runs on a laptop: both ops run in the CPU interpreter; on a GPU world (emulated) each is one
# fused kernel that runs the same tasks (docs/moe.md).

# %%
import torch

import mkernel
from mkernel.ops import moe_dispatch_gemm as mdg
from mkernel.ops.moe_common import route
from mkernel.ops.moe_dispatch_gemm import moe_dispatch_gemm
from mkernel.ops.moe_gemm_combine import moe_gemm_combine

# %% [markdown]
# ## 1. A router picks k experts per token
# W = 4 ranks, 2 experts each (E = 8 global experts: expert g lives on rank g // 2), k = 2. Each
# rank routes its own 6 tokens with a linear router: top-2 logits, softmax weights.

# %%
W, T, H, INTER, E_LOCAL, K = 4, 6, 16, 16, 2, 2
g = torch.Generator().manual_seed(0)
x = torch.randn(W, T, H, generator=g).bfloat16()
router = torch.randn(H, W * E_LOCAL, generator=g)
w1 = (torch.randn(W, E_LOCAL, H, INTER, generator=g) / H**0.5).bfloat16()
w2 = (torch.randn(W, E_LOCAL, INTER, H, generator=g) / INTER**0.5).bfloat16()
logits = x.float() @ router
top = logits.topk(K, dim=-1)
topk_ids, topk_weights = top.indices, top.values.softmax(dim=-1)
topk_ids[0, 0, 1] = -1  # an unused slot: token 0 of rank 0 feeds one expert only
print("rank 0 routes its tokens to experts", topk_ids[0].tolist())

# %% [markdown]
# ## 2. Dispatch + first grouped GEMM
# Rank d gets one row per (token, slot) routed to its experts, grouped by expert, then by source
# rank and token: `y[d][expert_offsets[d][e] : expert_offsets[d][e + 1]]` are the rows of its
# expert e, and `src` says whose they are.

# %%
world = mkernel.World.emulated(W)
sched = mkernel.Schedule(overlap="inter_sm", chunk_rows=4)
d = moe_dispatch_gemm(x, topk_ids, w1, world, sched)
print("rows per rank", d.rows, "; expert_offsets of rank 1:", d.expert_offsets[1].tolist())
print("first rows of rank 1 come from (rank, token, slot):", d.src[1][:3].tolist())

# %% [markdown]
# ## 3. Activation, then second grouped GEMM + combine
# The activation runs on the rows where they are; the combine sends each expert's output rows back
# and every rank sums its own tokens' slots in fp32, in slot order, with one bf16 store.

# %%
h = [torch.nn.functional.silu(y.float()).bfloat16() for y in d.y]
out = moe_gemm_combine(h, w2, d, topk_weights, world, sched)
ref_d = mkernel.reference.moe_dispatch_gemm(x, topk_ids, w1, world)
ref = mkernel.reference.moe_gemm_combine(h, w2, ref_d, topk_weights, world)


def dense_moe(s: int) -> torch.Tensor:
    """The same layer on rank s's tokens, with no parallelism at all: fp32 loops over slots."""
    rows = []
    for t in range(T):
        acc = torch.zeros(H)
        for j, gid in enumerate(topk_ids[s, t].tolist()):
            if gid >= 0:
                r, e = divmod(gid, E_LOCAL)
                y = (x[s, t].float() @ w1[r, e].float()).bfloat16()
                hh = torch.nn.functional.silu(y.float()).bfloat16()
                acc += topk_weights[s, t, j] * (hh.float() @ w2[r, e].float())
        rows.append(acc)
    return torch.stack(rows)


dense = torch.stack([dense_moe(s) for s in range(W)])
err = ((out.float() - dense).abs().max() / dense.abs().max()).item()
assert err < 2**-7, err
assert torch.allclose(out.float(), ref.float(), rtol=2**-7, atol=2**-7 * ref.abs().max().item())
print(f"out matches the dense MoE: max relative error {err:.2e} (bf16 rounding); and the reference")

# %% [markdown]
# ## 4. What the layout phase made
# The plan is built once per shape: its compute and comm roles are `Capacity` (room per rank), not
# task lists. At the start of every call the layout twin (on a GPU: the op's device `layout`) reads
# the routing ids, computes the counts and prefix sums, and appends this rank's tasks: pushes, each
# a run of up to `PIECE_ROWS` of the tokens it sends one destination (each token once per rank it
# feeds, whatever the number of experts there), adding their number to `landed[src]` there; on the
# receiving side expands, which wait for `landed[src]` to count every token of that source, copy
# the tokens into their experts' rows and add to `expert_rows[e, src]`; and per expert GEMM tiles
# that wait for their own expert's rows only: one count per source that sends some, so a late rank
# is the one a timeout names.

# %%
plan = mdg.make_plan(sched, world, T, H, INTER, E_LOCAL, K)
print("plan roles:", {role: t.capacity for role, t in plan.roles.items()})
routing = route(topk_ids.tolist(), E_LOCAL)
made = mdg.layout_tasks(plan, routing, 0)
pushes = [t for t in made["comm"] if t.args[0] == mdg.PUSH]
expands = [t for t in made["comm"] if t.args[0] == mdg.EXPAND]
n_push, n_exp, n_gemm = len(pushes), len(expands), len(made["compute"])
print(f"the layout phase on rank 0 made {n_push} pushes, {n_exp} expands, {n_gemm} GEMM tiles")
# a push's args: (PUSH, destination d, first position i0 in rank 0's send list for d, tokens n):
# it copies the tokens routing.sent[0][d][i0 : i0 + n] into d's recv rows from
# recv_base[d][0] + i0 on, and adds n to landed[0] there
for t in pushes[:3]:
    _, d, i0, n = t.args[:4]
    (add,) = t.raises
    tokens = routing.sent[0][d][i0 : i0 + n]
    at = routing.recv_base[d][0] + i0
    print(
        f"  push to rank {d}: send list [{i0}:{i0 + n}] = tokens {tokens[:4]}"
        f"{' ...' if n > 4 else ''} -> its recv rows [{at}:{at + n}]; "
        f"+{add.value} {add.pad}{list(add.index)} on rank {add.rank}"
    )
sent = [sum(t.args[3] for t in pushes if t.args[1] == d) for d in range(W)]
assert sent == [len(routing.sent[0][d]) for d in range(W)]  # every token sent, once per rank
for t in expands[:3]:
    (w,), (add,) = t.waits, t.raises
    print(
        f"  expand rows [{t.args[1]}:{t.args[1] + t.args[2]}] from rank {t.args[3]}: waits "
        f"landed[{w.index[0]}] == {w.value}, then +{add.value} expert_rows{list(add.index)}"
    )
for t in made["compute"]:
    e, r0, n, c0 = t.args
    waits = ", ".join(f"expert_rows[{w.index[0]}, {w.index[1]}] == {w.value}" for w in t.waits)
    print(f"  GEMM expert {e} rows [{r0}:{r0 + n}] columns [{c0}:]: waits {waits}")

# %% [markdown]
# ## 5. Another routing, the same plan
# A second call with a different routing reuses the cached plan; the layout makes new tasks, and
# every signal pad is back to zero after each call.

# %%
plans = len(world._plans)
ids2 = torch.where(topk_ids >= 0, (topk_ids + 3) % (W * E_LOCAL), -1)  # other experts
d2 = moe_dispatch_gemm(x, ids2, w1, world, sched)
out2 = moe_gemm_combine([y.clone() for y in d2.y], w2, d2, topk_weights, world, sched)
assert len(world._plans) == plans
assert all(int(p.abs().sum()) == 0 for p in world.signal_pads().values())
print("second routing: rows per rank", d2.rows, "; same plans, pads back to zero")
