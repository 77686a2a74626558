"""The cost model behind a Schedule's defaults: overlap, comm_sms and transfer per op, shape, world.

Every candidate schedule (intra_sm; inter_sm with each comm_sms of ``comm_sms_choices(S)``; for
ag_gemm, each transfer) gets a predicted time for one call on one rank, and the cheapest one wins.
Inputs: the op, its global sizes, the world size W, the SMs per rank S, and ``Rates`` (measured).

One role produces what the other consumes (ag_gemm, all_gather: the comm role pushes chunks that the
GEMM reads; gemm_ar: the GEMM produces tiles that the comm role finalizes), so a call is a
two-stage pipeline (gemm_rs has no comm role: T = max(GEMM with its epilogue, link))::

    T = max(produce + consume_step, produce_step + consume, link) + after

- ``produce`` / ``consume``: a role's whole work spread over its units; ``_step``: one step of it.
  ag_gemm: a step is one round of chunk pushes (each comm unit pushes one chunk), then the share of
  the GEMM those chunks feed; gemm_rs / gemm_ar: one wave of tiles, then one tile's finalize.
- GEMM: ``flops / (engine_tflops * n / 132)`` on n CTAs (intra_sm: S; inter_sm: S - comm_sms;
  never more than the tiles), plus, at W > 1, each tile's fp32 epilogue to a peer at one CTA's
  red.add rate (the CTA does it between two tiles): gemm_ar's reduce-adds, gemm_rs's partials
  (the (W - 1) / W of its tiles its peers own).
- comm: inter_sm, comm_sms CTAs at the mechanism's ``per_cta`` GB/s; intra_sm, one communicator
  warp per compute CTA at ``per_warp``. One step takes a task's bytes at the unit's rate, or longer
  where all active units together pass the link's ceiling or local memory's.
- ``link``: every byte this rank sends over its links, at the mechanism's ceiling.
- ``after``: gemm_ar's copy of the result into ``out`` after the kernel.

Bytes: ag_gemm pushes (W - 1) / W of A (plus its own copy); gemm_rs stores the fp32 partials of
its peers' tiles (4 bytes per element) into their owners' stage, which the owners add in their own
tiles' epilogues; gemm_ar reduce-adds fp32 partials into the tiles' owners, whose finalize loop
loads 4 bytes, stores 4 (zeros) and 2 (bf16 out) per element, and 2 into each peer's result.

W = 1 moves nothing but all_gather's own copy: the GEMM ops then keep every SM for the GEMM
(intra_sm). Any shape and S >= 1 gives a valid choice (inter_sm needs S >= 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .schedule import TILE_CONFIGS, pick_tile

FIELDS = ("overlap", "comm_sms", "transfer")  # the Schedule fields the model picks when unset
GEMM_OPS = ("gemm_rs", "ag_gemm", "gemm_ar")


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
    # reduce-add). per_warp of stores: 0.75 GB/s, ag_gemm's intra_sm warp pushing a 2 MB chunk
    # in 2.8 ms beside the GEMM (docs/benchmarks.md, from the GPU timeline); tma has no intra_sm
    # path.
    stores: Link = Link(25.0, 0.75, 358.0)
    tma: Link = Link(8.2, 0.0, 353.0)
    red_add: Link = Link(9.3, 0.0, 317.0)
    # The finalize loop of gemm_rs / gemm_ar, bytes loaded + stored: one 16-byte load in flight per
    # thread, as peer_store_v4 before it kept four in flight: 9.8 GB/s per CTA (docs/benchmarks.md);
    # a warp is an eighth of that 256-thread CTA: 1.2 GB/s.
    loop: Link = Link(9.8, 1.2, 358.0)
    local_gbps: float = 4000.0  # local stores at 132 CTAs: 4.0-4.2 TB/s (/work/shared/FACTS.md)
    # The attention forward engine on 132 SMs: 640-680 TFLOP/s at S = 8192, D = 128
    # (benchmarks/results/ring_local_2026-12-02_final.json, attention_2026-12-01_final.json).
    attention_tflops: float = 650.0
    # One ring-attention K / V send piece (a BulkRing of 4 x 8 KB on an intra_sm spare warp):
    # ~10 GB/s beside the engine, emulated W = 2 (a 64 MB block: 16 pieces in ~335-420 us, 66 in
    # ~110-150 us; benchmarks/results/ring_local_bwd_2026-12-01_home_bf16_trace.txt,
    # ring_kv_landing_2026-12-02.txt).
    ring_part_gbps: float = 10.0
    # The attention backward engine on 132 SMs: 470-500 TFLOP/s at S = 8192, D = 128, counting
    # 2.5x the forward's FLOPs (benchmarks/results/ring_local_bwd_2026-12-02_grad_parts.json).
    attention_bwd_tflops: float = 480.0
    # The compute a unit loses to its own spare warp's copies (intra_sm: the comm unit shares the
    # SM), as a rate of their traffic (bytes read + written): in an emulated W = 2 ring backward
    # the units hosting a grad part (~17 MB) ended their K/V tiles ~340 us after those hosting no
    # comm task, those hosting a K/V piece (~8 MB) ~170 us after (full: ~210 and ~75 us):
    # ~50 GB/s (benchmarks/results/bwd_item_cost_2026-12-02.txt, run 9).
    spare_copy_gbps: float = 50.0
    # An attention-backward work item's fixed cost beyond its q steps: 6.9 us fitted on the
    # engine alone (1024-8192 items of equal FLOPs), 7-25 us in the fused kernel's traces
    # (benchmarks/results/bwd_item_cost_2026-12-02.txt).
    attention_bwd_item_us: float = 10.0
    # A row task of the ring backward's tails (home, dq, finish: fp32 accumulators to bf16) on
    # one unit's consumer warpgroups, bytes read + written: 22-32 GB/s per unit with every unit
    # of an emulated W = 2 world at it (HBM-bound; benchmarks/results/
    # ring_local_bwd_2026-12-02_hosted_costs_trace.txt: home ~335 MB a rank in ~157 us on 66 units).
    row_task_gbps: float = 30.0


RATES = Rates()


def comm_sms_choices(sms: int) -> list[int]:
    """The comm_sms the model weighs on ``sms`` SMs per rank: S/16, S/8, 3S/16, S/4 and S/2 (on
    132 SMs: 8, 16, 24, 33, 66; the tp sweep measured 8, 16 and 24), at least 1, below S."""
    picks = {max(1, sms * f // 16) for f in (1, 2, 3, 4, 8)}
    return sorted(c for c in picks if c < sms)


class Candidate(NamedTuple):
    overlap: str  # "intra_sm" or "inter_sm"
    comm_sms: int | None  # inter_sm only
    transfer: str  # "stores" or "tma" (ag_gemm); "stores" for ops without the knob


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


class _Work(NamedTuple):
    """One op's work on one rank: what the pipeline formula needs."""

    tiles: int  # GEMM tiles (0: no GEMM)
    flops: float
    epilogue_bytes: float  # reduce-added by a GEMM CTA after each tile
    comm_tasks: int  # the comm role's data-moving tasks
    task_bytes: float  # moved by one comm task
    task_remote: float  # of which over a link
    comm_produces: bool  # the comm role feeds the GEMM (pushes) rather than finishing its tiles
    link_bytes: float  # sent over the links, both roles
    after_ms: float  # serial work after the kernel


def _work(op: str, s: dict[str, int], W: int, bm: int, bn: int, rates: Rates) -> _Work | None:
    if op in ("ag_gemm", "all_gather"):
        ag = op == "ag_gemm"
        m, n, k = (s["m"], s["n"], s["k"]) if ag else (s["rows"] * W, 0, s["cols"])
        ms = m // W
        cr = min(s.get("chunk_rows") or (bm if ag else 64), ms)
        chunk = cr * k * 2.0
        moves = W > 1 or not ag  # ag_gemm at W = 1 reads a directly
        return _Work(
            tiles=_ceil(m, bm) * _ceil(n, bn) if ag else 0,
            flops=2.0 * m * n * k,
            epilogue_bytes=0.0,
            comm_tasks=W * _ceil(ms, cr) if moves else 0,
            task_bytes=chunk,
            task_remote=chunk * (W - 1) / W,  # one push in W is the rank's own copy
            comm_produces=True,
            link_bytes=(W - 1) * ms * k * 2.0,
            after_ms=0.0,
        )
    if op == "gemm_rs":  # peers' tiles: fp32 partials by bulk copies; no comm role, no pass after
        m, n, k = s["m"], s["n"], s["k"]
        tiles = W * _ceil(m // W, bm) * _ceil(n, bn)
        return _Work(
            tiles=tiles,
            flops=2.0 * m * n * (k // W),
            epilogue_bytes=bm * bn * 4.0 * (W - 1) / W,  # the average tile's remote store
            comm_tasks=0,
            task_bytes=0.0,
            task_remote=0.0,
            comm_produces=False,
            link_bytes=(W - 1) / W * m * n * 4.0,
            after_ms=0.0,
        )
    if op == "gemm_ar":
        m, n, k = s["m"], s["n"], s["k"]
        tile = bm * bn
        tiles = _ceil(m, bm) * _ceil(n, bn)
        remote = (W - 1) * tile * 2.0  # bf16 into each peer's result
        return _Work(
            tiles=tiles,
            flops=2.0 * m * n * (k // W),
            epilogue_bytes=tile * 4.0 if W > 1 else 0.0,
            comm_tasks=_ceil(tiles, W) if W > 1 else 0,
            task_bytes=tile * 10.0 + remote,  # load fp32, store zeros, store bf16
            task_remote=remote,
            comm_produces=False,
            link_bytes=(W - 1) / W * m * n * 6.0,
            after_ms=0.0 if W == 1 else m * n * 4.0 / rates.local_gbps / 1e6,
        )
    return None


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
    ``cand``. ``shapes``: the global sizes Schedule.plan takes (m, n, k; all_gather: rows, cols),
    optionally ``chunk_rows``; ``tile``: a TILE_CONFIGS name (default: pick_tile's, as plans)."""
    W, S, intra = world_size, sms, cand.overlap == "intra_sm"
    if not intra and not (cand.comm_sms and 1 <= cand.comm_sms < S):
        raise ValueError(f"inter_sm needs 1 <= comm_sms < sms={S}, got {cand.comm_sms}")
    if op in GEMM_OPS:
        cfg = TILE_CONFIGS[tile] if tile else pick_tile(shapes["m"], shapes["n"], 0, S)
    else:
        cfg = TILE_CONFIGS["64x128x64"]
    w = _work(op, shapes, W, cfg.bm, cfg.bn, rates)
    if w is None:
        raise ValueError(f"no cost model for op {op!r}")
    n = max(1, min(S if intra else S - cand.comm_sms, w.tiles))  # GEMM CTAs
    per_sm = rates.engine_tflops * 1e12 / rates.engine_sms
    epilogue = w.tiles * w.epilogue_bytes / (rates.red_add.per_cta * 1e9)
    gemm = (w.flops / per_sm + epilogue) / n * 1e3  # ms
    mech = rates.tma if cand.transfer == "tma" else rates.stores
    mech = rates.loop if op in ("gemm_rs", "gemm_ar") else mech
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
    transfers = [transfer] if transfer else ["stores", "tma"] if op == "ag_gemm" else ["stores"]
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
    """The cheapest candidate for ``op`` within the fields set (None: the model picks). An op
    without a model, or no valid candidate, keeps the fixed defaults of before: intra_sm, S // 8
    comm SMs when inter_sm, stores."""
    user = tuple(f for f, v in zip(FIELDS, (overlap, comm_sms, transfer), strict=True) if v)
    key = tuple(sorted(shapes.items()))
    ov = overlap or ("inter_sm" if comm_sms or transfer == "tma" else "intra_sm")
    fixed = Candidate(
        ov, (comm_sms or max(1, sms // 8)) if ov == "inter_sm" else None, transfer or "stores"
    )
    if op == "ring_attention":
        ov = overlap or RING_OVERLAP
        cs = (comm_sms or ring_attention_comm_sms(sms)) if ov == "inter_sm" else None
        return Choice(op, world_size, sms, key, Candidate(ov, cs, "stores"), user, (), "rule")
    if op not in GEMM_OPS + ("all_gather",):
        return Choice(op, world_size, sms, key, fixed, user, (), "no cost model: fixed defaults")
    cands = candidates(op, sms, overlap=overlap, comm_sms=comm_sms, transfer=transfer)
    if not cands:  # e.g. inter_sm on one SM: split_units says why
        return Choice(op, world_size, sms, key, fixed, user, (), "no valid candidate")
    scored = [(c, predict(op, shapes, world_size, sms, c, tile=tile, rates=rates)) for c in cands]
    scored.sort(key=lambda cs: cs[1])  # stable: equal times keep candidates()' order
    return Choice(op, world_size, sms, key, scored[0][0], user, tuple(scored))


def ring_attention_comm_sms(sms: int) -> int:
    """Comm CTAs of ring attention when inter_sm is asked for: a step's K / V block must cross the
    link within the step's attention. At S_local = 8192, Hkv = 32, D = 128 a causal zigzag step
    is 134 MB against ~1 ms of engine work on 132 SMs: ~134 GB/s, 3 BulkRing CTAs at ~45 GB/s
    each over NVLink (the issue's probe); 8 leave room. Scaled by the SMs a rank has."""
    return max(1, min(8, sms // 16))


def ring_block_lag(
    block_bytes: int, parts: int, q_rows: int, head_dim: int, emulated: bool, rates: Rates = RATES
) -> float:
    """How far one compute unit of ring attention gets while a K / V block crosses one hop, in
    key rows folded into a q tile of ``q_rows`` rows (the plan's task cost unit): the plan's
    ``chain_order`` runs a q tile's next step in the same work item only once its block should
    have landed. The block moves as ``parts`` BulkRing pieces at ``rates.ring_part_gbps`` each, at
    most the link's ceiling (an emulated world copies within one GPU's memory: reads and writes);
    a unit (one SM) runs at the attention engine's rate per SM. No margin: a chain that waits
    for its block stalls its unit until the block lands, one that turns early costs a state
    round trip; both cost about the estimate's error (on one H200, emulated W = 2, the pieces
    landed when the rate says, and lag 0 measured within 1-2% of this estimate)."""
    ceiling = rates.local_gbps / 2 if emulated else rates.tma.ceiling
    seconds = block_bytes / (min(parts * rates.ring_part_gbps, ceiling) * 1e9)
    flops_per_row = 4.0 * q_rows * head_dim  # QK^T and PV for one key row
    rows_per_second = rates.attention_tflops * 1e12 / rates.engine_sms / flops_per_row
    return seconds * rows_per_second


def _bwd_rows_per_second(kv_rows: int, head_dim: int, rates: Rates) -> float:
    """q rows a unit walks per second with a K / V tile of ``kv_rows`` rows (the backward's five
    products, 2.5x the forward's FLOPs), at the backward engine's rate per SM."""
    flops_per_row = 2.5 * 4.0 * kv_rows * head_dim
    return rates.attention_bwd_tflops * 1e12 / rates.engine_sms / flops_per_row


def item_rows(kv_rows: int, head_dim: int, rates: Rates = RATES) -> float:
    """An attention-backward work item's fixed cost (K / V tile load, pipeline fill, dK / dV
    epilogue) in the ring backward plan's task cost unit (q rows walked)."""
    return rates.attention_bwd_item_us * 1e-6 * _bwd_rows_per_second(kv_rows, head_dim, rates)


def spare_copy_rows(traffic_bytes: int, kv_rows: int, head_dim: int, rates: Rates = RATES) -> float:
    """The compute a unit of the ring-attention backward loses to ``traffic_bytes`` of copies by
    its own spare warp, in the plan's task cost unit (q rows walked by one K / V tile of
    ``kv_rows`` rows): the copy's time at ``rates.spare_copy_gbps`` at the backward engine's rate
    per SM. The plan's LPT starts a unit with the cost of the comm tasks it hosts."""
    return _traffic_rows(traffic_bytes, rates.spare_copy_gbps, kv_rows, head_dim, rates)


def row_task_rows(traffic_bytes: int, kv_rows: int, head_dim: int, rates: Rates = RATES) -> float:
    """A ring-backward row task of ``traffic_bytes`` (read + written) in the plan's task cost unit,
    at ``rates.row_task_gbps`` on the unit's consumer warpgroups (``spare_copy_rows``' unit)."""
    return _traffic_rows(traffic_bytes, rates.row_task_gbps, kv_rows, head_dim, rates)


def _traffic_rows(
    traffic_bytes: int, gbps: float, kv_rows: int, head_dim: int, rates: Rates
) -> float:
    """``traffic_bytes`` at ``gbps`` on one unit, in q rows the backward engine walks meanwhile."""
    return traffic_bytes / (gbps * 1e9) * _bwd_rows_per_second(kv_rows, head_dim, rates)


# Ring attention's overlap by rule (no model yet): intra_sm, the block pushed by the idle
# producer-warpgroup warps of a few compute CTAs (a TMA ring each, no SM taken from the engine).
# Measured on one H200 (emulated W = 2, S = 8192 global, ring_local_*.json): intra_sm 0.78x /
# 0.72x of the engine on the same FLOPs (full / causal), inter_sm with 4 comm CTAs 0.73x / 0.69x.
RING_OVERLAP = "intra_sm"
