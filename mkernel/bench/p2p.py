"""Transfer primitives alone: one primitive moves a buffer into a peer's (or local) memory.

``transfer`` runs one primitive (kernels/p2p.cu); ``bandwidth`` measures GB/s per direction against
the number of SMs driving it, rank 0 writing into rank 1's symmetric buffer (distributed world,
launch under torchrun: ``torchrun --nproc_per_node=2 -m mkernel.bench.p2p``).
"""

from __future__ import annotations

import torch

MODES = {"tile_send_bulk": 0, "reduce_add_bulk_f32": 1, "peer_store_v4": 2, "red_add_v4_f32": 3}


def transfer(
    src: torch.Tensor, dst_ptr: int, mode: str, ctas: int, chunk_bytes: int = 16384
) -> None:
    """Moves ``src`` (contiguous, 16-byte multiple) to address ``dst_ptr`` with primitive ``mode``
    on ``ctas`` CTAs (fp32 reduce modes add ``src`` read as fp32 into the destination)."""
    from ..ops.common import extension

    ext = extension()
    L = ext.P2PLaunch()
    L.src, L.dst, L.bytes = src.data_ptr(), dst_ptr, src.numel() * src.element_size()
    L.ctas, L.mode, L.chunk_bytes = ctas, MODES[mode], chunk_bytes
    rc = ext.launch_p2p(L, torch.cuda.current_stream().cuda_stream)
    if rc:
        raise ValueError(
            f"p2p launch rejected (code {rc}): sizes and addresses must be 16-byte multiples"
        )


def bandwidth(world, mib: int = 256, ctas_list=(1, 2, 4, 8, 16, 32, 66, 132), iters: int = 10):
    """GB/s of each primitive from rank 0 into rank 1, per number of CTAs (one direction)."""
    import torch.distributed as dist

    from .timing import median_ms

    n = mib << 20
    buf = world.symmetric(("bench", "p2p"), (n // 4,), torch.float32)
    src = torch.randn(n // 4, device=world.device)
    peer = int(buf.peer_ptrs[1].item()) if world.size > 1 else buf.local.data_ptr()
    rows = []
    for mode in MODES:
        for ctas in ctas_list:
            dist.barrier()
            if world.rank == 0:
                fn = lambda i, mode=mode, ctas=ctas: transfer(src, peer, mode, ctas)
                ms = median_ms(fn, 1, iters, warmup=2)
                rows.append(
                    {"primitive": mode, "ctas": ctas, "mib": mib, "ms": ms, "gbps": n / ms / 1e6}
                )
            torch.cuda.synchronize()
    dist.barrier()
    return rows


def main() -> None:
    import os

    import torch.distributed as dist

    import mkernel

    from .timing import save, table

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    world = mkernel.World.from_process_group()
    rows = bandwidth(world)
    if world.rank == 0:
        print(table(rows, ["primitive", "ctas", "mib", "ms", "gbps"]))
        print("saved", save(f"p2p_w{world.size}", rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
