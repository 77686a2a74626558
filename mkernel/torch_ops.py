"""mkernel's ops as PyTorch custom ops (``torch.library``), in the ``mkernel`` namespace.

``import mkernel.torch_ops`` registers ``torch.ops.mkernel.<op>`` for every public op, each with
a fake (meta) implementation, so that ``torch.compile(fullgraph=True)`` traces a model that calls
them without a graph break, and with autograd where the op has a backward (``attention``,
``ring_attention``). The public functions (``mkernel.gemm_rs`` ...) are unchanged; under
``torch.compile`` call the custom ops (or this module's wrappers of the same names, which take a
``World`` or its handle). docs/pytorch.md has the whole story.

Worlds through the schema: an op's ``world`` argument is a ``str``, the world's handle
(``world_handle(world)``): an emulated world gets ``"emulated:<n>"`` when first registered (held
weakly: the handle works while the World lives); a distributed world gets its process group's
``group_name`` (the name PyTorch's own symmetric-memory ops take), and a group name that no World
was registered for makes one (``World.from_process_group(group)``, kept for the process). The op
body and the fake implementation look the world up by its handle (the fake reads only its size
and kind). Schedules do not travel through the schema: the custom ops run the default
``Schedule()`` (the cost model's picks per shape and world), or the one ``set_schedule(world,
schedule)`` set for the world, process-wide.

Per-rank tensors are as in the Python API: in an emulated world one tensor with a leading rank
dimension [W, ...], in a distributed world this rank's tensor. Two ops differ from their Python
API so that their results are tensors of shapes known from the inputs' shapes alone:

- ``moe_dispatch_gemm`` returns ``(y, src, expert_offsets)`` tensors in the worst case's layout
  (as under CUDA-graph capture): R = W * T * min(k, E_local) rows per rank, of which rank d's
  first ``expert_offsets[d][-1]`` are its rows; the rest are zeros in ``y`` and -1 in ``src``.
  ``moe_gemm_combine`` takes ``h`` in that layout (e.g. an activation of ``y``) with the
  dispatch's ``src``, ``expert_offsets`` and ``topk_ids``.
- ``grouped_gemm`` writes zeros into the rows in no group (the Python API leaves them unwritten)
  and takes no ``out``.
"""

import functools
import itertools
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .ops import ring_attention_backward as _bwd
from .ops.ag_gemm import ag_gemm as _ag_gemm
from .ops.all_gather import all_gather as _all_gather
from .ops.gemm_ar import gemm_ar as _gemm_ar
from .ops.gemm_rs import gemm_rs as _gemm_rs
from .ops.grouped_gemm import grouped_gemm as _grouped_gemm
from .ops.moe_common import MoeDispatch, max_rows
from .ops.moe_dispatch_gemm import moe_dispatch_gemm as _moe_dispatch_gemm
from .ops.moe_gemm_combine import moe_gemm_combine as _moe_gemm_combine
from .ops.ring_attention import attention as _attention
from .ops.ring_attention import ring_attention as _ring_attention
from .schedule import Schedule
from .world import World

__all__ = [
    "OPS",
    "world_handle",
    "lookup",
    "set_schedule",
    "gemm_rs",
    "ag_gemm",
    "gemm_ar",
    "all_gather",
    "attention",
    "ring_attention",
    "moe_dispatch_gemm",
    "moe_gemm_combine",
    "grouped_gemm",
]

bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32

# -- world handles --------------------------------------------------------------------------------

_worlds: "weakref.WeakValueDictionary[str, World]" = weakref.WeakValueDictionary()
_group_worlds: dict[str, World] = {}  # worlds made here for a process group's name: kept
_count = itertools.count()


def world_handle(world: World | str) -> str:
    """The handle that names ``world`` in a custom op's ``world`` argument, registering the world
    on first use: ``"emulated:<n>"`` for an emulated world, the process group's ``group_name``
    for a distributed one (``"<group_name>/<n>"`` for a second World over the same group). A
    handle (str) is returned as it is: the op looks it up (ValueError if it names no World)."""
    if isinstance(world, str):
        return world
    if not isinstance(world, World):
        raise TypeError(f"world must be an mkernel.World or its handle (str), got {type(world)}")
    # NOTE: under torch.compile a registered world's handle is an attribute read, which every
    # dynamo traces to a constant (guarded on the world); a torch build that cannot trace
    # _register's assume_constant_result on a World (seen on the GPU machine's torch) only
    # needs the world used once outside the compiled code.
    handle = getattr(world, "_torch_handle", None)
    if handle is not None:
        return handle
    return _register(world)


# NOTE: under torch.compile the call runs once while tracing, its result a constant of the graph:
# registering inside the traced code would put weakrefs in the graph.
@torch.compiler.assume_constant_result
def _register(world: World) -> str:
    if world.emulated_world:
        handle = f"emulated:{next(_count)}"
    else:
        handle = world.group.group_name
        if handle in _worlds and _worlds[handle] is not world:
            handle = f"{handle}/{next(_count)}"
    _worlds[handle] = world
    world._torch_handle = handle
    return handle


def lookup(handle: str) -> World:
    """The World a handle names: a registered one (``world_handle``), else, for the name of a
    process group, that group's distributed world (made once, ``World.from_process_group``)."""
    if not isinstance(handle, str):
        raise TypeError(f"world handle must be a str, got {type(handle).__name__}")
    world = _worlds.get(handle)
    if world is not None:
        return world
    world = _group_worlds.get(handle)
    if world is not None:
        return world
    group = None
    if dist.is_available() and dist.is_initialized():
        try:
            group = dist.distributed_c10d._resolve_process_group(handle)
        except (ValueError, RuntimeError, KeyError):
            group = None
    if group is None:
        raise ValueError(
            f"world handle {handle!r} names no live World (world_handle(world) registers one; an "
            "emulated world's handle lives as long as its World) and no process group"
        )
    world = World.from_process_group(group)
    _group_worlds[handle] = world
    _worlds[handle] = world
    world._torch_handle = handle
    return world


_schedules: dict[str, Schedule] = {}


def set_schedule(world: World | str, schedule: Schedule | None) -> None:
    """The Schedule the custom ops run in ``world`` (a World or its handle; None: the default
    ``Schedule()``, the cost model's picks). Schedules do not travel through the op schema: this
    is each world's, process-wide (e.g. ``Schedule(sms=60)`` for two processes sharing a GPU,
    whose persistent kernels must fit on it at once)."""
    if schedule is not None and not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be an mkernel.Schedule or None, got {type(schedule)}")
    handle = world_handle(world)
    if schedule is None:
        _schedules.pop(handle, None)
    else:
        _schedules[handle] = schedule


def _world(handle: str) -> tuple[World, Schedule | None]:
    """The World a handle names and the Schedule set for it (set_schedule)."""
    return lookup(handle), _schedules.get(handle)


def _lead(world: World) -> tuple[int, ...]:
    """The leading rank dimension of a per-rank tensor: (W,) in an emulated world, else ()."""
    return (world.size,) if world.emulated_world else ()


# -- the GEMM ops and all_gather -----------------------------------------------------------------


@torch.library.custom_op("mkernel::gemm_rs", mutates_args=())
def _gemm_rs_op(a: Tensor, b: Tensor, world: str) -> Tensor:
    """GEMM + ReduceScatter. Per rank r of W: a bf16 [M, K/W], b bf16 [K/W, N] (emulated world:
    [W, ...] of each); returns bf16 [M/W, N], rows r*M/W.. of ``sum_q a_q.float() @ b_q.float()``
    rounded once (``mkernel.gemm_rs``)."""
    return _gemm_rs(a, b, *_world(world))


@_gemm_rs_op.register_fake
def _(a: Tensor, b: Tensor, world: str) -> Tensor:
    w = lookup(world)
    m = a.shape[-2]
    torch._check(m % w.size == 0, lambda: f"gemm_rs: M={m} (rows of a) must divide by W={w.size}")
    return a.new_empty((*_lead(w), m // w.size, b.shape[-1]), dtype=bf16)


@torch.library.custom_op("mkernel::ag_gemm", mutates_args=())
def _ag_gemm_op(a: Tensor, b: Tensor, world: str) -> Tensor:
    """AllGather + GEMM. Per rank: a bf16 [M/W, K], b bf16 [K, N]; returns bf16 [M, N] =
    ``torch.cat(a_q for q in ranks).float() @ b.float()`` rounded once (``mkernel.ag_gemm``)."""
    return _ag_gemm(a, b, *_world(world))


@_ag_gemm_op.register_fake
def _(a: Tensor, b: Tensor, world: str) -> Tensor:
    w = lookup(world)
    return a.new_empty((*_lead(w), a.shape[-2] * w.size, b.shape[-1]), dtype=bf16)


@torch.library.custom_op("mkernel::gemm_ar", mutates_args=())
def _gemm_ar_op(a: Tensor, b: Tensor, world: str) -> Tensor:
    """GEMM + AllReduce. Per rank: a bf16 [M, K/W], b bf16 [K/W, N]; returns bf16 [M, N] =
    ``sum_q a_q.float() @ b_q.float()`` rounded once, on every rank (``mkernel.gemm_ar``)."""
    return _gemm_ar(a, b, *_world(world))


@_gemm_ar_op.register_fake
def _(a: Tensor, b: Tensor, world: str) -> Tensor:
    w = lookup(world)
    return a.new_empty((*_lead(w), a.shape[-2], b.shape[-1]), dtype=bf16)


@torch.library.custom_op("mkernel::all_gather", mutates_args=())
def _all_gather_op(x: Tensor, world: str) -> Tensor:
    """AllGather. Per rank: x bf16 [R, C]; returns bf16 [W * R, C] = ``torch.cat(x_q for q in
    ranks)`` (``mkernel.all_gather``)."""
    return _all_gather(x, *_world(world))


@_all_gather_op.register_fake
def _(x: Tensor, world: str) -> Tensor:
    w = lookup(world)
    return x.new_empty((*_lead(w), x.shape[-2] * w.size, x.shape[-1]), dtype=bf16)


# -- attention and ring attention (differentiable) ------------------------------------------------


@functools.cache
def _solo_world(device: str) -> World:
    """A 1-rank emulated world on ``device`` (plain attention's backward runs there)."""
    return World.emulated(1, device=device)


def _grads_like(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The backward's fake results: bf16 dq, dk, dv of q's, k's and v's shapes."""
    return tuple(t.new_empty(t.shape, dtype=bf16) for t in (q, k, v))


def _attention_shapes(q: Tensor, lead: tuple[int, ...]) -> tuple[tuple, tuple]:
    """(out, lse) shapes for q [*lead, B, S, Hq, D]: out like q, lse fp32 [*lead, B, Hq, S]."""
    *_, B, S, H, _ = q.shape
    return tuple(q.shape), (*lead, B, H, S)


@torch.library.custom_op("mkernel::ring_attention", mutates_args=())
def _ring_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    world: str,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
) -> tuple[Tensor, Tensor]:
    """Ring attention over the ranks' sequence shards. Per rank: q bf16 [B, S_local, Hq, D], k, v
    bf16 [B, S_local, Hkv, D]; returns (out bf16 like q, lse fp32 [B, Hq, S_local]): softmax
    attention of the rank's queries over the whole sequence at the layout's positions
    (``mkernel.ring_attention``). Differentiable (``ring_attention_backward``)."""
    with torch.no_grad():  # the custom op's autograd is registered below, not the Function's
        w, schedule = _world(world)
        return _ring_attention(q, k, v, w, causal, scale, layout, schedule)


@_ring_attention_op.register_fake
def _(q, k, v, world, causal=False, scale=None, layout="contiguous"):
    out_shape, lse_shape = _attention_shapes(q, _lead(lookup(world)))
    return q.new_empty(out_shape, dtype=bf16), q.new_empty(lse_shape, dtype=f32)


@torch.library.custom_op("mkernel::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dlse: Tensor | None,
    world: str,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients (dq, dk, dv) (bf16, like q, k, v) of ``ring_attention`` for the incoming
    gradients ``dout`` (bf16 like out) and ``dlse`` (fp32 like lse, or None: zero), from the
    forward's ``out`` and ``lse`` (``mkernel.ring_attention_backward``)."""
    w, schedule = _world(world)
    return _bwd.run(dout, q, k, v, out, lse, w, causal, scale, layout, schedule, dlse)


@_ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, world, causal=False, scale=None, layout="contiguous"):
    return _grads_like(q, k, v)


def _grads_in(ctx, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The incoming gradients as the backward ops take them: dout bf16 (zeros when None), dlse
    fp32 or None, both contiguous."""
    out = ctx.saved_tensors[3]
    dout = torch.zeros_like(out) if dout is None else dout.to(bf16).contiguous()
    return dout, None if dlse is None else dlse.to(f32).contiguous()


def _ring_setup(ctx, inputs, output) -> None:
    q, k, v, world, causal, scale, layout = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = (world, causal, scale, layout)


def _ring_backward(ctx, dout, dlse):
    dout, dlse = _grads_in(ctx, dout, dlse)
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _ring_attention_backward_op(dout, q, k, v, out, lse, dlse, *ctx.args)
    return dq, dk, dv, None, None, None, None


_ring_attention_op.register_autograd(_ring_backward, setup_context=_ring_setup)


@torch.library.custom_op("mkernel::attention", mutates_args=())
def _attention_op(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Plain attention (one rank, no world): q bf16 [B, S, Hq, D], k, v bf16 [B, S, Hkv, D];
    returns (out bf16 [B, S, Hq, D], lse fp32 [B, Hq, S]) = softmax(q k^T * scale) v and the log
    of each row's softmax denominator (``mkernel.attention``). Differentiable."""
    with torch.no_grad():
        return _attention(q, k, v, causal, scale)


@_attention_op.register_fake
def _(q, k, v, causal=False, scale=None):
    out_shape, lse_shape = _attention_shapes(q, ())
    return q.new_empty(out_shape, dtype=bf16), q.new_empty(lse_shape, dtype=f32)


@torch.library.custom_op("mkernel::attention_backward", mutates_args=())
def _attention_backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dlse: Tensor | None,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients (dq, dk, dv) of ``attention`` (shapes as ``ring_attention_backward`` at one
    rank, without the rank dimension)."""
    world = _solo_world(str(q.device))
    lift = lambda t: None if t is None else t.unsqueeze(0)  # noqa: E731
    ins = (lift(t) for t in (dout, q, k, v, out, lse))
    grads = _bwd.run(*ins, world, causal, scale, "contiguous", None, lift(dlse))
    return tuple(g[0] for g in grads)


@_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, causal=False, scale=None):
    return _grads_like(q, k, v)


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = (causal, scale)


def _attention_backward(ctx, dout, dlse):
    dout, dlse = _grads_in(ctx, dout, dlse)
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(dout, q, k, v, out, lse, dlse, *ctx.args)
    return dq, dk, dv, None, None


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)


# -- MoE: dispatch + grouped GEMM, grouped GEMM + combine -----------------------------------------


def _padded(parts: Sequence[Tensor], rows: int, fill: float) -> Tensor:
    """Per-rank [R_d, C] tensors (R_d <= rows) as one [n, rows, C] tensor, padded with ``fill``."""
    out = parts[0].new_full((len(parts), rows, parts[0].shape[1]), fill)
    for d, p in enumerate(parts):
        out[d, : p.shape[0]] = p
    return out


@torch.library.custom_op("mkernel::moe_dispatch_gemm", mutates_args=())
def _moe_dispatch_gemm_op(
    x: Tensor, topk_ids: Tensor, w1: Tensor, world: str
) -> tuple[Tensor, Tensor, Tensor]:
    """MoE dispatch + first grouped GEMM. Per rank: x bf16 [T, H], topk_ids int32/int64 [T, k]
    (global expert ids in [0, W * E_local), -1 unused), w1 bf16 [E_local, H, I]. Returns, per
    destination rank d, in the worst case's layout of R = W * T * min(k, E_local) rows:
    y bf16 [R, I] (row of (s, t, j) routed to d's expert e: ``x_s[t].float() @ w1_d[e].float()``
    rounded; rows by expert, source, token, slot), src int32 [R, 3] (source, token, slot) and
    expert_offsets int32 [E_local + 1] (expert e's rows; rows from ``expert_offsets[-1]`` on are
    zeros in y, -1 in src) (``mkernel.moe_dispatch_gemm``)."""
    w, schedule = _world(world)
    d: MoeDispatch = _moe_dispatch_gemm(x, topk_ids, w1, w, schedule)
    T, k = topk_ids.shape[-2:]
    rows = max_rows(w.size, T, k, w1.shape[-3])
    offsets = torch.stack(list(d.expert_offsets)).to(x.device)  # [n, E + 1]
    y, src = _padded(d.y, rows, 0.0), _padded([s.to(x.device) for s in d.src], rows, -1)
    # rows past each rank's count are unspecified when the dispatch ran under CUDA-graph capture
    # (MoeDispatch.captured): set on the device, no host read
    valid = torch.arange(rows, device=x.device) < offsets[:, -1:]  # [n, rows]
    y = torch.where(valid[..., None], y, 0.0)
    src = torch.where(valid[..., None], src, -1)
    if not w.emulated_world:
        return y[0], src[0], offsets[0]
    return y, src, offsets


@_moe_dispatch_gemm_op.register_fake
def _(x, topk_ids, w1, world):
    w = lookup(world)
    lead = _lead(w)
    T, k = topk_ids.shape[-2:]
    E, _, inter = w1.shape[-3:]
    rows = w.size * T * torch.sym_min(k, E)
    y = x.new_empty((*lead, rows, inter), dtype=bf16)
    return y, x.new_empty((*lead, rows, 3), dtype=i32), x.new_empty((*lead, E + 1), dtype=i32)


@torch.library.custom_op("mkernel::moe_gemm_combine", mutates_args=())
def _moe_gemm_combine_op(
    h: Tensor,
    w2: Tensor,
    src: Tensor,
    expert_offsets: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    world: str,
) -> Tensor:
    """Second grouped GEMM + combine. Per rank: h bf16 [R, I] in the dispatch's layout (e.g. an
    activation of its y), w2 bf16 [E_local, I, H], the dispatch's src [R, 3] and expert_offsets
    [E_local + 1], the routing topk_ids [T, k] it ran and topk_weights fp32 [T, k]. Returns bf16
    [T, H]: ``out_s[t] = sum_j topk_weights_s[t, j] * h_d[row(s, t, j)].float() @ w2_d[e].float()``
    rounded once, zero for a token routed nowhere (``mkernel.moe_gemm_combine``)."""
    w, schedule = _world(world)
    emulated = w.emulated_world
    per_rank = (lambda t: list(t.unbind(0))) if emulated else (lambda t: [t])  # noqa: E731
    hs = per_rank(h)
    dispatch = MoeDispatch(
        y=hs,
        src=per_rank(src),
        expert_offsets=per_rank(expert_offsets),
        world=w,
        topk_ids=topk_ids.to(i32),
        hidden=w2.shape[-1],
        captured=True,  # the worst case's rows
        peak_rows=h.shape[-2],
    )
    return _moe_gemm_combine(hs if emulated else h, w2, dispatch, topk_weights, w, schedule)


@_moe_gemm_combine_op.register_fake
def _(h, w2, src, expert_offsets, topk_ids, topk_weights, world):
    lead = _lead(lookup(world))
    return h.new_empty((*lead, topk_weights.shape[-2], w2.shape[-1]), dtype=bf16)


@torch.library.custom_op("mkernel::grouped_gemm", mutates_args=())
def _grouped_gemm_op(
    a: Tensor,
    b: Tensor,
    offsets: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    rows: Tensor | None = None,
    tile: str | None = None,
) -> Tensor:
    """Grouped GEMM (one device, no world): a bf16 [M, K], b bf16 [G, K, N], offsets int32
    [G + 1]; returns [M, N] of ``out_dtype`` (bf16 or fp32): ``out[offsets[g]:offsets[g + 1]] =
    a[offsets[g]:offsets[g + 1]].float() @ b[g].float()``, zeros in rows of no group. ``rows``
    (int32 [M']) gathers a's rows first (out is then [M', N]) (``mkernel.grouped_gemm``)."""
    m = a.shape[0] if rows is None else rows.shape[0]
    out = torch.zeros((m, b.shape[2]), dtype=out_dtype, device=a.device)
    return _grouped_gemm(a, b, offsets, out=out, out_dtype=out_dtype, rows=rows, tile=tile)


@_grouped_gemm_op.register_fake
def _(a, b, offsets, out_dtype=torch.bfloat16, rows=None, tile=None):
    m = a.shape[0] if rows is None else rows.shape[0]
    return a.new_empty((m, b.shape[2]), dtype=out_dtype)


# -- the custom ops by name, and wrappers that take a World --------------------------------------

OPS = {
    "gemm_rs": _gemm_rs_op,
    "ag_gemm": _ag_gemm_op,
    "gemm_ar": _gemm_ar_op,
    "all_gather": _all_gather_op,
    "attention": _attention_op,
    "attention_backward": _attention_backward_op,
    "ring_attention": _ring_attention_op,
    "ring_attention_backward": _ring_attention_backward_op,
    "moe_dispatch_gemm": _moe_dispatch_gemm_op,
    "moe_gemm_combine": _moe_gemm_combine_op,
    "grouped_gemm": _grouped_gemm_op,
}


def gemm_rs(a: Tensor, b: Tensor, world: World | str) -> Tensor:
    """``torch.ops.mkernel.gemm_rs(a, b, world_handle(world))`` (see ``mkernel.gemm_rs``)."""
    return torch.ops.mkernel.gemm_rs(a, b, world_handle(world))


def ag_gemm(a: Tensor, b: Tensor, world: World | str) -> Tensor:
    """``torch.ops.mkernel.ag_gemm(a, b, world_handle(world))`` (see ``mkernel.ag_gemm``)."""
    return torch.ops.mkernel.ag_gemm(a, b, world_handle(world))


def gemm_ar(a: Tensor, b: Tensor, world: World | str) -> Tensor:
    """``torch.ops.mkernel.gemm_ar(a, b, world_handle(world))`` (see ``mkernel.gemm_ar``)."""
    return torch.ops.mkernel.gemm_ar(a, b, world_handle(world))


def all_gather(x: Tensor, world: World | str) -> Tensor:
    """``torch.ops.mkernel.all_gather(x, world_handle(world))`` (see ``mkernel.all_gather``)."""
    return torch.ops.mkernel.all_gather(x, world_handle(world))


def attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """``torch.ops.mkernel.attention`` (see ``mkernel.attention``); differentiable."""
    return torch.ops.mkernel.attention(q, k, v, causal, scale)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    world: World | str,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
) -> tuple[Tensor, Tensor]:
    """``torch.ops.mkernel.ring_attention`` (see ``mkernel.ring_attention``); differentiable."""
    return torch.ops.mkernel.ring_attention(q, k, v, world_handle(world), causal, scale, layout)


def moe_dispatch_gemm(
    x: Tensor, topk_ids: Tensor, w1: Tensor, world: World | str
) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.ops.mkernel.moe_dispatch_gemm``: (y, src, expert_offsets) in the worst case's
    layout (module docstring; ``mkernel.moe_dispatch_gemm``)."""
    return torch.ops.mkernel.moe_dispatch_gemm(x, topk_ids, w1, world_handle(world))


def moe_gemm_combine(
    h: Tensor,
    w2: Tensor,
    src: Tensor,
    expert_offsets: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    world: World | str,
) -> Tensor:
    """``torch.ops.mkernel.moe_gemm_combine`` (see ``mkernel.moe_gemm_combine``)."""
    handle = world_handle(world)
    return torch.ops.mkernel.moe_gemm_combine(
        h, w2, src, expert_offsets, topk_ids, topk_weights, handle
    )


def grouped_gemm(
    a: Tensor,
    b: Tensor,
    offsets: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    rows: Tensor | None = None,
    tile: str | None = None,
) -> Tensor:
    """``torch.ops.mkernel.grouped_gemm`` (see ``mkernel.grouped_gemm``; zeros in no group)."""
    return torch.ops.mkernel.grouped_gemm(a, b, offsets, out_dtype, rows, tile)
