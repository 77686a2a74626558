"""Lowering: a TaskGraph into tasks (tiles of its ops) with per-tile events, as a protocol Plan.

Tasks. The live nodes (those an output depends on) in build order, each cut into tiles
(mkernel/taskgraph/ops.py); task i of every rank is the same tile of the same op, so task ids are
rank-independent. Every rank's list is a topological order: a task reads only tiles of earlier
tasks. All tasks are in the compute role (no comm role: the collectives pull their peers' tiles).

Events. A task depends, before it loads anything, on every tile j (of rank q) that overlaps a
rectangle it reads, and nothing else: a down-projection tile waits for the SiLU tiles of its rows,
not for the whole SiLU op (``Lowered.deps``). Two counted signal pads per rank carry them:
``ready[task]``: task j raises ``ready[j]`` on its own rank (set 1, release) after its tile has
landed, for the reads that cover that tile alone; and ``ready_group[group]``: a group is the set
of tiles one read covers where it covers several (a norm or a linear reading whole rows, an
attention partial the q tiles of its heads' columns), and each of its tiles adds 1 there once
landed, so the read waits once, for the group's size, instead of once per tile. NOTE: a wait is a
poll and an acquire fence on the task's one producer thread; an MLP norm's 128 waits, one after
another, took 0.2 ms of a 0.7 ms decode layer (one H100). A flag or count is raised only if some
task waits on it. ``consumers`` is the number of waits on it over all ranks, so the last reader
resets it (and its counter) and the pads end every call at zero.

No deadlock: units take a rank's tasks round robin (task u, u + n, ...) and run them in order, and
every rank has the same topological order, so a wait of task i only needs tasks j < i; by
induction on i every task runs.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..protocol import Buffer, OpSpec, Pad, Raise, Task, Wait
from ..schedule import TILE_CONFIGS, Plan, Schedule, build_plan
from ..tiles import Tile
from ..world import World
from .ops import (
    DEFAULT_BLOCKS,
    Blocks,
    BlocksOf,
    TileTask,
    const_2d,
    const_buf,
    fuse_linears,
    split_attention,
    tiles,
    value_buf,
)

if TYPE_CHECKING:
    from .graph import Node, TaskGraph

# A debug hook (tests): drop(rank, task, peer, producer) -> True drops the wait of ``task`` on
# ``rank`` for tile ``producer`` of ``peer`` from the plan, as a lowering bug would.
DropHook = Callable[[int, int, int, int], bool]
READY = "ready"
COUNT = "ready_group"  # the groups' counts (module docstring)
_IDS = itertools.count()  # each compiled graph's own spec name, so workspaces never mix


@dataclass
class Lowered:
    """A graph's tasks per rank (``tasks[r][i]``: what task i reads and writes), the live nodes,
    the output values, the buffers and the Plan (protocol tables)."""

    nodes: list[Node]  # the lowered nodes (lowered_nodes), by index (the dead ones too)
    live: list[int]  # the indices of the nodes the outputs need, in order
    tasks: list[list[TileTask]]
    deps: list[list[list[tuple[int, int]]]]  # [rank][task]: the (rank, task) tiles it waits for
    outputs: dict[int, list[str]]  # output value id -> its output names
    buffers: dict[str, tuple[str, tuple[int, int]]]  # name -> (kind, per-rank 2-D shape)
    plan: Plan

    def describe(self, task: int) -> str:
        """What task ``task`` is: ``linear #5 (node 5) rows 0:4 cols 32:64``."""
        t = self.tasks[0][task]
        r0, nr, c0, nc = t.rect
        return f"{self.nodes[t.node].op} (node {t.node}) rows {r0}:{r0 + nr} cols {c0}:{c0 + nc}"


def live_nodes(graph: TaskGraph, nodes: list[Node] | None = None) -> list[int]:
    """The nodes (of ``nodes``, default the graph's) the outputs depend on, in build order (the
    others are never lowered)."""
    nodes = graph.nodes if nodes is None else nodes
    need = {v.id for v in graph.outputs.values()}
    for node in reversed(nodes):
        if node.out.id in need:
            need.update(a.id for a in node.args)
    return [i for i, n in enumerate(nodes) if n.out.id in need and n.op != "input"]


def lowered_nodes(graph: TaskGraph, blocks: BlocksOf, fuse: bool = False) -> list[Node]:
    """The graph's nodes as the tasks run them: each attention_decode split over chunks of its
    cached positions (``blocks(node).cols`` of them: ops.split_attention) into partials and
    their combine, so that a long cache is read by many CTAs at once; with ``fuse``, a norm or
    SiLU read only by a linear computed by that linear's tasks (ops.fuse_linears)."""
    nodes: list[Node] = []
    next_id = len(graph.values)
    for node in graph.nodes:
        if node.op != "attention_decode":
            nodes.append(node)
            continue
        chunk = (blocks if isinstance(blocks, Blocks) else blocks(node)).cols
        nodes += split_attention(node, chunk, next_id)
        next_id += 1
    return fuse_linears(nodes, {v.id for v in graph.outputs.values()}) if fuse else nodes


def _overlap(a, b) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1] and a[2] < b[2] + b[3] and b[2] < a[2] + a[3]


def _add_new(items: list, item) -> None:
    if item not in items:
        items.append(item)


def _buffers(graph: TaskGraph, nodes: list[Node], live: list[int], outs: dict[int, list[str]]):
    bufs: dict[str, tuple[str, tuple[int, int]]] = {}
    for v in graph.inputs.values():
        bufs[value_buf(v.id)] = ("input", v.shape)
    for i in live:
        node = nodes[i]
        for name, ts in node.consts.items():
            bufs[const_buf(i, name)] = ("input", tuple(const_2d(ts[0]).shape))
        kind = "output" if node.out.id in outs else "symmetric"
        bufs[value_buf(node.out.id)] = (kind, node.out.shape)
    return bufs


def lower(
    graph: TaskGraph,
    world: World,
    schedule: Schedule,
    blocks: BlocksOf = DEFAULT_BLOCKS,
    drop: DropHook | None = None,
    device_buffers: tuple[Buffer, ...] | None = None,
    fuse: bool = False,
) -> Lowered:
    """The graph's tasks and Plan. ``device_buffers``: the buffers of the GPU kernel's spec (its
    task and pointer tables, then the call's inputs and outputs: mkernel/taskgraph/device.py)
    instead of one buffer per value, which the interpreter's twins address by name; the tasks,
    waits and raises are the same either way. ``fuse``: norms and SiLUs into the linears that
    alone read them (lowered_nodes)."""
    W = world.size
    nodes = lowered_nodes(graph, blocks, fuse)
    live = live_nodes(graph, nodes)
    outs: dict[int, list[str]] = {}
    for name, v in graph.outputs.items():
        outs.setdefault(v.id, []).append(name)
    per_rank = [[t for i in live for t in tiles(nodes[i], i, r, W, blocks)] for r in range(W)]
    T = len(per_rank[0])
    producers: dict[int, list[tuple[int, tuple]]] = {}
    for j, t in enumerate(per_rank[0]):
        producers.setdefault(nodes[t.node].out.id, []).append((j, t.rect))
    # Per read: the producer tiles it covers. A read of one tile waits on that tile's flag, of
    # several on the count of that set (a group). Groups are sets of tile ids, the same on every
    # rank; each lives on the producers' rank.
    deps: list[list[list[tuple[int, int]]]] = []  # [rank][task] -> (peer, producer task)
    tile_deps: list[list[list[tuple[int, int]]]] = []  # reads of one tile: (peer, task)
    group_deps: list[list[list[tuple[int, int]]]] = []  # reads of several: (peer, group)
    group_ids: dict[frozenset[int], int] = {}
    for r in range(W):
        deps.append([])
        tile_deps.append([])
        group_deps.append([])
        for i, t in enumerate(per_rank[r]):
            found: list[tuple[int, int]] = []
            one: list[tuple[int, int]] = []
            many: list[tuple[int, int]] = []
            for rd in t.reads:
                members = []
                for j, rect in producers.get(rd.value, []):
                    if _overlap(rect, rd.rect):
                        assert j < i, f"task {i} reads task {j}: not a topological order"
                        if drop is None or not drop(r, i, rd.rank, j):
                            members.append(j)
                            _add_new(found, (rd.rank, j))
                if len(members) == 1:
                    _add_new(one, (rd.rank, members[0]))
                elif members:
                    g = group_ids.setdefault(frozenset(members), len(group_ids))
                    _add_new(many, (rd.rank, g))
            deps[r].append(found)
            tile_deps[r].append(one)
            group_deps[r].append(many)
    groups_of: dict[int, list[int]] = {}
    for members, g in group_ids.items():
        for j in members:
            groups_of.setdefault(j, []).append(g)
    size = {g: len(members) for members, g in group_ids.items()}
    readers = Counter(k for per_task in tile_deps for ks in per_task for k in ks)
    group_readers = Counter(k for per_task in group_deps for ks in per_task for k in ks)
    compute = []
    for r in range(W):
        rank_tasks = []
        for i, t in enumerate(per_rank[r]):
            waits = tuple(
                Wait(COUNT, q, (g,), value=size[g], consumers=group_readers[(q, g)])
                for q, g in group_deps[r][i]
            ) + tuple(Wait(READY, q, (j,), consumers=readers[(q, j)]) for q, j in tile_deps[r][i])
            raises = (Raise(READY, r, (i,)),) if readers[(r, i)] else ()
            raises += tuple(
                Raise(COUNT, r, (g,), op="add")
                for g in sorted(groups_of.get(i, ()))
                if group_readers[(r, g)]
            )
            rank_tasks.append(Task(i, (i, t.node), waits=waits, raises=raises))
        compute.append(rank_tasks)
    bufs = _buffers(graph, nodes, live, outs)
    groups = max(1, len(group_ids))  # NOTE: a pad of one unused count where no read is a group
    sizes = {"tasks": T, "groups": groups}
    for name, (_, (rows, cols)) in bufs.items():
        sizes[f"{name}_rows"], sizes[f"{name}_cols"] = rows, cols
    named = tuple(
        Buffer(name, kind, torch.bfloat16, (f"{name}_rows", f"{name}_cols"))
        for name, (kind, _) in bufs.items()
    )
    spec = OpSpec(
        name=f"taskgraph{next(_IDS)}",
        doc="a TaskGraph: tiles of its ops as tasks, per-tile ready events",
        buffers=named if device_buffers is None else device_buffers,
        pads=(
            Pad(READY, ("task",), ("tasks",), counted=True, doc="the task's tile has landed"),
            Pad(COUNT, ("group",), ("groups",), counted=True, doc="how many of its tiles landed"),
        ),
        scalars=(),
        # NOTE: the interpreter's spec names every value (past MAX_SLOTS for a real model); the
        # kernel's reaches them through its pointer table (kernels/taskgraph.cuh)
        device=device_buffers is not None,
        kernel="taskgraph",
    )
    # the tile's tag is its task id: the kernel's task descriptor row (kernels/taskgraph.cuh)
    tile_table = [
        Tile(i, t.rect[0], t.rect[2], t.rect[1], t.rect[3], i) for i, t in enumerate(per_rank[0])
    ]
    cfg = TILE_CONFIGS["64x128x64"]  # NOTE: unused: the TaskGraph engine sizes its own tiles
    comm: list[list[Task]] = [[] for _ in range(W)]
    counts = {"tasks": T, "groups": groups}
    plan = build_plan(spec, schedule, world, cfg, counts, sizes, tile_table, compute, comm)
    return Lowered(nodes, live, per_rank, deps, outs, bufs, plan)
