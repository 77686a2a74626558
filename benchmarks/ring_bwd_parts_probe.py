"""Plan constants of the fused ring backward, timed (issue 13 diagnostics).

How many pieces its transfers take (``KV_PARTS``, ``GRAD_PARTS``: in an emulated W = 2 world the
K/V tile tasks that run while a block's K/V sends or its fp32 grad sends are under way take longer,
``bwd_item_cost.py``), how its tails are grouped and placed (``TAIL_GROUPS``, ``TAIL_LAG``), and
the overlap. This times ``ring_attention_backward`` (W = 2, the bench's shapes) with plans made
under other values of those module constants of mkernel/ops/ring_attention_backward.py (patched
while each variant's plan is built), interleaved in rounds with the engine and cuDNN
(``mkernel.bench.ring_local_bwd``'s baselines).

``python3 benchmarks/ring_bwd_parts_probe.py VARIANT ...``, a variant being comma-separated
``NAME=value`` (an int constant, or ``overlap=intra_sm|inter_sm``), e.g.
``GRAD_PARTS=16 overlap=inter_sm,TAIL_LAG=9``; default: the module's values, intra_sm.
"""

from __future__ import annotations

import sys

from mkernel import World, ring_attention, ring_attention_backward
from mkernel.bench.ring_local import B, D, H, S, interleaved_rows, rank_rows
from mkernel.bench.ring_local_bwd import baselines
from mkernel.bench.timing import table
from mkernel.ops import ring_attention_backward as rb
from mkernel.schedule import Schedule


def parse(spec: str) -> tuple[str, dict[str, int]]:
    """(overlap, {constant: value}) of one variant."""
    overlap, consts = "intra_sm", {}
    for item in filter(None, spec.split(",")):
        name, value = item.split("=")
        if name == "overlap":
            overlap = value
        elif isinstance(getattr(rb, name, None), int):
            consts[name] = int(value)
        else:
            raise SystemExit(f"{name}: not an int constant of ring_attention_backward")
    return overlap, consts


def variants(causal: bool, specs: list[str]) -> dict:
    (q, k, v, dout, _, _), fns = baselines(causal)
    layout = "zigzag" if causal else "contiguous"
    rq, rk, rv, rdo = rank_rows((q, k, v, dout), causal)
    for spec in specs:
        overlap, consts = parse(spec)
        world = World.emulated(2, device="cuda")  # its own plan cache
        rout, rlse = ring_attention(rq, rk, rv, world, causal, None, layout)
        sched = Schedule(overlap=overlap)
        old = {name: getattr(rb, name) for name in consts}
        for name, value in consts.items():
            setattr(rb, name, value)
        try:  # the plan is made (and cached in this world) by the first call
            ring_attention_backward(rdo, rq, rk, rv, rout, rlse, world, causal, None, layout, sched)
        finally:
            for name, value in old.items():
                setattr(rb, name, value)
        fns[spec or "default"] = lambda w=world, a=(rdo, rq, rk, rv, rout, rlse), s=sched: (
            ring_attention_backward(*a, w, causal, None, layout, s)
        )
    return fns


if __name__ == "__main__":
    specs = sys.argv[1:] or [""]
    cases = [("W=2", c, variants(c, specs)) for c in (False, True)]
    flops = lambda causal: 2.5 * 4.0 * B * H * S * S * D / (2 if causal else 1)  # noqa: E731
    rows = interleaved_rows(cases, flops, 8, 4.0)
    print(table(rows, ["world", "causal", "version", "ms", "vs_engine"]))
