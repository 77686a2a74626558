"""TaskGraph's GPU kernel tables on the CPU (mkernel/taskgraph/device.py): the generated header is
current; a Python run of the task table alone (decoded as kernels/taskgraph.cuh decodes it: op,
buffer ids, rank codes, rectangles, attributes) reproduces the graph's reference, so the encoding
says everything a task needs; the GPU-sized tiles (gpu_blocks) run clean in the interpreter (the
tables the kernel runs have no race or deadlock); what the kernel cannot serve is refused."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import pytest
import torch

import mkernel
from mkernel import jit, models
from mkernel.runtime.run import check_schedule
from mkernel.taskgraph import TaskGraph, kernel_ext, ops
from mkernel.taskgraph import device as dv
from mkernel.taskgraph.compiled import compile_graph
from mkernel.taskgraph.lower import lower
from tests.test_taskgraph import assert_close, mlp_graph, randn

ROOT = Path(__file__).resolve().parents[1]


def test_the_generated_header_is_current():
    assert (ROOT / dv.HEADER).read_text() == dv.header_text(), (
        "run python -m mkernel.taskgraph.kernel_ext"
    )


def _lowered(g, W, units=8, fuse=True):
    """The graph lowered as the kernel backend lowers it (GPU tiles; fused norms / SiLUs)."""
    world = g.world or mkernel.World.emulated(W)
    blocks, bufs = dv.gpu_blocks(units), dv.device_buffers(g)
    low = lower(g, world, check_schedule(None), blocks, None, bufs, fuse)
    return world, low


def _run_tables(g, W, inputs, fuse=True):
    """The graph run from its task table alone, task after task (a topological order), each rank
    reading its buffers as the kernel would: own, a fixed rank, or every rank summed in order."""
    world, low = _lowered(g, W, fuse=fuse)
    io = dv.io_buffers(low)
    bufs = {}
    for name, (_kind, shape) in low.buffers.items():
        bufs[name] = torch.full((W, *shape), float("nan"), dtype=torch.bfloat16)
    for i in low.live:
        for name, ts in low.nodes[i].consts.items():
            bufs[ops.const_buf(i, name)] = torch.stack([ops.const_2d(t) for t in ts])
    for name, v in g.inputs.items():
        t = inputs[name]
        bufs[ops.value_buf(v.id)] = t.expand(W, *v.shape) if t.dim() == 2 else t
    fixed = {n: t.contiguous() for n, t in bufs.items() if n not in io}
    _, ids = dv.pointer_table(low, W, fixed, io)
    names = {i: n for n, i in ids.items()}
    table = dv.encode_tasks(low, W, ids)
    F = dv.FIELD
    for row in table.tolist():
        node = next(
            low.nodes[t.node]
            for t in low.tasks[0]
            if ops.value_buf(low.nodes[t.node].out.id) == names[row[F["out"]]]
        )
        assert dv.OPS[row[F["op"]]] == node.op
        if node.op in ("rmsnorm", "norm_linear"):
            assert struct.unpack("<f", struct.pack("<i", row[F["attr0"]]))[0] == pytest.approx(
                node.attrs["eps"]
            )
        for r in range(W):
            loaded = []
            for k in range(row[F["reads"]]):
                f = [row[F[f"read{k}_{x}"]] for x in dv.READ_FIELDS]
                buf, code, r0, nr, c0, nc, step = f
                r0 += r * step
                ranks = list(range(W)) if code == dv.RANK_ALL else [r if code < 0 else code]
                for q in ranks:
                    loaded.append(bufs[names[buf]][q, r0 : r0 + nr, c0 : c0 + nc])
            y = ops.compute(node, loaded).to(torch.bfloat16)
            o = [row[F[x]] for x in ("out_r0", "out_rows", "out_c0", "out_cols")]
            dst = bufs[names[row[F["out"]]]][r, o[0] : o[0] + o[1], o[2] : o[2] + o[3]]
            assert torch.isnan(dst.float()).all(), "a tile written twice"
            dst.copy_(y)
    return {name: bufs[ops.value_buf(v.id)] for name, v in g.outputs.items()}


@pytest.mark.parametrize(("W", "fuse"), [(1, True), (2, True), (4, True), (1, False), (2, False)])
def test_the_task_table_alone_computes_the_decode_step(W, fuse):
    cfg = models.DecoderConfig(layers=2, heads=8, kv_heads=4)
    weights, final = models.random_decoder(cfg, 3, seq=16, seed=W)
    world = mkernel.World.emulated(W) if W > 1 else None
    g = models.decode_graph(cfg, weights, final, 3, 11, world)
    x = randn(3, cfg.hidden, seed=9)
    y = _run_tables(g, W, {"x": x}, fuse)["y"]
    ref = models.torch_decode(cfg, weights, final, x, 11)
    for r in range(W):
        assert_close(y[r], ref, 2.0**-6 * 1.5, f"rank {r}")


@pytest.mark.parametrize("W", [2, 4])
def test_the_task_table_alone_computes_the_tp_mlp(W):
    world = mkernel.World.emulated(W)
    H, F, rows = 64, 96, 8
    wg, wu = randn(F, H, seed=1, scale=H**-0.5), randn(F, H, seed=2, scale=H**-0.5)
    wd = randn(H, F, seed=3, scale=F**-0.5)
    g = models.tp_mlp_graph(world, rows, wg, wu, wd)
    x = randn(W, rows, H, seed=4)
    y = _run_tables(g, W, {"x": x})["y"]
    ref = models.torch_mlp(x.reshape(W * rows, H), wg, wu, wd).reshape(W, rows, H)
    assert_close(y, ref, 2.0**-6, f"W={W}")


def test_collectives_encode_rank_codes():
    world = mkernel.World.emulated(2)
    g = models.tp_mlp_graph(world, 8, randn(96, 64), randn(96, 64), randn(64, 96))
    _, low = _lowered(g, 2)
    ids = {n: i for i, n in enumerate(low.buffers)}
    table = dv.encode_tasks(low, 2, ids)
    F = dv.FIELD
    by_op = {}
    for row in table.tolist():
        by_op.setdefault(dv.OPS[row[F["op"]]], []).append(row)
    gathers = {row[F["read0_rank"]] for row in by_op["all_gather"]}
    assert gathers == {0, 1}, "all_gather reads a fixed rank"
    for row in by_op["reduce_scatter"]:
        assert (
            row[F["read0_rank"]] == dv.RANK_ALL and row[F["read0_rank_rows"]] == 8
        )  # rows r * M/W + ..
    assert {row[F["read0_rank"]] for row in by_op["linear"]} == {dv.RANK_OWN}


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("W", [1, 2])
def test_gpu_sized_tiles_run_clean_in_the_interpreter(W, fuse):
    cfg = models.DecoderConfig(layers=2, heads=8, kv_heads=4)
    weights, final = models.random_decoder(cfg, 2, seq=16, seed=3)
    world = mkernel.World.emulated(W) if W > 1 else None
    g = models.decode_graph(cfg, weights, final, 2, 9, world)
    k = compile_graph(
        g, mkernel.Schedule(seed=W), blocks=dv.gpu_blocks(8), backend="interp", fuse=fuse
    )
    x = randn(2, cfg.hidden, seed=1)
    y = k(x=x)["y"]
    # fused: the norms' outputs are not rounded to bf16 and their weights are folded (rounded
    # once) into the linears', so the path is compared with the fp32 reference (2^-6, as the
    # decode step's), unfused with the per-value rounded one
    ref = k.reference(round_values=not fuse, x=x)["y"]
    assert_close(y, ref, 2.0**-6 if fuse else 2.0**-7, "interpreter on the kernel's tiles")


def test_gpu_blocks_cut_a_linear_into_about_one_task_per_unit():
    g = TaskGraph()
    x = g.input("x", (1, 4096))
    g.output("y", g.linear(x, torch.zeros(12288, 4096, dtype=torch.bfloat16)))
    blocks = dv.gpu_blocks(132)(g.nodes[-1])
    assert blocks.cols % dv.VEC == 0 and -(-12288 // blocks.cols) <= 132


def test_shapes_the_kernel_cannot_serve_are_refused():
    g = TaskGraph()
    x = g.input("x", (2, 60))
    g.output("y", g.linear(x, randn(64, 60)))
    with pytest.raises(ValueError, match="multiples of 8"):
        dv.check_graph(g)
    g = TaskGraph()
    q = g.input("q", (1, 16 * 16))
    g.output("y", g.attention_decode(q, randn(1, 1, 8, 16), randn(1, 1, 8, 16), 8))
    with pytest.raises(ValueError, match="at most 8"):
        dv.check_graph(g)


@pytest.mark.parametrize(
    ("B", "Hkv", "L"), [(1, 8, 1024), (8, 8, 1024), (1, 8, 4096), (1, 1, 65536)]
)
def test_a_long_cache_is_cut_into_chunks_that_fit_and_busy_every_unit(B, Hkv, L):
    """A GPU attention's partials: every chunk's scores fit the shared memory (65536 positions of
    one kv head, whole, would not), and the (sequence, kv head) pairs x chunks give every one of
    132 units a task where the cache is long enough (MIN_CHUNK positions a task at least)."""
    G, D, units = 8, 128, 132
    g = TaskGraph()
    q = g.input("q", (B, Hkv * G * D))
    kv = torch.zeros(B, Hkv, L, D, dtype=torch.bfloat16)
    g.output("y", g.attention_decode(q, kv, kv, L))
    dv.check_graph(g)  # served: no length is refused
    node = g.nodes[-1]
    chunk = dv.attention_chunk(node, units)
    chunks = -(-L // chunk)
    assert dv.attention_smem(G, D, chunk) <= dv.SMEM_BYTES
    assert dv.attention_smem(G, D, L) > dv.SMEM_BYTES or L <= 4096
    assert chunk >= min(L, dv.MIN_CHUNK)
    assert B * Hkv * chunks >= min(units, B * Hkv * (L // dv.MIN_CHUNK))


def test_the_kernel_backend_needs_a_gpu():
    with pytest.raises(ValueError, match="CUDA device only"):
        compile_graph(mlp_graph(), backend="kernel")


@pytest.mark.parametrize("W", [1, 2])
def test_the_kernel_plan_has_the_interpreters_tables(W):
    """The kernel's spec differs in its buffers only: the same tasks, waits, raises and tiles."""
    cfg = models.DecoderConfig(layers=2, heads=8, kv_heads=4)
    weights, final = models.random_decoder(cfg, 2, seq=16, seed=3)
    world = mkernel.World.emulated(W)
    g = models.decode_graph(cfg, weights, final, 2, 9, world if W > 1 else None)
    sched, blocks = check_schedule(None), dv.gpu_blocks(8)
    interp = lower(g, world, sched, blocks).plan
    kernel = lower(g, world, sched, blocks, None, dv.device_buffers(g)).plan
    assert kernel.spec.device and not interp.spec.device
    assert [p.name for p in kernel.spec.all_pads()] == [p.name for p in interp.spec.all_pads()]
    for role in ("compute", "comm"):
        a, b = interp.roles[role].tensors, kernel.roles[role].tensors
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), role
    assert torch.equal(interp.tile_table(), kernel.tile_table())


@pytest.mark.skipif(jit.find_nvcc() is None, reason="no nvcc: the device code is not compiled")
def test_the_kernel_compiles_with_its_ab_knobs_turned():
    # MK_TG_WEIGHT_RING and MK_TG_THREAD_FENCE (kernels/taskgraph.cuh): the A/B builds them
    # turned from their defaults (tools/ab_taskgraph.sh)
    knobs = (("MK_TG_WEIGHT_RING", "1"), ("MK_TG_THREAD_FENCE", "0"))
    spec = dataclasses.replace(kernel_ext.SPEC, defines=kernel_ext.SPEC.defines + knobs)
    assert jit.compile_check(["kernels/taskgraph.cu"], spec=spec) == []


@pytest.mark.parametrize("B", [1, 8])
def test_every_linear_of_a_qwen3_width_layer_reads_what_the_weight_ring_serves(B):
    # the ring (kernels/taskgraph.cuh ring_job) takes a linear task whose weight read covers
    # whole rows of its buffer (ld == cols), at batch 1 with K <= 12288 (x's row in 24 KB), at
    # batch 2..16 with 8-aligned rows; a decode layer's linears all qualify at Qwen3-8B's widths
    cfg = models.DecoderConfig(
        hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, layers=1
    )
    e = lambda *s: torch.empty(*s, dtype=torch.bfloat16)  # noqa: E731 (values are never read)
    H, D, F = cfg.hidden, cfg.head_dim, cfg.intermediate
    layer = models.Layer(
        attn_norm=e(H), wq=e(32 * D, H), wo=e(H, 32 * D), mlp_norm=e(H), wg=e(F, H), wu=e(F, H),
        wd=e(H, F), k_cache=e(B, 8, 64, D), v_cache=e(B, 8, 64, D),
    )  # fmt: skip
    g = models.decode_graph(cfg, [layer], e(H), B, 64)
    _, low = _lowered(g, 1, units=132)
    ids = {n: i for i, n in enumerate(low.buffers)}
    F_ = dv.FIELD
    linears = 0
    for row in dv.encode_tasks(low, 1, ids).tolist():
        if dv.OPS[row[F_["op"]]] not in ("linear", "norm_linear", "silu_linear"):
            continue
        linears += 1
        assert row[F_["out_rows"]] == B <= dv.GEMV_ROWS
        cols = low.buffers[list(low.buffers)[row[F_["read1_buf"]]]][1][1]
        assert row[F_["read1_c0"]] == 0 and row[F_["read1_cols"]] == cols  # whole rows: ld == K
        assert cols % 8 == 0 and (B > 1 or 2 * cols <= 24 * 1024)
    assert linears >= 4 * 100  # q, o, gate/up, down: about one task per unit each
