"""Schedules and plans.

A ``Schedule`` says who does what, when: intra-SM or inter-SM overlap, how many SMs each role gets,
the order of tiles on each rank (a user's Python hook), chunk sizes. ``schedule.plan(op, world,
...)`` compiles it into a ``Plan``: small int32 tables (the tile table, each rank's compute order
and comm tasks) plus the few compile-time choices (overlap mode, tile config). The GPU kernel and
the CPU interpreter run the same plan.

Task assignment is static and shared by both backends: the c-th unit of a role on a rank (a CTA, or
the communicator warp of CTA c) takes that role's tasks c, c + n, c + 2n, ... in plan order, or the
list the plan gave that unit (``PerUnit``; ``least_loaded`` places items on units by cost).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from . import cost
from .protocol import (
    OVERLAPS,
    TILE_CONFIG_IDS,  # noqa: F401 (re-exported: names -> device config ids)
    Capacity,
    OpSpec,
    PerUnit,
    RoleTables,
    Task,
    check_protocol,
    empty_tables,
    encode,
)
from .runtime import registry
from .tiles import (  # noqa: F401 (re-exported: mkernel.schedule's tile names)
    _TILE_RATE,
    TILE_CONFIGS,
    Tile,
    TileConfig,
    grid_tiles,
    grouped_order,
    pick_grouped_tile,
    pick_tile,
)
from .world import check_world

T = TypeVar("T")

TRANSFERS = ("auto", "stores", "tma")


# The longest injected delay: a minute, past any deadline a test sets (the device sleeps
# delay_us * 1000 ns in int64 nanoseconds; the interpreter sleeps delay_us steps).
MAX_DELAY_US = 60_000_000
SEED_LIMIT = 2**63  # seeds fit an int64, as any seeded policy takes them


def _check_int(name: str, v: Any, form: str) -> int:
    """``v`` is an int (a bool is not: True would pass as 1): else TypeError naming ``name``."""
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name} must be {form}, got {type(v).__name__} {v!r}")
    return v


def _check_choice(name: str, v: Any, choices: Sequence[str]) -> None:
    """``v`` is None or one of ``choices`` (strings)."""
    if v is None:
        return
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a str or None (one of {tuple(choices)}), got {v!r}")
    if v not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)} or None, got {v!r}")


@dataclass(frozen=True)
class Faults:
    """Injected faults for tests: ``silent_rank`` never raises its signals (its peers' waits must
    time out); ``delay_rank`` sleeps ``delay_us`` (an int in [0, MAX_DELAY_US], a minute) before
    each of its communication tasks (results must not change). Ranks are ints >= 0 or None,
    checked against the world when an op runs."""

    silent_rank: int | None = None
    delay_rank: int | None = None
    delay_us: int = 0

    def __post_init__(self) -> None:
        # NOTE: the ranks are checked against the world at the call (common.check_faults).
        for name in ("silent_rank", "delay_rank"):
            v = getattr(self, name)
            if v is not None:
                _check_int(f"Faults.{name}", v, "an int or None")
                if v < 0:
                    raise ValueError(f"Faults.{name} must be a rank >= 0 or None, got {v}")
        _check_int("Faults.delay_us", self.delay_us, f"an int in [0, {MAX_DELAY_US}]")
        if not 0 <= self.delay_us <= MAX_DELAY_US:
            raise ValueError(
                f"Faults.delay_us must be an int in [0, {MAX_DELAY_US}], got {self.delay_us}"
            )


TileOrderHook = Callable[[int, Sequence[Tile]], Sequence[int]]


@dataclass
class Schedule:
    """How an op runs. Every field has a default chosen per shape; set one to override it.

    overlap, comm_sms and transfer left None are picked when the plan is built, per op, shape and
    world, by the cost model of mkernel/cost.py (``plan.extra["choice"]`` shows what it picked and
    every candidate's predicted time); the fields set are kept.

    overlap:   "intra_sm" (each CTA has compute warpgroups and a communicator warp) or "inter_sm"
               (separate compute CTAs and communication CTAs); None: the model's.
    sms:       SMs per rank (default: the GPU's SMs divided among the emulated ranks; the CPU
               interpreter uses a small virtual count).
    comm_sms:  inter_sm only: how many of those SMs run the communication role (None: the
               model's; setting it needs overlap="inter_sm").
    tile:      a TILE_CONFIGS name (default: a heuristic per shape).
    tile_order: hook ``fn(rank, tiles) -> order`` returning a permutation of ``range(len(tiles))``:
               the order in which ``rank`` computes its tiles (e.g. the tiles a peer waits for
               first). gemm_rs keeps it within two classes: the peers' tiles, then its own (whose
               waits must never block a tile a peer waits for).
    chunk_rows: rows per transfer chunk (ag_gemm; default one tile row), per grouped-GEMM tile
               (MoE; at most 128 on a GPU; default 128 when T * k >= 128 * E_local, else 64), per
               query tile of a compute task (ring attention, forward and backward; default 16).
    faults:    injected faults for tests (Faults; None: none).
    seed:      the CPU interpreter's random interleaving policy, an int in [0, 2**63) (ignored on
               the GPU).
    backoff_ns: GPU waits sleep between polls of a flag, doubling from 32 ns up to this (0: spin),
               so waiting warps take few issue slots and memory transactions from the compute warps
               beside them (measured: a spinning communicator warp slowed intra-SM GEMMs 30x).
    trace:     a bool. GPU: record each task's start and end (global timer) and wait for the
               kernel; the timeline lands in ``world.last_timeline`` (the interpreter always
               records one).
    transfer:  how ag_gemm pushes its chunks: "stores" (16-byte stores, any overlap), "tma" (TMA
               bulk copies staged in shared memory; inter_sm only, where comm CTAs own their
               shared memory), or None / "auto": the model's (stores at the measured rates).
    """

    overlap: str | None = None
    sms: int | None = None
    comm_sms: int | None = None
    tile: str | None = None
    tile_order: TileOrderHook | None = None
    chunk_rows: int | None = None
    faults: Faults = field(default_factory=Faults)
    seed: int = 0
    backoff_ns: int = 2048
    trace: bool = False
    transfer: str | None = None

    def __post_init__(self) -> None:
        _check_choice("Schedule.overlap", self.overlap, OVERLAPS)
        _check_choice("Schedule.tile", self.tile, sorted(TILE_CONFIGS))
        _check_choice("Schedule.transfer", self.transfer, TRANSFERS)
        _check_int("Schedule.backoff_ns", self.backoff_ns, "an int in [0, 1e6]")
        if not 0 <= self.backoff_ns <= 1_000_000:
            raise ValueError(
                f"Schedule.backoff_ns must be an int in [0, 1e6], got {self.backoff_ns!r}"
            )
        for name in ("sms", "comm_sms", "chunk_rows"):
            v = getattr(self, name)
            if v is not None and _check_int(f"Schedule.{name}", v, "an int or None") < 1:
                raise ValueError(f"Schedule.{name} must be a positive int or None, got {v!r}")
        _check_int("Schedule.seed", self.seed, "an int in [0, 2**63)")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"Schedule.seed must be an int in [0, 2**63), got {self.seed}")
        if not isinstance(self.trace, bool):
            raise TypeError(f"Schedule.trace must be a bool, got {self.trace!r}")
        # NOTE: these two need overlap="inter_sm" set too, not left to the model, as when the
        # default was intra_sm: a schedule means the same whatever the model would pick.
        if self.overlap != "inter_sm" and self.comm_sms is not None:
            raise ValueError("Schedule.comm_sms applies to overlap='inter_sm' only")
        if self.transfer == "tma" and self.overlap != "inter_sm":
            raise ValueError(
                "Schedule transfer='tma' needs overlap='inter_sm' (intra_sm has no smem to stage)"
            )
        if self.tile_order is not None and not callable(self.tile_order):
            raise TypeError("Schedule.tile_order must be a callable fn(rank, tiles) -> order")
        if self.faults is None:  # None: no faults, as the default
            object.__setattr__(self, "faults", Faults())
        elif not isinstance(self.faults, Faults):
            got = type(self.faults).__name__
            raise TypeError(f"Schedule.faults must be a mkernel.Faults or None, got {got}")

    def plan(self, op: str, world: Any, *operands: Any, **shapes: int) -> Plan:
        """The plan ``op`` (a registered op: "gemm_rs", "ag_gemm", "gemm_ar", "all_gather", ...)
        runs over ``world`` with this schedule: give the op's operands (``plan("gemm_rs", world,
        a, b)``, checked as the op checks them) or its sizes by name (the GEMM ops: ``m=, n=,
        k=`` global sizes; all_gather: ``rows=, cols=``). It is the very plan object a call with
        the same schedule and shapes executes (cached on the world); ``print(plan)`` shows the
        overlap, comm SMs and transfer it runs and the cost model's choice among the candidates
        (``plan.extra["choice"]``, mkernel/cost.py)."""
        import inspect

        module = registry.get(op)
        names = sorted(set(inspect.signature(module.make_plan).parameters) - {"schedule", "world"})
        want = ", ".join(f"{n}=" for n in names)
        if operands:
            if shapes:
                raise TypeError(f"Schedule.plan takes the operands or {want} not both")
            shapes = module.shapes(*operands, world)
        if sorted(shapes) != names:
            raise TypeError(f"Schedule.plan needs the operands or {want} (got {sorted(shapes)})")
        check_world(world)
        if not operands:  # sizes by name: the checks an op's operands would have had
            check_sizes(op, shapes)
            if hasattr(module, "check_sizes"):  # what the op adds (divisibility, ranges)
                module.check_sizes(world, **shapes)
        return cached_plan(module.OP, self, world, **shapes)


# Sizes by name (Schedule.plan): each is an extent or count >= 1 (m, n, k, rows, cols, experts,
# heads, ...) but these: a MoE call of no tokens is a call (it launches nothing), an emulated
# combine's partial_rows is 0, causal / zigzag are flags; scale_bits is a float32's bits.
SIZES_FROM_ZERO = frozenset({"tokens", "partial_rows", "causal", "zigzag"})
SIZES_ANY_INT32 = frozenset({"scale_bits"})


def check_sizes(op: str, shapes: dict[str, Any]) -> None:
    """Sizes given to ``Schedule.plan(op, world, **shapes)`` by name are ints (not bools), each
    >= 1 but those of SIZES_FROM_ZERO (>= 0) and SIZES_ANY_INT32 (any int32): a negative or
    zero extent would compile to a plan of no tiles. What the op's operand check adds (e.g. M
    divisible by W) is its module's ``check_sizes(world, **sizes)``, where it has one.)"""
    for name, v in sorted(shapes.items()):
        if name in SIZES_ANY_INT32:
            lo, hi, form = -(2**31), 2**31, "an int32"
        else:
            lo = 0 if name in SIZES_FROM_ZERO else 1
            hi, form = 2**63, f"an int >= {lo}"
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
            raise ValueError(f"Schedule.plan({op!r}): {name} must be {form}, got {v!r}")


@dataclass
class Plan:
    """What both backends execute: the op's tasks per role and rank, with their waits and raises
    (``roles``: int32 CSR tables, mkernel/protocol.py), the tile table, the units per role and the
    compile-time choices. ``to_device`` copies the tables once."""

    op: str
    spec: OpSpec
    world_size: int
    overlap: str
    tile: TileConfig
    shapes: dict[str, int]
    sizes: dict[str, int]  # every size the spec's buffers and pads name
    tiles: list[Tile]
    roles: dict[str, RoleTables]  # "compute", "comm"
    compute_units: int  # per rank: compute CTAs
    comm_units: int  # per rank: comm CTAs (inter_sm) or comm warps (intra_sm, one per CTA)
    faults: Faults = field(default_factory=Faults)
    # the world's nodes: > 1, a hierarchical plan (cross-node steps by rdma puts, docs/rdma.md)
    nodes: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    _device_tables: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def __str__(self) -> str:
        units = f"{self.compute_units} compute + {self.comm_units} comm " + (
            "warps in the same CTAs" if self.overlap == "intra_sm" else "CTAs"
        )
        head = (
            f"Plan {self.op}, W={self.world_size}, {self.shapes}: {self.overlap}, {units} per "
            f"rank, tile {self.tile.name}, {len(self.tiles)} tiles"
        )
        if self.nodes > 1:
            R = self.world_size // self.nodes
            head += f", hierarchical over {self.nodes} nodes x {R} ranks (rdma puts across nodes)"
        choice = self.extra.get("choice")
        return head if choice is None else f"{head}\n{choice}"

    @property
    def ctas_per_rank(self) -> int:
        if self.overlap == "intra_sm":
            return self.compute_units
        return self.compute_units + self.comm_units

    def _ids(self, role: str) -> torch.Tensor | list[torch.Tensor]:
        tasks = self.roles[role].tasks
        rows = [torch.tensor([t.id for t in ts], dtype=torch.int32) for ts in tasks]
        return torch.stack(rows) if len({len(r) for r in rows}) <= 1 else rows

    @property
    def compute_order(self) -> torch.Tensor:
        """[W, T]: each rank's compute task ids (tile indices) in plan order."""
        return self._ids("compute")

    @property
    def comm_tasks(self) -> torch.Tensor | list[torch.Tensor]:
        """[W, Tm]: each rank's comm task ids in plan order (a list when counts differ)."""
        return self._ids("comm")

    def task_rows(self, role: str, rank: int, unit: int) -> list[int]:
        """The table rows unit ``unit`` of ``role`` on ``rank`` runs, in order: the unit's own
        list when the plan gave the role PerUnit, else rows u, u + units, ... of the rank's."""
        n = self.compute_units if role == "compute" else self.comm_units
        return self.roles[role].unit_rows(rank, unit, n)

    def tasks_of(self, role: str, rank: int, unit: int) -> list[int]:
        """The task ids that unit ``unit`` of ``role`` on ``rank`` runs, in order."""
        n = self.compute_units if role == "compute" else self.comm_units
        return [t.id for t in self.roles[role].unit_tasks(rank, unit, n)]

    def task(self, role: str, row: int) -> Task:
        """The task at table row ``row`` of ``role``."""
        for ts in self.roles[role].tasks:
            if row < len(ts):
                return ts[row]
            row -= len(ts)
        raise IndexError(row)

    def capacity(self, role: str) -> list[int]:
        """Per-rank (rows, waits, raises) room of a device-filled role; zeros for a host one."""
        cap = self.roles[role].capacity
        return [cap.rows, cap.waits, cap.raises] if cap else [0, 0, 0]

    def tile_table(self) -> torch.Tensor:
        """[T, 5] int32: m0, n0, rows, cols, tag per tile. A device-filled compute role gets one
        zeroed row per table row (its layout phase writes each task's tile at the task's row)."""
        cap = self.roles["compute"].capacity
        if cap is not None:
            return torch.zeros(self.world_size * cap.rows, 5, dtype=torch.int32)
        return torch.tensor([t[1:] for t in self.tiles], dtype=torch.int32).reshape(-1, 5)

    def device_tables(self, device: torch.device) -> dict[str, torch.Tensor]:
        if not self._device_tables:
            from .protocol import tables_to

            self._device_tables = tables_to(self.roles, device)
            self._device_tables["tiles"] = self.tile_table().to(device)
        return self._device_tables


# -- helpers the ops use to build plans ----------------------------------------------------------


def _shown(got: Any, most: int = 8) -> str:
    """A short repr of what a hook returned: a sequence's first ``most`` entries."""
    if isinstance(got, (list, tuple)):
        head = ", ".join(repr(x) for x in got[:most])
        return f"[{head}, ...]" if len(got) > most else f"[{head}]"
    return f"{type(got).__name__} {got!r}"[:200]


def apply_order(hook: TileOrderHook | None, rank: int, tiles: Sequence[Tile], default: list[int]):
    """The rank's compute order: the user's hook if given, checked to be a permutation; whatever
    goes wrong in it is reported as Schedule.tile_order's error, naming the rank."""
    if hook is None:
        return default
    where = f"Schedule.tile_order(rank={rank}, tiles=<{len(tiles)} tiles>)"
    try:
        got = hook(rank, list(tiles))
    except Exception as e:
        raise ValueError(f"{where} raised {type(e).__name__}: {e}") from e
    n = len(tiles)
    try:
        # NOTE: operator.index takes ints and int-like scalars (numpy, 0-d int tensors) but no
        # float or str, which int() would turn into a wrong order or a bare ValueError
        order = [operator.index(i) for i in got]
    except Exception as e:  # whatever iterating the user's object raises: named as the hook's
        raise ValueError(
            f"{where} must return a sequence of tile indices (a permutation of range({n}), as "
            f"ints), got {_shown(got)}"
        ) from e
    if sorted(order) != list(range(n)):
        raise ValueError(
            f"{where} returned an order that is not a permutation of range({n}) "
            f"(got {_shown(order)}, {len(order)} entries)"
        )
    return order


# SMs an emulated GPU world of several nodes leaves free: the proxy's device-to-device copies run
# as kernels (measured on the H200: with every SM holding a persistent CTA, puts waited until
# CTAs timed out; with 4 SMs free every call passed), so they need SMs the fused kernel does not
# hold while its CTAs wait for those very puts.
PROXY_COPY_SMS = 4  # MKERNEL_PROXY_COPY_SMS overrides it (probes)


def rank_sms(schedule: Schedule, world: Any) -> int:
    """SMs per rank: the GPU's SMs (split among an emulated world's ranks; a world of several
    nodes leaves PROXY_COPY_SMS free), or 8 virtual SMs per rank in the CPU interpreter;
    ``schedule.sms`` may lower it."""
    if world.on_gpu:
        total_sms = torch.cuda.get_device_properties(world.device).multi_processor_count
        if world.emulated_world and getattr(world, "nodes", 1) > 1:
            total_sms -= int(os.environ.get("MKERNEL_PROXY_COPY_SMS", PROXY_COPY_SMS))
        per_rank = total_sms // world.size if world.emulated_world else total_sms
    else:
        per_rank = 8
    return min(schedule.sms or per_rank, per_rank)


def resolve(
    schedule: Schedule, op: str, world: Any, shapes: dict[str, int]
) -> tuple[Schedule, Any]:
    """(the schedule with overlap, comm_sms and transfer filled in, the cost model's Choice) for
    ``op`` at global ``shapes`` over ``world``: the fields left None (transfer "auto" too) are the
    model's (mkernel/cost.py), the ones set are kept. An op without a model gets the fixed
    defaults of before (intra_sm, S // 8 comm SMs, stores)."""
    import dataclasses

    if schedule.chunk_rows is not None:
        shapes = {**shapes, "chunk_rows": schedule.chunk_rows}
    choice = cost.choose(
        op,
        shapes,
        world.size,
        rank_sms(schedule, world),
        overlap=schedule.overlap,
        comm_sms=schedule.comm_sms,
        transfer=None if schedule.transfer == "auto" else schedule.transfer,
        tile=schedule.tile,
    )
    c = choice.chosen
    fields = {"overlap": c.overlap, "comm_sms": c.comm_sms, "transfer": c.transfer}
    return dataclasses.replace(schedule, **fields), choice


def is_resolved(schedule: Schedule) -> bool:
    """Whether nothing is left to the cost model."""
    return (
        schedule.overlap is not None
        and schedule.transfer not in (None, "auto")
        and (schedule.overlap == "intra_sm" or schedule.comm_sms is not None)
    )


def least_loaded(
    items: Iterable[tuple[T, float]],
    units: int,
    load: list[float] | None = None,
    longest_first: bool = True,
) -> list[list[T]]:
    """Each unit's items: every (item, cost) onto the unit least loaded so far (the lowest on a
    tie), longest first (a stable sort: equal costs keep their order) or, ``longest_first=False``,
    in the order given. ``load``: the units' costs before these (updated in place). The lists
    suit ``PerUnit`` (a unit's own tasks, none padded to the longest)."""
    load = [0.0] * units if load is None else load
    if len(load) != units:
        raise ValueError(f"least_loaded: {len(load)} loads for {units} units")
    items = sorted(items, key=lambda x: -x[1]) if longest_first else items
    lists: list[list[T]] = [[] for _ in range(units)]
    for item, c in items:
        u = min(range(units), key=load.__getitem__)
        load[u] += c
        lists[u].append(item)
    return lists


def split_units(schedule: Schedule, world: Any, n_compute_tasks: int) -> tuple[int, int]:
    """(compute units, comm units) per rank."""
    sms = rank_sms(schedule, world)
    if sms < 1 or (schedule.overlap == "inter_sm" and sms < 2):
        raise ValueError(
            f"{sms} SMs per rank cannot serve overlap={schedule.overlap!r} with world size "
            f"{world.size} (inter_sm needs >= 2 SMs per rank)"
        )
    if schedule.overlap == "intra_sm":
        units = max(1, min(sms, n_compute_tasks))
        return units, units
    comm = schedule.comm_sms or max(1, sms // 8)
    if comm >= sms:
        raise ValueError(f"Schedule.comm_sms={comm} leaves no compute SMs out of {sms} per rank")
    return max(1, min(sms - comm, n_compute_tasks)), comm


def build_plan(
    spec: OpSpec,
    schedule: Schedule,
    world: Any,
    tile: TileConfig,
    shapes: dict[str, int],
    sizes: dict[str, int],
    tiles: list[Tile],
    compute: list[list[Task]] | PerUnit | Capacity,
    comm: list[list[Task]] | PerUnit | Capacity,
    extra: dict[str, Any] | None = None,
) -> Plan:
    """An op's Plan from its tiles and per-rank task lists (``compute[r]``, ``comm[r]`` in execution
    order), after the static protocol check (mkernel/protocol.py check_protocol). A role given
    ``PerUnit`` names each unit's tasks itself (its unit count is the role's units: at most what
    the schedule gives, ``split_units``); a plain list is dealt out u, u + units, ...

    A role given as a ``Capacity`` is filled by the kernel's layout phase (the op's ``layout`` on
    the device, its twin in the interpreter) from data only the device has: the plan holds empty
    tables of that room per rank, and the static check is left to the interpreter's run (it sees
    the tasks the layout makes)."""
    extra = dict(extra or {})
    if not is_resolved(schedule):  # a direct call; cached_plan resolves before make_plan
        # NOTE: ag_gemm's make_plan read transfer before: None / "auto" made it stores there.
        schedule, extra["choice"] = resolve(schedule, spec.name, world, shapes)
    n_compute = (
        compute.rows
        if isinstance(compute, Capacity)
        else compute.units
        if isinstance(compute, PerUnit)
        else len(compute[0])
    )
    compute_units, comm_units = split_units(schedule, world, n_compute)
    for role, ts, n in (("compute", compute, compute_units), ("comm", comm, comm_units)):
        if isinstance(ts, PerUnit) and ts.units != n:
            raise ValueError(
                f"{spec.name}: the plan gives its {role} role {ts.units} units, the schedule "
                f"{n} (split_units)"
            )
    nodes = getattr(world, "nodes", 1)
    sizes = {"W": world.size, "nodes": nodes, **sizes}  # the extents every pad may name
    device_filled = {
        role: empty_tables(world.size, ts)
        for role, ts in (("compute", compute), ("comm", comm))
        if isinstance(ts, Capacity)
    }
    roles = {
        role: ts for role, ts in (("compute", compute), ("comm", comm)) if role not in device_filled
    }
    per_unit = {role: ts for role, ts in roles.items() if isinstance(ts, PerUnit)}
    roles = {role: ts.flat() if isinstance(ts, PerUnit) else ts for role, ts in roles.items()}
    raisers = {}
    for ts in roles.values():
        for r, rank_tasks in enumerate(ts):
            for t in rank_tasks:
                for x in t.raises:
                    raisers[(x.pad, x.rank, x.index)] = r
    for ts in roles.values():  # each wait names its peer: the rank that raises the signal
        for rank_tasks in ts:
            for t in rank_tasks:
                t.waits = tuple(
                    w if w.peer >= 0 else w._with_peer(raisers.get((w.pad, w.rank, w.index), -1))
                    for w in t.waits
                )
    # the PerUnit lists hold the same Task objects as the flat lists (their waits' peers set)
    tables = {role: encode(spec, sizes, per_unit.get(role, ts)) for role, ts in roles.items()}
    if not device_filled:
        check_protocol(spec, sizes, tables)
    tables = {role: device_filled.get(role) or tables[role] for role in ("compute", "comm")}
    return Plan(
        op=spec.name,
        spec=spec,
        world_size=world.size,
        overlap=schedule.overlap,
        tile=tile,
        shapes=shapes,
        sizes=sizes,
        tiles=tiles,
        roles=tables,
        compute_units=compute_units,
        comm_units=comm_units,
        faults=schedule.faults,
        nodes=nodes,
        extra=extra,
    )


def cached_plan(op: Any, schedule: Schedule, world: Any, **shapes: int) -> Plan:
    """The plan of ``op`` (its OpDef: ``spec``, ``make_plan``) for these shapes, built once per
    (schedule settings, shapes) and kept on the world: its device tables are copied once, so
    calls (and CUDA-graph captures) copy nothing."""
    hook = schedule.tile_order
    key = (
        op.spec.name,
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
        # The fields left None are the cost model's (mkernel/cost.py), picked once per key.
        schedule, choice = resolve(schedule, op.spec.name, world, shapes)
        plan = op.make_plan(schedule, world, **shapes)
        plan.extra["choice"] = choice
        if hook is not None:
            plan.extra["_hook"] = hook  # keeps id(hook) from being reused while cached
        plan.extra["backoff_ns"] = schedule.backoff_ns
        plan.extra["trace"] = schedule.trace
        plan.extra["transfer"] = schedule.transfer
        plans[key] = plan
    return plan
