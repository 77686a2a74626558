"""The transfer primitives on the GPU: every mode lands exactly the right bytes (peer = another
rank's slice of an emulated world's symmetric buffer)."""

from __future__ import annotations

import pytest
import torch

import mkernel
from mkernel.bench.p2p import MODES, transfer

pytestmark = pytest.mark.gpu


CHUNK_FLOATS = 4096  # transfer()'s default chunk: 16 KiB
RING_STAGES = 8  # kernels/p2p.cu kRingStages


def _sent_from_smem(src: torch.Tensor, before: torch.Tensor, ctas: int) -> torch.Tensor:
    """What send_from_smem leaves in dst (kernels/p2p.cu): CTA b's j-th chunk of dst (chunk
    b + j * ctas) gets the buffer j % stages, which CTA b filled from src chunk b * stages + j %
    stages; clipped to both chunks' sizes, nothing where that src chunk does not exist."""
    want = before.clone()
    n = src.numel()
    chunks = -(-n // CHUNK_FLOATS)
    for c in range(chunks):
        b, j = c % ctas, c // ctas
        f = b * RING_STAGES + j % RING_STAGES
        if f >= chunks:
            continue
        size = min(CHUNK_FLOATS, n - c * CHUNK_FLOATS, n - f * CHUNK_FLOATS)
        dst0, src0 = c * CHUNK_FLOATS, f * CHUNK_FLOATS
        want[dst0 : dst0 + size] = src[src0 : src0 + size]
    return want


@pytest.mark.parametrize("mode", [m for m in MODES if "bf16" not in m])
@pytest.mark.parametrize("ctas", [1, 3, 16])
@pytest.mark.parametrize("floats", [4, 1000, 4096 * 9 + 4, 4096 * 40 + 12])
def test_transfer_lands_the_data(mode, ctas, floats):
    world = mkernel.World.emulated(2, device="cuda")
    buf = world.symmetric(("test", "p2p", floats), (floats,), torch.float32)
    before = torch.randn(floats, device="cuda")
    buf.local[1].copy_(before)
    buf.local[0].fill_(float("nan"))  # the other rank's copy must stay untouched
    src = torch.randn(floats, device="cuda")
    transfer(src, int(buf.peer_ptrs[1].item()), mode, ctas)
    torch.cuda.synchronize()
    adds = "add" in mode or "reduce" in mode
    if mode == "send_from_smem":
        want = _sent_from_smem(src, before, ctas)
    else:
        want = before + src if adds else src
    torch.testing.assert_close(buf.local[1], want, rtol=0, atol=1e-6 if adds else 0)
    assert torch.isnan(buf.local[0]).all()


@pytest.mark.parametrize("ctas", [1, 3, 16])
@pytest.mark.parametrize("halves", [8, 2000, 8192 * 9 + 8, 8192 * 40 + 24])
def test_ring_reduce_bf16_adds_at_the_destination(ctas, halves):
    world = mkernel.World.emulated(2, device="cuda")
    buf = world.symmetric(("test", "p2p_bf16", halves), (halves // 2,), torch.float32)
    dst = buf.local[1].view(torch.bfloat16)
    before = torch.randn(halves, device="cuda").bfloat16()
    dst.copy_(before)
    buf.local[0].fill_(float("nan"))
    src = torch.randn(halves, device="cuda").bfloat16()
    transfer(src, int(buf.peer_ptrs[1].item()), "ring_reduce_bf16", ctas)
    torch.cuda.synchronize()
    want = before.float() + src.float()  # one bf16 rounding of the exact sum
    torch.testing.assert_close(dst.float(), want, rtol=2**-8, atol=1e-6)
    assert torch.isnan(buf.local[0]).all()


def test_bad_sizes_are_rejected_before_launch():
    src = torch.randn(5, device="cuda")  # 20 bytes: not a 16-byte multiple
    dst = torch.empty(8, device="cuda")
    with pytest.raises(ValueError, match="16-byte"):
        transfer(src, dst.data_ptr(), "tile_send_bulk", 1)
