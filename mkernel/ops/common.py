"""What every fused op shares: input checks, the interpreter driver, the GPU launch plumbing."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CommTimeout
from ..protocol import OpSpec
from ..runtime.gpu import (  # noqa: F401 (the GPU path)
    extension,
    raise_pending,
    raise_timeout,
    run_gpu,
    status_block,
)
from ..runtime.memory import SymBuffer, barrier_pad, workspace  # noqa: F401 (the ops' workspaces)
from ..schedule import Plan, Schedule, cached_plan  # noqa: F401 (the ops' plans)
from ..world import World, check_world

ALIGN = 8  # elements: TMA needs 16-byte strides, the epilogues store column pairs / quads


# -- input checks (before anything is launched) -------------------------------------------------


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


def check_rows_divisible(op: str, world: World, m: int) -> None:
    """The operand path's divisibility of the GEMM ops' M by W (each rank owns M/W rows), for
    Schedule.plan by sizes, which reaches make_plan without the operands."""
    if m % world.size:
        raise ValueError(f"{op}: M (m={m}) must be divisible by the world size W={world.size}")


def check_nodes(module: Any, world: World) -> None:
    """A world of several nodes needs the op's hierarchical plan (``module.HIERARCHICAL``: the
    plan moves data across nodes only by rdma puts, docs/rdma.md). On a GPU it also needs the
    plan's kernel (``SPEC_NODES.device``: kernels/<op>_nodes.cu), and a distributed world needs
    NVSHMEM (its puts cross the nodes; an emulated world's proxy transport serves one GPU)."""
    if world.nodes == 1:
        return
    name = module.SPEC.name
    if not getattr(module, "HIERARCHICAL", False):
        raise UnsupportedWorld(
            f"{name} has no plan for a world of {world.nodes} nodes yet (world.nodes > 1): only "
            "gemm_rs, ag_gemm and gemm_ar span nodes; pass a world of nodes=1"
        )
    if not world.on_gpu:
        return
    spec = getattr(module, "SPEC_NODES", None)
    if spec is None or not spec.device:
        raise NotImplementedError(f"{name} has no GPU kernel over {world.nodes} nodes")
    if not world.emulated_world:
        from .. import nvshmem_ext

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


def check_operand(
    name: str,
    t: Any,
    world: World,
    ndim: int,
    form: str,
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
    aligned: bool = True,
) -> tuple[int, ...]:
    """Checks a per-rank operand (emulated world: stacked, [W, *form]; distributed: this rank's)
    and returns its per-rank shape. ``form`` names the expected shape, ``dtypes`` the accepted
    element types (default bf16, a GEMM operand), ``aligned`` whether its TMA loads need a
    16-byte aligned start."""
    emulated = world.emulated_world
    lead = f"[W={world.size}, {form[1:]}" if emulated else form
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {lead}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        if dtypes == (torch.bfloat16,):
            raise TypeError(
                f"{name} must be torch.bfloat16 (fp32 accumulation inside), got {t.dtype}"
            )
        raise TypeError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    dev, wdev = t.device, world.device
    if dev != wdev and not (dev.type == wdev.type == "cuda" and dev.index == wdev.index):
        raise ValueError(f"{name} is on {dev}, but the world's device is {wdev}")
    want = ndim + (1 if emulated else 0)
    if t.dim() != want:
        raise ValueError(f"{name} must have shape {lead} ({want} dims), got {tuple(t.shape)}")
    if world.emulated_world and t.shape[0] != world.size:
        raise ValueError(
            f"{name} has leading dimension {t.shape[0]}, but this world has {world.size} ranks: "
            f"expected {lead} (a tensor of another world?)"
        )
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), shape {lead}")
    if aligned and t.numel() and t.data_ptr() % 16:
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
    inputs: dict[str, Any],
    world: Any,
    schedule: Any,
    out: Any,
    out_shape: Callable[[dict[str, int], int], tuple[int, ...]],
) -> torch.Tensor:
    """The path every fused op's API takes: check the world, schedule, operands (the op's
    ``shapes(*inputs, world)``, named as its SPEC's input buffers), faults and ``out`` (per-rank
    shape ``out_shape(shapes, W)``), all before anything
    runs; then the cached plan on the GPU (``run_gpu``, then the op's optional ``after_gpu``) or
    in the interpreter with the op's data-movement twins (``module.twins_of(plan)``) and the output
    tiles the kernel end reads (``module.outputs(plan, rank)``). A world of several nodes needs a
    hierarchical op, on the CPU (check_nodes)."""
    world = check_world_for(module.SPEC, world)
    check_nodes(module, world)
    schedule = check_schedule(schedule)
    s = module.shapes(*inputs.values(), world)
    check_faults(schedule, world)
    out = check_out(out, world, out_shape(s, world.size))
    plan = cached_plan(module, schedule, world, **s)
    operands = {**inputs, "out": out}
    if world.on_gpu:
        run_gpu(world, plan, operands)
        if hasattr(module, "after_gpu"):
            module.after_gpu(world, plan, out)
    else:
        outputs = lambda rank: module.outputs(plan, rank)
        run_cpu(world, plan, operands, module.twins_of(plan), outputs, schedule.seed)
    return out


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
    from ..interp.program import run_plan

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
