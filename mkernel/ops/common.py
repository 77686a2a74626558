"""What the fused ops share: operand checks, and the names of the run path they take
(mkernel/runtime/run.py: run_op and its checks; runtime/gpu.py: the launch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..runtime.gpu import (  # noqa: F401 (the GPU path)
    extension,
    raise_pending,
    raise_timeout,
    run_gpu,
    status_block,
)
from ..runtime.memory import SymBuffer, barrier_pad, workspace  # noqa: F401 (the ops' workspaces)
from ..runtime.run import (  # noqa: F401 (the run path and its checks, for the ops)
    Call,
    OpDef,
    Twins,
    UnsupportedWorld,
    check_faults,
    check_nodes,
    check_out,
    check_schedule,
    check_world_for,
    prepare,
    result_buffer,
    run_cpu,
    run_op,
)
from ..schedule import Plan, Schedule, cached_plan  # noqa: F401 (the ops' plans)
from ..world import World

ALIGN = 8  # elements: TMA needs 16-byte strides, the epilogues store column pairs / quads


# -- input checks (before anything is launched) -------------------------------------------------


def check_rows_divisible(op: str, world: World, m: int) -> None:
    """The operand path's divisibility of the GEMM ops' M by W (each rank owns M/W rows), for
    Schedule.plan by sizes, which reaches make_plan without the operands."""
    if m % world.size:
        raise ValueError(f"{op}: M (m={m}) must be divisible by the world size W={world.size}")


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


# -- the GEMM family's OpDef: one bf16 result ``out`` ---------------------------------------------


def copy_result(call: Call) -> None:
    """after_gpu of an op whose distributed peers write a symmetric ``result`` buffer (gemm_ar,
    all_gather): copy it into ``out`` (the launch cached the plan's workspace)."""
    result = call.plan.extra["_workspace"].get("result")
    if result is not None:
        call.results["out"].copy_(result.local)


def single_output_op(
    module: Any,
    out_shape: Callable[[dict[str, int], int], tuple[int, ...]],
    after_gpu: Callable[[Call], None] | None = None,
) -> OpDef:
    """The OpDef of an op with one bf16 result ``out`` of per-rank shape ``out_shape(sizes, W)``
    (the caller's, checked, or new) whose module gives ``SPEC``, ``make_plan``, ``shapes``,
    ``twins_of(plan)`` and ``outputs(plan, rank)``, and ``SPEC_NODES`` if it spans nodes: the
    GEMM family and all_gather."""
    return OpDef(
        spec=module.SPEC,
        make_plan=lambda *args, **sizes: module.make_plan(*args, **sizes),
        spec_nodes=getattr(module, "SPEC_NODES", None),
        shapes=lambda *args: module.shapes(*args),
        results=lambda c: {
            "out": check_out(c.options["out"], c.world, out_shape(c.sizes, c.world.size))
        },
        twins=lambda c: module.twins_of(c.plan),
        outputs=lambda plan, rank: module.outputs(plan, rank),
        after_gpu=after_gpu,
    )
