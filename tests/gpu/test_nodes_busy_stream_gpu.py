"""The GEMM ops over emulated nodes on one GPU (the rdma proxies carry their cross-node puts),
called while the stream is still busy (issue 33.1): inputs moved from the host just before the
call (pageable copies still queued), a large copy or a long kernel queued before it, several calls
back to back without a synchronize, calls from two streams in turn, and the first use of cuBLAS
(the reference) or a jiterator op's first call (a module load) right after the call: before the
fix (a call over nodes returns once its kernel ended, mkernel/runtime/gpu.py wait_nodes_launch) the
first of these timed out gemm_rs W=4 over 2 nodes on the H100. Each first call runs in a
fresh process (tests/helpers.run_script), since the first call of a world is the one that sets up
its rings and copy stream. Results against the fp32 reference; no timeout; rings drained."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers import run_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCRIPT = r"""
import sys, torch, mkernel
op, W, N, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
world = mkernel.World.emulated(W, device="cuda", nodes=N, timeout_s=3)
rows = 48 if op == "ag_gemm" else 96
k = 32 * (W if op == "ag_gemm" else 1)
a_host, b_host = torch.randn(W, rows, k).bfloat16(), torch.randn(W, k, 48).bfloat16()
fn, ref_fn = getattr(mkernel, op), getattr(mkernel.reference, op)
side = torch.cuda.Stream()
outs = []
if mode == "moved_inputs":  # the issue's repro: pageable copies queued, no synchronize
    a, b = a_host.cuda(), b_host.cuda()
    outs.append(fn(a, b, world=world))
    ref = ref_fn(a, b, world=world)  # cuBLAS's first use while the kernel may still wait
elif mode in ("big_copy", "long_kernel"):
    a, b = a_host.cuda(), b_host.cuda()
    if mode == "big_copy":
        big = torch.empty(2**28, dtype=torch.uint8).cuda()  # 256 MB, pageable
    else:
        torch.cuda._sleep(100_000_000)
    outs.append(fn(a, b, world=world))
    ref = ref_fn(a, b, world=world)
elif mode == "module_load":  # a jiterator op's first call loads its module (tools/lazy_probe.py)
    a, b = a_host.cuda(), b_host.cuda()
    outs.append(fn(a, b, world=world))
    torch.special.bessel_j0(torch.rand(64, device="cuda"))
    ref = ref_fn(a, b, world=world)
elif mode == "back_to_back":
    a, b = a_host.cuda(), b_host.cuda()
    outs += [fn(a, b, world=world) for _ in range(20)]
    ref = ref_fn(a, b, world=world)
elif mode == "two_streams":
    a, b = a_host.cuda(), b_host.cuda()
    for i in range(6):
        s = side if i % 2 else torch.cuda.current_stream()
        s.wait_stream(torch.cuda.current_stream() if i % 2 else side)
        with torch.cuda.stream(s):
            outs.append(fn(a, b, world=world))
    torch.cuda.current_stream().wait_stream(side)
    ref = ref_fn(a, b, world=world)
world.check()
for i, out in enumerate(outs):
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 2**-7, f"{op} W={W} N={N} {mode} call {i}: relative error {err}"
torch.cuda.synchronize()
for r in range(W):
    c = world._rdma.counters(r)
    assert c["reserve"] == c["head"] == c["tail"], (r, c)
print("OK")
"""

CASES = [
    ("gemm_rs", 4, 2),
    ("gemm_ar", 4, 2),
    ("gemm_ar", 8, 2),
    ("gemm_rs", 8, 2),
    ("ag_gemm", 4, 2),
]
MODES = ["moved_inputs", "module_load", "big_copy", "long_kernel", "back_to_back", "two_streams"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op,W,N", CASES)
def test_calls_with_a_busy_stream(op, W, N, mode):
    rc, out = run_script([sys.executable, "-c", SCRIPT, op, str(W), str(N), mode], timeout=120)
    assert rc == 0 and out.strip().endswith("OK"), out
