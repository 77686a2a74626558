"""The reference: a TaskGraph evaluated op by op on whole tensors with plain torch in fp32 (no
tiles, no tasks), per rank; the collectives sum, stack or split over the ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .graph import Node, TaskGraph


def _attention(node: Node, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    at = node.attrs
    B, Hq, Hkv, D, L = q.shape[0], at["heads"], at["kv_heads"], at["head_dim"], at["length"]
    qh = q.reshape(B, Hq, 1, D)
    kh = k[:, :, :L].repeat_interleave(Hq // Hkv, dim=1)  # query head i reads kv head i // G
    vh = v[:, :, :L].repeat_interleave(Hq // Hkv, dim=1)
    return F.scaled_dot_product_attention(qh, kh, vh).reshape(B, Hq * D)


def _local(node: Node, args: list[torch.Tensor], consts: dict[str, torch.Tensor]) -> torch.Tensor:
    if node.op == "rmsnorm":
        x = args[0]
        return F.rms_norm(x, (x.shape[-1],), consts["weight"], node.attrs["eps"])
    if node.op == "linear":
        y = F.linear(args[0], consts["weight"])
        return y + args[1] if len(args) > 1 else y
    if node.op == "silu_mul":
        gate, up = args[0].chunk(2, dim=-1)
        return F.silu(gate) * up
    if node.op == "add":
        return args[0] + args[1]
    if node.op == "attention_decode":
        return _attention(node, args[0], consts["k"], consts["v"])
    raise ValueError(node.op)


def evaluate(
    graph: TaskGraph, inputs: dict[str, torch.Tensor], round_values: bool = True
) -> dict[str, torch.Tensor]:
    """``inputs``: [W, *shape] per input name; returns [W, *shape] fp32 per output name. With
    ``round_values`` each value is rounded to bf16 as the tasks store it."""
    W = graph.W
    rnd = (lambda t: t.bfloat16().float()) if round_values else (lambda t: t)
    vals: dict[int, list[torch.Tensor]] = {}
    for name, v in graph.inputs.items():
        vals[v.id] = [inputs[name][r].float() for r in range(W)]
    for node in graph.nodes:
        if node.op == "input":
            continue
        args = [vals[a.id] for a in node.args]
        if node.op == "all_reduce":
            total = sum(args[0][1:], args[0][0])
            out = [total] * W
        elif node.op == "all_gather":
            out = [torch.cat(args[0])] * W
        elif node.op == "reduce_scatter":
            total = sum(args[0][1:], args[0][0])
            out = list(total.chunk(W, dim=0))
        else:
            out = []
            for r in range(W):
                dev = args[0][r].device  # the inputs' (compile may have moved the graph)
                consts = {k: ts[r].to(dev).float() for k, ts in node.consts.items()}
                out.append(_local(node, [a[r] for a in args], consts))
        vals[node.out.id] = [rnd(t) for t in out]
    return {name: torch.stack(vals[v.id]) for name, v in graph.outputs.items()}
