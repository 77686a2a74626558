"""The protocol as data: an op's declaration (``OpSpec``), the dependency tables its plan emits, and
the constants Python and device code share.

An op declares once, in Python, its named buffers (per-rank operands and symmetric workspaces), its
signal pads, its scalars. Its plan lists every task of every role on every rank, each with its
arguments, the waits that must hold before it moves data and the raises that publish its writes
afterwards. Both backends execute those tables with one generic task program:

    for each task of a unit:  waits (acquire; reset per policy)  ->  the op's data movement
                              -> bulk copies landed, system fence  ->  raises (release)

so the protocol the CPU interpreter property-tests is the protocol the GPU runs. Device code reads
the same tables and a generated header (``templates/protocol_gen.h``, ``python -m mkernel.codegen``)
that holds every constant and per-op layout shared with this file; a test checks that it is current.

Tables (int32, per role): ``task_span [W, 2]`` (first, end) rows of each rank; ``args [n,
TASK_ARGS]``; ``wait_span [n, 2]`` / ``waits [*, WAIT_FIELDS]``; ``raise_span [n, 2]`` /
``raises [*, RAISE_FIELDS]``. Spans rather than CSR offsets, so that a role filled on the device
(``Capacity``: a plan whose task counts only the kernel knows, such as MoE routing) can give each
rank a region of fixed capacity and leave the unused rest of it as a gap.
Reset policy of a wait (``consumers``): 0 leaves the signal as it is (another wait resets it), 1 the
single consumer sets it back to 0, n > 1 each consumer counts itself on the pad's counter and the
n-th resets signal and counter. ``check_protocol`` verifies statically that every waited value is
raised, every raised signal is reset exactly once, and counters match their consumers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# -- constants shared with device code (emitted into templates/protocol_gen.h) --------------------
MAX_LOCAL_RANKS = 16  # ranks one launch serves (an emulated world on one GPU)
MAX_BARRIER_SLOTS = 256  # entry-barrier flags per rank: [slot, W]
MAX_PADS = 8  # signal pads per op, the template's barrier (id 0) included
MAX_SLOTS = 16  # named buffers per op (the ring backward declares 16)
MAX_SCALARS = 8  # named int scalars per op
TASK_ARGS = 4  # int32 arguments per task
ROLES = ("compute", "comm", "barrier", "rdma")  # WaitSite::role ids (rdma: a put's ring waits)
OVERLAPS = ("intra_sm", "inter_sm")
TILE_CONFIG_IDS = {"128x256x64": 0, "128x128x64": 1, "64x128x64": 2}
STATUS_FIELDS = (
    "error",  # STATUS_ERRORS: what the first error of the world's launches was
    "rank",
    "peer",
    "task",
    "role",
    "pad",
    "index",
    "abort",
    "launch",
    "value",  # bad_input: the value found (an expert id)
)
# timeout: rank waited for pad[index] from peer in task of role; bad_input: a layout phase found
# an input value it cannot use (MoE: expert id `value` at rank `rank`, token `task`, slot `index`),
# ignored it (nothing written for it) and carried on
STATUS_ERRORS = ("none", "timeout", "bad_input")
WAIT_FIELDS = ("pad", "rank", "index", "value", "consumers", "counter", "patience", "peer")
RAISE_FIELDS = ("pad", "rank", "index", "value", "op")
RAISE_OPS = ("set", "add")  # st.release.sys / red.release.sys.add
TABLES = ("task_span", "args", "wait_span", "waits", "raise_span", "raises", "unit_span")
CAPACITY_FIELDS = ("rows", "waits", "raises")
BARRIER_PAD = "barrier"  # pad id 0 of every op: the template's entry barrier [slot, peer]

# The launch record: one int64 array per launch, filled by name here and read by the generated
# constants on the device side (no hand-kept field order, no per-field binding).
RECORD_FIELDS = (
    # plan tables (device addresses), per role (TABLES)
    *(f"{role}_{t}" for role in ROLES[:2] for t in TABLES),
    # per-rank capacity (rows, waits, raises) of a device-filled role (Capacity), 0 if host-built
    *(f"{role}_cap_{f}" for role in ROLES[:2] for f in CAPACITY_FIELDS),
    "tiles",  # [T, 5] int32 tile table (m0, n0, rows, cols, tag), or 0
    "compute_units",
    "comm_units",
    "ctas_per_rank",
    "overlap",
    "tile_config",
    "compute_signals",
    "world_size",
    "rank0",
    "ranks_here",
    "timeout_ns",
    "backoff_ns",
    "status",
    "launch",  # the launch's id: a timeout records it, the host names the flag by its plan
    "silent_rank",
    "delay_rank",
    "delay_ns",
    "timeline",  # int64 (start, end) pairs, or 0; the host's tensor sets the layout by its strides:
    "timeline_cap",  # tasks recorded per unit
    "timeline_stride_rank",  # elements between local ranks,
    "timeline_stride_slot",  # CTA slots,
    "timeline_stride_role",  # roles (compute, comm); consecutive tasks are 2 apart
    # a plan over several nodes (the proxy transport, primitives/rdma/put.cuh), else 0
    "rdma_rings",  # the W rings (mapped host memory), back to back
    "rdma_reserve",  # [W] int32 ticket counters (device memory)
    "rdma_capacity",  # descriptor slots per ring
    "ranks_per_node",  # W // nodes (W with one node)
    *(f"pad{i}" for i in range(MAX_PADS)),  # [W] address table of each pad (0: the barrier)
    *(f"slot{i}" for i in range(MAX_SLOTS)),  # buffer base (operand) or [W] table (symmetric)
    *(f"stride{i}" for i in range(MAX_SLOTS)),  # operand: elements between ranks (emulated)
    *(f"scalar{i}" for i in range(MAX_SCALARS)),
)
RECORD = {name: i for i, name in enumerate(RECORD_FIELDS)}
assert len(RECORD) == len(RECORD_FIELDS), "launch record field names must be unique"

_CTYPES = {torch.bfloat16: "__nv_bfloat16", torch.float32: "float", torch.int32: "int"}


# -- the declaration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Buffer:
    """A named buffer of an op. ``kind``: "input" / "output" (the caller's per-rank tensors: rank
    r's at base + r * stride in an emulated world) or "symmetric" (a workspace every rank can
    address, from ``World.symmetric``). ``shape`` names sizes of the plan (``Plan.sizes``)."""

    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple[str, ...]
    doc: str = ""
    # "always"; "ranks": only when W > 1 (a staging area peers write); "distributed": only in
    # distributed worlds of W > 1 (an emulated world writes the caller's tensor directly)
    when: str = "always"


@dataclass(frozen=True)
class Pad:
    """A signal pad: symmetric int32 flags of ``shape`` (plan sizes), indexed by ``dims`` (the
    names errors print: ``tile_flag[tile=3, src=1]``). ``counted``: several consumers per flag;
    a companion counter pad ``<name>_count`` lets the last one reset it."""

    name: str
    dims: tuple[str, ...]
    shape: tuple[str, ...]
    counted: bool = False
    doc: str = ""


@dataclass(frozen=True)
class OpSpec:
    """One op, declared once. Pad ids: 0 is the template's barrier, then ``pads`` in order, each
    counted pad followed by its counter. Buffer and scalar ids are their positions."""

    name: str
    buffers: tuple[Buffer, ...]
    pads: tuple[Pad, ...]
    scalars: tuple[str, ...]
    doc: str = ""
    # False: the op has no device kernel yet (no kernels/<op>.cu); it runs in the CPU interpreter,
    # and a call on a GPU world raises before anything runs.
    device: bool = True
    # Named int constants the op's plan and its device code share (an encoding's field widths):
    # emitted into kernels/layouts_gen.h as spec::<op>::k<Name>, so neither side restates them.
    constants: tuple[tuple[str, int], ...] = ()
    # The device kernel's name when it is not ``name``: an op's second declaration (a plan over
    # several nodes, SPEC_NODES) has kernels/<kernel>.cu, launch_<kernel> and spec::<kernel>.
    kernel: str = ""

    @property
    def kernel_name(self) -> str:
        return self.kernel or self.name

    def __post_init__(self) -> None:
        # NOTE: the pad and buffer limits are the launch record's; an op without a kernel
        # (device=False, the interpreter's) is not bound by them.
        too_many = len(self.all_pads()) > MAX_PADS or len(self.buffers) > MAX_SLOTS
        if self.device and too_many:
            raise ValueError(f"{self.name}: more than {MAX_PADS} pads or {MAX_SLOTS} buffers")
        if len(self.scalars) > MAX_SCALARS:
            raise ValueError(f"{self.name}: more than {MAX_SCALARS} scalars")

    def all_pads(self) -> list[Pad]:
        out = [Pad(BARRIER_PAD, ("slot", "peer"), ("barrier_slots", "W"))]
        for p in self.pads:
            out.append(p)
            if p.counted:
                out.append(Pad(p.name + "_count", p.dims, p.shape, doc=f"consumers of {p.name}"))
        return out

    def pad_id(self, name: str) -> int:
        for i, p in enumerate(self.all_pads()):
            if p.name == name:
                return i
        raise KeyError(f"{self.name} declares no signal pad {name!r}")

    def buffer_id(self, name: str) -> int:
        for i, b in enumerate(self.buffers):
            if b.name == name:
                return i
        raise KeyError(f"{self.name} declares no buffer {name!r}")


def signal_name(spec: OpSpec, pad: int, index: int, sizes: dict[str, int]) -> str:
    """The name both backends print for flag ``index`` (flat) of pad ``pad``:
    ``tile_flag[tile=3, src=1]``."""
    pads = spec.all_pads()
    if not 0 <= pad < len(pads):
        return f"pad{pad}[{index}]"
    p = pads[pad]
    coords = _unflatten(index, [_size(sizes, s) for s in p.shape])
    return f"{p.name}[" + ", ".join(f"{d}={c}" for d, c in zip(p.dims, coords, strict=True)) + "]"


def _size(sizes: dict[str, int], name: str) -> int:
    if name == "barrier_slots":
        return MAX_BARRIER_SLOTS
    if name.isdigit():
        return int(name)
    return sizes[name]


def _unflatten(index: int, shape: Sequence[int]) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(index % n)
        index //= n
    return out[::-1]


def pad_shape(spec: OpSpec, pad: Pad, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(_size(sizes, s) for s in pad.shape)


def buffer_shape(buf: Buffer, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(_size(sizes, s) for s in buf.shape)


# -- the plan's dependency tables -----------------------------------------------------------------


@dataclass(frozen=True)
class Wait:
    """Before the task: spin until ``pad[rank][index] == value`` (acquire); ``consumers`` is the
    reset policy (module docstring); ``patience`` multiplies the deadline (a wait that only follows
    another rank's own waits reports second)."""

    pad: str
    rank: int
    index: tuple[int, ...]
    value: int = 1
    consumers: int = 1
    patience: int = 1
    peer: int = -1  # who raises it (errors name it); the plan fills it in from the raises

    def _with_peer(self, peer: int) -> Wait:
        return Wait(
            self.pad, self.rank, self.index, self.value, self.consumers, self.patience, peer
        )


@dataclass(frozen=True)
class Raise:
    """After the task's writes have landed: ``pad[rank][index]`` = value (``op="set"``) or +=
    value (``"add"``), with release semantics at system scope."""

    pad: str
    rank: int
    index: tuple[int, ...]
    value: int = 1
    op: str = "set"


@dataclass
class Task:
    """One task of a role on a rank: its id (what timelines and errors print), its arguments and
    its dependencies."""

    id: int
    args: tuple[int, ...]
    waits: tuple[Wait, ...] = ()
    raises: tuple[Raise, ...] = ()


@dataclass
class PerUnit:
    """A role's tasks given unit by unit: ``lists[rank][unit]`` in that unit's execution order,
    every rank with the same number of units. Its tables hold a rank's units back to back and
    ``unit_span`` says where each one's rows are, so no unit is padded to the longest. A role
    given as plain per-rank lists instead runs rows u, u + units, ... on unit u (the template's
    default rule, which suits tasks that any unit may take in turn)."""

    lists: list[list[list[Task]]]

    def __post_init__(self) -> None:
        counts = {len(units) for units in self.lists}
        if len(counts) != 1 or 0 in counts:
            raise ValueError(f"PerUnit: every rank needs the same number (>= 1) of units: {counts}")

    @property
    def units(self) -> int:
        return len(self.lists[0])

    def flat(self) -> list[list[Task]]:
        """Per rank, its units' tasks back to back (the table order)."""
        return [[t for unit in units for t in unit] for units in self.lists]

    def counts(self) -> list[list[int]]:
        return [[len(unit) for unit in units] for units in self.lists]


@dataclass
class RoleTables:
    """A role's tasks, per rank in execution order, and their int32 tables."""

    tasks: list[list[Task]]  # [W][i]; a device-filled role: empty (the kernel's layout fills it)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    capacity: Capacity | None = None  # set: filled on the device, rank r in region r
    # [W][units]: each unit's task count when the role was given PerUnit (units back to back in
    # a rank's rows); None: unit u runs rows u, u + units, ...
    unit_counts: list[list[int]] | None = None

    def rows(self, rank: int) -> range:
        start = sum(len(t) for t in self.tasks[:rank])
        return range(start, start + len(self.tasks[rank]))

    def unit_rows(self, rank: int, unit: int, units: int) -> list[int]:
        """The table rows unit ``unit`` (of ``units``) runs on ``rank``, in order."""
        rows = self.rows(rank)
        if self.unit_counts is None:
            return list(rows[unit::units])
        counts = self.unit_counts[rank]
        first = rows.start + sum(counts[:unit])
        return list(range(first, first + counts[unit])) if unit < len(counts) else []

    def unit_tasks(self, rank: int, unit: int, units: int) -> list[Task]:
        base = self.rows(rank).start
        return [self.tasks[rank][i - base] for i in self.unit_rows(rank, unit, units)]

    def regroup(self, tasks: list[list[Task]]) -> list[list[Task]] | PerUnit:
        """``tasks``, per rank as ``self.tasks`` (a copy edited row by row, say), in the form
        ``encode`` took: unit by unit again, with the same counts, when the role was PerUnit."""
        if self.unit_counts is None:
            return tasks
        lists = []
        for rank_tasks, counts in zip(tasks, self.unit_counts, strict=True):
            if len(rank_tasks) != sum(counts):
                raise ValueError(f"regroup: {len(rank_tasks)} tasks for units of {counts}")
            ends = [sum(counts[: u + 1]) for u in range(len(counts))]
            lists.append([rank_tasks[e - n : e] for e, n in zip(ends, counts, strict=True)])
        return PerUnit(lists)


def _flat(spec: OpSpec, sizes: dict[str, int], pad: str, index: tuple[int, ...]) -> tuple[int, int]:
    pid = spec.pad_id(pad)
    shape = pad_shape(spec, spec.all_pads()[pid], sizes)
    if len(index) != len(shape) or any(not 0 <= i < n for i, n in zip(index, shape, strict=True)):
        raise ValueError(f"{spec.name}: index {list(index)} outside pad {pad} of shape {shape}")
    flat = 0
    for i, n in zip(index, shape, strict=True):
        flat = flat * n + i
    return pid, flat


def encode(spec: OpSpec, sizes: dict[str, int], tasks: list[list[Task]] | PerUnit) -> RoleTables:
    """The int32 tables of one role (``tasks[rank]`` in execution order, or given PerUnit: then
    ``unit_span`` [W * units, 2] holds each unit's rows; else it is empty)."""
    unit_counts = tasks.counts() if isinstance(tasks, PerUnit) else None
    tasks = tasks.flat() if isinstance(tasks, PerUnit) else tasks
    task_span, args, wait_span, waits, raise_span, raises = [], [], [], [], [], []
    unit_span = []
    for rank_tasks in tasks:
        first = len(args)
        for t in rank_tasks:
            if len(t.args) > TASK_ARGS:
                raise ValueError(f"{spec.name}: task {t.id} has more than {TASK_ARGS} args")
            args.append(list(t.args) + [0] * (TASK_ARGS - len(t.args)))
            w0, r0 = len(waits), len(raises)
            for w in t.waits:
                pid, flat = _flat(spec, sizes, w.pad, w.index)
                counter = spec.pad_id(w.pad + "_count") if w.consumers > 1 else -1
                waits.append([pid, w.rank, flat, w.value, w.consumers, counter, w.patience, w.peer])
            for r in t.raises:
                pid, flat = _flat(spec, sizes, r.pad, r.index)
                raises.append([pid, r.rank, flat, r.value, RAISE_OPS.index(r.op)])
            wait_span.append([w0, len(waits)])
            raise_span.append([r0, len(raises)])
        task_span.append([first, len(args)])
        for n in unit_counts[len(task_span) - 1] if unit_counts else ():
            unit_span.append([first, first + n])
            first += n

    def t32(rows: list, width: int) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int32).reshape(-1, width)

    tensors = {
        "task_span": t32(task_span, 2),
        "args": t32(args, TASK_ARGS),
        "wait_span": t32(wait_span, 2),
        "waits": t32(waits, len(WAIT_FIELDS)),
        "raise_span": t32(raise_span, 2),
        "raises": t32(raises, len(RAISE_FIELDS)),
        "unit_span": t32(unit_span, 2),
    }
    return RoleTables(tasks=tasks, tensors=tensors, unit_counts=unit_counts)


@dataclass(frozen=True)
class Capacity:
    """Per-rank room of a role whose tables the kernel fills in its layout phase (the op's device
    ``layout`` and its interpreter twin): at most ``rows`` tasks, ``waits`` waits and ``raises``
    raises per rank. The plan knows only these bounds; the tasks come from data on the device."""

    rows: int
    waits: int
    raises: int

    def __post_init__(self) -> None:
        for name in CAPACITY_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"Capacity.{name} must be an int >= 0, got {v!r}")


def empty_tables(world_size: int, cap: Capacity) -> RoleTables:
    """The tables of a device-filled role before its layout phase: rank r owns rows [r * rows,
    (r + 1) * rows) (and waits, raises likewise) and has no task yet (task_span [r] = (first,
    first)). The kernel appends to them; the host never reads them back."""
    W = world_size
    tensors = {
        "task_span": torch.tensor([[r * cap.rows] * 2 for r in range(W)], dtype=torch.int32),
        "args": torch.zeros(W * cap.rows, TASK_ARGS, dtype=torch.int32),
        "wait_span": torch.zeros(W * cap.rows, 2, dtype=torch.int32),
        "waits": torch.zeros(W * cap.waits, len(WAIT_FIELDS), dtype=torch.int32),
        "raise_span": torch.zeros(W * cap.rows, 2, dtype=torch.int32),
        "raises": torch.zeros(W * cap.raises, len(RAISE_FIELDS), dtype=torch.int32),
        "unit_span": torch.zeros(0, 2, dtype=torch.int32),  # the device fills rows u, u + n, ...
    }
    return RoleTables(tasks=[[] for _ in range(W)], tensors=tensors, capacity=cap)


def check_protocol(spec: OpSpec, sizes: dict[str, int], roles: dict[str, RoleTables]) -> None:
    """Static checks of a plan's tables (before anything runs): every waited value is what its
    raises add up to, every raised flag is reset exactly once per call (by its single consumer or
    by the last of its counted consumers), and counted consumers agree on their number. Raises
    ValueError naming the signal."""
    raised: dict[tuple[str, int, tuple[int, ...]], list[Raise]] = {}
    waited: dict[tuple[str, int, tuple[int, ...]], list[Wait]] = {}
    for tables in roles.values():
        for rank_tasks in tables.tasks:
            for t in rank_tasks:
                for r in t.raises:
                    raised.setdefault((r.pad, r.rank, r.index), []).append(r)
                for w in t.waits:
                    waited.setdefault((w.pad, w.rank, w.index), []).append(w)

    def name(key) -> str:
        pad, rank, index = key
        return f"{signal_name(spec, *_flat(spec, sizes, pad, index), sizes)} on rank {rank}"

    for key, ws in waited.items():
        rs = raised.get(key, [])
        total = sum(r.value for r in rs) if all(r.op == "add" for r in rs) else None
        if any(r.op == "set" for r in rs):
            total = rs[-1].value if len(rs) == 1 else None
        if total is None:
            raise ValueError(f"{spec.name}: {name(key)} is set more than once (or set and added)")
        for w in ws:
            if w.value != total:
                raise ValueError(
                    f"{spec.name}: a wait for {name(key)} expects {w.value}, raises give {total}"
                )
        resetting = [w for w in ws if w.consumers > 0]
        if len({w.consumers for w in resetting}) > 1:
            raise ValueError(f"{spec.name}: waits on {name(key)} disagree on their consumers")
        want = resetting[0].consumers if resetting else 0
        if want == 0 or len(resetting) != want:
            raise ValueError(
                f"{spec.name}: {name(key)} is reset by {len(resetting)} of its waits, expected "
                f"exactly one consumer (or all n counted consumers) to reset it"
            )
    for key in raised:
        if key not in waited:
            raise ValueError(f"{spec.name}: {name(key)} is raised but nobody waits for it")


def tables_to(roles: dict[str, RoleTables], device: torch.device) -> dict[str, torch.Tensor]:
    """Every role's tables on ``device`` (copied once per plan), keyed ``<role>_<table>``."""
    return {
        f"{role}_{k}": v.contiguous().to(device)
        for role, t in roles.items()
        for k, v in t.tensors.items()
    }


def new_record() -> torch.Tensor:
    return torch.zeros(len(RECORD_FIELDS), dtype=torch.int64)


def set_fields(record: torch.Tensor, **values: Any) -> None:
    for k, v in values.items():
        record[RECORD[k]] = int(v)
