"""Pictures of benchmark results: ours against the baselines, shape by shape.

``python -m mkernel.bench.plot benchmarks/results/<file>.json -o docs/img/<name>.png`` draws a
committed result on any machine (no GPU); a benchmark's ``--plot PATH`` draws the run it just made.
Top panel: one bar per version and shape, TFLOP/s (ms for the distributed ring and MoE benchmarks,
which record no rate for their baselines); bottom panel: each of our versions against the main
baseline of its shape (> 1: ours is faster). The title names the device, the date and the versions
(torch, CUDA, the commit where the record has one) from the result's metadata.

matplotlib is an optional dependency (``pip install mkernel[plot]``), imported only when a picture
is drawn; without it a benchmark asked for ``--plot`` exits at once with one line saying so, before
it times anything (``mkernel.bench.cli``), and so does this command.

A result is the JSON document ``timing.save`` writes: ``{"benchmark": name, device, date, ...,
"records": rows}``. ``chart_of`` turns each benchmark's rows (their columns differ) into one
``Chart``; the benchmark is found by the longest prefix in ``KINDS`` of the document's
``benchmark`` field, or of the file's name where the document has none.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .timing import environment

INSTALL = "pip install mkernel[plot]"
Values = list[float | None]  # one per shape; None where that version did not run at that shape


class MissingMatplotlib(ImportError):
    """matplotlib is not installed: the pictures are an optional extra."""


@dataclass
class Chart:
    """What a picture shows: ``labels`` name the shapes (the x axis); ``ours`` and ``baselines``
    map a version's name to its value at each shape; the ratios divide by ``reference`` (one of
    the baselines). ``metric`` is "TFLOP/s" (higher is better) or "ms" (lower is better)."""

    labels: list[str]
    metric: str
    ours: dict[str, Values]
    baselines: dict[str, Values]
    reference: str
    subtitle: str = ""

    def ratios(self, name: str) -> Values:
        """Ours ``name`` against the reference per shape, > 1 where ours is faster."""
        out: Values = []
        for mine, base in zip(self.ours[name], self.baselines[self.reference], strict=True):
            if mine is None or base is None or not mine or not base:
                out.append(None)
            else:
                out.append(mine / base if self.metric == "TFLOP/s" else base / mine)
        return out


def _col(rows: Sequence[dict], key: str) -> Values:
    return [r.get(key) for r in rows]


def _wide(rows: Sequence[dict], ours: dict[str, str], baselines: dict[str, str]) -> tuple:
    """Rows with one column per version: name -> column, the versions no row has left out."""

    def pick(cols: dict[str, str]) -> dict[str, Values]:
        got = {name: _col(rows, col) for name, col in cols.items()}
        return {n: v for n, v in got.items() if any(x is not None for x in v)}

    return pick(ours), pick(baselines)


def _long(
    rows: Sequence[dict],
    label: Callable[[dict], str],
    baselines: dict[str, str],
    metric_col: str,
) -> tuple[list[str], dict[str, Values], dict[str, Values]]:
    """Rows with one row per (shape, version): the shapes in their first-seen order; versions
    named in ``baselines`` (version -> shown name) are baselines, the others ours."""
    labels = list(dict.fromkeys(label(r) for r in rows))
    at = {lab: i for i, lab in enumerate(labels)}
    ours: dict[str, Values] = {}
    base: dict[str, Values] = {}
    for r in rows:
        v = r["version"]
        table, name = (base, baselines[v]) if v in baselines else (ours, v)
        table.setdefault(name, [None] * len(labels))[at[label(r)]] = r.get(metric_col)
    order = [baselines[v] for v in baselines if baselines[v] in base]
    return labels, ours, {n: base[n] for n in order}


def _causal(r: dict) -> str:
    return "causal" if r.get("causal") else "full"


def _dims(r: dict, keys: Sequence[str]) -> str:
    return ", ".join(f"{k}={r[k]}" for k in keys if k in r)


def _gemm(rows: Sequence[dict]) -> Chart:
    fused = {f"{op} W=1": f"{op}_w1_tflops" for op in ("gemm_rs", "ag_gemm", "gemm_ar")}
    ours, base = _wide(rows, {"engine": "tflops", **fused}, {"cuBLAS": "cublas_tflops"})
    labels = [f"{r['m']}x{r['n']}x{r['k']}" for r in rows]
    return Chart(labels, "TFLOP/s", ours, base, "cuBLAS", "bf16, M x N x K")


def _best(r: dict, names: Sequence[str]) -> float | None:
    got = [r[f"{n}_tflops"] for n in names if r.get(f"{n}_tflops") is not None]
    return max(got) if got else None


def _attention(rows: Sequence[dict]) -> Chart:
    pick = "default_mk" if all("default_mk" in r for r in rows) else "best_mk"
    ours = {f"ours ({pick[:-3]} schedule)": [r.get(f"{r[pick]}_tflops") for r in rows]}
    base = {
        "cuDNN (faster layout)": [_best(r, ("cudnn", "cudnn_bhsd")) for r in rows],
        "FlashAttention (faster layout)": [_best(r, ("flash", "flash_bhsd")) for r in rows],
    }
    labels = [f"S={r['S']} {_causal(r)}" for r in rows]
    return Chart(labels, "TFLOP/s", ours, base, "cuDNN (faster layout)", _dims(rows[0], "BHD"))


def _attention_bwd(rows: Sequence[dict]) -> Chart:
    base_cols = {"cuDNN": "cudnn_tflops", "FlashAttention": "flash_tflops"}
    ours, base = _wide(rows, {"ours": "mk_tflops"}, base_cols)
    labels = [f"S={r['S']} {_causal(r)}" for r in rows]
    return Chart(labels, "TFLOP/s", ours, base, "cuDNN", _dims(rows[0], "BHD") + ", backward")


def _grouped(rows: Sequence[dict]) -> Chart:
    ours, base = _wide(rows, {"ours": "tflops"}, {"torch._grouped_mm": "torch_tflops"})
    labels = [r["shape"] for r in rows]
    return Chart(labels, "TFLOP/s", ours, base, "torch._grouped_mm", "bf16 grouped GEMM")


def _ring_local(rows: Sequence[dict]) -> Chart:
    labels, ours, base = _long(
        rows,
        lambda r: f"{r['world']} {_causal(r)}",
        {"cudnn": "cuDNN", "engine": "engine (one launch)"},
        "tflops",
    )
    sub = _dims(rows[0], ("B", "H", "D", "S_global")) + "; W=2: two emulated ranks on one GPU"
    return Chart(labels, "TFLOP/s", ours, base, "cuDNN", sub)


def _moe_local(rows: Sequence[dict]) -> Chart:
    gather = {v: v for r in rows if (v := r["version"]).startswith("gemm_")}
    labels, ours, base = _long(
        rows,
        lambda r: f"{r['op']} W={r['W']} T={r['T']}",
        {"unfused": "unfused (moe_gpu)", "gemm": "grouped GEMM alone", **gather},
        "tflops",
    )
    sub = _dims(rows[0], ("E", "k", "H", "I")) + "; W ranks emulated on one GPU"
    return Chart(labels, "TFLOP/s", ours, base, "unfused (moe_gpu)", sub)


def _ring(rows: Sequence[dict]) -> Chart:
    base_cols = {"unfused (cuDNN)": "unfused_cudnn_ms", "ideal": "ideal_ms"}
    base_cols |= {"compute alone": "compute_ms", "traffic alone": "traffic_ms"}
    ours, base = _wide(rows, {"ours": "ours_ms"}, base_cols)
    labels = [f"{r['pass']} S_local={r['S_local']} {r['layout']}" for r in rows]
    sub = _dims(rows[0], ("W", "B", "H", "D")) + "; ideal = max(compute, traffic)"
    return Chart(labels, "ms", ours, base, "unfused (cuDNN)", sub)


def _moe(rows: Sequence[dict]) -> Chart:
    base_cols = {"unfused": "unfused_ms", "ideal": "ideal_ms"}
    base_cols |= {"GEMM alone": "gemm_ms", "all-to-all alone": "a2a_ms"}
    ours, base = _wide(rows, {"ours": "ours_ms"}, base_cols)
    labels = [f"{r['op']} {r['routing']}" for r in rows]
    sub = _dims(rows[0], ("W", "T", "H", "I", "E")) + "; ideal = max(GEMM, all-to-all)"
    return Chart(labels, "ms", ours, base, "unfused", sub)


KINDS: dict[str, Callable[[Sequence[dict]], Chart]] = {  # benchmark name prefix -> its chart
    "gemm": _gemm,
    "attention": _attention,
    "attention_bwd": _attention_bwd,
    "grouped": _grouped,
    "ring_local": _ring_local,
    "ring_local_bwd": _ring_local,
    "ring_w": _ring,
    "moe_local": _moe_local,
    "moe_w": _moe,
}


def kind_of(doc: dict, path: str | Path | None = None) -> str:
    """The entry of ``KINDS`` for a result: the longest that prefixes its benchmark's name."""
    name = doc.get("benchmark") or (Path(path).stem if path else "")
    found = [k for k in KINDS if name.startswith(k)]
    if not found:
        raise ValueError(f"no picture for benchmark {name!r} (known: {', '.join(KINDS)})")
    return max(found, key=len)


def chart_of(doc: dict, path: str | Path | None = None) -> Chart:
    rows = doc.get("records") or []
    if not rows:
        raise ValueError(f"{path or 'result'}: no records to draw")
    return KINDS[kind_of(doc, path)](rows)


def title_of(doc: dict, kind: str) -> str:
    """'<benchmark>: ours vs baselines on <device>' over '<date> · torch · CUDA · commit'."""
    name = doc.get("benchmark") or kind
    facts = [str(doc.get("date", "undated")).replace("T", " ")[:16]]
    facts += [f"{k} {doc[k]}" for k in ("torch", "cuda") if doc.get(k)]
    facts += [f"{doc['sms']} SMs"] if doc.get("sms") else []
    facts += [f"commit {str(doc['commit'])[:9]}"] if doc.get("commit") else []
    return f"{name}: ours vs baselines on {doc.get('device', 'an unnamed device')}\n" + " · ".join(
        facts
    )


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or MissingMatplotlib saying what to
    install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingMatplotlib(f"plotting needs matplotlib ({exc}): {INSTALL}") from None
    return plt


def _bars(
    ax: Any, labels: Sequence[str], series: dict[str, Values], colors: dict, note: bool = False
) -> None:
    """Per shape, one bar per version that ran there, side by side and centred on the shape
    (``note``: each bar's value written over it)."""
    for i in range(len(labels)):
        present = [(n, v[i]) for n, v in series.items() if v[i] is not None]
        width = min(0.3, 0.8 / max(1, len(present)))
        for j, (name, value) in enumerate(present):
            x = i + width * (j + 0.5 - len(present) / 2)
            ax.bar(x, value, width * 0.92, color=colors[name], label=name)
            if note:
                ax.text(x, value, f"{value:.2f}", ha="center", va="bottom", fontsize=7)


def draw(doc: dict, out: str | Path, *, path: str | Path | None = None, dpi: int = 100) -> Path:
    """Draws the result ``doc`` (``path``: where it was read from, for its kind when the
    document names no benchmark) into the PNG ``out``; returns ``out``."""
    kind = kind_of(doc, path)
    chart = chart_of(doc, path)
    plt = _pyplot()
    n = len(chart.labels)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(max(9.0, 0.9 * n + 4.5), 6.2), sharex=True, height_ratios=(2.2, 1)
    )
    cmap = plt.get_cmap("tab10")
    colors = {name: cmap(i % 10) for i, name in enumerate(chart.ours)}
    grey = [str(0.25 + 0.5 * i / max(1, len(chart.baselines) - 1)) for i in range(10)]
    colors |= {name: grey[i % 10] for i, name in enumerate(chart.baselines)}
    _bars(top, chart.labels, {**chart.ours, **chart.baselines}, colors)
    better = "higher" if chart.metric == "TFLOP/s" else "lower"
    top.set_ylabel(f"{chart.metric} ({better} is better)")
    handles = dict(zip(*reversed(top.get_legend_handles_labels()), strict=True))
    names = [n for n in (*chart.ours, *chart.baselines) if n in handles]  # ours first
    top.legend([handles[n] for n in names], names, fontsize=8, loc="upper left",
               bbox_to_anchor=(1.01, 1))  # fmt: skip
    top.grid(axis="y", alpha=0.3)
    top.set_title(
        title_of(doc, kind) + (f"\n{chart.subtitle}" if chart.subtitle else ""), fontsize=9
    )
    ratios = {name: chart.ratios(name) for name in chart.ours}
    _bars(bottom, chart.labels, ratios, colors, note=True)
    bottom.axhline(1.0, color="black", linewidth=0.8)
    bottom.set_ylabel(f"vs {chart.reference}\n(> 1: ours faster)", fontsize=9)
    values = [v for r in ratios.values() for v in r if v is not None]
    if values:
        bottom.set_ylim(min(0.0, min(values)), max(1.2, max(values) * 1.15))
    bottom.grid(axis="y", alpha=0.3)
    bottom.set_xticks(range(n))
    rotate = n > 4 or max(len(label) for label in chart.labels) > 14
    bottom.set_xticklabels(chart.labels, rotation=20 if rotate else 0,
                           ha="right" if rotate else "center", fontsize=8)  # fmt: skip
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, metadata={"Software": None})
    plt.close(fig)
    return out


def draw_file(result: str | Path, out: str | Path, *, dpi: int = 100) -> Path:
    """Draws a committed result JSON into the PNG ``out``."""
    return draw(json.loads(Path(result).read_text()), out, path=result, dpi=dpi)


def draw_run(name: str, rows: Sequence[dict], out: str | Path | None) -> Path | None:
    """A benchmark's ``--plot``: draws the rows it just measured (``name`` as ``timing.save``
    names the result), the metadata of this machine in the title; nothing when ``out`` is None."""
    if out is None:
        return None
    path = draw({"benchmark": name, **environment(), "records": list(rows)}, out)
    print("plotted", path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mkernel.bench.plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("result", help="a benchmark's result JSON (benchmarks/results/*.json)")
    p.add_argument("-o", "--out", help="the PNG to write (default: the result's name, .png)")
    p.add_argument("--dpi", type=int, default=100)
    args = p.parse_args(argv)
    out = args.out or Path(args.result).with_suffix(".png").name
    try:
        path = draw_file(args.result, out, dpi=args.dpi)
    except (MissingMatplotlib, ValueError, OSError) as exc:
        print(f"{p.prog}: {exc}", file=sys.stderr)
        return 1
    print("plotted", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
