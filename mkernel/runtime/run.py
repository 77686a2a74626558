"""The one run path of every fused op (``run_op``) and the checks it runs before anything is
launched: an op declares what differs (``OpDef``: its sizes, extra checks, a path without the
fused plan, its results, the interpreter's views and twins, what it returns) and the path does
the rest the same way for all: world, nodes, schedule and faults checked; the cached plan; one
launch on the GPU (runtime/gpu.py) or the plan's tables in the CPU interpreter (interp/)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..errors import CommTimeout
from ..interp.program import run_plan
from ..protocol import OpSpec
from ..schedule import Plan, Schedule, cached_plan
from ..world import World, check_world
from .gpu import run_gpu
from .memory import workspace


@dataclass
class Call:
    """One call as it goes down the run path; the op's hooks read it and fill in their part."""

    op: OpDef  # what the op declared
    world: World
    schedule: Schedule
    inputs: dict[str, Any]  # the operands by their SPEC buffer names, in the API's order
    options: dict[str, Any]  # the API's other arguments (out, causal, scale, ...)
    sizes: dict[str, int] = field(default_factory=dict)  # the plan's key (shapes, then check)
    plan: Plan | None = None
    results: dict[str, torch.Tensor] = field(default_factory=dict)  # output buffers by name
    state: dict[str, Any] = field(default_factory=dict)  # the op's own, between its hooks
    result: Any = None  # what the API returns, once known before a run (solo, empty)


class Twins(NamedTuple):
    """The interpreter side of a call made in one piece (an op whose routing gives them all):
    data-movement twins per role, the layout twin (a plan with device-filled roles, run_plan) and
    the output tiles the kernel end reads per rank."""

    moves: dict[str, Callable | None]
    layout: Callable | None
    outputs: Callable[[int], dict[int, tuple[int, int, int, int]]]


@dataclass(frozen=True)
class OpDef:
    """What an op declares to ``run_op`` (its module's ``OP``), all the run path knows of it.

    - ``spec``: its OpSpec; ``make_plan(schedule, world, **sizes)``: its plan (cached_plan);
      ``spec_nodes`` (optional): the SPEC of its plan over several nodes (docs/rdma.md
      "Hierarchical ops"), which ``make_plan`` builds when ``world.nodes > 1``; an op without
      one refuses such a world.

    Every hook below takes the Call.

    - ``shapes(*inputs, world, **shape_options)``: the plan's sizes, after checking the operands
      (``shape_options``: the options named in ``shape_args``, e.g. causal and layout);
    - ``results``: the output tensors by SPEC buffer name (the caller's ``out``, checked, or new);
    - ``twins``: the interpreter's data-movement twins per role, or a ``Twins`` (with the layout
      twin and the kernel-end reads); ``outputs(plan, rank)``: the output tiles of buffer
      ``output`` (default ``out``) its kernel end reads (unused when twins gives a Twins);
    - ``check`` (optional): the op's checks beyond its operands', before anything runs; it may
      set sizes (a scale's bits), options (defaults) and inputs (as the kernel takes them);
    - ``world_check(world)`` (optional): the op's checks of the world, before the nodes' (the
      MoE pair's CUDA-graph capture in a distributed world);
    - ``refused`` (optional): called when a check (nodes to plan) raises TypeError / ValueError,
      before it propagates (the MoE dispatch's peers, about to exchange counts, raise too);
    - ``solo`` (optional): the result of a path without the fused plan (the ring ops' one-rank
      engines), or None to take the plan;
    - ``empty`` (optional): the result of a call with nothing to run (the MoE ops' T == 0),
      after the results, or None to run;
    - ``operands`` (optional): the kernel's tensors by SPEC name on both paths (default: the
      inputs, then the results); ``views`` (optional): the interpreter's, if they differ;
    - ``after_gpu`` (optional): host work after the launch (gemm_ar's copy into ``out``);
    - ``finish``: what the API returns (default: the result ``out``)."""

    spec: OpSpec
    make_plan: Callable[..., Plan]
    shapes: Callable[..., dict[str, int]]
    results: Callable[[Call], dict[str, torch.Tensor]]
    twins: Callable[[Call], dict[str, Callable] | Twins]
    outputs: Callable[[Plan, int], dict] | None = None
    output: str = "out"
    shape_args: tuple[str, ...] = ()
    check: Callable[[Call], None] | None = None
    world_check: Callable[[World], None] | None = None
    refused: Callable[[Call], None] | None = None
    solo: Callable[[Call], Any] | None = None
    empty: Callable[[Call], Any] | None = None
    operands: Callable[[Call], dict[str, torch.Tensor]] | None = None
    views: Callable[[Call], dict[str, torch.Tensor]] | None = None
    after_gpu: Callable[[Call], None] | None = None
    finish: Callable[[Call], Any] = lambda call: call.results["out"]
    spec_nodes: OpSpec | None = None

    @property
    def name(self) -> str:
        return self.spec.name


def run_op(op: OpDef, inputs: dict[str, Any], world: Any, schedule: Any, **options: Any) -> Any:
    """The path every fused op's API takes: ``prepare`` (every check, then the op's ``solo`` path
    or the cached plan and the results), the op's ``empty`` result if it has nothing to run,
    else the plan on the GPU (``run_gpu``, then ``after_gpu``) or in the interpreter with the
    op's twins and kernel-end reads. Returns the op's ``finish``."""
    call = prepare(op, inputs, world, schedule, **options)
    if call.result is None and op.empty is not None:
        call.result = op.empty(call)
    if call.result is not None:
        return call.result
    world, plan = call.world, call.plan
    operands = op.operands(call) if op.operands else {**call.inputs, **call.results}
    if world.on_gpu:
        run_gpu(world, plan, operands)
        if op.after_gpu is not None:
            op.after_gpu(call)
    else:
        tw = op.twins(call)
        if not isinstance(tw, Twins):
            tw = Twins(tw, None, lambda rank: op.outputs(plan, rank))
        views = op.views(call) if op.views else operands
        run_cpu(world, plan, views, tw.moves, tw.outputs, call.schedule.seed, tw.layout, op.output)
    return op.finish(call)


def prepare(op: OpDef, inputs: dict[str, Any], world: Any, schedule: Any, **options: Any) -> Call:
    """run_op before the run: the world (its kind, the op's ``world_check``, its nodes:
    check_nodes), the schedule, the operands (the op's ``shapes``), the op's own checks and the
    faults, all before anything runs (a TypeError / ValueError among them calls ``refused``
    first); then the op's ``solo`` result (``call.result``) or the cached plan and the results.
    Also for tests and benchmarks that run a call's plan themselves."""
    world = check_world_for(op.spec, world)
    if op.world_check is not None:
        op.world_check(world)
    call = Call(op, world, _DEFAULT_SCHEDULE, dict(inputs), dict(options))
    try:
        check_nodes(op, world)
        call.schedule = check_schedule(schedule)
        shape_options = {k: call.options[k] for k in op.shape_args}
        call.sizes = op.shapes(*call.inputs.values(), world, **shape_options)
        if op.check is not None:
            op.check(call)
        check_faults(call.schedule, world)
        call.result = op.solo(call) if op.solo is not None else None
        if call.result is None:
            call.plan = cached_plan(op, call.schedule, world, **call.sizes)
    except (TypeError, ValueError):
        if op.refused is not None:
            op.refused(call)
        raise
    if call.result is None:
        call.results = op.results(call)
    return call


# -- the checks of the run path (before anything is launched) ---------------------------------


def check_world_for(spec: OpSpec, world: Any) -> World:
    """check_world, and for an op with no device kernel yet (``spec.device`` False) a CPU emulated
    world: its plan runs only in the interpreter; any op on a CPU world: an emulated one."""
    world = check_world(world)
    if not spec.device and world.on_gpu:
        raise NotImplementedError(
            f"{spec.name} has no GPU kernel yet: it runs in the CPU interpreter "
            "(World.emulated(W), device='cpu')"
        )
    if not spec.device and not world.emulated_world:
        raise NotImplementedError(f"{spec.name} runs in emulated worlds only (World.emulated(W))")
    if not world.on_gpu and not world.emulated_world:
        raise NotImplementedError(
            f"{spec.name} on the CPU runs in the interpreter, which runs emulated worlds "
            "(World.emulated(W)); a distributed world runs on GPUs (one process per GPU)"
        )
    return world


class UnsupportedWorld(NotImplementedError, ValueError):
    """A world the op cannot serve (yet): a NotImplementedError, as it was raised before, and a
    ValueError, as the README promises for bad input (the world argument), raised before
    anything runs."""


def check_nodes(op: OpDef, world: World) -> None:
    """A world of several nodes needs the op's hierarchical plan (``op.spec_nodes``: the plan
    moves data across nodes only by rdma puts, docs/rdma.md). On a GPU it also needs the plan's
    kernel (``spec_nodes.device``: kernels/<op>_nodes.cu), and a distributed world needs NVSHMEM
    (its puts cross the nodes; an emulated world's proxy transport serves one GPU)."""
    if world.nodes == 1:
        return
    name = op.spec.name
    if op.spec_nodes is None:
        raise UnsupportedWorld(
            f"{name} has no plan for a world of {world.nodes} nodes yet (world.nodes > 1): only "
            "gemm_rs, ag_gemm and gemm_ar span nodes; pass a world of nodes=1"
        )
    if not world.on_gpu:
        return
    if not op.spec_nodes.device:
        raise NotImplementedError(f"{name} has no GPU kernel over {world.nodes} nodes")
    if not world.emulated_world:
        from .. import nvshmem_ext  # NOTE: on first use (no cycle): it finds the library

        if nvshmem_ext.SPEC is None:
            raise RuntimeError(
                f"{name} in a distributed world of {world.nodes} nodes puts across them through "
                f"NVSHMEM: {nvshmem_ext.ABSENT}"
            )


_DEFAULT_SCHEDULE = Schedule()  # never handed out: calls without a schedule share it (host time)


def check_schedule(schedule: Any) -> Schedule:
    if schedule is None:
        return _DEFAULT_SCHEDULE
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"schedule must be an mkernel.Schedule or None, got {type(schedule).__name__}"
        )
    return schedule


def check_faults(schedule: Schedule, world: World) -> None:
    """The injected faults (Schedule.faults) must name ranks of this world."""
    f = schedule.faults
    for name in ("silent_rank", "delay_rank"):
        v = getattr(f, name)
        if v is not None and not 0 <= v < world.size:
            raise ValueError(f"Faults.{name}={v} is not a rank of this world (0..{world.size - 1})")


def check_out(out: Any, world: World, shape: tuple[int, ...]) -> torch.Tensor:
    """The result tensor: the caller's ``out`` (checked) or a new one (``result_buffer``: NaN on
    the CPU and under MKERNEL_POISON=1, so that an unwritten tile shows)."""
    full = (world.size, *shape) if world.emulated_world else shape
    if out is None:
        return result_buffer(full, torch.bfloat16, world.device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.dtype != torch.bfloat16 or tuple(out.shape) != full:
        raise ValueError(
            f"out must be bfloat16 of shape {list(full)}, got {out.dtype} {list(out.shape)}"
        )
    if out.device.type != world.device.type or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor on {world.device}")
    return out


def result_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A result or per-call workspace that the kernel writes in full before anything reads it,
    made by an op that takes no ``out``: NaN-filled on the CPU (the interpreter) and wherever
    ``MKERNEL_POISON=1`` (the test suites set it), so a row nobody writes shows; left
    uninitialized on a GPU otherwise (the fill is a write of every byte, per call)."""
    if device.type == "cpu" or os.environ.get("MKERNEL_POISON") == "1":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


# -- the CPU interpreter's run of a plan ------------------------------------------------------


def run_cpu(
    world: World,
    plan: Plan,
    operands: dict[str, torch.Tensor],
    moves: dict[str, Callable],
    outputs: Callable[[int], dict[int, tuple[int, int, int, int]]],
    seed: int,
    layout: Callable | None = None,
    output: str = "out",
) -> None:
    """One call in the CPU interpreter: the plan's tables run by the template's twin
    (mkernel/interp/program.py) with the op's data-movement twins ``moves`` per role;
    ``outputs(rank)`` gives the output tiles of buffer ``output`` the kernel end reads; ``layout``:
    the op's layout twin, for a plan with device-filled roles (run_plan)."""
    ws = workspace(world, plan)
    buffers = {**operands, **{k: v.local for k, v in ws.items() if v is not None}}
    try:
        m = run_plan(world, plan, buffers, moves, seed, outputs, layout=layout, output=output)
    except Exception as exc:
        # as on the GPU (gpu.poison_on_timeout): a failed call's outputs, the caller's ``out``
        # among them, hold NaN rather than partial results that could pass for valid ones
        for b in plan.spec.buffers:
            t = operands.get(b.name)
            if b.kind == "output" and t is not None and t.is_floating_point():
                t.fill_(float("nan"))
        if isinstance(exc, CommTimeout):
            world.reset()  # as on the GPU: a timed-out call leaves flags and workspace dirty
        raise
    world.last_timeline = m.timeline
