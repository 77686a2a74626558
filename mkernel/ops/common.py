"""What every fused op shares: input checks, the interpreter driver, the GPU launch plumbing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import CommTimeout
from ..interp.machine import Machine
from ..schedule import Plan, Schedule
from ..world import World

ALIGN = 8  # elements: TMA needs 16-byte strides, the epilogues store column pairs / quads
BARRIER_SLOTS = 256  # templates/persistent.cuh kMaxBarrierSlots
MAX_LOCAL_RANKS = 16  # templates/persistent.cuh kMaxLocalRanks
ROLE_NAMES = {0: "compute", 1: "comm", 2: "barrier"}
# Signal ids recorded by device waits (WaitSite::signal), shared by every op.
SIGNAL_NAMES = {0: "barrier", 1: "tile_flag", 2: "chunk_ready", 3: "tile_ready"}


# -- input checks (before anything is launched) -------------------------------------------------


def check_world(world: Any) -> World:
    if not isinstance(world, World):
        raise TypeError(f"world must be an mkernel.World, got {type(world).__name__}")
    return world


def check_schedule(schedule: Any) -> Schedule:
    if schedule is None:
        return Schedule()
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"schedule must be an mkernel.Schedule or None, got {type(schedule).__name__}"
        )
    return schedule


def check_operand(name: str, t: Any, world: World, ndim: int, form: str) -> tuple[int, ...]:
    """Checks a per-rank operand and returns its per-rank shape. ``form`` names the expected
    shape."""
    lead = f"[W={world.size}, {form[1:]}" if world.emulated_world else form
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {lead}, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be torch.bfloat16 (fp32 accumulation inside), got {t.dtype}")
    if t.device != world.device and not (
        t.device.type == world.device.type == "cuda" and t.device.index == world.device.index
    ):
        raise ValueError(f"{name} is on {t.device}, but the world's device is {world.device}")
    want = ndim + (1 if world.emulated_world else 0)
    if t.dim() != want:
        raise ValueError(f"{name} must have shape {lead} ({want} dims), got {tuple(t.shape)}")
    if world.emulated_world and t.shape[0] != world.size:
        raise ValueError(
            f"{name} has leading dimension {t.shape[0]}, but this world has {world.size} ranks: "
            f"expected {lead} (a tensor of another world?)"
        )
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), shape {lead}")
    if t.numel() and t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned")
    return tuple(t.shape[1:]) if world.emulated_world else tuple(t.shape)


def check_operands(
    a: Any, a_form: str, b: Any, b_form: str, world: World, inner: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Checks a GEMM op's two operands (check_operand, ``a`` first) and that a's columns and b's
    rows, the shared dimension named ``inner``, agree; returns their per-rank shapes."""
    a_shape = check_operand("a", a, world, 2, a_form)
    b_shape = check_operand("b", b, world, 2, b_form)
    if a_shape[1] != b_shape[0]:
        raise ValueError(
            f"a is {a_form} = {list(a_shape)} but b is {b_form} = {list(b_shape)}: {inner} differs"
        )
    return a_shape, b_shape


def check_divides(name: str, value: int, by: int, what: str) -> None:
    if value <= 0 or value % by:
        raise ValueError(f"{name}={value} must be a positive multiple of {by} ({what})")


def check_columns(k_name: str, k: int, n: int) -> None:
    """The engine's TMA loads need 16-byte rows: ``k`` (columns of a, named ``k_name``) and ``n``
    (columns of b) must be multiples of ALIGN."""
    check_divides(f"{k_name} (columns of a)", k, ALIGN, "16-byte rows")
    check_divides("N (columns of b)", n, ALIGN, "16-byte rows")


def check_faults(schedule: Schedule, world: World) -> None:
    """The injected faults (Schedule.faults) must name ranks of this world."""
    f = schedule.faults
    for name in ("silent_rank", "delay_rank"):
        v = getattr(f, name)
        if v is not None and not 0 <= v < world.size:
            raise ValueError(f"Faults.{name}={v} is not a rank of this world (0..{world.size - 1})")


def check_out(out: Any, world: World, shape: tuple[int, ...]) -> torch.Tensor:
    """The result tensor: the caller's ``out`` (checked) or a new one, poisoned with NaN on the CPU
    so that an unwritten tile shows."""
    full = (world.size, *shape) if world.emulated_world else shape
    if out is None:
        if world.on_gpu:
            return torch.empty(full, dtype=torch.bfloat16, device=world.device)
        return torch.full(full, float("nan"), dtype=torch.bfloat16)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.dtype != torch.bfloat16 or tuple(out.shape) != full:
        raise ValueError(
            f"out must be bfloat16 of shape {list(full)}, got {out.dtype} {list(out.shape)}"
        )
    if out.device.type != world.device.type or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor on {world.device}")
    return out


def cached_plan(op_module: Any, schedule: Schedule, world: World, **shapes: int) -> Plan:
    """The op's plan for these shapes, built once per (schedule settings, shapes) and kept on the
    world: its device tables are copied once, so calls (and CUDA-graph captures) copy nothing."""
    hook = schedule.tile_order
    key = (
        op_module.__name__,
        schedule.overlap,
        schedule.sms,
        schedule.comm_sms,
        schedule.tile,
        id(hook) if hook is not None else None,
        schedule.chunk_rows,
        schedule.faults,
        schedule.backoff_ns,
        schedule.trace,
        schedule.transfer,
        tuple(sorted(shapes.items())),
    )
    plans = world._plans
    plan = plans.get(key)
    if plan is None:
        plan = op_module.make_plan(schedule, world, **shapes)
        if hook is not None:
            plan.extra["_hook"] = hook  # keeps id(hook) from being reused while cached
        plan.extra["backoff_ns"] = schedule.backoff_ns
        plan.extra["trace"] = schedule.trace
        plan.extra["transfer"] = schedule.transfer
        plans[key] = plan
    return plan


def barrier_pad(world: World):
    """The template's entry-barrier flags, [BARRIER_SLOTS, W] int32, shared by every fused op."""
    return world.symmetric(("fused", "barrier"), (BARRIER_SLOTS, world.size), torch.int32)


def per_rank(x: torch.Tensor, world: World) -> list[torch.Tensor]:
    """Every rank's tensor, for the references: the slices of an emulated world's [W, ...] tensor,
    or an all_gather over a distributed world's group."""
    if world.emulated_world:
        return list(x.unbind(0))
    import torch.distributed as dist

    # gloo (e.g. two processes sharing one GPU) gathers host tensors only.
    host = dist.get_backend(world.group) == "gloo"
    src = x.detach().cpu().contiguous() if host else x.contiguous()
    parts = [torch.empty_like(src) for _ in range(world.size)]
    dist.all_gather(parts, src, group=world.group)
    return [p.to(x.device) for p in parts]


def run_op(
    module: Any,
    a: Any,
    b: Any,
    world: Any,
    schedule: Any,
    out: Any,
    out_shape: Callable[[dict[str, int], int], tuple[int, ...]],
) -> torch.Tensor:
    """The path every fused GEMM op's API takes: check the world, schedule, operands (the op's
    ``shapes``), faults and ``out`` (per-rank shape ``out_shape(shapes, W)``), all before anything
    runs; then the cached plan on the GPU (the op's ``_run_gpu``) or in the interpreter
    (``_run_cpu``)."""
    world = check_world(world)
    schedule = check_schedule(schedule)
    s = module.shapes(a, b, world)
    check_faults(schedule, world)
    out = check_out(out, world, out_shape(s, world.size))
    plan = cached_plan(module, schedule, world, **s)
    if world.on_gpu:
        return module._run_gpu(world, plan, a, b, out)
    return module._run_cpu(world, plan, a, b, schedule, out)


# -- the CPU interpreter driver -----------------------------------------------------------------


def run_interpreter(
    world: World,
    plan: Plan,
    pads: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    compute: Callable,
    comm: Callable,
    seed: int,
    expected_outputs: dict[int, list[int]] | None = None,
    barrier_pad: str = "barrier",
) -> Machine:
    """Runs one call of an op: an agent per compute unit and per comm unit of every rank, each
    starting with the template's entry barrier (intra_sm: the CTA's barrier, then its comm warp).
    ``expected_outputs``: the output tiles each rank must have written in full (default: every
    tile of the plan on every rank)."""
    from ..interp import twins

    steps = max(10_000, int(world.timeout_s * 200_000))
    m = Machine(world.size, pads, buffers, seed=seed, deadline_steps=steps)

    def cta_prologue(slot: int, publish: bool):
        def prologue(ctx):
            yield from twins.entry_barrier(ctx, barrier_pad, slot)
            if publish:  # intra_sm: the comm warp starts after its CTA's barrier
                yield from twins.local_event_set(ctx, ctx.sig("cta_ready", ctx.rank, slot))

        return prologue

    def wait_cta(slot: int):
        def prologue(ctx):
            yield from twins.wait_acquire_reset(
                ctx, ctx.sig("cta_ready", ctx.rank, slot), 1, ctx.rank
            )

        return prologue

    def with_prologue(program: Callable, prologue: Callable) -> Callable:
        def run(ctx, task):
            yield from program(ctx, task)

        run.prologue = prologue
        return run

    pads.setdefault("cta_ready", torch.zeros(world.size, BARRIER_SLOTS, dtype=torch.int32))
    intra = plan.overlap == "intra_sm"
    for r in range(world.size):
        for u in range(plan.compute_units):
            prologue = cta_prologue(u, publish=intra)
            m.add_agent(
                r, "compute", u, plan.tasks_of("compute", r, u), with_prologue(compute, prologue)
            )
        for u in range(plan.comm_units):
            prologue = wait_cta(u) if intra else cta_prologue(plan.compute_units + u, publish=False)
            m.add_agent(r, "comm", u, plan.tasks_of("comm", r, u), with_prologue(comm, prologue))
    try:
        m.run()
    except CommTimeout:
        world.reset()  # as on the GPU: a timed-out call leaves flags and workspace dirty
        raise
    if expected_outputs is None:
        expected_outputs = {r: list(range(len(plan.tiles))) for r in range(world.size)}
    m.check_outputs(expected_outputs)
    world.last_timeline = m.timeline
    return m


# -- the GPU launch -----------------------------------------------------------------------------

_EXT: Any = None


def extension() -> Any:
    global _EXT
    if _EXT is None:
        from .. import jit

        _EXT = jit.load()
    return _EXT


class _StatusBlock:
    """CommStatus (primitives/signal.cuh) in pinned, mapped host memory: the kernel records a
    timeout there; the host reads it after the launch without a device copy."""

    FIELDS = ("error", "rank", "peer", "task", "role", "signal", "index", "abort")

    def __init__(self) -> None:
        self.t = torch.zeros(len(self.FIELDS), dtype=torch.int32, pin_memory=True)

    def ptr(self) -> int:
        return self.t.data_ptr()

    def raise_if_set(self, signal_names: dict[int, str] | None = None) -> None:
        v = dict(zip(self.FIELDS, self.t.tolist(), strict=True))
        if not v["error"]:
            return
        self.t.zero_()
        name = (signal_names or SIGNAL_NAMES).get(v["signal"], f"signal{v['signal']}")
        raise CommTimeout(
            v["rank"], v["peer"], f"{name}[{v['index']}]", v["task"], ROLE_NAMES.get(v["role"], "?")
        )


def status_block(world: World) -> _StatusBlock:
    blk = getattr(world, "_status", None)
    if blk is None:
        blk = _StatusBlock()
        world._status = blk
    return blk


def fill_launch(world: World, plan: Plan) -> Any:
    """A FusedLaunch with the plan, world, status and fault fields set; the op fills its
    operands."""
    from ..schedule import TILE_CONFIG_IDS

    if world.emulated_world and world.size > MAX_LOCAL_RANKS:
        raise ValueError(
            f"an emulated GPU world serves at most {MAX_LOCAL_RANKS} ranks, got {world.size}"
        )
    ext = extension()
    L = ext.FusedLaunch()
    tables = plan.device_tables(world.device)
    L.tc, L.tm = plan.compute_order.shape[1], plan.comm_tasks.shape[1]
    # The kernel indexes the per-rank tables by its local rank: in a distributed world (one rank
    # per launch) point them at this rank's row.
    row = 0 if world.emulated_world else world.rank
    L.tiles = tables["tiles"].data_ptr()
    L.compute_order = tables["compute_order"].data_ptr() + row * L.tc * 4
    L.comm_tasks = tables["comm_tasks"].data_ptr() + row * L.tm * 4
    L.compute_units, L.comm_units = plan.compute_units, plan.comm_units
    L.ctas_per_rank = plan.ctas_per_rank
    L.overlap = 0 if plan.overlap == "intra_sm" else 1
    L.tile_config = TILE_CONFIG_IDS[plan.tile.name]
    L.world_size = world.size
    L.rank0 = 0 if world.emulated_world else world.rank
    L.ranks_here = world.size if world.emulated_world else 1
    L.timeout_ns = int(world.timeout_s * 1e9)
    L.status = status_block(world).ptr()
    f = plan.faults
    L.silent_rank = -1 if f.silent_rank is None else f.silent_rank
    L.delay_rank = -1 if f.delay_rank is None else f.delay_rank
    L.delay_ns = int(f.delay_us * 1000)
    L.backoff_ns = plan.extra.get("backoff_ns", 0)
    L.transfer = 1 if plan.extra.get("transfer") == "tma" else 0
    world._pending_trace = None
    if plan.extra.get("trace"):
        ranks_here = L.ranks_here
        cap = max(1, -(-L.tc // plan.compute_units), -(-L.tm // max(1, plan.comm_units)))
        buf = torch.zeros(
            (ranks_here, plan.ctas_per_rank, 2, cap, 2), dtype=torch.int64, device=world.device
        )
        L.timeline, L.timeline_cap = buf.data_ptr(), cap
        world._pending_trace = (plan, buf)
    return L


def set_operands(L: Any, world: World, a: torch.Tensor, b: torch.Tensor, out=None) -> None:
    """The FusedLaunch operand fields every op sets the same way: the a and b pointers (and out's,
    when given) and each one's rank stride, the elements between consecutive ranks' tensors (an
    emulated world's [W, ...] tensors; 0 in a distributed world, one rank per launch)."""
    emulated = world.emulated_world
    L.a, L.b = a.data_ptr(), b.data_ptr()
    L.a_rank_stride = a[0].numel() if emulated else 0
    L.b_rank_stride = b[0].numel() if emulated else 0
    if out is not None:
        L.out = out.data_ptr()
        L.out_rank_stride = out[0].numel() if emulated else 0


def launch_and_check(world: World, fn: Callable, L: Any, signal_names: dict[int, str]) -> None:
    """Launches on the current stream. Outside graph capture it waits for the kernel and raises
    CommTimeout if a wait timed out (the kernel has exited cleanly by then)."""
    status = status_block(world)
    raise_timeout(world, status, signal_names)  # a timeout left by an earlier, unchecked launch
    stream = torch.cuda.current_stream(world.device)
    rc = fn(L, stream.cuda_stream)
    if rc != 0:
        raise RuntimeError(f"kernel launch failed with code {rc} ({torch.cuda.get_device_name()})")
    trace = getattr(world, "_pending_trace", None)
    if not torch.cuda.is_current_stream_capturing() and (world.sync_checks or trace):
        stream.synchronize()
        raise_timeout(world, status, signal_names)
        if trace is not None:
            world.last_timeline = gpu_timeline(world, *trace)


def gpu_timeline(world: World, plan: Plan, buf: torch.Tensor):
    """The timeline the kernel recorded (Schedule(trace=True)): ns since the first task began."""
    from ..interp.trace import Timeline

    ev = buf.cpu()
    tl = Timeline(unit_of_time="ns")
    valid = ev[..., 0] > 0
    t0 = int(ev[..., 0][valid].min()) if valid.any() else 0
    ranks = range(world.size) if world.emulated_world else [world.rank]
    for lr, rank in enumerate(ranks):
        for slot in range(plan.ctas_per_rank):
            for role_id, role in enumerate(("compute", "comm")):
                if role == "compute":
                    unit = slot if slot < plan.compute_units else None
                elif plan.overlap == "intra_sm":
                    unit = slot
                else:
                    unit = slot - plan.compute_units if slot >= plan.compute_units else None
                if unit is None:
                    continue
                for i, task in enumerate(plan.tasks_of(role, rank, unit)[: ev.shape[3]]):
                    start, end = (int(x) for x in ev[lr, slot, role_id, i])
                    if start > 0 and end >= start:
                        tl.add(rank, f"{role}{unit}", task, start - t0, end - t0)
    return tl


def raise_timeout(
    world: World, status: _StatusBlock, signal_names: dict[int, str] | None = None
) -> None:
    # NOTE: a timed-out call leaves flags and accumulators dirty (late producers land after the
    # waiter gave up). An emulated world's kernel has fully exited here, so it is safe to clear
    # them; a distributed world needs world.reset() on every rank.
    try:
        status.raise_if_set(signal_names)
    except CommTimeout:
        if world.emulated_world:
            world.reset()
        raise
