"""Before/after of the fused ops at W=1 on one GPU: two source trees, timed in alternating
processes.

    python benchmarks/ab_fused_w1.py OLD_TREE NEW_TREE [ROUNDS]

Each process runs ``mkernel.bench.gemm`` (engine, cuBLAS and the three fused ops interleaved in
rounds, inputs rotated) from one tree; processes alternate old, new, old, new, ... so both see the
same GPU temperature. The figure compared is each fused op's time against the bare engine measured
in the same process (``<op>_vs_engine``): the engine's code is the same in both trees, so it is the
yardstick that cancels clock drift. Prints a table (median over rounds) and writes JSON under
``$MKERNEL_BENCH_DIR`` (default benchmarks/results)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

PROBE = (
    "import json; from mkernel.bench import gemm; "
    "print('ROWS ' + json.dumps(gemm.run(save_json=False)))"
)


def one(tree: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": tree, "MKERNEL_CACHE_DIR": f"{tree}/.mkcache"}
    res = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tree, env=env, capture_output=True, text=True
    )
    if res.returncode:
        raise RuntimeError(f"{tree}: {res.stderr[-3000:]}")
    line = next(x for x in res.stdout.splitlines() if x.startswith("ROWS "))
    return json.loads(line[5:])


def main() -> int:
    old, new = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    runs: dict[str, list[list[dict]]] = {"old": [], "new": []}
    for i in range(rounds):
        pair = [("old", old), ("new", new)]
        for name, tree in pair if i % 2 == 0 else pair[::-1]:
            runs[name].append(one(tree))
            print(f"round {i} {name} done", flush=True)
    ops = ("gemm_rs", "ag_gemm", "gemm_ar")
    rows = []
    for s, shape in enumerate(runs["new"][0]):
        row = {"shape": f"{shape['m']}x{shape['n']}x{shape['k']}"}
        for op in ops:
            o = statistics.median(r[s][f"{op}_vs_engine"] for r in runs["old"])
            n = statistics.median(r[s][f"{op}_vs_engine"] for r in runs["new"])
            row.update({f"{op}_old": o, f"{op}_new": n, f"{op}_new/old": n / o})
        rows.append(row)
    from mkernel.bench.timing import save, table

    cols = ["shape", *(f"{op}_{w}" for op in ops for w in ("old", "new", "new/old"))]
    print(table(rows, cols))
    path = save("ab_fused_w1", [{"rounds": rounds, "runs": runs}, *rows])
    print("saved", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
