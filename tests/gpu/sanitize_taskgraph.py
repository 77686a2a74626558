"""Small TaskGraph launches for compute-sanitizer (tests/gpu/test_sanitizers_gpu.py runs it under
memcheck, racecheck and synccheck; each must report 0 errors):

    compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/gpu/sanitize_taskgraph.py

Every op in one graph (GEMV at an odd batch, attention off the tiles, GQA), the decode step of two
layers on one GPU and over emulated worlds of 2 ranks (the all_reduce tasks), and the TP MLP at
W = 2; each output is compared with the fp32 reference, so a launch the tool perturbs still has to
be right. Prints "ok <case>" per case."""

from __future__ import annotations

import torch

import mkernel
from mkernel import models
from mkernel.taskgraph import TaskGraph
from tests.gpu.test_taskgraph_kernel_gpu import on_gpu, randn
from tests.test_taskgraph import assert_close


def every_op() -> None:
    B, H, Hq, Hkv, S, D = 3, 256, 4, 2, 70, 128
    g = TaskGraph()
    x = g.input("x", (B, H))
    q = g.linear(g.rmsnorm(x, randn(H, seed=1) + 1), randn(Hq * D, H, seed=2, scale=H**-0.5))
    att = g.attention_decode(q, randn(B, Hkv, S, D, seed=3), randn(B, Hkv, S, D, seed=4), 65)
    h = g.linear(att, randn(H, Hq * D, seed=5, scale=0.05), residual=x)
    s = g.silu_mul(g.linear(h, randn(512, H, seed=6, scale=H**-0.5)))
    g.output("y", g.add(s, g.input("z", (B, 256))))
    k = g.compile()
    assert k.backend == "kernel"
    ins = {"x": randn(B, H, seed=7), "z": randn(B, 256, seed=8)}
    ref = k.reference(round_values=False, **ins)["y"]  # fp32: the norm is fused (norm_linear)
    assert_close(k(**ins)["y"], ref, 2.0**-6, "every op")


def decode(W: int | None) -> None:
    cfg = models.DecoderConfig(
        hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=256, layers=2
    )
    weights, final = models.random_decoder(cfg, 2, seq=40, seed=1)
    x = torch.randn(2, cfg.hidden, generator=torch.Generator().manual_seed(2)).bfloat16()
    ref = models.torch_decode(cfg, weights, final, x, length=33)
    weights, final = on_gpu(weights, final)
    world = mkernel.World.emulated(W, device="cuda") if W else None
    y = models.decode_graph(cfg, weights, final, 2, length=33, world=world).compile()(x=x.cuda())[
        "y"
    ]
    for r, yr in enumerate([y] if W is None else list(y)):
        assert_close(yr.cpu(), ref, 2.0**-6 * 1.5, f"decode W={W} rank {r}")


def tp_mlp() -> None:
    world = mkernel.World.emulated(2, device="cuda")
    H, F, rows = 128, 256, 8
    wg, wu = randn(F, H, seed=1, scale=H**-0.5), randn(F, H, seed=2, scale=H**-0.5)
    wd = randn(H, F, seed=3, scale=F**-0.5)
    x = randn(2, rows, H, seed=4)
    y = models.tp_mlp_graph(world, rows, wg, wu, wd).compile()(x=x)["y"]
    ref = models.torch_mlp(x.reshape(2 * rows, H), wg, wu, wd).reshape(2, rows, H)
    assert_close(y, ref, 2.0**-6, "tp mlp")


def main() -> int:
    for name, case in [
        ("every_op", every_op),
        ("decode_w1", lambda: decode(None)),
        ("decode_w2", lambda: decode(2)),
        ("tp_mlp_w2", tp_mlp),
    ]:
        case()
        torch.cuda.synchronize()
        print("ok", name, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
