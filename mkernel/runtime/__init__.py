"""The runtime layer: what every fused op's call runs on, below mkernel/ops (which depends on it)
and above the declarations (mkernel/protocol.py, tiles.py, cost.py, interp/): the op registry,
symmetric memory and workspaces (memory.py), the GPU launch, status block and watchdog (gpu.py).
Nothing here imports mkernel.ops; tests/test_imports.py checks that and that no import cycle
exists anywhere in the package (counting imports inside functions). docs/architecture.md draws
the layers."""
