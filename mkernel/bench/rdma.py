"""rdma_put through the proxy transport (issue 14) on one GPU, against message size, next to a
plain device copy of the same bytes.

``python3 -m mkernel.bench.rdma [--save]``: an emulated world of W = 2 ranks on 2 virtual nodes,
each rank putting to the other through its ring and host proxy thread (mkernel/rdma.py), message
sizes 4 KiB .. 64 MiB. Every number is wall-clock per call to completion (``exchange`` waits for
its kernel, and its receivers for every signal), the median of ITERS calls after a warm-up, the
proxy and the device copy taking turns in rounds:

- latency_us: one put per rank (post -> proxy copy -> signal -> receiver sees it), and
  copy_latency_us: ``dst.copy_(src)`` of one message then a synchronize;
- gbps: PUTS puts per rank, W * PUTS * size bytes per call (both directions together), ring
  capacity 8 (the proxy drains a batch with one stream synchronize), and copy_gbps: one device
  copy of the same total bytes.

The proxy copies within one GPU here: this measures the ring, the proxy thread's
cudaMemcpyAsync + synchronize and the signal path, not a network (docs/rdma.md).
``--save`` writes rdma_proxy_<date>.json under $MKERNEL_BENCH_DIR (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from ..rdma import ProxyRing, exchange
from . import require_gpu
from .timing import save, table

W, NODES, PUTS, CAPACITY = 2, 2, 8, 8
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
ITERS, WARMUP, ROUNDS = 30, 5, 5


def interleaved_wall_us(
    fns: dict[str, Callable[[], object]], rounds: int = ROUNDS, warmup: int = WARMUP
) -> dict[str, float]:
    """Median wall-clock microseconds of each fn() to completion (fn synchronizes, or we do). The
    versions take turns in ``rounds`` rounds of ITERS // rounds calls (the first of a round
    rotates), so clock and thermal drift hit the proxy and the copy it is compared with alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(ITERS // rounds):
                t0 = time.perf_counter()
                fns[name]()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def measure(size: int, ring: ProxyRing) -> dict:
    """One row: latency and throughput of the proxy path and of a device copy at ``size``, timed
    interleaved."""
    one = torch.randint(0, 255, (W, size), dtype=torch.uint8, device="cuda")
    many = torch.randint(0, 255, (W, PUTS * size), dtype=torch.uint8, device="cuda")
    d_one, d_many = torch.empty_like(one), torch.empty_like(many)
    us = interleaved_wall_us(
        {
            "lat": lambda: exchange(one, ring, NODES, 1, receive="wait", dst=d_one),
            "thr": lambda: exchange(many, ring, NODES, PUTS, posters=2, receive="wait", dst=d_many),
            "copy_lat": lambda: d_one[0].copy_(one[0]),
            "copy_thr": lambda: d_many.copy_(many),
        }
    )
    exchange(many, ring, NODES, PUTS, posters=2, receive="wait", dst=d_many)
    assert torch.equal(d_many, torch.roll(many, W // NODES, dims=0))  # the timed call is right
    total = W * PUTS * size
    return {
        "kib": size >> 10,
        "latency_us": us["lat"],
        "copy_latency_us": us["copy_lat"],
        "gbps": total / us["thr"] / 1e3,
        "copy_gbps": total / us["copy_thr"] / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m mkernel.bench.rdma")
    parser.add_argument("--save", action="store_true", help="write the JSON record")
    parser.add_argument("--max-mib", type=int, default=64, help="largest message (MiB)")
    args = parser.parse_args()
    require_gpu(__spec__.name)
    rows = []
    with ProxyRing(W, CAPACITY) as ring:
        for size in SIZES:
            if size <= args.max_mib << 20:
                rows.append(measure(size, ring))
    print(table(rows, ["kib", "latency_us", "copy_latency_us", "gbps", "copy_gbps"]))
    if args.save:
        print("saved", save("rdma_proxy", rows))


if __name__ == "__main__":
    main()
