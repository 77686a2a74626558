"""mkernel: multi-GPU kernels that fuse communication with computation.

Public API: ``World`` (emulated or distributed), ``Schedule`` / ``Plan`` / ``Faults``, the fused ops
(``gemm_rs``, ``ag_gemm``, ``gemm_ar``; ``all_gather``, the op tutorial 03 writes; the MoE
experts' ``grouped_gemm`` (one GPU, GEMM engine); the MoE pair ``moe_dispatch_gemm`` /
``moe_gemm_combine`` and ``ring_attention`` / ``attention`` / ``ring_attention_backward`` (fused:
one persistent kernel per call in emulated and distributed GPU worlds, the same plans in the CPU
interpreter; with one rank and the default Schedule the ring attention calls run the single-GPU
engines), their unfused references
(``mkernel.reference``), ``TaskGraph`` (graphs of ops whose tasks are tiles, run by the CPU
interpreter; docs/megakernel.md), ``CommTimeout`` and the CPU interpreter's errors.
"""

from .errors import (
    CommTimeout,
    DeadlockError,
    DeviceInputError,
    PlanError,
    RaceError,
    TileWriteError,
)
from .ops.ag_gemm import ag_gemm
from .ops.all_gather import all_gather
from .ops.gemm_ar import gemm_ar
from .ops.gemm_rs import gemm_rs
from .ops.grouped_gemm import grouped_gemm
from .ops.moe_common import MoeDispatch
from .ops.moe_dispatch_gemm import moe_dispatch_gemm
from .ops.moe_gemm_combine import moe_gemm_combine
from .ops.ring_attention import attention, ring_attention
from .ops.ring_attention_backward import ring_attention_backward
from .schedule import TILE_CONFIGS, Faults, Plan, Schedule, Tile
from .taskgraph import TaskGraph
from .world import World

# isort: split
from . import reference  # after the ops: it collects their references from the registry

__all__ = [
    "World",
    "Schedule",
    "Plan",
    "Faults",
    "Tile",
    "TILE_CONFIGS",
    "gemm_rs",
    "ag_gemm",
    "gemm_ar",
    "all_gather",
    "grouped_gemm",
    "moe_dispatch_gemm",
    "moe_gemm_combine",
    "MoeDispatch",
    "ring_attention",
    "attention",
    "ring_attention_backward",
    "reference",
    "TaskGraph",
    "CommTimeout",
    "DeadlockError",
    "DeviceInputError",
    "PlanError",
    "RaceError",
    "TileWriteError",
]
