"""TaskGraph (the megakernel, issue 36): a builder of graphs of ops on bf16 values whose tasks are
tiles of those ops, each waiting for the tiles it reads on the same signal / wait entries of the
protocol tables as the fused ops; the CPU interpreter runs them (docs/megakernel.md).

Modules: graph (the builder and its checks, with checks.py), ops (each op's tiles and tile math),
lower (tasks, per-tile events, the Plan), compiled (the call: interpreter or GPU fallback),
reference (the graph in plain torch)."""

from .graph import TaskGraph, Value

__all__ = ["TaskGraph", "Value"]
