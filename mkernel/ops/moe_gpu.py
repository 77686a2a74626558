"""The unfused MoE dispatch (moe_dispatch_gemm.py runs it for a call with T == 0); the baseline
moved to mkernel/bench/baselines/moe_gpu.py."""

# TODO(issue 34): the fused op stops importing this; then delete the file

from mkernel.bench.baselines.moe_gpu import dispatch

__all__ = ["dispatch"]
