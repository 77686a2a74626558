"""A compiled TaskGraph: its call checks the inputs, then runs the lowered tasks: in the CPU
interpreter (the protocol tables through the template's twin, with the tasks' data-movement
twins), on a GPU as one persistent launch of the TaskGraph kernel (mkernel/taskgraph/device.py,
the same tables with tiles sized for a GPU), or with torch ops one task after another in plan
order ("eager": a reference fallback, many launches)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from ..interp import twins
from ..runtime.run import check_faults, check_schedule, result_buffer, run_cpu
from ..schedule import rank_sms
from ..world import World
from . import device as gpu_kernel
from . import ops, reference
from .lower import DropHook, Lowered, lower
from .ops import DEFAULT_BLOCKS, BlocksOf, const_2d, const_buf, value_buf

if TYPE_CHECKING:
    from .graph import TaskGraph

BACKENDS = ("interp", "kernel", "eager")


def compile_graph(
    graph: TaskGraph,
    schedule: Any = None,
    *,
    blocks: BlocksOf | None = None,
    drop: DropHook | None = None,
    backend: str | None = None,
    fuse: bool | None = None,
    device: Any = None,
) -> CompiledGraph:
    """``TaskGraph.compile``; ``blocks`` (the tile shape, or a function of the node; None: the
    interpreter's 4 x 32, or the kernel's ``device.gpu_blocks``), ``drop`` (a debug hook that
    removes waits, lower.py), ``backend`` ("interp": the CPU interpreter, the default on the
    CPU; "kernel": one persistent launch, the default on a GPU; "eager": torch ops per task) and
    ``fuse`` (norms and SiLUs computed by the linears that alone read them, lower.lowered_nodes;
    None: on the kernel backend) are for tests and benchmarks. ``device``: TaskGraph.compile's."""
    if not graph.outputs:
        raise ValueError(
            "TaskGraph.compile: the graph has no output (g.output(name, value)): nothing would "
            "be produced"
        )
    schedule = check_schedule(schedule)
    if schedule.tile_order is not None:
        raise ValueError("TaskGraph.compile: Schedule.tile_order is not taken by TaskGraph yet")
    world = graph.world
    if device is None:
        device = graph.device or torch.device("cpu")
    else:  # the graph's tensors are copied there at compile (CompiledGraph.consts)
        device = _check_device(device)
        if world is not None and world.device != device:
            world = World.emulated(world.size, device=device, timeout_s=world.timeout_s)
    world = world or World.emulated(1, device=device)
    device = world.device
    check_faults(schedule, world)
    if backend is None:
        backend = "kernel" if device.type == "cuda" else "interp"
    if backend not in BACKENDS:
        raise ValueError(f"TaskGraph.compile: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "interp" and device.type != "cpu":
        raise ValueError("TaskGraph.compile: the interpreter runs graphs on the CPU only")
    if backend == "kernel" and device.type != "cuda":
        raise ValueError("TaskGraph.compile: the kernel backend runs graphs on a CUDA device only")
    device_buffers = None
    if backend == "kernel":
        gpu_kernel.check_graph(graph)
        device_buffers = gpu_kernel.device_buffers(graph)
        if blocks is None:
            blocks = gpu_kernel.gpu_blocks(rank_sms(schedule, world))
    if blocks is None:
        blocks = DEFAULT_BLOCKS
    if fuse is None:
        fuse = backend == "kernel"
    low = lower(graph, world, schedule, blocks, drop, device_buffers, fuse)
    low.plan.extra["trace"] = schedule.trace  # the kernel records each task's span (GPU)
    return CompiledGraph(graph, world, schedule, low, backend)


def _check_device(device: Any) -> torch.device:
    """``TaskGraph.compile(device=)``: "cpu", "cuda" or a torch.device of either."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"TaskGraph.compile: device must be 'cpu' or 'cuda' (or None), got {device!r}"
        ) from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"TaskGraph.compile: device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("TaskGraph.compile: device='cuda' asked for, but torch sees no GPU")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class CompiledGraph:
    """``k(**inputs) -> {output name: tensor}`` (TaskGraph.compile says what it takes and gives)."""

    def __init__(self, graph: TaskGraph, world: World, schedule, lowered: Lowered, backend: str):
        self.graph, self.world, self.schedule = graph, world, schedule
        self.lowered, self.backend = lowered, backend
        self.W, self.per_world = world.size, graph.world is not None
        self.inputs = dict(graph.inputs)
        self.outputs = dict(graph.outputs)
        self.device = world.device
        self.consts = {}  # the build-time tensors, as [W, rows, cols] (copied at compile)
        for i in lowered.live:
            node = lowered.nodes[i]
            for name, ts in node.consts.items():
                t = torch.stack([const_2d(x) for x in ts]).to(self.device).contiguous()
                self.consts[const_buf(i, name)] = t
            if node.op == "norm_linear":  # its folded weight is the lowering's own: copied now
                lowered.nodes[i] = dataclasses.replace(node, consts={})
        self._eager_bufs: dict[str, torch.Tensor] = {}
        self.kernel = None  # the GPU kernel's tables and launch (backend "kernel")
        if backend == "kernel":
            # NOTE: the build machinery, imported at the first GPU compile (not by `import mkernel`)
            from . import kernel_ext

            self.kernel = gpu_kernel.DeviceGraph(lowered, world, self.consts, kernel_ext.load())

    @property
    def plan(self):
        """The protocol tables of the graph's tasks (mkernel.Plan)."""
        return self.lowered.plan

    def describe(self, task: int) -> str:
        return self.lowered.describe(task)

    # -- the call -------------------------------------------------------------------------------
    def _check_inputs(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        extra = sorted(set(inputs) - set(self.inputs))
        if extra:
            raise TypeError(
                f"TaskGraph call: unexpected input(s) {extra}; inputs: {sorted(self.inputs)}"
            )
        out = {}
        for name, v in self.inputs.items():
            if name not in inputs:
                raise ValueError(f"TaskGraph call: input {name!r} is missing")
            t = inputs[name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"TaskGraph call: input {name!r} must be a torch.Tensor, got {type(t).__name__}"
                )
            if t.dtype != torch.bfloat16:
                raise TypeError(
                    f"TaskGraph call: input {name!r} must be torch.bfloat16, got {t.dtype}"
                )
            if t.device != self.device:
                raise ValueError(
                    f"TaskGraph call: input {name!r} must be on {self.device}, got {t.device}"
                )
            shape = tuple(t.shape)
            if shape == v.shape:
                t = t.unsqueeze(0).expand(self.W, *v.shape)
            elif not (self.per_world and shape == (self.W, *v.shape)):
                forms = [list(v.shape)] + ([[self.W, *v.shape]] if self.per_world else [])
                raise ValueError(
                    f"TaskGraph call: input {name!r} must be of shape "
                    f"{' or '.join(map(str, forms))}, got {list(shape)}"
                )
            out[value_buf(v.id)] = t.contiguous()
        return out

    def __call__(self, **inputs: Any) -> dict[str, torch.Tensor]:
        operands = {**self._check_inputs(inputs), **self.consts}
        results = {}
        for vid in self.lowered.outputs:
            rows, cols = self.lowered.buffers[value_buf(vid)][1]
            results[value_buf(vid)] = result_buffer(
                (self.W, rows, cols), torch.bfloat16, self.device
            )
        operands.update(results)
        if self.backend == "interp":
            self._run_interp(operands)
        elif self.backend == "kernel":
            self.kernel.launch(operands)
        else:
            self._run_eager(operands)
        out = {}
        for vid, names in self.lowered.outputs.items():
            t = results[value_buf(vid)]
            for name in names:
                out[name] = t if self.per_world else t[0]
        return {name: out[name] for name in self.outputs}

    def reference(self, round_values: bool = True, **inputs: Any) -> dict[str, torch.Tensor]:
        """The graph evaluated op by op with whole-tensor torch ops in fp32 (each value rounded
        to bf16 where ``round_values``, as the tasks store them): fp32, shaped as the call's."""
        checked = self._check_inputs(inputs)
        ins = {name: checked[value_buf(v.id)] for name, v in self.inputs.items()}
        res = reference.evaluate(self.graph, ins, round_values)  # on the inputs' device
        return {name: t if self.per_world else t[0] for name, t in res.items()}

    # -- the backends ---------------------------------------------------------------------------
    def _run_interp(self, operands: dict[str, torch.Tensor]) -> None:
        low, nodes = self.lowered, self.lowered.nodes
        outs = set(low.outputs)

        def move(ctx, task):  # the task's data movement: load its reads, compute, store the tile
            t = low.tasks[ctx.rank][task.id]
            loaded = []
            for rd in t.reads:
                load = twins.tile_load_async if rd.rank == ctx.rank else twins.tile_load
                loaded.append((yield from load(ctx, rd.buf, rd.rank, rd.rect)))
            node = nodes[t.node]
            y = ops.compute(node, loaded).to(torch.bfloat16)
            buf = value_buf(node.out.id)
            if node.out.id in outs:
                yield from twins.output_store(ctx, buf, ctx.rank, t.rect, y, task.id)
            else:  # an intermediate: a TMA store, landed before the task's raise
                yield from twins.tile_send_bulk(ctx, buf, ctx.rank, t.rect, y)

        def reads(rank: int) -> dict[str, dict[int, tuple]]:  # the kernel end reads the outputs
            found: dict[str, dict[int, tuple]] = {}
            for i, t in enumerate(low.tasks[rank]):
                vid = nodes[t.node].out.id
                if vid in outs:
                    found.setdefault(value_buf(vid), {})[i] = t.rect
            return found

        moves = {"compute": move, "comm": None}
        run_cpu(self.world, low.plan, operands, moves, reads, self.schedule.seed)

    def _run_eager(self, operands: dict[str, torch.Tensor]) -> None:
        low, nodes = self.lowered, self.lowered.nodes
        for name, (kind, shape) in low.buffers.items():
            if kind == "symmetric" and name not in self._eager_bufs:
                self._eager_bufs[name] = torch.empty(
                    (self.W, *shape), dtype=torch.bfloat16, device=self.device
                )
        bufs = {**operands, **self._eager_bufs}

        def view(buf: str, rank: int, rect) -> torch.Tensor:
            r0, nr, c0, nc = rect
            return bufs[buf][rank, r0 : r0 + nr, c0 : c0 + nc]

        for i in range(len(low.tasks[0])):  # task i on every rank, then i + 1: a topological order
            for r in range(self.W):
                t = low.tasks[r][i]
                node = nodes[t.node]
                y = ops.compute(node, [view(rd.buf, rd.rank, rd.rect) for rd in t.reads])
                view(value_buf(node.out.id), r, t.rect).copy_(y.to(torch.bfloat16))
