"""Benchmarks: tables against the baselines (cuBLAS, NCCL, PyTorch's fused ops), JSON results."""
