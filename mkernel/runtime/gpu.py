"""The GPU launch of every fused op: the launch record, the status block, asynchronous error
reporting and the watchdog.

A call enqueues its kernel and returns (like NCCL and PyTorch's ops): no host synchronize. A wait
that times out in the kernel fills the world's status block (pinned, mapped host memory) with the
launch id, rank, peer, task, role and flag; the kernel then exits cleanly. The error is raised as
``CommTimeout`` by the next call on that world, by ``world.check()``, or at once by the call itself
when ``world.sync_checks`` is set. A watchdog thread polls the status blocks of the worlds with work
in flight and reports a timeout within ``WATCHDOG_PERIOD_S`` (a RuntimeWarning, and the world's
``on_timeout`` callback when set), so a program that never calls again still learns of it.

Host cost per call is kept near one ``torch.matmul``: the record's fields that depend only on the
plan are filled once per plan; a call copies that template and sets its operands' addresses.
"""

from __future__ import annotations

import ctypes
import threading
import time
import warnings
import weakref
from array import array
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CommTimeout, DeviceInputError
from ..protocol import (
    CAPACITY_FIELDS,
    MAX_LOCAL_RANKS,
    OVERLAPS,
    RECORD,
    RECORD_FIELDS,
    ROLES,
    STATUS_ERRORS,
    STATUS_FIELDS,
    TASK_ARGS,
    TILE_CONFIG_IDS,
    signal_name,
)
from . import registry
from .memory import workspace

if TYPE_CHECKING:
    from ..schedule import Plan
    from ..world import World

WATCHDOG_PERIOD_S = 0.1
_LAUNCH_HISTORY = 1024  # launch ids remembered per world, to name the flag of a late-read timeout
_EXT: Any = None


def extension() -> Any:
    global _EXT
    if _EXT is None:
        from .. import jit

        _EXT = jit.load()
    return _EXT


def launcher(world: World, plan: Plan) -> Any:
    """The extension that launches ``plan`` in ``world``: the nvshmem one for a distributed world
    of several nodes (its kernels put across nodes through NVSHMEM), else the package's."""
    if plan.nodes > 1 and not world.emulated_world:
        from .. import nvshmem_ext

        return nvshmem_ext.load()
    return extension()


class StatusBlock:
    """CommStatus (primitives/protocol_gen.h) in pinned, mapped host memory, plus the plans of the
    world's recent launches by id (the kernel records the id of the launch that timed out)."""

    def __init__(self) -> None:
        self.t = torch.zeros(len(STATUS_FIELDS), dtype=torch.int32, pin_memory=True)
        self._error = ctypes.c_int32.from_address(self.t.data_ptr())  # read without torch
        self.plans: dict[int, Plan] = {}
        self.next_id = 1
        self.reported = False  # the watchdog has warned about the current error

    def ptr(self) -> int:
        return self.t.data_ptr()

    def launched(self, plan: Plan) -> int:
        lid = self.next_id
        self.next_id += 1
        self.plans[lid] = plan
        self.plans.pop(lid - _LAUNCH_HISTORY, None)
        return lid

    @property
    def error(self) -> bool:
        return self._error.value != 0

    def timeout(self) -> CommTimeout | DeviceInputError:
        """The recorded error: a timeout, as the exception both backends raise (names the flag by
        the op's SPEC, as the interpreter does), or an input value a kernel found unusable."""
        v = dict(zip(STATUS_FIELDS, self.t.tolist(), strict=True))
        plan = self.plans.get(v["launch"])
        if STATUS_ERRORS[v["error"]] == "bad_input":
            return bad_input(plan, v)
        if plan is not None:
            name = signal_name(plan.spec, v["pad"], v["index"], plan.sizes)
        else:
            name = f"pad{v['pad']}[{v['index']}]"
        role = ROLES[v["role"]] if 0 <= v["role"] < len(ROLES) else "?"
        if role == "rdma":  # a put's wait on its ring (primitives/rdma/ring_layout.h RingWait)
            name = f"rdma_{'tail' if v['pad'] == 0 else 'head'}[{v['rank']}][0]"
        return CommTimeout(v["rank"], v["peer"], name, v["task"], role)


def bad_input(plan: Plan | None, v: dict[str, int]) -> DeviceInputError:
    """The DeviceInputError of a status block's bad_input record (``v``: its fields by name),
    worded by the op's ``bad_input_detail(plan, rank, task, index, value)`` if it has one."""
    rank, task, index, value = v["rank"], v["task"], v["index"], v["value"]
    op = plan.spec.name if plan is not None else "a kernel"
    detail = getattr(registry.get(op), "bad_input_detail", None) if plan is not None else None
    if detail is not None:
        what = detail(plan, rank, task, index, value)
    else:
        what = f"input value {value} of rank {rank} at ({task}, {index})"
    return DeviceInputError(op, rank, task, index, value, what)


def status_block(world: World) -> StatusBlock:
    blk = getattr(world, "_status", None)
    if blk is None:
        blk = StatusBlock()
        world._status = blk
    return blk


def raise_timeout(world: World, status: StatusBlock | None = None) -> None:
    """Raises the world's recorded timeout, if any, once its kernels have ended.
    NOTE: a timed-out call leaves flags and accumulators dirty (late producers land after the
    waiter gave up). Once the world's work has drained it is safe to clear an emulated world's
    workspaces; a distributed world needs world.reset() on every rank."""
    status = status or status_block(world)
    if not status.error:
        return
    torch.cuda.synchronize(world.device)  # every wait has returned (abort): the kernel ends
    exc = status.timeout()
    rings = getattr(world, "_rdma", None)
    if rings is not None and isinstance(exc, CommTimeout):
        # a proxy that stopped on a bad descriptor or a CUDA error: its waiters timed out; say
        # why before world.reset() restarts it (and clears the error); else what can hold it
        exc = CommTimeout(
            exc.rank,
            exc.peer,
            exc.signal,
            exc.task,
            exc.role,
            "; ".join(rings.errors()) or NODES_TIMEOUT_HINT,
            unit=exc.unit,
        )
    status.t.zero_()
    status.reported = False
    if world.emulated_world:
        world.reset()
    raise exc


# -- the watchdog ---------------------------------------------------------------------------------

_watched: weakref.WeakSet[World] = weakref.WeakSet()
_watchdog: threading.Thread | None = None
_watch_lock = threading.Lock()


def _watch_loop() -> None:
    while True:
        time.sleep(WATCHDOG_PERIOD_S)
        for world in list(_watched):
            status = getattr(world, "_status", None)
            if status is None or not status.error or status.reported:
                continue
            status.reported = True
            exc = status.timeout()
            callback = getattr(world, "on_timeout", None)
            if callback is not None:
                callback(exc)
            else:
                warnings.warn(
                    f"mkernel watchdog: {exc} (raised by the next call on this world or by "
                    "world.check())",
                    RuntimeWarning,
                    stacklevel=1,
                )


def watch(world: World) -> None:
    """Adds ``world`` to the watchdog's list (starting the thread on first use)."""
    global _watchdog
    if world in _watched:
        return
    with _watch_lock:
        _watched.add(world)
        if _watchdog is None:
            _watchdog = threading.Thread(target=_watch_loop, name="mkernel-watchdog", daemon=True)
            _watchdog.start()


# -- the launch record ----------------------------------------------------------------------------


def _plan_record(world: World, plan: Plan) -> array:
    """The record fields that depend on the plan and the world only (cached on the plan)."""
    cached = plan.extra.get("_record")
    if cached is not None:
        return cached
    spec, emulated = plan.spec, world.emulated_world
    if emulated and world.size > MAX_LOCAL_RANKS:
        raise ValueError(
            f"an emulated GPU world serves at most {MAX_LOCAL_RANKS} ranks, got {world.size}"
        )
    rec = array("q", bytes(8 * len(RECORD_FIELDS)))

    def put(name: str, value: int) -> None:
        rec[RECORD[name]] = int(value)

    for name, t in plan.device_tables(world.device).items():
        put(name, t.data_ptr() if t.numel() else 0)  # an empty unit_span: the default rule
    for role in ("compute", "comm"):
        for field, value in zip(CAPACITY_FIELDS, plan.capacity(role), strict=True):
            put(f"{role}_cap_{field}", value)
    put("compute_units", plan.compute_units)
    put("comm_units", plan.comm_units)
    put("ctas_per_rank", plan.ctas_per_rank)
    put("overlap", OVERLAPS.index(plan.overlap))
    put("tile_config", TILE_CONFIG_IDS[plan.tile.name])
    put("compute_signals", plan.roles["compute"].tensors["raises"].shape[0] > 0)
    put("world_size", world.size)
    put("rank0", 0 if emulated else world.rank)
    put("ranks_here", world.size if emulated else 1)
    put("timeout_ns", int(world.timeout_s * 1e9))
    put("backoff_ns", plan.extra.get("backoff_ns", 0))
    put("status", status_block(world).ptr())
    f = plan.faults
    put("silent_rank", -1 if f.silent_rank is None else f.silent_rank)
    put("delay_rank", -1 if f.delay_rank is None else f.delay_rank)
    put("delay_ns", int(f.delay_us * 1000))
    ws = workspace(world, plan)
    for i, p in enumerate(spec.all_pads()):
        put(f"pad{i}", ws[p.name].peer_ptrs.data_ptr())
    put("ranks_per_node", world.size // plan.nodes)
    if plan.nodes > 1:
        plan.extra["_puts_per_ring"] = check_cross_node_raises(plan)
        if emulated:  # the proxy transport's rings carry the raises across nodes (else NVSHMEM)
            from ..rdma import fused_rings

            rings = fused_rings(world)
            put("rdma_rings", rings.rings.ptr)
            put("rdma_reserve", rings.reserve.data_ptr())
            put("rdma_capacity", rings.capacity)
    operands = []
    for i, b in enumerate(spec.buffers):
        if b.kind == "symmetric":
            buf = ws[b.name]
            if buf is not None:
                put(f"slot{i}", buf.peer_ptrs.data_ptr())
                put(f"stride{i}", buf.local.data_ptr())
        else:
            operands.append((b.name, RECORD[f"slot{i}"], RECORD[f"stride{i}"]))
    for i, name in enumerate(spec.scalars):
        put(f"scalar{i}", plan.sizes[name])
    plan.extra["_record"] = rec
    plan.extra["_operand_slots"] = operands
    plan.extra["_workspace"] = ws  # keeps the buffers the record points at alive
    return rec


def check_cross_node_raises(plan: Plan) -> int:
    """A raise on a rank of another node travels as a put whose signal is then set (by the proxy's
    stream, kPutSetDevice, or NVSHMEM's atomic set): it must be a "set" (an "add" is not atomic
    on the proxy's path). Returns the most puts a rank's ring takes per call (one per cross-node
    raise)."""
    R = plan.world_size // plan.nodes
    most = 0
    for rank in range(plan.world_size):
        puts = 0
        for role in ("compute", "comm"):
            for task in plan.roles[role].tasks[rank]:
                for r in task.raises:
                    if r.rank // R == rank // R:
                        continue
                    if r.op != "set":
                        raise ValueError(
                            f"{plan.op}: task {task.id} of rank {rank} adds to {r.pad} on rank "
                            f"{r.rank} of another node; a put's signal can only be set"
                        )
                    puts += 1
        most = max(most, puts)
    return most


# NOTE (issue 33.1, the root cause of the emulated-nodes race): the proxies issue their copies
# through the CUDA driver while the kernel waits for them. A CUDA call that must wait for the
# device (loading a module: cuBLAS's or a jiterator op's first launch; freeing pinned or device
# memory) holds the driver until the running kernel ends, so the proxies' next copy waits for a
# kernel that waits for it, until the device deadline. Measured: the first GPU matmul issued
# right after an asynchronous call over nodes timed out gemm_rs (W=4, 2 nodes) in a fresh process
# (tests/gpu/test_nodes_busy_stream_gpu.py, H100, 2026-12-06), as tools/lazy_probe.py had shown
# for jiterator ops. So a launch over nodes returns once its kernel has ended (wait_nodes_launch):
# the caller's own next CUDA call then never meets a kernel that depends on the proxies. Another
# thread's such call meanwhile still can (docs/rdma.md).
NODES_TIMEOUT_HINT = (
    "over nodes on one GPU the rdma proxies' copies go through the CUDA driver while the kernel "
    "waits for them; a CUDA call from another thread that waits for the device meanwhile "
    "(loading a module, as cuBLAS or a torch op compiled at run time does at its first call; "
    "freeing pinned or device memory) stalls them (docs/rdma.md)"
)
NODES_POLL_S = 20e-6  # the host's poll of a launch over nodes (wait_nodes_launch)


def before_nodes_launch(world: World, plan: Plan, stream: int) -> bool:
    """Before a launch over nodes on ``stream`` (nothing under graph capture, whose replays the
    host does not see): no proxy copies on a stream of ``stream``'s hardware queue
    (ProxyRing.ensure_independent: there they would wait behind whatever is queued after the
    kernel, as the kernel waits for them); count the launch's puts per ring (the tickets are int32
    and monotonic: before they could pass 2^31 the idle rings are emptied and restarted, a
    synchronize once in ~2^31 puts; a graph replayed that often needs
    ``fused_rings(world).restart()`` between replays, on an idle GPU).
    Returns whether the launch is to be waited for (wait_nodes_launch): not under capture."""
    from ..rdma import _MAX_COUNT

    if torch.cuda.is_current_stream_capturing():
        return False
    rings, puts = world._rdma, plan.extra["_puts_per_ring"]
    rings.ensure_independent(stream)
    if rings.posted + puts > _MAX_COUNT:
        torch.cuda.synchronize(world.device)
        rings.restart()
    rings.count_posted(puts)
    return True


def wait_nodes_launch() -> None:
    """After a launch over nodes (not under capture): returns once the current stream has reached
    the end of it. Polled (cudaEventQuery never waits for the device, so it never holds the
    driver against the proxies), without a deadline: the kernel's own waits time out."""
    done = torch.cuda.Event()
    done.record()
    while not done.query():
        time.sleep(NODES_POLL_S)


_POISON_LOADED: set[int] = set()


def preload_poison(device_index: int) -> None:
    """Loads the poison kernel's module on this device before the device's first fused launch
    (kernels/poison_launch.h preload_poison): CUDA loads a module at its first launch and a load
    waits for the device, so loading it right after a kernel over nodes that waits for the
    proxies would stall them (the NOTE above) and time the first call of every process out."""
    if device_index in _POISON_LOADED:
        return
    rc = extension().preload_poison()
    if rc != 0:
        raise RuntimeError(f"loading the poison kernel failed with code {rc}")
    _POISON_LOADED.add(device_index)


def _record(world: World, plan: Plan, operands: dict[str, torch.Tensor], launch: int) -> array:
    """The launch record (mkernel/protocol.py RECORD_FIELDS) of one call."""
    rec = array("q", _plan_record(world, plan))
    emulated = world.emulated_world
    for name, slot, stride in plan.extra["_operand_slots"]:
        t = operands[name]
        rec[slot] = t.data_ptr()
        # one rank's elements: emulated, the contiguous [W, ...]'s stride; distributed, this
        # rank's whole tensor (only rank 0 is addressed there; a kernel may read its extent, as
        # the MoE kernels take their A operands' rows from it)
        rec[stride] = t.stride(0) if emulated else t.numel()
    rec[RECORD["launch"]] = launch
    world._pending_trace = None
    if plan.extra.get("trace"):
        ranks_here = world.size if emulated else 1
        counts = [len(ts) for role in ("compute", "comm") for ts in plan.roles[role].tasks]
        counts += [plan.capacity(role)[0] for role in ("compute", "comm")]  # device-filled
        cap = max(1, -(-max(counts) // min(plan.compute_units, max(1, plan.comm_units))))
        buf = torch.zeros(
            (ranks_here, plan.ctas_per_rank, 2, cap, 2), dtype=torch.int64, device=world.device
        )
        rec[RECORD["timeline"]] = buf.data_ptr()
        rec[RECORD["timeline_cap"]] = cap
        for dim, name in enumerate(("rank", "slot", "role")):
            rec[RECORD[f"timeline_stride_{name}"]] = buf.stride(dim)
        world._pending_trace = (plan, buf)
    return rec


def stream_handle(index: int) -> int:
    """The current stream's handle on CUDA device ``index`` (torch's raw accessor when it has
    one: a fraction of a microsecond instead of building a Stream object)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(index)
    return torch.cuda.current_stream(index).cuda_stream


def run_gpu(world: World, plan: Plan, operands: dict[str, torch.Tensor]) -> None:
    """Enqueues the op's kernel on the current stream with these operands (by the spec's names)
    and returns. A timeout left by an earlier launch on this world is raised first. With
    ``world.sync_checks`` (or a trace) it waits for the kernel and raises its timeout at once.
    Inside CUDA-graph capture nothing waits."""
    if world.device.index != torch.cuda.current_device():  # kernels launch into the current
        with torch.cuda.device(world.device):  # device's context: a world on another GPU
            return run_gpu(world, plan, operands)
    status = raise_pending(world)
    watch(world)
    rec = _record(world, plan, operands, status.launched(plan))
    stream = stream_handle(world.device.index)
    tracked = plan.nodes > 1 and world.emulated_world and before_nodes_launch(world, plan, stream)
    launch = plan.extra.get("_launch")
    if launch is None:
        launch = plan.extra["_launch"] = getattr(
            launcher(world, plan), f"launch_{plan.spec.kernel_name}"
        )
    preload_poison(world.device.index)
    rc = launch(rec.buffer_info()[0], stream)
    if rc != 0:
        raise RuntimeError(f"kernel launch failed with code {rc} ({torch.cuda.get_device_name()})")
    poison_on_timeout(world, plan, operands, stream)
    if tracked:
        wait_nodes_launch()
    trace = world._pending_trace
    if (world.sync_checks or trace) and not torch.cuda.is_current_stream_capturing():
        torch.cuda.current_stream(world.device).synchronize()
        raise_timeout(world, status)
        if trace is not None:
            world.last_timeline = gpu_timeline(world, *trace)


# The element types a failed launch's outputs are poisoned in (kernels/poison_launch.h
# PoisonDtype): NaN needs a floating-point type; integer outputs (MoE rows' sources, offsets) are
# left as they are, since the call's float results and the next call's raise already say it failed.
_POISON_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def poison_on_timeout(
    world: World, plan: Plan, operands: dict[str, torch.Tensor], stream: int
) -> None:
    """Enqueues, after the op's kernel on ``stream``, the kernel that fills its floating-point
    outputs with NaN if the world's status block then records a timeout (this launch's or an
    earlier one's still in flight): an asynchronous call that timed out leaves no result that
    looks valid, however late the host learns of it. Captured into CUDA graphs like the launch."""
    outs = [
        (operands[b.name], _POISON_DTYPES[b.dtype])
        for b in plan.spec.buffers
        if b.kind == "output" and b.dtype in _POISON_DTYPES and b.name in operands
    ]
    ext, status = extension(), status_block(world).ptr()
    step = ext.POISON_MAX_OUTPUTS
    for first in range(0, len(outs), step):
        rec = array("q", [status, len(outs[first : first + step])])
        for t, code in outs[first : first + step]:
            rec.extend((t.data_ptr(), t.numel(), code))
        rc = ext.launch_poison_if_failed(rec.buffer_info()[0], stream)
        if rc != 0:
            raise RuntimeError(f"poison launch failed with code {rc}")


def raise_pending(world: World) -> StatusBlock:
    """The world's status block, once a timeout an earlier launch left on it is raised: what
    every launch on the world does first."""
    status = status_block(world)
    if status.error:
        raise_timeout(world, status)
    return status


def filled_task_ids(plan: Plan, world: World, role: str, rank: int) -> list[int]:
    """The task ids (args[0], as the device names them) a device-filled role's layout phase wrote
    for ``rank`` in the last launch, in table order."""
    t = plan.device_tables(world.device)
    first, end = t[f"{role}_task_span"].view(-1, 2)[rank].tolist()
    return t[f"{role}_args"].view(-1, TASK_ARGS)[first:end, 0].tolist()


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
                tasks = plan.tasks_of(role, rank, unit)
                if plan.roles[role].capacity is not None:  # device-filled: its tables say
                    n = plan.compute_units if role == "compute" else plan.comm_units
                    tasks = filled_task_ids(plan, world, role, rank)[unit::n]
                for i, task in enumerate(tasks[: ev.shape[3]]):
                    start, end = (int(x) for x in ev[lr, slot, role_id, i])
                    if start > 0 and end >= start:
                        tl.add(rank, f"{role}{unit}", task, start - t0, end - t0)
    return tl
