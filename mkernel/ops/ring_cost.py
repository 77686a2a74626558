"""Ring attention's costs (its forward and backward): the overlap its Schedule defaults to, by rule
(no model yet: its module registers ``overlap_rule`` with mkernel/cost.py), and the plans' estimates
in their task cost units (``ring_block_lag``: how far a unit gets while a K / V block crosses a hop;
``item_rows``, ``spare_copy_rows``, ``row_task_rows``: the backward's fixed and hosted costs), from
the rates measured for them (``RingRates``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..cost import Candidate, Rates


@dataclass(frozen=True)
class RingRates(Rates):
    """``Rates`` and ring attention's own (its engines, K / V pieces and copies), measured on one
    H200 (132 SMs), 2026-12-01/02; files per figure."""

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


RING_RATES = RingRates()

# Ring attention's overlap by rule (no model yet): intra_sm, the block pushed by the idle
# producer-warpgroup warps of a few compute CTAs (a TMA ring each, no SM taken from the engine).
# Measured on one H200 (emulated W = 2, S = 8192 global, ring_local_*.json): intra_sm 0.78x /
# 0.72x of the engine on the same FLOPs (full / causal), inter_sm with 4 comm CTAs 0.73x / 0.69x.
RING_OVERLAP = "intra_sm"


def ring_attention_comm_sms(sms: int) -> int:
    """Comm CTAs of ring attention when inter_sm is asked for: a step's K / V block must cross the
    link within the step's attention. At S_local = 8192, Hkv = 32, D = 128 a causal zigzag step
    is 134 MB against ~1 ms of engine work on 132 SMs: ~134 GB/s, 3 BulkRing CTAs at ~45 GB/s
    each over NVLink (the issue's probe); 8 leave room. Scaled by the SMs a rank has."""
    return max(1, min(8, sms // 16))


def overlap_rule(sms: int, overlap: str | None, comm_sms: int | None) -> Candidate:
    """The forward's schedule by rule (its OpCost): RING_OVERLAP unless set, and where inter_sm,
    ``ring_attention_comm_sms`` unless set; stores (the K / V ring has no transfer knob)."""
    ov = overlap or RING_OVERLAP
    cs = (comm_sms or ring_attention_comm_sms(sms)) if ov == "inter_sm" else None
    return Candidate(ov, cs, "stores")


def ring_block_lag(
    block_bytes: int,
    parts: int,
    q_rows: int,
    head_dim: int,
    emulated: bool,
    rates: RingRates = RING_RATES,
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


def _bwd_rows_per_second(kv_rows: int, head_dim: int, rates: RingRates) -> float:
    """q rows a unit walks per second with a K / V tile of ``kv_rows`` rows (the backward's five
    products, 2.5x the forward's FLOPs), at the backward engine's rate per SM."""
    flops_per_row = 2.5 * 4.0 * kv_rows * head_dim
    return rates.attention_bwd_tflops * 1e12 / rates.engine_sms / flops_per_row


def item_rows(kv_rows: int, head_dim: int, rates: RingRates = RING_RATES) -> float:
    """An attention-backward work item's fixed cost (K / V tile load, pipeline fill, dK / dV
    epilogue) in the ring backward plan's task cost unit (q rows walked)."""
    return rates.attention_bwd_item_us * 1e-6 * _bwd_rows_per_second(kv_rows, head_dim, rates)


def spare_copy_rows(
    traffic_bytes: int, kv_rows: int, head_dim: int, rates: RingRates = RING_RATES
) -> float:
    """The compute a unit of the ring-attention backward loses to ``traffic_bytes`` of copies by
    its own spare warp, in the plan's task cost unit (q rows walked by one K / V tile of
    ``kv_rows`` rows): the copy's time at ``rates.spare_copy_gbps`` at the backward engine's rate
    per SM. The plan's LPT starts a unit with the cost of the comm tasks it hosts."""
    return _traffic_rows(traffic_bytes, rates.spare_copy_gbps, kv_rows, head_dim, rates)


def row_task_rows(
    traffic_bytes: int, kv_rows: int, head_dim: int, rates: RingRates = RING_RATES
) -> float:
    """A ring-backward row task of ``traffic_bytes`` (read + written) in the plan's task cost unit,
    at ``rates.row_task_gbps`` on the unit's consumer warpgroups (``spare_copy_rows``' unit)."""
    return _traffic_rows(traffic_bytes, rates.row_task_gbps, kv_rows, head_dim, rates)


def _traffic_rows(
    traffic_bytes: int, gbps: float, kv_rows: int, head_dim: int, rates: RingRates
) -> float:
    """``traffic_bytes`` at ``gbps`` on one unit, in q rows the backward engine walks meanwhile."""
    return traffic_bytes / (gbps * 1e9) * _bwd_rows_per_second(kv_rows, head_dim, rates)
