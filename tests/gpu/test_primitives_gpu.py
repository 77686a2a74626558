"""The transfer primitives on the GPU: every mode lands exactly the right bytes (peer = another
rank's slice of an emulated world's symmetric buffer)."""

from __future__ import annotations

import pytest
import torch

import mkernel
from mkernel.bench.p2p import MODES, transfer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("ctas", [1, 3, 16])
@pytest.mark.parametrize("floats", [4, 1000, 4096 * 9 + 4])
def test_transfer_lands_the_data(mode, ctas, floats):
    world = mkernel.World.emulated(2, device="cuda")
    buf = world.symmetric(("test", "p2p", floats), (floats,), torch.float32)
    before = torch.randn(floats, device="cuda")
    buf.local[1].copy_(before)
    buf.local[0].fill_(float("nan"))  # the other rank's copy must stay untouched
    src = torch.randn(floats, device="cuda")
    transfer(src, int(buf.peer_ptrs[1].item()), mode, ctas)
    torch.cuda.synchronize()
    want = before + src if "add" in mode else src
    torch.testing.assert_close(buf.local[1], want, rtol=0, atol=0 if "add" not in mode else 1e-6)
    assert torch.isnan(buf.local[0]).all()


def test_bad_sizes_are_rejected_before_launch():
    src = torch.randn(5, device="cuda")  # 20 bytes: not a 16-byte multiple
    dst = torch.empty(8, device="cuda")
    with pytest.raises(ValueError, match="16-byte"):
        transfer(src, dst.data_ptr(), "tile_send_bulk", 1)
