"""GPU calls are asynchronous: a call enqueues its kernel and returns; a timeout is raised by the
next call, by world.check(), or at the call itself with sync_checks=True; the watchdog reports it
within a second even when the program makes no further call."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import mkernel
from tests.helpers import assert_close_bf16, assert_pads_zero, gemm_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _silent(world):
    a, b = gemm_inputs(world.size, world.size * 128, 256, 64, 0)
    a, b = a.cuda(), b.cuda()
    return a, b, mkernel.Schedule(faults=mkernel.Faults(silent_rank=1))


def test_call_returns_before_its_kernel_ends():
    world = mkernel.World.emulated(2, device="cuda", timeout_s=1.0)
    a, b, bad = _silent(world)
    t0 = time.perf_counter()
    mkernel.gemm_rs(a, b, world=world, schedule=bad)  # its waits run into the 1 s deadline
    assert time.perf_counter() - t0 < 0.5, "the call waited for its kernel"
    with pytest.raises(mkernel.CommTimeout) as e:
        world.check()
    assert e.value.peer == 1 and e.value.signal.startswith("partial[")
    assert_pads_zero(world)


def test_next_call_raises_an_earlier_timeout():
    world = mkernel.World.emulated(2, device="cuda", timeout_s=0.2)
    a, b, bad = _silent(world)
    mkernel.gemm_rs(a, b, world=world, schedule=bad)
    torch.cuda.synchronize()  # the failed kernel has ended (its status is recorded)
    with pytest.raises(mkernel.CommTimeout) as e:
        mkernel.gemm_rs(a, b, world=world)  # the next call on this world raises it
    assert e.value.signal.startswith("partial[")
    out = mkernel.gemm_rs(a, b, world=world)  # and the world is clean again
    assert_close_bf16(out, mkernel.reference.gemm_rs(a, b, world=world), "after timeout")


def test_sync_checks_raise_at_the_call():
    world = mkernel.World.emulated(2, device="cuda", timeout_s=0.2)
    world.sync_checks = True
    a, b, bad = _silent(world)
    with pytest.raises(mkernel.CommTimeout):
        mkernel.gemm_rs(a, b, world=world, schedule=bad)
    out = mkernel.gemm_rs(a, b, world=world)
    assert_close_bf16(out, mkernel.reference.gemm_rs(a, b, world=world), "after timeout")


def test_watchdog_reports_within_a_second():
    world = mkernel.World.emulated(2, device="cuda", timeout_s=0.2)
    seen: list[mkernel.CommTimeout] = []
    fired = threading.Event()
    world.on_timeout = lambda exc: (seen.append(exc), fired.set())
    _, b, bad = _silent(world)
    a = torch.randn(2, 128, 64, device="cuda").bfloat16()  # shards [M/W, K]
    mkernel.ag_gemm(a, b, world=world, schedule=bad)
    t0 = time.perf_counter()
    assert fired.wait(timeout=5.0), "the watchdog never reported the timeout"
    # deadline 0.2 s + at most one watchdog period after it
    assert time.perf_counter() - t0 < 1.2
    assert seen[0].peer == 1 and seen[0].signal.startswith("chunk_ready[")
    with pytest.raises(mkernel.CommTimeout):  # still raised to the program
        world.check()
    world.check()  # once
