"""Models built with TaskGraph (issue 36): a decode step of a Llama / Qwen3-shaped stack and the
tensor-parallel MLP, each with the plain torch implementation it is checked against.

Decode step, per layer (pre-norm, GQA attention, SwiGLU MLP), then a final norm::

    a = rmsnorm(x, attn_norm);  q = a @ wq.T                        [B, Hq*D]
    h = x + attention_decode(q, k_cache, v_cache, length) @ wo.T    [B, H]
    m = rmsnorm(h, mlp_norm);   x = h + (silu(m @ wg.T) * (m @ wu.T)) @ wd.T
    y = rmsnorm(x, final_norm)

What it leaves out: RoPE, Qwen3's q / k norms, and the new token's K / V projection and cache
write: the caches are given at build time and are taken to hold the new token already at
position ``length - 1`` (TaskGraph has no cache-write op yet).

Tensor parallelism over W ranks (Megatron's convention; ``shard``): wq and the gate / up
projections are column-parallel (rank r holds output rows r of W: its Hq/W query heads, its F/W
gate and up rows, packed [gate_r; up_r] so that ``silu_mul`` splits them), the caches hold rank
r's Hkv/W kv heads, wo and wd are row-parallel (rank r's input columns), each followed by
``all_reduce`` and the residual ``add``; norms are replicated. Needs Hq and Hkv divisible by W.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .taskgraph import TaskGraph
from .world import World

bf16 = torch.bfloat16


@dataclass(frozen=True)
class DecoderConfig:
    """The shapes of a Llama / Qwen3-shaped decoder stack (small defaults for tests)."""

    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 96
    layers: int = 1
    eps: float = 1e-6


@dataclass
class Layer:
    """One layer's weights (torch's [out, in] layout) and caches [B, Hkv, S, D], unsharded."""

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    wg: torch.Tensor
    wu: torch.Tensor
    wd: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def random_decoder(
    cfg: DecoderConfig, batch: int, seq: int, seed: int = 0, device: str | torch.device = "cpu"
) -> tuple[list[Layer], torch.Tensor]:
    """Seeded bf16 weights and caches of ``cfg.layers`` layers, and the final norm's weight, made
    on ``device`` by its own generator (so the bits differ between devices; a device's are the
    same every run). NOTE: the CPU took 16.9 s for one 8-layer Qwen3-shaped case (2 cores), so
    the decode benchmark and the TaskGraph probe make theirs on the GPU."""
    g = torch.Generator(device=device).manual_seed(seed)
    H, D, F_ = cfg.hidden, cfg.head_dim, cfg.intermediate

    def w(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(bf16)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(H, generator=g, device=device)).to(bf16)

    layers = []
    for _ in range(cfg.layers):
        cache = (batch, cfg.kv_heads, seq, D)
        layers.append(
            Layer(
                attn_norm=norm(),
                wq=w(cfg.heads * D, H, scale=H**-0.5),
                wo=w(H, cfg.heads * D, scale=(cfg.heads * D) ** -0.5),
                mlp_norm=norm(),
                wg=w(F_, H, scale=H**-0.5),
                wu=w(F_, H, scale=H**-0.5),
                wd=w(H, F_, scale=F_**-0.5),
                k_cache=w(*cache),
                v_cache=w(*cache),
            )
        )
    return layers, norm()


def shard(cfg: DecoderConfig, layer: Layer, W: int) -> dict[str, list[torch.Tensor]]:
    """Rank r's pieces of one layer (module docstring): per name, a list of W tensors."""
    for name, n in (
        ("heads", cfg.heads),
        ("kv_heads", cfg.kv_heads),
        ("intermediate", cfg.intermediate),
    ):
        if n % W:
            raise ValueError(f"shard: DecoderConfig.{name}={n} is not divisible by W={W}")
    qd, kvh, f = cfg.heads * cfg.head_dim // W, cfg.kv_heads // W, cfg.intermediate // W
    rows = lambda t, n, r: t[r * n : (r + 1) * n].contiguous()  # noqa: E731
    cols = lambda t, n, r: t[:, r * n : (r + 1) * n].contiguous()  # noqa: E731
    return {
        "wq": [rows(layer.wq, qd, r) for r in range(W)],
        "wo": [cols(layer.wo, qd, r) for r in range(W)],
        "wgu": [torch.cat([rows(layer.wg, f, r), rows(layer.wu, f, r)]) for r in range(W)],
        "wd": [cols(layer.wd, f, r) for r in range(W)],
        "k": [layer.k_cache[:, r * kvh : (r + 1) * kvh].contiguous() for r in range(W)],
        "v": [layer.v_cache[:, r * kvh : (r + 1) * kvh].contiguous() for r in range(W)],
    }


def decode_graph(
    cfg: DecoderConfig,
    layers: list[Layer],
    final_norm: torch.Tensor,
    batch: int,
    length: int,
    world: World | None = None,
) -> TaskGraph:
    """The decode step as a TaskGraph: input ``x`` [B, H], output ``y`` [B, H] (per rank in a
    TP world: replicated)."""
    g = TaskGraph(world)
    W = g.W
    x = g.input("x", (batch, cfg.hidden))

    def row_parallel(a, w, residual):  # a @ w.T summed over ranks, plus the residual
        if W == 1:
            return g.linear(a, w, residual=residual)
        return g.add(g.all_reduce(g.linear(a, w)), residual)

    for layer in layers:
        p = shard(cfg, layer, W)
        a = g.rmsnorm(x, layer.attn_norm, cfg.eps)
        q = g.linear(a, p["wq"])
        h = row_parallel(g.attention_decode(q, p["k"], p["v"], length), p["wo"], x)
        m = g.rmsnorm(h, layer.mlp_norm, cfg.eps)
        x = row_parallel(g.silu_mul(g.linear(m, p["wgu"])), p["wd"], h)
    g.output("y", g.rmsnorm(x, final_norm, cfg.eps))
    return g


def torch_decode(
    cfg: DecoderConfig,
    layers: list[Layer],
    final_norm: torch.Tensor,
    x: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """The plain torch decode step (unsharded weights, fp32): [B, H] -> [B, H]."""
    B, D, G = x.shape[0], cfg.head_dim, cfg.heads // cfg.kv_heads
    x = x.float()

    def norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.eps) * w.float()

    for ly in layers:
        q = (norm(x, ly.attn_norm) @ ly.wq.float().T).view(B, cfg.heads, 1, D)
        k = ly.k_cache.float()[:, :, :length].repeat_interleave(G, dim=1)
        v = ly.v_cache.float()[:, :, :length].repeat_interleave(G, dim=1)
        p = torch.softmax(q @ k.transpose(-1, -2) / D**0.5, dim=-1)
        h = x + (p @ v).reshape(B, cfg.heads * D) @ ly.wo.float().T
        m = norm(h, ly.mlp_norm)
        x = h + (F.silu(m @ ly.wg.float().T) * (m @ ly.wu.float().T)) @ ly.wd.float().T
    return norm(x, final_norm)


# -- the tensor-parallel MLP: all-gather -> GEMM -> SwiGLU -> GEMM -> reduce-scatter --------------


def tp_mlp_graph(
    world: World, rows: int, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor
) -> TaskGraph:
    """The sequence-parallel MLP in one graph over ``world``: input ``x`` per rank [rows, H] (rank
    r's rows of the sequence), all-gathered to [W * rows, H], the column-parallel gate / up GEMM
    (rank r's F/W rows of wg and wu), SwiGLU, the row-parallel down GEMM (rank r's F/W columns
    of wd) and the reduce-scatter back to rank r's rows: output ``y`` [rows, H]."""
    W, F_ = world.size, wg.shape[0]
    if F_ % W:
        raise ValueError(f"tp_mlp_graph: the intermediate size {F_} is not divisible by W={W}")
    f = F_ // W
    wgu = [torch.cat([wg[r * f : (r + 1) * f], wu[r * f : (r + 1) * f]]) for r in range(W)]
    wds = [wd[:, r * f : (r + 1) * f].contiguous() for r in range(W)]
    g = TaskGraph(world)
    x = g.input("x", (rows, wg.shape[1]))
    gathered = g.all_gather(x)
    y = g.linear(g.silu_mul(g.linear(gathered, wgu)), wds)
    g.output("y", g.reduce_scatter(y))
    return g


def torch_mlp(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor):
    """The plain torch MLP (fp32) of the whole sequence: x [M, H] -> [M, H]."""
    x = x.float()
    return (F.silu(x @ wg.float().T) * (x @ wu.float().T)) @ wd.float().T
