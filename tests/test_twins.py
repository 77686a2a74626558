"""Every device primitive has a Python twin of the same name (the interpreter's contract)."""

from __future__ import annotations

import re
from pathlib import Path

from mkernel.interp import twins

ROOT = Path(__file__).parents[1] / "primitives"
# Ordering/fencing helpers and raw PTX wrappers that the interpreter models implicitly (its vector
# clocks give release/acquire and bulk completion at the signal), not as separate steps.
IMPLICIT = {
    "smem_u32",
    "fence_proxy_async_smem",
    "fence_proxy_async_global",
    "bulk_commit",
    "bulk_wait_read",
    "bulk_wait_read_n",
    "fence_acq_rel_sys",
    "bulk_wait_all",
    "globaltimer_ns",
    "ld_acquire_sys",
    "ld_relaxed_sys",
    "st_release_sys",
    "st_relaxed_sys",
    "red_add_release_sys",
    "cas_acq_rel_sys",
    "ld_relaxed_gpu",  # the gpu-scope twins of the above (a one-GPU op's flags, kOneGpu)
    "st_release_gpu",
    "st_relaxed_gpu",
    "red_add_release_gpu",
    "fence_acq_rel_gpu",
    "st_relaxed_at",  # st_relaxed_sys or _gpu by the op's scope
    "aborting",
    "record_timeout",
    "record_bad_input",  # status-block writers: the interpreter raises its errors directly
    "spin_until",
    "delay_ns",
}


def device_primitives() -> set[str]:
    names = set()
    for f in ("signal.cuh", "comm.cuh"):
        text = (ROOT / f).read_text()
        names |= set(
            re.findall(r"__device__\s+(?:__forceinline__\s+|inline\s+)*\w+\s+(\w+)\(", text)
        )
    return names


def test_every_primitive_has_a_twin():
    prims = device_primitives()
    assert {"wait_acquire", "signal_set_release", "tile_send_bulk", "reduce_add_bulk_f32"} <= prims
    missing = sorted(p for p in prims - IMPLICIT if not hasattr(twins, p))
    assert not missing, f"device primitives without a Python twin: {missing}"
