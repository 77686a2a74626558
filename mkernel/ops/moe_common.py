"""What MoE dispatch (moe_dispatch_gemm.py) and combine (moe_gemm_combine.py) share: the routing
(counts -> prefix sums -> every row's slot), the dispatch result, the input checks. No SPEC: not an
op itself (the registry skips it).

Routing, from every rank's ``topk_ids`` [T, k] (global expert ids, -1 unused; E = W * E_local, the
global id of local expert e on rank d is d * E_local + e):

- ``sent[s][d]``: the tokens of source s that feed at least one expert of rank d, in token order.
  Each goes to d once (one copy of x_token per destination rank), into d's receive buffer at
  ``recv_base[d][s] + position`` with ``recv_base[d][s] = s * T``: each source owns T receive
  rows on d (a source knows where its tokens go without the other sources' counts; a push of a
  run of its tokens lands in consecutive rows).
- ``rows[d]``: the (source, token, slot, local expert) of each row of d's grouped GEMM: by expert,
  then source, then token (a token names an expert at most once, so the slot follows). Counts per
  (source, expert) and their prefix sums give each row its final place before any data moves, so
  nothing is reordered later and the order does not depend on timing.
- ``offsets[d]``: rows of local expert e are ``offsets[d][e] : offsets[d][e + 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..schedule import TILE_CONFIGS, TileConfig
from ..world import World
from .common import ALIGN, check_divides


@dataclass(frozen=True)
class Routing:
    """Where every row goes (module docstring); a pure function of the routing ids."""

    experts: int  # E_local
    sent: list[list[list[int]]]  # [s][d] -> tokens of s sent to d, in token order
    recv_base: list[list[int]]  # [d][s] -> first receive row of s's tokens on d
    rows: list[list[tuple[int, int, int, int]]]  # [d] -> (src, token, slot, local expert) per row
    offsets: list[list[int]]  # [d] -> E_local + 1 prefix sums of rows per local expert

    def recv_row(self, d: int, s: int, t: int) -> int:
        """The receive row of token t of source s on rank d."""
        return self.recv_base[d][s] + self.sent[s][d].index(t)


def route(ids: list[list[list[int]]], experts: int) -> Routing:
    """The Routing of ``ids[s][t][j]`` (every rank's topk_ids, as lists) over local experts."""
    W = len(ids)
    fed = [[{g // experts for g in row if g >= 0} for row in ids[s]] for s in range(W)]
    sent = [
        [[t for t, ranks in enumerate(fed[s]) if d in ranks] for d in range(W)] for s in range(W)
    ]
    T = len(ids[0]) if W else 0
    recv_base = [[s * T for s in range(W)] for _ in range(W)]
    rows, offsets = [], []
    for d in range(W):
        mine: list[tuple[int, int, int, int]] = []
        offs = [0]
        for e in range(experts):
            g = d * experts + e
            mine += [
                (s, t, row.index(g), e)
                for s in range(W)
                for t, row in enumerate(ids[s])
                if g in row
            ]
            offs.append(len(mine))
        rows.append(mine)
        offsets.append(offs)
    return Routing(experts, sent, recv_base, rows, offsets)


def gemm_tiles(offsets: list[int], tile_rows: int) -> list[tuple[int, int, int]]:
    """A rank's grouped-GEMM tiles (local expert, first row, rows): each expert's rows cut into
    tiles of ``tile_rows``; an expert with no rows has none. Task and output tile ids are positions
    in this list."""
    out = []
    for e in range(len(offsets) - 1):
        for r0 in range(offsets[e], offsets[e + 1], tile_rows):
            out.append((e, r0, min(tile_rows, offsets[e + 1] - r0)))
    return out


def gemm_tasks(
    offsets: list[int], tile_rows: int, cols: int, bn: int
) -> list[tuple[int, int, int, int, int, int]]:
    """A rank's grouped-GEMM compute tasks as the device lays them out: each row tile of
    ``gemm_tiles`` (index i) cut into ``bn``-wide column tiles, as (i, expert, first row, rows,
    first column, columns). Task and output tile ids are positions in this list (i * tiles_n + j,
    the device's numbering)."""
    return [
        (i, e, r0, n, c0, min(bn, cols - c0))
        for i, (e, r0, n) in enumerate(gemm_tiles(offsets, tile_rows))
        for c0 in range(0, cols, bn)
    ]


def max_rows(world_size: int, tokens: int, k: int, experts: int) -> int:
    """The most grouped-GEMM rows one rank can receive: every token of every rank, each with up to
    min(k, E_local) of its slots on this rank. Workspaces and capacities are sized by it, so a plan
    serves every routing of its shape."""
    return world_size * tokens * min(k, experts)


def tile_rows(schedule: Any, tokens: int, k: int, experts: int) -> int:
    """Rows per grouped-GEMM tile: ``Schedule.chunk_rows``, else 128 when a local expert gets 128
    rows or more on average (a rank receives T * k rows over its E_local experts under uniform
    routing: 128-row tiles measured 1.5x faster for the combine, 1.14x for the dispatch, at 512
    rows per expert, benchmarks/results/moe_local_2026-12-01.json), else 64 (less waste in an
    expert's last tile)."""
    if schedule.chunk_rows:
        return schedule.chunk_rows
    return 128 if tokens * k >= 128 * experts else 64


def grouped_tile(rows: int, world: Any, wide: str | None = None) -> TileConfig:
    """The grouped GEMM engine's tile config for tiles of ``rows`` rows (its BM holds them; a
    shorter tile computes zeros past its rows and stores none of them); BN = 128 columns, or
    the config ``wide`` names for tiles of more than 64 rows (an op whose kernel has it: the
    dispatch's 128 x 256). The device takes tiles of at most 128 rows."""
    if rows > 128 and world.on_gpu:
        raise ValueError(
            f"Schedule.chunk_rows={rows}: the grouped GEMM engine takes tiles of at most 128 rows"
        )
    return TILE_CONFIGS["64x128x64" if rows <= 64 else wide or "128x128x64"]


@dataclass(frozen=True, eq=False)
class MoeDispatch:
    """The result of ``moe_dispatch_gemm``, per rank (lists with one entry per rank of an emulated
    world):

    - ``y`` [R, I] bf16: one row per (token, slot) routed to this rank's experts, x_token @ w1[e];
    - ``src`` [R, 3] int32: (source rank, token, slot) of each row;
    - ``expert_offsets`` [E_local + 1] int32: rows of local expert e are
      ``expert_offsets[e] : expert_offsets[e + 1]``; within an expert, by source, token, slot.

    It also holds what ``moe_gemm_combine`` needs: the world, the routing ids and the shapes.
    Made under CUDA-graph capture (``captured``), ``y`` and ``src`` hold the worst case's rows,
    each replay's the first ``expert_offsets[-1]``."""

    y: list[torch.Tensor]
    src: list[torch.Tensor]
    expert_offsets: list[torch.Tensor]
    world: World
    topk_ids: torch.Tensor  # [W, T, k] int32, a copy of the routing the dispatch ran
    hidden: int  # H
    # made under CUDA-graph capture: y and src hold the worst case's rows (the plan's max_rows),
    # the first expert_offsets[-1] of them this replay's (no host read of the counts)
    captured: bool = False
    # the largest rank's buffer rows (a distributed world learns them by the dispatch's counts
    # exchange; emulated: max of buffer_rows): what the combine's symmetric partial is sized by
    peak_rows: int | None = None

    @property
    def peak(self) -> int:
        """The most buffer rows of any rank (every rank's, however many ranks this process has)."""
        if self.peak_rows is not None:
            return self.peak_rows
        return max((int(y.shape[0]) for y in self.y), default=0)

    @property
    def rows(self) -> list[int]:
        """Routed rows per rank (reads the offsets: a device -> host copy)."""
        return [int(o[-1]) for o in self.expert_offsets]

    @property
    def buffer_rows(self) -> list[int]:
        """Rows of each rank's ``y`` (and of the ``h`` the combine takes): the routed rows, or
        the worst case when captured. Known on the host without reading the device."""
        return [int(y.shape[0]) for y in self.y]

    @property
    def experts(self) -> int:
        return self.expert_offsets[0].numel() - 1


def dispatch_result(
    world: World, routing: Routing, ids: torch.Tensor, y: list[torch.Tensor], hidden: int
) -> MoeDispatch:
    """The MoeDispatch of ``routing`` with the rows ``y`` (per rank)."""
    src = [
        torch.tensor([r[:3] for r in rows], dtype=torch.int32).reshape(-1, 3)
        for rows in routing.rows
    ]
    offsets = [torch.tensor(o, dtype=torch.int32) for o in routing.offsets]
    return MoeDispatch(y, src, offsets, world, ids, hidden)


def partial_rows(peak: int) -> int:
    """Rows of the combine's symmetric fp32 partial for a dispatch whose largest rank has ``peak``
    rows: rounded up to a quarter of a power of two (at least 64), so routings of similar counts
    share one buffer (a plan and a symmetric allocation per size; at most 25% unused rows)."""
    unit = 1 << max(4, max(1, peak).bit_length() - 3)
    return max(64, -(-peak // unit) * unit)


def rows_per_rank(world: World, ids: torch.Tensor | None, experts: int) -> list[int]:
    """A distributed world's rows per rank (used slots routed to each rank's experts, every
    source's) by one all-gather of each rank's T, id check (routing_summary) and counts: the
    call's one host synchronize, as the emulated world's one read of check_ids. Also checks that
    every rank has the same T (the symmetric receive rows are sized by it). ``ids`` None: this
    rank refused its inputs; it still takes part, so that every rank raises (a ValueError naming
    the refusing ranks; a rank with a bad id names the id) instead of waiting for it."""
    import torch.distributed as dist

    W = world.size
    if ids is None:
        mine = torch.full((W + 3,), -1, dtype=torch.long)
    else:
        summary = routing_summary(ids[None], W * experts, experts)[0]
        mine = torch.cat((torch.tensor([ids.shape[0]], device=ids.device), summary))
    gloo = dist.get_backend(world.group) == "gloo"  # gloo moves CPU tensors
    mine = mine.cpu() if gloo else mine.to(world.device)
    parts = [torch.empty_like(mine) for _ in range(W)]
    dist.all_gather(parts, mine, group=world.group)
    every = torch.stack(parts).cpu()
    if ids is not None and bool(every[world.rank, 1:3].any()):
        raise_bad_ids(ids[None], W * experts, world.rank)  # names the id (peers: "refused")
    tokens = every[:, 0].tolist()
    refused = [r for r, t in enumerate(tokens) if t < 0 or bool(every[r, 1:3].any())]
    if refused:
        raise ValueError(
            f"moe_dispatch_gemm: rank(s) {refused} refused their inputs (each says why); nothing "
            "ran on any rank"
        )
    if len(set(tokens)) > 1:
        raise ValueError(
            f"every rank must pass the same number of tokens T (its symmetric receive rows are "
            f"sized by it; pad with -1 ids): ranks have T = {tokens}"
        )
    return every[:, 3:].sum(dim=0).tolist()


def stacked(parts: list[torch.Tensor], rows: int, fill: float = 0.0) -> torch.Tensor:
    """Ragged per-rank [R_d, C] tensors as one [W, rows, C] tensor (the interpreter's buffers hold
    every rank at the same shape), padded with ``fill``."""
    C = parts[0].shape[1]
    out = torch.empty((len(parts), rows, C), dtype=parts[0].dtype, device=parts[0].device)
    for d, p in enumerate(parts):  # each byte written once (a fill first would write them twice)
        out[d, : p.shape[0]] = p
        out[d, p.shape[0] :] = fill
    return out


# -- checks (before anything runs) ----------------------------------------------------------------


def capturing(t: torch.Tensor) -> bool:
    """A CUDA graph is being captured on the current stream (no host reads of device data)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_capture(name: str, world: World) -> None:
    """CUDA-graph capture of the MoE pair runs in emulated worlds. A distributed one would size
    its results and the combine's symmetric rows without the counts exchange and build plans and
    symmetric buffers inside the capture: not built, so refused by name before anything runs."""
    if world.emulated_world or not torch.cuda.is_available():
        return
    if torch.cuda.is_current_stream_capturing():
        raise ValueError(
            f"{name}: CUDA-graph capture is supported in emulated worlds (World.emulated); in a "
            "distributed world call it outside the capture"
        )


def check_columns(name: str, value: int) -> None:
    """Row lengths the device's TMA copies will need (16-byte rows)."""
    check_divides(name, value, ALIGN, "16-byte rows")


def bad_id(value: int, rank: int, token: int, slot: int, experts_total: int) -> str:
    """What is wrong with routing id ``value`` at (rank, token, slot), found by the host's check
    or by the dispatch's device layout (which also finds a repeat: an id in range is one)."""
    where = f"topk_ids: expert id {value} of rank {rank}, token {token} (slot {slot})"
    if 0 <= value < experts_total:
        return f"{where} names an expert an earlier slot of the token names"
    return f"{where} is outside [-1, E={experts_total})"


def routing_summary(ids: torch.Tensor, experts_total: int, experts_local: int) -> torch.Tensor:
    """Per source rank of topk_ids [n, T, k], on the ids' device without a host read: [n, 2 + W]
    int64 = (ids outside [-1, E), ids a token repeats, then its used slots routed to the experts
    of rank 0 .. W - 1). No boolean indexing: that would read the device."""
    n, T, k = ids.shape
    W = experts_total // experts_local
    ids = ids.long()
    bad = (ids < -1) | (ids >= experts_total)
    used = (ids >= 0) & ~bad
    dest = torch.where(used, ids // experts_local, 0).view(n, -1)
    counts = torch.zeros(n, W, dtype=torch.long, device=ids.device)
    counts.scatter_add_(1, dest, used.view(n, -1).long())
    repeats = torch.zeros(n, dtype=torch.long, device=ids.device)
    if k > 1 and T:
        s = ids.sort(dim=-1).values
        repeats = ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).view(n, -1).sum(dim=1)
    return torch.cat((bad.view(n, -1).sum(dim=1, keepdim=True), repeats[:, None], counts), 1)


def check_ids(ids: torch.Tensor, experts_total: int, experts_local: int) -> list[list[int]] | None:
    """topk_ids [W, T, k] of an emulated world: every id in [-1, E) (an id outside names its rank
    and token), no expert twice in a token; returns each source rank's used slots per destination
    rank ([W][W], from routing_summary: the call's one host read). Not under CUDA-graph capture
    (None): there (and for ids written after a call's checks) the device layout finds such an id,
    ignores it (nothing written for it) and reports it as it does a timeout (DeviceInputError)."""
    if capturing(ids):
        return None
    summary = routing_summary(ids, experts_total, experts_local).tolist()  # NOTE: the host read
    if any(row[0] or row[1] for row in summary):
        raise_bad_ids(ids, experts_total)
    return [row[2:] for row in summary]


def raise_bad_ids(ids: torch.Tensor, experts_total: int, first_rank: int = 0) -> None:
    """The ValueError naming the first bad id of topk_ids [n, T, k] (``first_rank``: the rank of
    ids[0]), once routing_summary has counted one."""
    W, T, k = ids.shape
    bad = (ids < -1) | (ids >= experts_total)
    if bool(bad.any()):
        r, t, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(bad_id(int(ids[r, t, j]), first_rank + r, t, j, experts_total))
    if k > 1 and T:
        s = ids.sort(dim=-1).values
        dup = ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any(dim=-1)
        if bool(dup.any()):
            r, t = (int(v) for v in dup.nonzero()[0])
            raise ValueError(
                f"topk_ids: token {t} of rank {first_rank + r} names an expert twice: "
                f"{ids[r, t].tolist()} (a token's expert ids must be distinct)"
            )
