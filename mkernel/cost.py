"""The cost model behind a Schedule's defaults: overlap, comm_sms and transfer per op, shape, world.

This module knows no op by name: each op module declares an ``OpCost`` (its ``Work`` per call, the
transfers it offers, the mechanism its comm role moves bytes by) and ``register``s it at import, so
``import mkernel`` registers them all. An op may give a ``rule`` instead (no model yet); an op with
neither keeps the fixed defaults.

Every candidate schedule (intra_sm; inter_sm with each comm_sms of ``comm_sms_choices(S)`` and each
transfer the op offers) gets a predicted time for one call on one rank, and the cheapest one wins.
Inputs: the op's ``Work`` at its global sizes, the world size W, the SMs per rank S, and ``Rates``
(measured).

One role produces what the other consumes (``Work.comm_produces``: the comm role pushes chunks that
the GEMM reads; else the GEMM produces tiles that the comm role finalizes), so a call is a
two-stage pipeline (an op without comm tasks: T = max(GEMM with its epilogue, link))::

    T = max(produce + consume_step, produce_step + consume, link) + after

- ``produce`` / ``consume``: a role's whole work spread over its units; ``_step``: one step of it.
  Pushes: a step is one round of chunk pushes (each comm unit pushes one chunk), then the share of
  the GEMM those chunks feed; finalizes: one wave of tiles, then one tile's finalize.
- GEMM: ``flops / (engine_tflops * n / 132)`` on n CTAs (intra_sm: S; inter_sm: S - comm_sms;
  never more than the tiles), plus each tile's ``epilogue_bytes`` to a peer at one CTA's red.add
  rate (the CTA does it between two tiles).
- comm: inter_sm, comm_sms CTAs at the mechanism's ``per_cta`` GB/s; intra_sm, one communicator
  warp per compute CTA at ``per_warp``. One step takes a task's bytes at the unit's rate, or longer
  where all active units together pass the link's ceiling or local memory's. The mechanism is the
  op's (``OpCost.mechanism``), else the candidate's transfer's.
- ``link``: every byte this rank sends over its links, at the mechanism's ceiling.
- ``after``: serial work after the kernel (a copy of the result, say).

Each op's bytes are stated beside its work function, in its module. Any shape and S >= 1 gives a
valid choice (inter_sm needs S >= 2); where the work moves nothing (W = 1), intra_sm keeps every SM
on the GEMM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from .tiles import TILE_CONFIGS, pick_tile

FIELDS = ("overlap", "comm_sms", "transfer")  # the Schedule fields the model picks when unset


class Link(NamedTuple):
    """GB/s of one data-movement mechanism: one comm CTA, one intra_sm communicator warp beside
    the GEMM, and all units together (the ceiling)."""

    per_cta: float
    per_warp: float
    ceiling: float


@dataclass(frozen=True)
class Rates:
    """Measured on H200s (132 SMs), two of them over NVLink NV18, 2026-11-29; files per figure."""

    # The bf16 GEMM engine on all 132 SMs: 640-702 TFLOP/s over the six shapes, ~680 typical
    # (benchmarks/results/gemm_2026-11-29_tma4_6.json; docs/benchmarks.md). Scaled by SM count.
    engine_tflops: float = 680.0
    engine_sms: int = 132
    # From one GPU's SMs into the peer's memory, 256 MiB, one CTA of 256 threads and 132 CTAs
    # (benchmarks/results/p2p_w2_2026-11-29.json). stores: peer_store_v4 (four 16-byte loads
    # in flight per thread); tma: tile_send_bulk; red_add: red_add_v4_f32 (the GEMM epilogue's
    # reduce-add). per_warp of stores: 0.75 GB/s, the all-gather GEMM's intra_sm warp pushing a
    # 2 MB chunk in 2.8 ms beside the GEMM (docs/benchmarks.md, from the GPU timeline); tma has no
    # intra_sm path.
    stores: Link = Link(25.0, 0.75, 358.0)
    tma: Link = Link(8.2, 0.0, 353.0)
    red_add: Link = Link(9.3, 0.0, 317.0)
    # The reduce ops' finalize loop, bytes loaded + stored: one 16-byte load in flight per
    # thread, as peer_store_v4 before it kept four in flight: 9.8 GB/s per CTA (docs/benchmarks.md);
    # a warp is an eighth of that 256-thread CTA: 1.2 GB/s.
    loop: Link = Link(9.8, 1.2, 358.0)
    local_gbps: float = 4000.0  # local stores at 132 CTAs: 4.0-4.2 TB/s (/work/shared/FACTS.md)


RATES = Rates()


def comm_sms_choices(sms: int) -> list[int]:
    """The comm_sms the model weighs on ``sms`` SMs per rank: S/16, S/8, 3S/16, S/4 and S/2 (on
    132 SMs: 8, 16, 24, 33, 66; the tp sweep measured 8, 16 and 24), at least 1, below S."""
    picks = {max(1, sms * f // 16) for f in (1, 2, 3, 4, 8)}
    return sorted(c for c in picks if c < sms)


class Candidate(NamedTuple):
    overlap: str  # "intra_sm" or "inter_sm"
    comm_sms: int | None  # inter_sm only
    transfer: str  # one of the op's OpCost.transfers ("stores" or "tma")


@dataclass(frozen=True)
class Choice:
    """What the model picked for one op, shape and world, and from what: every candidate's
    predicted ms per call, best first. ``user``: the fields the Schedule set itself."""

    op: str
    world_size: int
    sms: int
    shapes: tuple[tuple[str, int], ...]
    chosen: Candidate
    user: tuple[str, ...]
    predicted: tuple[tuple[Candidate, float], ...]  # () where the op has no model
    note: str = ""

    @property
    def predicted_ms(self) -> float | None:
        return dict(self.predicted).get(self.chosen)

    def __str__(self) -> str:
        c, shape = self.chosen, ", ".join(f"{k}={v}" for k, v in self.shapes)
        by = {f: "set" if f in self.user else "model" for f in FIELDS}
        lines = [
            f"{self.op} ({shape}), W={self.world_size}, {self.sms} SMs per rank: "
            f"overlap={c.overlap} ({by['overlap']}), comm_sms={c.comm_sms} ({by['comm_sms']}), "
            f"transfer={c.transfer} ({by['transfer']})"
        ]
        lines += [f"  {self.note}"] if self.note else []
        for cand, ms in self.predicted:
            sms = f" comm_sms={cand.comm_sms}" if cand.comm_sms else ""
            mark = "*" if cand == c else " "
            lines.append(f"  {mark} {ms:9.4f} ms  {cand.overlap} {cand.transfer}{sms}")
        return "\n".join(lines)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class Work(NamedTuple):
    """One op's work on one rank for one call: what the pipeline formula needs."""

    tiles: int  # GEMM tiles (0: no GEMM)
    flops: float
    epilogue_bytes: float  # reduce-added by a GEMM CTA after each tile
    comm_tasks: int  # the comm role's data-moving tasks
    task_bytes: float  # moved by one comm task
    task_remote: float  # of which over a link
    comm_produces: bool  # the comm role feeds the GEMM (pushes) rather than finishing its tiles
    link_bytes: float  # sent over the links, both roles
    after_ms: float  # serial work after the kernel


@dataclass(frozen=True)
class OpCost:
    """What the model knows of one op, declared by the op's module and ``register``ed at import:
    either ``work`` (the model weighs the candidates) or ``rule`` (a fixed pick, no model yet)."""

    # (global sizes, W, tile rows bm, tile cols bn, rates) -> one rank's Work for one call
    work: Callable[[dict[str, int], int, int, int, Rates], Work] | None = None
    transfers: tuple[str, ...] = ("stores",)  # what an inter_sm comm role may move bytes by
    # The Rates Link the comm role moves bytes by whatever the transfer (a finalize loop: "loop");
    # None: the candidate's transfer's (stores or tma).
    mechanism: str | None = None
    # The work depends on the GEMM tile: the one the Schedule names, else pick_tile's for the
    # sizes' m and n. False: 64x128x64 always (an op without tiles: its work ignores bm, bn).
    tiled: bool = True
    # (sms, overlap, comm_sms; None where unset) -> the pick, for an op chosen by rule
    rule: Callable[[int, str | None, int | None], Candidate] | None = None
    note: str = ""  # shown with a rule's pick

    def __post_init__(self) -> None:
        if (self.work is None) == (self.rule is None):
            raise ValueError("an OpCost declares a work model or a rule, exactly one")
        if self.mechanism and not isinstance(getattr(RATES, self.mechanism, None), Link):
            raise ValueError(f"mechanism {self.mechanism!r} is not a Link of Rates")


_MODELS: dict[str, OpCost] = {}  # by op name, filled by the op modules at import


def register(op: str, model: OpCost) -> None:
    """Declare ``op``'s cost model (its module does, at import)."""
    if op in _MODELS:
        raise ValueError(f"op {op!r} already has a cost model")
    _MODELS[op] = model


def unregister(op: str) -> None:
    """Forget ``op``'s model (a test's toy op)."""
    del _MODELS[op]


def lookup(op: str) -> OpCost | None:
    """``op``'s declared model, None where it has none."""
    return _MODELS.get(op)


def registered() -> list[str]:
    """The ops with a declared model (a work model or a rule), sorted."""
    return sorted(_MODELS)


def predict(
    op: str,
    shapes: dict[str, int],
    world_size: int,
    sms: int,
    cand: Candidate,
    *,
    tile: str | None = None,
    rates: Rates = RATES,
) -> float:
    """Predicted ms of one call of ``op`` on one rank of ``world_size`` with ``sms`` SMs, run as
    ``cand``. ``shapes``: the global sizes Schedule.plan takes (m, n, k for a tiled op),
    optionally ``chunk_rows``; ``tile``: a TILE_CONFIGS name (default: pick_tile's, as plans)."""
    W, S, intra = world_size, sms, cand.overlap == "intra_sm"
    if not intra and not (cand.comm_sms and 1 <= cand.comm_sms < S):
        raise ValueError(f"inter_sm needs 1 <= comm_sms < sms={S}, got {cand.comm_sms}")
    model = _MODELS.get(op)
    if model is None or model.work is None:
        raise ValueError(f"no cost model for op {op!r}")
    if model.tiled:
        cfg = TILE_CONFIGS[tile] if tile else pick_tile(shapes["m"], shapes["n"], 0, S)
    else:
        cfg = TILE_CONFIGS["64x128x64"]
    w = model.work(shapes, W, cfg.bm, cfg.bn, rates)
    n = max(1, min(S if intra else S - cand.comm_sms, w.tiles))  # GEMM CTAs
    per_sm = rates.engine_tflops * 1e12 / rates.engine_sms
    epilogue = w.tiles * w.epilogue_bytes / (rates.red_add.per_cta * 1e9)
    gemm = (w.flops / per_sm + epilogue) / n * 1e3  # ms
    mech = rates.tma if cand.transfer == "tma" else rates.stores
    mech = getattr(rates, model.mechanism) if model.mechanism else mech
    link = w.link_bytes / mech.ceiling / 1e6
    if not w.comm_tasks:
        return max(gemm, link) + w.after_ms
    units = n if intra else cand.comm_sms  # communicator warps, or comm CTAs
    one = mech.per_warp if intra else mech.per_cta
    if one <= 0:
        raise ValueError(f"{cand.transfer} has no {cand.overlap} path")
    active = min(units, w.comm_tasks)
    step = max(
        w.task_bytes / one,
        active * w.task_remote / mech.ceiling,
        active * (w.task_bytes - w.task_remote) / rates.local_gbps,
    ) / 1e6  # fmt: skip
    rounds = _ceil(w.comm_tasks, units)
    comm = rounds * step
    if w.comm_produces:  # a round of chunks, then the GEMM's share that needs them
        t = max(comm + gemm / rounds, step + gemm)
    else:  # a wave of tiles, then one tile's finalize
        t = max(gemm + step, gemm / _ceil(w.tiles, n) + comm)
    return max(t, link) + w.after_ms


def candidates(
    op: str,
    sms: int,
    *,
    overlap: str | None = None,
    comm_sms: int | None = None,
    transfer: str | None = None,
) -> list[Candidate]:
    """The schedules the model weighs for ``op`` on ``sms`` SMs per rank, within the fields set
    (None: free), intra_sm first (it wins ties: no SM is taken from the GEMM)."""
    model = _MODELS.get(op)
    transfers = [transfer] if transfer else list(model.transfers if model else ("stores",))
    out = []
    if overlap in (None, "intra_sm") and comm_sms is None and transfer != "tma":
        out.append(Candidate("intra_sm", None, "stores"))
    if overlap in (None, "inter_sm") and sms >= 2:
        counts = [comm_sms] if comm_sms else comm_sms_choices(sms)
        out += [Candidate("inter_sm", c, t) for c in counts for t in transfers if c < sms]
    return out


def choose(
    op: str,
    shapes: dict[str, int],
    world_size: int,
    sms: int,
    *,
    overlap: str | None = None,
    comm_sms: int | None = None,
    transfer: str | None = None,
    tile: str | None = None,
    rates: Rates = RATES,
) -> Choice:
    """The cheapest candidate for ``op`` within the fields set (None: the model picks), or its
    rule's pick. An op without a model, or no valid candidate, keeps the fixed defaults of before:
    intra_sm, S // 8 comm SMs when inter_sm, stores."""
    user = tuple(f for f, v in zip(FIELDS, (overlap, comm_sms, transfer), strict=True) if v)
    key = tuple(sorted(shapes.items()))
    ov = overlap or ("inter_sm" if comm_sms or transfer == "tma" else "intra_sm")
    fixed = Candidate(
        ov, (comm_sms or max(1, sms // 8)) if ov == "inter_sm" else None, transfer or "stores"
    )
    model = _MODELS.get(op)
    if model is not None and model.rule is not None:
        picked = model.rule(sms, overlap, comm_sms)
        return Choice(op, world_size, sms, key, picked, user, (), model.note)
    if model is None:
        return Choice(op, world_size, sms, key, fixed, user, (), "no cost model: fixed defaults")
    cands = candidates(op, sms, overlap=overlap, comm_sms=comm_sms, transfer=transfer)
    if not cands:  # e.g. inter_sm on one SM: split_units says why
        return Choice(op, world_size, sms, key, fixed, user, (), "no valid candidate")
    scored = [(c, predict(op, shapes, world_size, sms, c, tile=tile, rates=rates)) for c in cands]
    scored.sort(key=lambda cs: cs[1])  # stable: equal times keep candidates()' order
    return Choice(op, world_size, sms, key, scored[0][0], user, tuple(scored))
