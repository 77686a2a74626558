"""The builder: ``TaskGraph`` records ops on 2-D bf16 values, checking every argument as it comes
(shapes, dtypes, devices, values of this graph), so a bad graph fails at the line that builds it.

Values are per-rank: in a TP world each rank holds its own tensor of the value's shape (the weights
given as a list of one per rank, or stacked [W, *shape], are that rank's shards; a single tensor
of the op's shape is the same on every rank).
Nothing is computed here; ``compile`` lowers the graph to tasks (mkernel/taskgraph/lower.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..world import World, check_world
from .checks import BF16, check_dtype, check_shape, fail, per_rank, shape_str
from .compiled import compile_graph

OPS = (
    "input",
    "rmsnorm",
    "linear",
    "silu_mul",
    "attention_decode",
    "add",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
)


@dataclass(frozen=True, eq=False)
class Value:
    """A bf16 [rows, cols] value of a TaskGraph (per rank), made by one of its ops."""

    graph: TaskGraph = field(repr=False)
    id: int
    shape: tuple[int, int]
    op: str  # the op that makes it ("input" for an input)
    name: str = ""  # an input's name

    def __repr__(self) -> str:
        what = f"input {self.name!r}" if self.op == "input" else f"{self.op} #{self.id}"
        return f"Value({what}, {shape_str(self.shape)})"


@dataclass
class Node:
    """One op of the graph: its result, the graph values it reads, its build-time tensors (per
    rank) and its attributes (eps, length)."""

    op: str
    out: Value
    args: tuple[Value, ...] = ()
    consts: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)


class TaskGraph:
    """A graph of ops on bf16 values, compiled into tasks (tiles of each op) that wait for the
    tiles they read: ``k = g.compile()``, then ``k(**inputs) -> {name: tensor}``.

    ``world``: None (one device: that of the tensors given, the CPU if none) or a ``World``: tensor
    parallelism over its ranks (emulated worlds; a distributed world is not served yet). Unfused
    meaning per rank: each op as its docstring says; ``all_reduce`` sums over the ranks.
    """

    def __init__(self, world: World | None = None) -> None:
        if world is not None:
            world = check_world(world)
            if not world.emulated_world:
                raise NotImplementedError(
                    "TaskGraph runs on one device or in an emulated world (World.emulated(W)); "
                    "a distributed world is not served yet"
                )
            if world.nodes > 1:
                raise NotImplementedError("TaskGraph does not span nodes yet (world.nodes > 1)")
        self.world = world
        self.W = world.size if world is not None else 1
        self.device: torch.device | None = world.device if world is not None else None
        self.nodes: list[Node] = []
        self.values: list[Value] = []
        self.inputs: dict[str, Value] = {}
        self.outputs: dict[str, Value] = {}

    # -- helpers --------------------------------------------------------------------------------
    def _new(self, op: str, shape: tuple[int, int], args=(), consts=None, attrs=None, name=""):
        v = Value(self, len(self.values), tuple(shape), op, name)
        self.values.append(v)
        self.nodes.append(Node(op, v, tuple(args), dict(consts or {}), dict(attrs or {})))
        return v

    def _value(self, op: str, arg: str, v: Any) -> Value:
        """A value of this graph: a Value it made, or the name of an input defined before."""
        if isinstance(v, str):
            if v not in self.inputs:
                raise ValueError(
                    f"TaskGraph.{op}: {arg}={v!r} is used before it is defined (inputs so far: "
                    f"{sorted(self.inputs)})"
                )
            return self.inputs[v]
        if not isinstance(v, Value):
            fail(
                op,
                arg,
                "a Value of this TaskGraph (or an input's name)",
                type(v).__name__,
                TypeError,
            )
        if v.graph is not self:
            raise ValueError(
                f"TaskGraph.{op}: {arg} is {v!r} of another TaskGraph: it is not defined in "
                "this one"
            )
        return v

    def _tensors(self, op: str, arg: str, t: Any, want: str, ok) -> list[torch.Tensor]:
        ts = per_rank(op, arg, t, self.W, self.device, want, ok)
        if self.device is None:
            self.device = ts[0].device
        return ts

    # -- the ops --------------------------------------------------------------------------------
    def input(self, name: str, shape: tuple[int, int], dtype: torch.dtype = BF16) -> Value:
        """A value given at each call as ``k(name=tensor)``: [rows, cols] bf16 (per rank)."""
        if not isinstance(name, str) or not name.isidentifier():
            fail(
                "input",
                "name",
                "a Python identifier (a keyword of the call)",
                repr(name),
                TypeError,
            )
        if name in self.inputs:
            raise ValueError(f"TaskGraph.input: an input named {name!r} is defined already")
        shape = check_shape("input", shape)
        check_dtype("input", "dtype", dtype)
        v = self._new("input", shape, name=name)
        self.inputs[name] = v
        return v

    def rmsnorm(self, x: Any, weight: Any, eps: float = 1e-6) -> Value:
        """``x * rsqrt(mean(x**2, -1) + eps) * weight``: x [M, H], weight [H]; -> [M, H]."""
        x = self._value("rmsnorm", "x", x)
        H = x.shape[1]
        w = self._tensors("rmsnorm", "weight", weight, f"[H={H}]", lambda s: s == (H,))
        if not isinstance(eps, (int, float)) or isinstance(eps, bool):
            fail("rmsnorm", "eps", "a positive float", repr(eps), TypeError)
        if not eps > 0:
            fail("rmsnorm", "eps", "a positive float", repr(eps))
        return self._new("rmsnorm", x.shape, (x,), {"weight": w}, {"eps": float(eps)})

    def linear(self, x: Any, weight: Any, residual: Any = None) -> Value:
        """``x @ weight.T (+ residual)``: x [M, K], weight [N, K], residual [M, N]; -> [M, N]."""
        x = self._value("linear", "x", x)
        M, K = x.shape
        w = self._tensors(
            "linear", "weight", weight, f"[N, K={K}]", lambda s: len(s) == 2 and s[1] == K
        )
        N = w[0].shape[0]
        if any(t.shape[0] != N for t in w):
            fail(
                "linear",
                "weight",
                "of one shape [N, K] on every rank",
                str([list(t.shape) for t in w]),
            )
        args = (x,)
        if residual is not None:
            res = self._value("linear", "residual", residual)
            if res.shape != (M, N):
                fail("linear", "residual", f"[M={M}, N={N}]", shape_str(res.shape))
            args = (x, res)
        return self._new("linear", (M, N), args, {"weight": w})

    def silu_mul(self, x: Any) -> Value:
        """``silu(x[:, :F]) * x[:, F:]`` (the gate | up halves of the last dim): x [M, 2F];
        -> [M, F]."""
        x = self._value("silu_mul", "x", x)
        M, F2 = x.shape
        if F2 % 2:
            fail("silu_mul", "x", "[M, 2F] (an even last dim: gate | up)", shape_str(x.shape))
        return self._new("silu_mul", (M, F2 // 2), (x,))

    def attention_decode(self, q: Any, k_cache: Any, v_cache: Any, length: int) -> Value:
        """One query token per sequence over the first ``length`` cached positions::

        q [B, Hq*D], k_cache / v_cache [B, Hkv, S, D]; G = Hq // Hkv (GQA: query head i reads
        kv head i // G); out[b, i] = softmax(q[b, i] @ k[b, i//G, :length].T / sqrt(D))
        @ v[b, i//G, :length]  -> [B, Hq*D]
        """
        q = self._value("attention_decode", "q", q)
        B, HqD = q.shape
        four = lambda s: len(s) == 4 and s[0] == B  # noqa: E731
        want = f"[B={B}, Hkv, S, D]"
        k = self._tensors("attention_decode", "k_cache", k_cache, want, four)
        shape = tuple(k[0].shape)
        v = self._tensors(
            "attention_decode",
            "v_cache",
            v_cache,
            f"{shape_str(shape)} (k_cache's)",
            lambda s: s == shape,
        )
        if any(tuple(t.shape) != shape for t in k):
            fail(
                "attention_decode",
                "k_cache",
                "of one shape on every rank",
                str([list(t.shape) for t in k]),
            )
        _, Hkv, S, D = shape
        if HqD % D or (HqD // D) % Hkv:
            fail(
                "attention_decode",
                "q",
                f"[B, Hq*D] with D={D} and Hq a multiple of Hkv={Hkv}",
                shape_str(q.shape),
            )
        if not isinstance(length, int) or isinstance(length, bool):
            fail("attention_decode", "length", f"an int in [1, S={S}]", repr(length), TypeError)
        if not 1 <= length <= S:
            fail("attention_decode", "length", f"an int in [1, S={S}]", repr(length))
        attrs = {"length": length, "heads": HqD // D, "kv_heads": Hkv, "seq": S, "head_dim": D}
        return self._new("attention_decode", q.shape, (q,), {"k": k, "v": v}, attrs)

    def add(self, a: Any, b: Any) -> Value:
        """``a + b``: two values of one shape."""
        a, b = self._value("add", "a", a), self._value("add", "b", b)
        if a.shape != b.shape:
            fail("add", "b", f"of a's shape {shape_str(a.shape)}", shape_str(b.shape))
        return self._new("add", a.shape, (a, b))

    def all_reduce(self, x: Any) -> Value:
        """The sum of ``x`` over the world's ranks, on every rank (one rank: ``x`` itself)."""
        x = self._value("all_reduce", "x", x)
        return x if self.W == 1 else self._new("all_reduce", x.shape, (x,))

    def all_gather(self, x: Any) -> Value:
        """Every rank's ``x`` [m, N], stacked by rank: [W * m, N] (one rank: ``x`` itself)."""
        x = self._value("all_gather", "x", x)
        m, N = x.shape
        return x if self.W == 1 else self._new("all_gather", (self.W * m, N), (x,))

    def reduce_scatter(self, x: Any) -> Value:
        """Rows ``r * M/W .. (r+1) * M/W`` of the sum of ``x`` [M, N] over ranks, on rank r:
        [M/W, N] (one rank: ``x`` itself)."""
        x = self._value("reduce_scatter", "x", x)
        M, N = x.shape
        if M % self.W:
            fail(
                "reduce_scatter", "x", f"[M, N] with M divisible by W={self.W}", shape_str(x.shape)
            )
        return x if self.W == 1 else self._new("reduce_scatter", (M // self.W, N), (x,))

    def output(self, name: str, x: Any) -> None:
        """The call's result ``name``: value ``x`` when the call ends."""
        if not isinstance(name, str) or not name:
            fail("output", "name", "a non-empty str", repr(name), TypeError)
        if name in self.outputs:
            raise ValueError(f"TaskGraph.output: an output named {name!r} is defined already")
        x = self._value("output", "x", x)
        if x.op == "input":
            raise ValueError(
                f"TaskGraph.output: output {name!r} is input {x.name!r} itself: no op produces it"
            )
        self.outputs[name] = x

    def compile(self, schedule: Any = None, device: Any = None):
        """The graph's callable ``k(**inputs) -> {output name: tensor}``.

        CPU (world None with CPU tensors, or a CPU emulated world): each call runs the graph's
        tasks in the CPU interpreter, which reports races, deadlocks and tiles written twice or
        never, as for the fused ops. GPU: each call is one persistent launch of the TaskGraph
        kernel running the same kind of tables with GPU-sized tiles (docs/megakernel.md); it
        needs column counts that are multiples of 8 (ValueError otherwise). ``schedule``: an
        ``mkernel.Schedule`` (seed, sms, faults) or None.

        ``device``: None (the graph's: that of its tensors or its World), or "cpu" / "cuda" to
        run it there instead (the build-time tensors are copied at compile; a World becomes an
        emulated world of as many ranks on that device): ``g.compile(device="cpu")`` runs a GPU
        graph in the CPU interpreter.

        Inputs: a tensor of the input's shape (the same on every rank) or, in a World, [W, *shape]
        (rank r's at [r]); bf16, on the compiled graph's device. Outputs: [*shape] (world None) or
        [W, *shape] (a World)."""
        return compile_graph(self, schedule, device=device)
