# %% [markdown]
# # Tutorial 03: author a fused op, end to end
#
# What you will learn, on `mkernel.all_gather` (a standalone all-gather, the smallest op there is):
# 1. the op's declaration (`SPEC`): named buffers, signal pads, scalars; and what is generated from
#    it for the device (a typed layout, pad ids);
# 2. its plan: every task of every role on every rank, with the waits and raises around it;
# 3. its device data movement: the only device code an op writes (compiled here when nvcc exists);
# 4. running it in the CPU interpreter under both overlaps, and a property test;
# 5. the protocol mistakes that are caught before anything runs, and the ones the interpreter
#    catches while it runs.
#
# Adding an op touched three places: `mkernel/ops/all_gather.py` (spec, plan, data-movement twin,
# reference, its `OpDef` and API, one `registry.register` line), `kernels/all_gather.cu` (data
# movement + a one-line launcher) and one export line in `mkernel/__init__.py`. The op registry,
# `mkernel.reference`, the Python binding, the JIT's source list and the generated headers
# (`python -m mkernel.codegen`) pick it up by themselves.

# %%
import subprocess
import tempfile
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mkernel
from mkernel import codegen, jit
from mkernel.interp.program import run_plan
from mkernel.ops import all_gather as ag
from mkernel.ops import common
from mkernel.protocol import Task
from mkernel.runtime import registry

ROOT = Path(mkernel.__file__).resolve().parents[1]

# %% [markdown]
# ## 1. The declaration
# Buffers are the caller's per-rank tensors (`input`, `output`) or symmetric workspaces every rank
# can address; `result` exists only in distributed worlds, where peers cannot write the caller's
# `out` directly. One pad, `landed[src, chunk]`: "chunk `chunk` of rank `src` is in my result".
# Pad 0 is always the template's entry barrier.

# %%
print(ag.SPEC.name, [(b.name, b.kind, b.shape) for b in ag.SPEC.buffers])
print("pads:", [p.name for p in ag.SPEC.all_pads()], "scalars:", ag.SPEC.scalars)
layout = codegen.layouts_header()
start = layout.index("namespace all_gather {")
print(layout[start : layout.index("}  // namespace all_gather", start)])

# %% [markdown]
# ## 2. The plan: tasks with their waits and raises
# Rank r pushes each own chunk to every rank (own copy first, then r+1, ...), each push raising
# `landed[r, c]` at its destination; then it waits for every chunk of every source. The plan is
# plain data: both backends run exactly these tables.

# %%
W = 3
world = mkernel.World.emulated(W)
sched = mkernel.Schedule(chunk_rows=4)
plan = sched.plan("all_gather", world, rows=10, cols=16)
for t in plan.roles["comm"].tasks[0][:4] + plan.roles["comm"].tasks[0][-2:]:
    print(f"rank 0 comm task {t.id}: args {t.args} waits {t.waits} raises {t.raises}")
print("compute tasks:", [len(ts) for ts in plan.roles["compute"].tasks], "(no GEMM here)")

# %% [markdown]
# ## 2b. What the run path knows of the op: its `OpDef`, and its registration
# Every fused op's API is one line, `common.run_op(OP, inputs, world, schedule, ...)`: the run
# path (mkernel/runtime/run.py) checks the world, the nodes, the schedule, the operands (`shapes`)
# and the faults, takes the cached plan (`make_plan`), makes the results and runs the plan on the
# GPU or in the interpreter (`twins`, `outputs`). `OP` declares exactly those pieces; an op with
# more to say gives the optional hooks (`check`, `solo`, `empty`, `after_gpu`, `finish`, ...).
# all_gather, with one bf16 `out`, builds its `OP` with `common.single_output_op`. The module then
# registers itself: codegen, the JIT's source list and `Schedule.plan` find it in the registry.

# %%
api = Path(ag.__file__).read_text()
print(api[api.index("OP = common.single_output_op") : api.index("registry.register")].strip())
last = api[api.index("    return common.run_op(OP") :].splitlines()[0]
print("the API's last line:", last.strip())
print("OP.spec is SPEC:", ag.OP.spec is ag.SPEC, "| registered:", registry.get("all_gather") is ag)
hooks = [h for h in ("check", "solo", "empty", "after_gpu") if getattr(ag.OP, h) is not None]
print("optional hooks all_gather declares:", hooks)
call = common.prepare(ag.OP, {"x": torch.randn(W, 10, 16).bfloat16()}, world, sched, out=None)
print("prepare (run_op up to the run): plan", call.plan.spec.name, "sizes", call.sizes)
print("results:", {k: list(v.shape) for k, v in call.results.items()})

# %% [markdown]
# ## 3. The device data movement
# `comm_move` is everything the op's `.cu` does per task: the template has already run the task's
# waits, and raises its signals once the team's writes are fenced. Below, the function as written
# in `kernels/all_gather.cu`, then a compile check for sm_90a when nvcc is installed.

# %%
src = (ROOT / "kernels/all_gather.cu").read_text()
print(src[src.index("  static __device__ void comm_move") : src.index("  static bool prepare")])
nvcc = jit.find_nvcc()
if nvcc:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", f"-I{ROOT}", "-c"]
        cmd += [str(ROOT / "kernels/all_gather.cu"), "-o", f"{tmp}/all_gather.o"]
        subprocess.run(cmd, check=True)
    print("kernels/all_gather.cu compiles for sm_90a")
else:
    print("nvcc not found: skipping the compile check")

# %% [markdown]
# ## 4. Run it, under both overlaps; then a property test
# The expected value is written here, independently of the op's own reference.

# %%
x = torch.randn(W, 10, 16).bfloat16()
want = torch.cat(list(x.unbind(0)))
for overlap in ("intra_sm", "inter_sm"):
    out = mkernel.all_gather(x, world, mkernel.Schedule(overlap=overlap, chunk_rows=4))
    assert all(torch.equal(out[r], want) for r in range(W))
    print(f"{overlap}: exact on every rank; timeline spans {len(world.last_timeline.spans)}")


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    W=st.integers(1, 5),
    rows=st.integers(1, 40),
    cols=st.sampled_from([8, 24]),
    chunk_rows=st.sampled_from([None, 1, 7]),
    overlap=st.sampled_from(["intra_sm", "inter_sm"]),
    seed=st.integers(0, 9),
)
def all_gather_is_exact(W, rows, cols, chunk_rows, overlap, seed):
    w = mkernel.World.emulated(W)
    x = torch.randn(W, rows, cols, generator=torch.Generator().manual_seed(seed)).bfloat16()
    sched = mkernel.Schedule(overlap=overlap, chunk_rows=chunk_rows, seed=seed)
    out = mkernel.all_gather(x, w, sched)
    assert all(torch.equal(out[r], torch.cat(list(x.unbind(0)))) for r in range(W))
    assert all(int(p.abs().sum()) == 0 for p in w.signal_pads().values())  # pads reset


all_gather_is_exact()
print("property: exact, pads reset, 12 draws")

# %% [markdown]
# ## 5. Mistakes, caught
# Before anything runs, `build_plan` checks the tables: a push whose signal nobody waits for is
# refused, naming the signal.

# %%
real_make = ag.make_plan


def without_waits(*args, **kw):
    real_build = ag.build_plan

    def build(spec, schedule, world, tile, shapes, sizes, tiles, compute, comm, extra=None):
        comm = [[t for t in ts if t.args[0] == ag.PUSH] for ts in comm]  # forgot the waits
        return real_build(spec, schedule, world, tile, shapes, sizes, tiles, compute, comm, extra)

    ag.build_plan = build
    try:
        return real_make(*args, **kw)
    finally:
        ag.build_plan = real_build


try:
    without_waits(mkernel.Schedule(), world, rows=10, cols=16)
except ValueError as e:
    print("refused before running:", e)

# %% [markdown]
# A subtler one passes the static check: rank 0 neither raises `landed` for its pushes to peers nor
# do the peers wait for rank 0's chunks. The tables are consistent, but nothing orders rank 0's
# stores before a peer's kernel ends: the interpreter's kernel-end read of every output tile
# reports the race.

# %%
plan = mkernel.Schedule(chunk_rows=4).plan("all_gather", world, rows=10, cols=16)
for r, ts in enumerate(plan.roles["comm"].tasks):
    for i, t in enumerate(ts):
        if t.args[0] == ag.PUSH and r == 0 and t.args[2] != 0:
            ts[i] = Task(t.id, t.args)  # no raise
        elif t.args[0] == ag.LANDED and t.args[1] == 0 and r != 0:
            ts[i] = Task(t.id, t.args)  # no wait
ws = common.workspace(world, plan)
out = torch.full((W, W * 10, 16), float("nan")).bfloat16()
bufs = {"x": x, "out": out, **{k: v.local for k, v in ws.items() if v is not None}}
try:
    run_plan(world, plan, bufs, ag.twins_of(plan), seed=0, outputs=lambda r: ag.outputs(plan, r))
except mkernel.RaceError as e:
    print("caught while running:", type(e).__name__, str(e))
for v in ws.values():  # the broken run left flags behind: clear them for later calls
    if v is not None:
        v.local.zero_()

# %% [markdown]
# ## 6. Where it runs
# On a GPU the same call runs one persistent kernel (`World.emulated(W, device="cuda")` or a
# distributed world); `tests/gpu/test_all_gather_gpu.py` checks it there. The files this op added:

# %%
print("mkernel/ops/all_gather.py, kernels/all_gather.cu, one line in mkernel/__init__.py")
print("generated (python -m mkernel.codegen):", ", ".join(codegen.outputs()))
