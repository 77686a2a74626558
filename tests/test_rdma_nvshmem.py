"""The nvshmem transport's host side without a GPU (mkernel/rdma_nvshmem.py, nvshmem_ext.py): its
argument checks come before anything is launched, it refuses worlds it cannot serve before
NVSHMEM is touched, and the extension finds NVSHMEM (or says plainly that it is absent). The
transport itself runs on two GPUs: tests/distributed/check_rdma_nvshmem.py."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

import mkernel
from mkernel import nvshmem_ext
from mkernel.rdma_nvshmem import SYM_TAG, NvshmemTransport, check_exchange, peer_table
from mkernel.world import World

CPU = torch.device("cpu")


def _ok(**kw):
    args = dict(
        src=torch.zeros(64, dtype=torch.int32),
        device=CPU,
        puts=4,
        posters=2,
        op="set",
        receive="copy",
        timeout_s=1.0,
    )
    return args | kw


def test_a_valid_exchange_passes_its_checks():
    assert check_exchange(**_ok()) == 256


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(src="x"), "src must be a tensor"),
        (dict(src=torch.zeros(8, 8)[:, :4]), "contiguous"),
        (dict(puts=0), "puts must be an int >= 1"),
        (dict(puts=True), "puts must be an int"),
        (dict(posters=5), r"posters must be an int in \[1, puts=4\]"),
        (dict(posters=0), "posters"),
        (dict(op="xor"), "op must be"),
        (dict(receive="none"), "receive must be"),
        (dict(timeout_s=0), "timeout_s must be > 0"),
        (dict(puts=3), r"bytes per put \(256 / 3\)"),
        (dict(src=torch.zeros(4, dtype=torch.int32), puts=2), r"bytes per put \(16 / 2\)"),
        (dict(src=torch.zeros(0, dtype=torch.int32), puts=1, posters=1), "positive multiple"),
    ],
)
def test_bad_exchange_arguments_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        check_exchange(**_ok(**bad))


def test_only_a_distributed_world_of_several_nodes():
    # the checks come before NVSHMEM is loaded: no extension, no GPU needed
    with pytest.raises(ValueError, match="distributed world, one process per GPU"):
        NvshmemTransport(mkernel.World.emulated(2, nodes=2))
    one_node = World(size=2, device=torch.device("cuda", 0), kind="distributed", nodes=1, rank=0)
    with pytest.raises(ValueError, match="across nodes: the world has 1"):
        NvshmemTransport(one_node)


def _fake_nvshmem(base: Path) -> Path:
    (base / "include").mkdir(parents=True)
    (base / "lib").mkdir()
    (base / "include" / "nvshmem.h").write_text("")
    (base / "lib" / "libnvshmem_device.a").write_text("")
    (base / "lib" / "libnvshmem_host.so.3").write_text("")
    return base


def test_the_extension_finds_nvshmem_and_links_it(tmp_path, monkeypatch):
    home = _fake_nvshmem(tmp_path / "nvshmem")
    monkeypatch.setenv("MKERNEL_NVSHMEM_HOME", str(home))
    try:
        ext = importlib.reload(nvshmem_ext)
        assert ext.nvshmem_home() == home.absolute() and ext.ABSENT == ""
        spec = ext.SPEC
        assert spec.rdc and f"-I{home.absolute() / 'include'}" in spec.extra_cuda_flags
        libs = spec.extra_link_flags
        # the device library before the host one, the host one by its versioned file name
        assert libs.index("-lnvshmem_device") < libs.index("-l:libnvshmem_host.so.3")
        assert f"-L{home.absolute() / 'lib'}" in libs
    finally:
        monkeypatch.delenv("MKERNEL_NVSHMEM_HOME")
        importlib.reload(nvshmem_ext)


def test_without_nvshmem_the_transport_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("MKERNEL_NVSHMEM_HOME", str(tmp_path / "nowhere"))
    monkeypatch.setattr("sys.path", [str(tmp_path)])
    try:
        ext = importlib.reload(nvshmem_ext)
        assert ext.SPEC is None and "nvidia-nvshmem-cu13" in ext.ABSENT
        with pytest.raises(RuntimeError, match="needs NVSHMEM.*nvidia-nvshmem-cu13"):
            ext.load()
    finally:
        monkeypatch.undo()
        importlib.reload(nvshmem_ext)


# -- the fused ops over nodes in a distributed world (tests/distributed/check_nodes.py on GPUs) ----


def test_peer_tables_give_node_peers_nvlink_and_other_nodes_a_tagged_symmetric_address():
    ptr, W, R = 0x7F00_0000_0000, 8, 4
    nvlink = {r: 0x1000_0000_0000 * (r + 1) for r in range(W)}
    asked = []

    def peer_ptr(p, pe):
        asked.append(pe)
        assert p == ptr
        return nvlink[pe]

    table = peer_table(ptr, 5, W, R, peer_ptr)
    assert sorted(asked) == [4, 6, 7]  # only the node peers are looked up
    assert table[5] == ptr and [table[r] for r in (4, 6, 7)] == [nvlink[r] for r in (4, 6, 7)]
    for r in range(4):  # the other node: this rank's own address, tagged (kSymTag = bit 62)
        assert table[r] == ptr | SYM_TAG and table[r] & ~SYM_TAG == ptr
    assert SYM_TAG == 1 << 62 and ptr < SYM_TAG  # device addresses are far below the tag bit


def test_a_node_peer_without_an_nvlink_address_is_an_error():
    with pytest.raises(RuntimeError, match="rank 1 is in rank 0's node.*NVLink"):
        peer_table(0x1000, 0, 4, 2, lambda p, pe: 0)


def test_the_tag_is_the_device_headers():
    text = (Path(mkernel.__file__).parent.parent / "primitives/rdma/put_nvshmem.cuh").read_text()
    assert "kSymTag = 1ull << 62;" in text


def test_a_distributed_world_over_nodes_launches_from_the_nvshmem_extension(monkeypatch):
    from mkernel.runtime import gpu

    sentinel = object()
    monkeypatch.setattr(nvshmem_ext, "load", lambda: sentinel)
    monkeypatch.setattr(gpu, "extension", lambda: "package")

    class Plan:
        nodes = 2

    distributed = World(size=4, device=torch.device("cuda", 0), kind="distributed", nodes=2)
    assert gpu.launcher(distributed, Plan()) is sentinel
    emulated = World(size=4, device=torch.device("cuda", 0), kind="emulated", nodes=2)
    assert gpu.launcher(emulated, Plan()) == "package"  # the proxy transport's kernels
    Plan.nodes = 1
    assert (
        gpu.launcher(World(size=4, device=torch.device("cuda", 0), kind="distributed"), Plan())
        == "package"
    )


def test_the_nvshmem_extension_builds_every_plan_over_nodes(tmp_path, monkeypatch):
    from mkernel.runtime import registry

    home = _fake_nvshmem(tmp_path / "nvshmem")
    monkeypatch.setenv("MKERNEL_NVSHMEM_HOME", str(home))
    try:
        spec = importlib.reload(nvshmem_ext).SPEC
        names = registry.nodes_kernel_names()
        assert names == ["ag_gemm_nodes", "gemm_ar_nodes", "gemm_rs_nodes"]
        assert all(f"kernels/{n}.cu" in spec.sources for n in names)
        assert ("MK_RDMA_NVSHMEM", "1") in spec.defines
        gen = (Path(mkernel.__file__).parent.parent / "primitives/protocol_gen.h").read_text()
        assert "#define MK_NODES_OPS(X) " + " ".join(f"X({n})" for n in names) in gen
    finally:
        monkeypatch.delenv("MKERNEL_NVSHMEM_HOME")
        importlib.reload(nvshmem_ext)


class _FakeNvshmem:
    """What NvshmemTransport asks of _mkernel_nvshmem, with NVSHMEM already up as PE 1 of 4."""

    def __init__(self) -> None:
        self.finalized = 0

    def initialized(self) -> bool:
        return True

    def my_pe(self) -> int:
        return 1

    def n_pes(self) -> int:
        return 4

    def free(self, ptr: int) -> None:
        pass

    def finalize(self) -> None:
        self.finalized += 1


def test_transports_of_one_process_share_nvshmem_and_the_last_one_finalizes(monkeypatch):
    import mkernel.rdma_nvshmem as rn

    monkeypatch.setattr(rn, "StatusBlock", lambda: None)  # pinned memory needs CUDA
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(rn, "_USERS", 0)
    ext = _FakeNvshmem()
    world = World(size=4, device=torch.device("cuda", 0), kind="distributed", nodes=2, rank=1)
    first, second = NvshmemTransport(world, ext=ext), NvshmemTransport(world, ext=ext)
    first.close()
    first.close()  # closing twice counts once
    assert ext.finalized == 0
    second.close()
    assert ext.finalized == 1
    other = World(size=4, device=torch.device("cuda", 0), kind="distributed", nodes=2, rank=2)
    with pytest.raises(ValueError, match="PE 1 of 4 in this process.*rank 2"):
        NvshmemTransport(other, ext=ext)


def test_a_distributed_world_over_nodes_takes_its_buffers_from_nvshmem(monkeypatch):
    import mkernel.rdma_nvshmem as rn

    made = []

    def fake_buffer(world, shape, dtype):
        made.append((world.nodes, shape, dtype))
        return mkernel.world.SymBuffer(local=torch.zeros(shape, dtype=dtype), peer_ptrs=None)

    monkeypatch.setattr(rn, "world_buffer", fake_buffer)
    world = World(size=4, device=torch.device("cuda", 0), kind="distributed", nodes=2, rank=1)
    buf = world.symmetric(("op", "stage"), (3, 5), torch.float32)
    assert made == [(2, (3, 5), torch.float32)] and buf.local.shape == (3, 5)
    assert world.symmetric(("op", "stage"), (3, 5), torch.float32) is buf  # cached, not remade


def test_shutdown_makes_the_worlds_forget_their_nvshmem_buffers(monkeypatch):
    import mkernel.rdma_nvshmem as rn

    closed = []

    class Transport:
        def close(self):
            closed.append(True)

    world = World(size=2, device=torch.device("cuda", 0), kind="distributed", nodes=2)
    world._buffers[("op", "x")] = "freed by the shutdown"
    world._plans[("op",)] = "its record points at them"
    monkeypatch.setattr(rn, "_TRANSPORT", Transport())
    rn._WORLDS.add(world)
    rn.shutdown()
    assert closed == [True] and rn._TRANSPORT is None
    assert world._buffers == {} and world._plans == {} and len(rn._WORLDS) == 0


def test_symmetric_buffers_grow_by_name_and_close_frees_every_allocation(monkeypatch):
    import mkernel.rdma_nvshmem as rn

    class Ext(_FakeNvshmem):
        def __init__(self) -> None:
            super().__init__()
            self.live: list[int] = []
            self.next = 0x1000

        def malloc(self, nbytes: int) -> int:
            self.next += 0x1000
            self.live.append(self.next)
            return self.next

        def free(self, ptr: int) -> None:
            self.live.remove(ptr)

    monkeypatch.setattr(rn, "StatusBlock", lambda: None)
    monkeypatch.setattr(rn, "_USERS", 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    monkeypatch.setattr(
        rn.NvshmemTransport, "_view", lambda self, p, n: torch.ones(n, dtype=torch.uint8)
    )
    monkeypatch.setattr(rn.NvshmemTransport, "barrier", lambda self: None)
    ext = Ext()
    world = World(size=4, device=torch.device("cuda", 0), kind="distributed", nodes=2, rank=1)
    nv = NvshmemTransport(world, ext=ext)
    p1, v1 = nv.symmetric("dst", 64)
    assert not v1.any()  # zeroed before any peer may put into it
    assert nv.symmetric("dst", 32)[0] == p1  # big enough: kept
    p2, v2 = nv.symmetric("dst", 128)  # grown: the old one freed
    assert p2 != p1 and ext.live == [p2] and v2.numel() == 128 and not v2.any()
    p3, v3 = nv.allocate(16)
    assert ext.live == [p2, p3] and not v3.any()
    nv.close()
    assert ext.live == [] and ext.finalized == 1
