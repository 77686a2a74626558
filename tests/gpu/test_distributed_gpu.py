"""The distributed worlds' checks, two processes (torchrun, gloo) sharing this GPU through symmetric
memory (tests/distributed/run.sh starts the MPS daemon when it can): every fused op in a world made
by World.from_process_group, this rank's tensors, against the emulated reference. With one GPU
this is how the distributed paths (the launch record of one rank, symmetric buffers, the MoE
counts exchange, a rank that refuses its inputs) run in the GPU test flow; two GPUs run the same
scripts with torchrun directly."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers import ROOT, run_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash"),
]

# (script, its arguments, PASS lines it prints at least): the GEMM ops with the ring attention
# forward and backward checks (check_ops.py), the MoE pair (check_moe.py), mkernel.torch_compat's
# drop-in functions against torch.ops.symm_mem's own (check_torch_compat.py, issue 37); 60 SMs per
# rank so both ranks' persistent kernels fit on the GPU at once
CHECKS = [
    ("check_ops.py", ["--ops", "gemm_rs,ag_gemm,gemm_ar", "--loop", "3", "--sms", "60"], 71),
    ("check_moe.py", ["--loop", "1", "--sms", "60"], 10),
    ("check_torch_compat.py", ["--sms", "60"], 12),
]


@pytest.mark.parametrize(("script", "args", "passes"), CHECKS)
def test_the_distributed_checks_pass_with_two_processes_on_this_gpu(script, args, passes):
    run_sh = str(ROOT / "tests/distributed/run.sh")
    rc, out = run_script(["bash", run_sh, "2", *args], timeout=900, CHECK=script)
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert rc == 0 and not fails, "\n".join(fails) or out[-4000:]
    assert out.count("PASS ") >= passes, out[-3000:]  # every check ran and reported


@pytest.mark.parametrize(("procs", "nodes", "passes"), [(2, 2, 28), (4, 2, 28)])
def test_the_ops_over_nodes_pass_through_nvshmem_with_processes_on_this_gpu(procs, nodes, passes):
    """gemm_rs, ag_gemm, gemm_ar in a distributed world of several nodes (NVSHMEM puts across
    them), as processes sharing this GPU. Without MPS: their kernels time-slice, so each may hold
    every SM (NVSHMEM allows several PEs per GPU)."""
    from mkernel import nvshmem_ext

    if nvshmem_ext.SPEC is None:
        pytest.skip(nvshmem_ext.ABSENT)
    cmd = ["python3", "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
    cmd += [str(ROOT / "tests/distributed/check_nodes.py"), "--nodes", str(nodes)]
    rc, out = run_script(
        [*cmd, "--loop", "20", "--shapes", "2", "--dump-after", "280"], timeout=300
    )
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert rc == 0 and not fails, "\n".join(fails) or out[-4000:]
    assert out.count("PASS ") >= passes, out[-3000:]  # every check ran and reported
