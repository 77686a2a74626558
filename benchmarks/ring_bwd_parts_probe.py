"""How many pieces the fused ring backward's transfers should take (issue 13 diagnostics).

In an emulated W = 2 world the K/V tile tasks that run while a block's K/V sends or its fp32
grad sends are under way take longer (``bwd_item_cost.py``, residuals by time: p90 of 250 us bins
40-80 us in the grad sends' window, up to 130 in the K/V sends'): all comm units send at once,
and the compute shares the memory with them. Fewer pieces move the
same bytes at a lower rate. This times ``ring_attention_backward`` (W = 2, intra_sm, the bench's
shapes) with plans made under other ``KV_PARTS`` / ``GRAD_PARTS`` (module constants of
mkernel/ops/ring_attention_backward.py, patched while each variant's plan is built), interleaved in
rounds with the engine and cuDNN (``mkernel.bench.ring_local_bwd``'s baselines).

``python3 benchmarks/ring_bwd_parts_probe.py [kv:grad ...]`` (default 16:66 16:16 16:8 4:16 4:8).
"""

from __future__ import annotations

import sys

from mkernel import World, ring_attention, ring_attention_backward
from mkernel.bench.attention import _event_ms  # noqa: F401  (the timing the rows use)
from mkernel.bench.ring_local import B, D, H, S, interleaved_rows, rank_rows
from mkernel.bench.ring_local_bwd import baselines
from mkernel.bench.timing import table
from mkernel.ops import ring_attention_backward as rb
from mkernel.schedule import Schedule


def variants(causal: bool, pairs: list[tuple[int, int]]) -> dict:
    (q, k, v, dout, _, _), fns = baselines(causal)
    layout = "zigzag" if causal else "contiguous"
    rq, rk, rv, rdo = rank_rows((q, k, v, dout), causal)
    for kv, grad in pairs:
        world = World.emulated(2, device="cuda")  # its own plan cache
        rout, rlse = ring_attention(rq, rk, rv, world, causal, None, layout)
        sched = Schedule(overlap="intra_sm")
        old = rb.KV_PARTS, rb.GRAD_PARTS
        rb.KV_PARTS, rb.GRAD_PARTS = kv, grad
        try:  # the plan is made (and cached in this world) by the first call
            ring_attention_backward(rdo, rq, rk, rv, rout, rlse, world, causal, None, layout, sched)
        finally:
            rb.KV_PARTS, rb.GRAD_PARTS = old
        fns[f"kv{kv}_grad{grad}"] = lambda w=world, a=(rdo, rq, rk, rv, rout, rlse), s=sched: (
            ring_attention_backward(*a, w, causal, None, layout, s)
        )
    return fns


if __name__ == "__main__":
    pairs = [tuple(map(int, a.split(":"))) for a in sys.argv[1:]] or [
        (16, 66), (16, 16), (16, 8), (4, 16), (4, 8)
    ]  # fmt: skip
    cases = [("W=2", c, variants(c, pairs)) for c in (False, True)]
    flops = lambda causal: 2.5 * 4.0 * B * H * S * S * D / (2 if causal else 1)  # noqa: E731
    rows = interleaved_rows(cases, flops, 8, 4.0)
    print(table(rows, ["world", "causal", "version", "ms", "vs_engine"]))
