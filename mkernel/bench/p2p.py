"""Transfer primitives alone: one primitive moves a buffer into a peer's (or local) memory.

``transfer`` runs one primitive (kernels/p2p.cu); ``bandwidth`` measures GB/s per direction against
the number of SMs driving it, rank 0 writing into rank 1's symmetric buffer (distributed world,
launch under torchrun: ``torchrun --nproc_per_node=2 -m mkernel.bench.p2p``). ``--local`` runs the
same table on one GPU (an emulated world: rank 1's buffer is in the same memory), which shows each
primitive's rate per CTA where no link limits it; ``--save`` writes the JSON (p2p_w<W>[_local]).
"""

from __future__ import annotations

import torch

MODES = {
    "tile_send_bulk": 0,
    "reduce_add_bulk_f32": 1,
    "peer_store_v4": 2,
    "red_add_v4_f32": 3,
    "send_from_smem": 4,
    "ring_copy": 5,
    "ring_reduce_bf16": 6,
    "ring_reduce_f32": 7,
}


def transfer(
    src: torch.Tensor, dst_ptr: int, mode: str, ctas: int, chunk_bytes: int = 16384
) -> None:
    """Moves ``src`` (contiguous, 16-byte multiple) to address ``dst_ptr`` with primitive ``mode``
    on ``ctas`` CTAs (reduce modes add ``src``, read as fp32 or bf16, into the destination;
    ``send_from_smem`` sends tiles its CTAs loaded once: kernels/p2p.cu says which go where)."""
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
    from .timing import median_ms

    distributed = not world.emulated_world
    if distributed:
        import torch.distributed as dist
    n = mib << 20
    buf = world.symmetric(("bench", "p2p"), (n // 4,), torch.float32)
    src = torch.randn(n // 4, device=world.device)
    src_bf16 = torch.randn(n // 2, device=world.device).bfloat16()  # bf16 values, not fp32 bits
    peer = int(buf.peer_ptrs[1].item()) if world.size > 1 else buf.local.data_ptr()
    rows = []
    for mode in MODES:
        x = src_bf16 if "bf16" in mode else src
        for ctas in ctas_list:
            if distributed:
                dist.barrier()
            if world.rank == 0:
                fn = lambda i, x=x, mode=mode, ctas=ctas: transfer(x, peer, mode, ctas)
                ms = median_ms(fn, 1, iters, warmup=2)
                rows.append(
                    {"primitive": mode, "ctas": ctas, "mib": mib, "ms": ms, "gbps": n / ms / 1e6}
                )
            torch.cuda.synchronize()
    if distributed:
        dist.barrier()
    return rows


def main(argv: list[str]) -> None:
    import os

    import torch.distributed as dist

    import mkernel

    from .timing import save, table

    local = "--local" in argv
    if local:
        world = mkernel.World.emulated(2, device="cuda")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        world = mkernel.World.from_process_group()
    rows = bandwidth(world)
    if world.rank == 0:
        print(table(rows, ["primitive", "ctas", "mib", "ms", "gbps"]))
        if "--save" in argv or not local:
            print("saved", save(f"p2p_w{world.size}" + ("_local" if local else ""), rows))
    if not local:
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    from . import cli

    cli(
        __spec__.name,
        __doc__,
        {"--local": "one GPU, an emulated world", "--save": "write the JSON record"},
        torchrun="--local" not in sys.argv,
    )
    main(sys.argv[1:])
