"""The unfused baselines: for each fused op pair, the same results computed the plain way (the
collective or point-to-point exchange, then the engine; or the engine per block, then a merge),
which the benchmarks time the fused ops against and the tests compare them with. Never called by
the public API (``mkernel.*`` runs the fused kernels); they import downward from ``mkernel.ops``,
never the other way.

- ``ring_gpu``: ring attention's backward in an emulated world on one GPU, the engine per block.
- ``ring_dist``: ring attention over a distributed world, K/V by torch.distributed point-to-point.
- ``moe_gpu``: the MoE pair in an emulated world on one GPU: device sort, row gather, grouped GEMM.
- ``moe_dist``: the MoE pair over a distributed world: ``all_to_all_single``, then grouped GEMM.
"""
