"""The persistent template's twin: runs a plan's tables in the interpreter.

One generic task program, the same as templates/persistent.cuh executes on the GPU, for every task
of every unit of every rank::

    waits (acquire; then the resets the task owns)  ->  proxy fence  ->  the op's data movement twin
    ->  bulk copies landed  ->  raises (release; a silent rank raises nothing, a late one sleeps)

preceded by the entry barrier of the unit's CTA (intra_sm: the comm warp starts once its CTA passed
it). Only the data movement is the op's (``moves[role](ctx, task)``); the waits and raises come from
the plan, so what is property-tested here is the protocol the GPU runs. Signals print as the GPU
names them (``tile_flag[tile=3, src=1]``, mkernel/protocol.py signal_name). The end of each call on
a rank reads every output tile ``outputs(rank)`` of buffer ``out`` (or the one named ``output``).

A plan over several nodes (``plan.nodes`` > 1, docs/rdma.md "Hierarchical ops"): the entry barrier
spans the CTA's node; a raise on a rank of another node travels through the rank's ``proxy`` ring
(interp/rdma.py, one host proxy agent per rank): carried by the put the task's data movement asked
for (``put_on_completion``: put-with-signal), else as a put of no bytes; puts are posted when the
task completes, after its bulk copies landed; and a unit that posted waits at its end until its
ring's tail has passed its last ticket (the quiet: the proxy has read every source, so the next
call may rewrite them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import PlanError
from ..protocol import BARRIER_PAD, MAX_BARRIER_SLOTS, Raise, Task, signal_name
from . import twins
from .machine import Machine, SigRef, Wait
from .rdma import Ring, proxy, rdma_put

# Descriptor slots of each rank's ring in the interpreter: few, so that wrap-around and
# back-pressure happen in the tests (the GPU's ring is sized by its ProxyRing).
RING_CAPACITY = 4
# Agents that claim one comm unit's tasks of an op whose comm tasks run in any order (its SPEC's
# constant comm_any_order; the device's warps claim them, templates/persistent.cuh claim_comm).
ANY_ORDER_AGENTS = 3

Rect = tuple[int, int, int, int]


@dataclass(frozen=True)
class NamedSig(SigRef):
    """A flag of a pad (flat index) that prints under the name both backends use."""

    label: str = field(default="", compare=False)

    def __str__(self) -> str:
        return self.label


class PlanSignals:
    """Flags of a plan's pads, by pad name and flat index, named as on the GPU."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.ids = {p.name: i for i, p in enumerate(plan.spec.all_pads())}

    def __call__(self, pad: str, rank: int, flat: int) -> NamedSig:
        label = signal_name(self.plan.spec, self.ids[pad], flat, self.plan.sizes)
        return NamedSig(pad, rank, (flat,), label=label)


def _flat_index(plan, pad: str, index: tuple[int, ...]) -> int:
    from ..protocol import _flat

    return _flat(plan.spec, plan.sizes, pad, index)[1]


def run_waits(ctx, plan, sig: PlanSignals, task: Task):
    """The template's run_waits: every wait, then the resets this task owns."""
    flats = [_flat_index(plan, w.pad, w.index) for w in task.waits]
    for w, flat in zip(task.waits, flats, strict=True):
        yield from twins.wait_acquire(ctx, sig(w.pad, w.rank, flat), w.value, w.peer)
    for w, flat in zip(task.waits, flats, strict=True):
        if w.consumers == 1:
            yield from twins.signal_set_relaxed(ctx, sig(w.pad, w.rank, flat), 0)
        elif w.consumers > 1:
            counter = sig(w.pad + "_count", w.rank, flat)
            old = yield from twins.fetch_add_relaxed(ctx, counter, 1)
            if old + 1 == w.consumers:
                yield from twins.signal_set_relaxed(ctx, sig(w.pad, w.rank, flat), 0)
                yield from twins.signal_set_relaxed(ctx, counter, 0)
    if task.waits:
        yield from twins.fence_proxy_async(ctx)


class RdmaPort:
    """The template's side of the ``proxy`` transport in a plan over several nodes: the ring of
    every rank, the puts each running task asked for, each unit's last ticket."""

    def __init__(self, machine: Machine, ring: Ring) -> None:
        self.m = machine
        self.ring = ring
        # (agent id, task id) -> {dest: (dst_buf, dst_rect, src_buf, src_rect)}
        self.queued: dict[tuple[int, int], dict[int, tuple]] = {}
        self.last: dict[int, int] = {}  # agent id -> the last ticket it took

    def remote(self, ctx, rank: int) -> bool:
        return self.m.node_of(rank) != self.m.node_of(ctx.rank)

    def post(self, ctx, r: Raise, flag: SigRef | None, put: tuple | None):
        """One descriptor: the bytes of ``put`` (None: none) and ``flag`` (None: no signal)."""
        dst_buf, dst_rect, src_buf, src_rect = put or (None, None, None, None)
        t = yield from rdma_put(
            ctx, self.ring, r.rank, dst_buf, dst_rect, src_buf, src_rect, flag, r.value, r.op
        )
        self.last[ctx.agent.id] = t

    def quiet(self, ctx):
        """The unit's puts are done: its ring's tail has passed its last ticket (the proxy has read
        every source and raised every signal; device: a bounded wait on the tail)."""
        t = self.last.pop(ctx.agent.id, None)
        if t is not None:
            tail = self.ring.counter("tail", ctx.rank)
            yield Wait(tail, t + 1, reset=False, peer=ctx.rank, at_least=True)


def put_on_completion(
    ctx, task: Task, dest: int, dst_buf: str, dst_rect: Rect, src_buf: str, src_rect: Rect
) -> None:
    """An op's data movement across nodes: copy ``src_rect`` of ``src_buf`` on this rank into
    ``dst_rect`` of ``dst_buf`` on ``dest`` (a rank of another node) by an rdma put that the
    template posts when ``task`` completes (after its bulk copies landed), carrying the task's raise
    on ``dest`` (put-with-signal); one put per destination and task. The source must hold the
    bytes by then and keep them until the unit's quiet."""
    port, a = ctx.m.rdma, ctx.agent
    where, what = {"role": a.role, "unit": a.unit}, f"put to rank {dest}"
    if port is None or not port.remote(ctx, dest):
        why = "within a node data moves by peer stores and bulk copies"
        raise PlanError("rdma put within a node", ctx.rank, task.id, what, why, **where)
    if not any(r.rank == dest for r in task.raises):
        why = "a put carries the task's raise on its destination (put-with-signal)"
        raise PlanError("rdma put without a raise", ctx.rank, task.id, what, why, **where)
    puts = port.queued.setdefault((a.id, task.id), {})
    if dest in puts:
        raise PlanError("two rdma puts", ctx.rank, task.id, what, "one per task", **where)
    puts[dest] = (dst_buf, dst_rect, src_buf, src_rect)


def run_raises(ctx, plan, sig: PlanSignals, task: Task):
    """The template's run_raises, after the task's writes have landed."""
    f = plan.faults
    port = ctx.m.rdma
    if port is not None:
        yield from _run_raises_nodes(ctx, plan, sig, task, port)
        return
    if not task.raises or ctx.rank == f.silent_rank:
        return
    if ctx.rank == f.delay_rank:
        yield from twins.delay(ctx, f.delay_us)
    for r in task.raises:
        flag = sig(r.pad, r.rank, _flat_index(plan, r.pad, r.index))
        if r.op == "add":
            yield from twins.signal_add_release(ctx, flag, r.value)
        else:
            yield from twins.signal_set_release(ctx, flag, r.value)


def _run_raises_nodes(ctx, plan, sig: PlanSignals, task: Task, port: RdmaPort):
    """run_raises over several nodes: a raise on another node's rank is a descriptor in this rank's
    ring, with the bytes of the put the task asked for to that rank, if any. A silent rank's puts
    still move their bytes, with no signal."""
    f = plan.faults
    puts = port.queued.pop((ctx.agent.id, task.id), {})
    if not task.raises:
        return
    silent = ctx.rank == f.silent_rank
    if ctx.rank == f.delay_rank:
        yield from twins.delay(ctx, f.delay_us)
    for r in task.raises:
        flag = sig(r.pad, r.rank, _flat_index(plan, r.pad, r.index))
        if port.remote(ctx, r.rank):
            yield from port.post(ctx, r, None if silent else flag, puts.pop(r.rank, None))
        elif silent:
            continue
        elif r.op == "add":
            yield from twins.signal_add_release(ctx, flag, r.value)
        else:
            yield from twins.signal_set_release(ctx, flag, r.value)


def may_defer_completion(task: Task, nxt: Task | None) -> bool:
    """Whether a compute task's completion may wait for the next task's epilogue (the engine's
    default): not when it raises and the next task waits (PlanHooks::defer_after_store), since the
    next task's waits may need what this one raises, on another rank, in a cycle."""
    return not (task.raises and nxt is not None and nxt.waits)


def entry_barrier(ctx, sig: PlanSignals, slot: int):
    """CTA ``slot`` meets CTA ``slot`` of every peer of its node (every rank, with one node):
    arrive by setting barrier[slot, me] on the peer once the previous call's arrival there was
    consumed (the device's CAS 0 -> 1), then wait for every peer's arrival on our own pad and
    consume it. Across nodes an op orders the reuse of what it puts itself (docs/rdma.md)."""
    W, node = ctx.W, ctx.m.node_of
    peers = [p for p in ((ctx.rank + i) % W for i in range(1, W)) if node(p) == node(ctx.rank)]
    for peer in peers:
        flag = sig(BARRIER_PAD, peer, slot * W + ctx.rank)
        yield from twins.wait_acquire(ctx, flag, 0, peer)
        yield from twins.signal_set_release(ctx, flag, 1)
    for peer in peers:
        flag = sig(BARRIER_PAD, ctx.rank, slot * W + peer)
        yield from twins.wait_acquire_reset(ctx, flag, 1, peer)


class _Claims:
    """One comm unit's tasks shared by several agents: each next() on the shared iterator claims
    the next task (the warps of a CTA and its counter in shared memory). Made when the first agent
    starts iterating, after its prologue (a device-filled role is laid out by then)."""

    def __init__(self, tasks) -> None:
        self.tasks, self.it = tasks, None

    def __iter__(self):
        if self.it is None:
            self.it = iter(self.tasks)
        return self.it


class _LaidOut:
    """The task ids a unit runs in a device-filled role: read when the unit starts iterating,
    i.e. after its prologue has waited for the layout phase (the device reads task_span then)."""

    def __init__(self, filled: dict, key: tuple, unit: int, units: int) -> None:
        self.filled, self.key, self.unit, self.units = filled, key, unit, units

    def __iter__(self):
        tasks = self.filled.get(self.key, [])
        return iter([t.id for t in tasks[self.unit :: self.units]])


def run_plan(
    world,
    plan,
    buffers: dict[str, torch.Tensor],
    moves: dict[str, Callable],
    seed: int,
    outputs: Callable[[int], dict[int, Rect]],
    calls: int = 1,
    layout: Callable | None = None,
    output: str = "out",
) -> Machine:
    """Runs ``calls`` calls of ``plan`` back to back on one machine state (the second call's agents
    of a rank start when its first call's have finished, as kernels on one stream). ``buffers``:
    every data buffer and pad by name ([W, ...] tensors; pads are reset by the protocol itself).

    A plan with device-filled roles (``Capacity``) needs ``layout(ctx)``: the twin of the op's
    device ``layout``, a generator returning ``{role: [Task, ...]}`` for ``ctx.rank``. As on the
    GPU (templates/persistent.cuh layout_phase), CTA slot 0 of each rank runs it after the entry
    barrier and raises the rank's layout flag (barrier[0, rank]); every other CTA of the rank waits
    for it before it reads its tasks, and the last of them resets it (counter barrier[1, rank]).
    ``outputs(rank)`` is asked at the end of the call, so it may depend on what the layout made.
    ``output`` names the buffer those tiles are in (an op whose result is not ``out``); an op with
    several output buffers returns ``{buffer: {tile: rect}}`` instead (Machine.expect_outputs)."""
    device_roles = [role for role, t in plan.roles.items() if t.capacity is not None]
    if device_roles and layout is None:
        raise ValueError(f"{plan.op}: roles {device_roles} are filled on the device: pass layout")
    W = world.size
    pad_names = [p.name for p in plan.spec.all_pads()]
    pads = {name: buffers[name].view(W, -1) for name in pad_names}
    # inside a CTA: its comm agent j may start (the CTA's barrier and layout are done)
    pads["cta_ready"] = torch.zeros(W, MAX_BARRIER_SLOTS, ANY_ORDER_AGENTS, dtype=torch.int32)
    any_order = bool(dict(plan.spec.constants).get("comm_any_order", 0))
    agents = ANY_ORDER_AGENTS if any_order else 1
    data = {k: v for k, v in buffers.items() if k not in pads}
    steps = max(10_000, int(world.timeout_s * 200_000))
    nodes = plan.nodes
    ring = Ring(W, RING_CAPACITY) if nodes > 1 else None
    if ring is not None:  # the proxy transport: a ring per rank, drained by the rank's host proxy
        pads.update(ring.pads())
        data.update(ring.buffers())
    m = Machine(W, pads, data, seed=seed, deadline_steps=steps, nodes=nodes)
    port = None
    if ring is not None:
        m.rdma = port = RdmaPort(m, ring)
        for r in range(W):
            m.add_agent(r, "proxy", -1, [0], proxy(ring, None), host=True)
    sig = PlanSignals(plan)
    by_id = {
        (role, r, t.id): t
        for role, tables in plan.roles.items()
        for r, ts in enumerate(tables.tasks)
        for t in ts
    }
    filled: dict[tuple[int, int, str], list[Task]] = {}  # (call, rank, role) -> the layout's tasks
    laid_by_id: dict[tuple[int, int, str, int], Task] = {}  # the same, by (call, rank, role, id)

    def find(ctx, role: str, task_id: int) -> Task:
        if role not in device_roles:
            return by_id[(role, ctx.rank, task_id)]
        return laid_by_id[(ctx.agent.call, ctx.rank, role, task_id)]

    def layout_phase(ctx, slot: int):
        flag = sig(BARRIER_PAD, ctx.rank, ctx.rank)  # barrier[0, rank]: no entry-barrier flag
        count = sig(BARRIER_PAD, ctx.rank, W + ctx.rank)  # barrier[1, rank]
        readers = plan.ctas_per_rank - 1
        if slot == 0:
            made = yield from layout(ctx)
            for role in device_roles:
                tasks = list(made.get(role, []))
                cap = plan.roles[role].capacity
                waits = sum(len(t.waits) for t in tasks)
                raises = sum(len(t.raises) for t in tasks)
                if len(tasks) > cap.rows or waits > cap.waits or raises > cap.raises:
                    raise ValueError(
                        f"{plan.op}: rank {ctx.rank}'s layout made {len(tasks)} {role} tasks, "
                        f"{waits} waits, {raises} raises: over the plan's {cap}"
                    )
                filled[(ctx.agent.call, ctx.rank, role)] = tasks
                laid_by_id.update({(ctx.agent.call, ctx.rank, role, t.id): t for t in tasks})
            if readers > 0:
                yield from twins.signal_set_release(ctx, flag, 1)
        else:
            yield from twins.wait_acquire(ctx, flag, 1, ctx.rank)
            old = yield from twins.fetch_add_relaxed(ctx, count, 1)
            if old + 1 == readers:  # the last reader resets both for the next call
                yield from twins.signal_set_relaxed(ctx, flag, 0)
                yield from twins.signal_set_relaxed(ctx, count, 0)

    def program(role: str, prologue: Callable, next_of: Callable | None = None) -> Callable:
        # The GEMM engine completes a compute task (bulk wait, raises) in the NEXT task's epilogue,
        # after that task's waits and loads, unless the task raises and the next one waits
        # (may_defer_completion): the twin defers the same way, so a plan that needs an early raise
        # deadlocks here as on the GPU.
        pending: list[Task] = []

        def complete(ctx, task: Task):
            yield from twins.bulk_wait_all(ctx)
            yield from run_raises(ctx, plan, sig, task)

        def run(ctx, task_id: int):
            task = find(ctx, role, task_id)
            yield from run_waits(ctx, plan, sig, task)
            yield from moves[role](ctx, task)
            while pending:
                yield from complete(ctx, pending.pop())
            nxt = next_of(ctx, task_id) if next_of is not None else None
            if next_of is not None and may_defer_completion(task, nxt):
                pending.append(task)
            else:
                yield from complete(ctx, task)

        def epilogue(ctx):
            while pending:
                yield from complete(ctx, pending.pop())
            if port is not None:
                yield from port.quiet(ctx)

        run.prologue = prologue
        run.epilogue = epilogue
        return run

    def cta(slot: int, publish: range) -> Callable:
        def prologue(ctx):
            yield from entry_barrier(ctx, sig, slot)
            if device_roles:
                yield from layout_phase(ctx, slot)
            for j in publish:  # comm agents of this CTA start after its barrier (and layout)
                yield from twins.local_event_set(ctx, SigRef("cta_ready", ctx.rank, (slot, j)))

        return prologue

    def comm_warp(slot: int, j: int) -> Callable:
        def prologue(ctx):
            ready = SigRef("cta_ready", ctx.rank, (slot, j))
            yield from twins.wait_acquire_reset(ctx, ready, 1, ctx.rank)

        return prologue

    def tasks_of(call: int, role: str, r: int, u: int):
        if role not in device_roles:
            return plan.tasks_of(role, r, u)
        units = plan.compute_units if role == "compute" else plan.comm_units
        return _LaidOut(filled, (call, r, role), u, units)

    def following(call: int, r: int, u: int) -> Callable:
        def next_of(ctx, task_id: int) -> Task | None:  # the unit's task after task_id
            ids = list(tasks_of(call, "compute", r, u))
            i = ids.index(task_id)
            return find(ctx, "compute", ids[i + 1]) if i + 1 < len(ids) else None

        return next_of

    intra = plan.overlap == "intra_sm"
    for call in range(calls):
        for r in range(W):
            for u in range(plan.compute_units):
                pub = range(agents if intra and u < plan.comm_units else 0)
                run = program("compute", cta(u, publish=pub), following(call, r, u))
                m.add_agent(r, "compute", u, tasks_of(call, "compute", r, u), run, call=call)
            for u in range(plan.comm_units):
                tasks = tasks_of(call, "comm", r, u)
                if agents > 1:  # any order: the unit's agents claim its tasks one at a time
                    tasks = _Claims(tasks)
                slot = u if intra else plan.compute_units + u
                for j in range(agents):
                    # inter_sm: the first agent is the comm CTA (its barrier), the others its warps
                    first = not intra and j == 0
                    pro = cta(slot, publish=range(1, agents)) if first else comm_warp(slot, j)
                    m.add_agent(r, "comm", u, tasks, program("comm", pro), call=call)
            rects = (lambda r=r: outputs(r)) if device_roles else outputs(r)
            m.expect_outputs(call, r, output, rects)
    m.run()
    return m
