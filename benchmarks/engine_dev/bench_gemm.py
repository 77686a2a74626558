"""Timing of the GEMM engine against torch.matmul (cuBLAS) on the target shapes (run on an H200).

    python3 benchmarks/engine_dev/bench_gemm.py <build_dir> [--json out.json] [--variants]

Each measurement: 4 input sets (A, B, C) rotated call by call so the 60 MB L2 never holds the next
call's inputs; 20 warm-up calls; then 6 rounds of 20 timed calls, each call between its own pair of
CUDA events, the versions (ours, torch.matmul, variants) taking turns round by round; the median of
the 120 calls is reported, with the medians of the first and second halves as the spread.
"""

import datetime
import json
import statistics
import sys

import torch

from common import env_info, launch, load_module, pick_config, tile_order

SHAPES = [
    (8192, 8192, 8192),
    (8192, 3584, 8192),
    (8192, 8192, 3584),
    (4096, 28672, 8192),
    (2048, 8192, 8192),
    (8192, 1024, 8192),
]
SETS, WARM, ROUNDS, PER = 4, 5, 6, 20


def time_interleaved(fns, rounds=ROUNDS, per=PER):
    """Median ms per call of each fn(i) (i = input set); the fns take turns in rounds of `per` calls,
    so clock and thermal drift hit all of them alike. Also returns each fn's medians over the first
    and second half of the rounds (the spread between two runs of one version)."""
    for f in fns.values():
        for i in range(WARM * SETS):
            f(i % SETS)
    times = {k: [[] for _ in range(rounds)] for k in fns}
    for r in range(rounds):
        for k, f in fns.items():
            ev = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(per)
            ]
            for c in range(per):
                ev[c][0].record()
                f(c % SETS)
                ev[c][1].record()
            torch.cuda.synchronize()
            times[k][r] = [a.elapsed_time(b) for a, b in ev]
    out = {}
    for k, t in times.items():
        flat = [x for rr in t for x in rr]
        h = rounds // 2
        out[k] = (
            statistics.median(flat),
            statistics.median([x for rr in t[:h] for x in rr]),
            statistics.median([x for rr in t[h:] for x in rr]),
        )
    return out


def main():
    mk = load_module(sys.argv[1])
    out_json = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    variants = "--variants" in sys.argv
    info = env_info()
    sms = info["sms"]
    records = []
    for M, N, K in SHAPES:
        flop = 2.0 * M * N * K
        sets = [
            (
                torch.randn(M, K, device="cuda").to(torch.bfloat16),
                torch.randn(K, N, device="cuda").to(torch.bfloat16),
                torch.empty(M, N, device="cuda", dtype=torch.bfloat16),
            )
            for _ in range(SETS)
        ]
        cfg = pick_config(M, N, K, sms)

        def ours(config, order):
            return lambda i: launch(
                mk, sets[i][0], sets[i][1], sets[i][2], M, N, K, config=config, order=order
            )

        def cublas(i):
            torch.matmul(sets[i][0], sets[i][1], out=sets[i][2])

        order = tile_order(mk, M, N, cfg, sms)
        fns = {"ours": ours(cfg, order), "cublas": cublas}
        if variants:
            for c in range(mk.gemm_num_configs):
                if c != cfg:
                    fns[f"cfg{c}"] = ours(c, tile_order(mk, M, N, c, sms))
            fns["rowmajor_order"] = ours(cfg, None)
        if "--experiments" in sys.argv:
            for c in (103, 104, 110, 112):
                fns[f"cfg{c}"] = ours(c, tile_order(mk, M, N, c, sms))
            for g in (4, 8):  # explicit group sizes, the picked config's grid
                fns[f"g{g}"] = ours(cfg, tile_order(mk, M, N, cfg, sms, group=g))
        t = time_interleaved(fns)
        tf = lambda ms: flop / (ms * 1e-3) / 1e12  # noqa: E731
        rec = {
            "m": M,
            "n": N,
            "k": K,
            "config": cfg,
            "config_name": "Tile{BM}x{BN}x{BK}".format(**mk.gemm_config_info(cfg)),
            "tflops": tf(t["ours"][0]),
            "tflops_halves": [tf(t["ours"][1]), tf(t["ours"][2])],
            "cublas_tflops": tf(t["cublas"][0]),
            "cublas_tflops_halves": [tf(t["cublas"][1]), tf(t["cublas"][2])],
            "ms_median": t["ours"][0],
            "cublas_ms_median": t["cublas"][0],
        }
        rec["ratio"] = rec["tflops"] / rec["cublas_tflops"]
        others = {k: tf(v[0]) for k, v in t.items() if k not in ("ours", "cublas")}
        if others:
            rec["variants_tflops"] = others
        records.append(rec)
        print(json.dumps(rec), flush=True)
        del sets
        torch.cuda.empty_cache()

    print(
        f"\n{info['device']}  torch {info['torch']}  CUDA {info['cuda']}  driver {info['driver']}"
    )
    print(
        f"{'M x N x K':>20} {'config':>16} {'ours TF/s':>10} {'cuBLAS':>8} {'ratio':>6}  variants"
    )
    for r in records:
        v = " ".join(f"{k}={x:.0f}" for k, x in r.get("variants_tflops", {}).items())
        print(
            f"{r['m']:>6}x{r['n']:>6}x{r['k']:>6} {r['config_name']:>16} {r['tflops']:>10.1f} "
            f"{r['cublas_tflops']:>8.1f} {r['ratio']:>6.3f}  {v}"
        )
    if out_json:
        doc = dict(
            info,
            date=datetime.date.today().isoformat(),
            method=f"median of {ROUNDS * PER} event-timed calls ({ROUNDS} rounds of {PER}, "
            f"variants interleaved round by round) after {WARM * SETS} warm-up calls; "
            f"{SETS} input sets rotated call by call",
            records=records,
        )
        with open(out_json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
