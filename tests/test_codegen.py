"""One source for what Python and device code share: the generated headers are current, their
constants equal the Python ones (read back through the host compiler), the JIT refuses stale
headers, the hand-written index math of the device data movement equals the twins' on random plans,
and a kernel that breaks the template's hook contract fails to compile with a readable message."""

from __future__ import annotations

import dataclasses
import random
import shutil
import subprocess
from pathlib import Path

import pytest

import mkernel
from mkernel import codegen, jit
from mkernel import protocol as P
from mkernel.ops import gemm_rs as rs_mod

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("c++")
NVCC = jit.find_nvcc()


def test_generated_headers_are_current():
    assert codegen.stale(ROOT) == [], "run python -m mkernel.codegen"


def test_jit_refuses_stale_generated_headers(tmp_path):
    for rel in ("primitives", "templates", "kernels"):
        shutil.copytree(ROOT / rel, tmp_path / rel)
    spec = dataclasses.replace(jit.EXTENSION, root=str(tmp_path))
    jit._check_generated(spec)  # a faithful copy passes
    gen = tmp_path / "primitives/protocol_gen.h"
    gen.write_text(gen.read_text().replace("kTaskArgs = 4", "kTaskArgs = 5"))
    with pytest.raises(jit.BuildError, match="stale.*mkernel.codegen"):
        jit._check_generated(spec)


@pytest.mark.skipif(CXX is None, reason="no host C++ compiler")
def test_device_constants_equal_python(tmp_path):
    fields = {
        "kMaxLocalRanks": P.MAX_LOCAL_RANKS,
        "kMaxBarrierSlots": P.MAX_BARRIER_SLOTS,
        "kMaxPads": P.MAX_PADS,
        "kMaxSlots": P.MAX_SLOTS,
        "kMaxScalars": P.MAX_SCALARS,
        "kTaskArgs": P.TASK_ARGS,
        "kWaitFields": len(P.WAIT_FIELDS),
        "kRaiseFields": len(P.RAISE_FIELDS),
        "kRecordFields": len(P.RECORD_FIELDS),
        "(int)(sizeof(CommStatus) / sizeof(int))": len(P.STATUS_FIELDS),
        "kRoleComm": P.ROLES.index("comm"),
        "kRaiseAdd": P.RAISE_OPS.index("add"),
        "kInterSM": P.OVERLAPS.index("inter_sm"),
        "kWPeer": P.WAIT_FIELDS.index("peer"),
        "kWConsumers": P.WAIT_FIELDS.index("consumers"),
        "kRecTileConfig": P.RECORD["tile_config"],
        "kRecScalar0": P.RECORD["scalar0"],
        "kRecCommRaises": P.RECORD["comm_raises"],
        **{f"kTile{n}": i for n, i in P.TILE_CONFIG_IDS.items()},
    }
    prints = "".join(f'  std::printf("%d\\n", {expr});\n' for expr in fields)
    src = tmp_path / "consts.cpp"
    src.write_text(
        '#include <cstdio>\n#include "primitives/protocol_gen.h"\nusing namespace mk;\n'
        f"int main() {{\n{prints}}}\n"
    )
    exe = tmp_path / "consts"
    subprocess.run([CXX, "-std=c++17", f"-I{ROOT}", str(src), "-o", str(exe)], check=True)
    got = [int(x) for x in subprocess.run([exe], capture_output=True, text=True).stdout.split()]
    assert dict(zip(fields, got, strict=True)) == fields


def _host_binary(tmp_path: Path, name: str, body: str) -> Path:
    src = tmp_path / f"{name}.cu"
    src.write_text(body)
    exe = tmp_path / name
    cmd = [NVCC, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", f"-I{ROOT}", str(src)]
    subprocess.run([*cmd, "-o", str(exe)], check=True, capture_output=True, text=True)
    return exe


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_device_index_math_equals_the_twins(tmp_path):
    """gemm_rs's owned_offset and ag_gemm's chunk_span (host side of __host__ __device__ functions
    in the op's .cu) against the rectangles the twins write, on random plans."""
    exe = _host_binary(
        tmp_path,
        "index_math",
        '#include "kernels/gemm_rs.cu"\n#include "kernels/ag_gemm.cu"\n#include <cstdio>\n'
        "int main() {\n  char op;\n  int a, b, c, d, e;\n"
        '  while (std::scanf(" %c %d %d %d %d %d", &op, &a, &b, &c, &d, &e) == 6) {\n'
        "    if (op == 'r') { std::printf(\"%lld\\n\", mk::owned_offset(a, b, c, d, e)); }\n"
        "    else { mk::ChunkSpan s = mk::chunk_span(a, b, c, d, e);\n"
        '      std::printf("%d %d %d\\n", s.shard_row, s.gather_row, s.rows); }\n  }\n}\n',
    )
    rng = random.Random(7)
    queries, want = [], []
    for _ in range(12):
        W = rng.randint(1, 8)
        world = mkernel.World.emulated(W)
        tile = rng.choice(sorted(mkernel.TILE_CONFIGS))
        n = 8 * rng.randint(1, 80)
        sched = mkernel.Schedule(tile=tile, chunk_rows=rng.choice([None, 1, 7, 64]))
        rs = sched.plan("gemm_rs", world, m=W * rng.randint(1, 300), n=n, k=8 * W)
        ms = rs.sizes["rows_per_rank"]
        for t in rs.tiles:  # the twin's rectangle: (t.m0 - t.tag * ms, ..., t.n0, ...) of [ms, n]
            queries.append(f"r {t.m0} {t.n0} {t.tag} {ms} {n}")
            want.append(f"{(t.m0 - t.tag * ms) * n + t.n0}")
        ag = sched.plan("ag_gemm", world, m=W * rng.randint(1, 300), n=n, k=16)
        cr, C, ms = ag.sizes["chunk_rows"], ag.sizes["chunks"], ag.sizes["ms"]
        for r in range(W):
            for t in ag.roles["comm"].tasks[r]:
                g = t.args[0]
                r0 = (g - r * C) * cr  # as ag_gemm.twins_of computes it
                queries.append(f"a {g} {r} {C} {cr} {ms}")
                want.append(f"{r0} {r * ms + r0} {min(cr, ms - r0)}")
    out = subprocess.run([exe], input="\n".join(queries), capture_output=True, text=True).stdout
    assert out.split("\n")[: len(want)] == want


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_gemm_rs_nodes_stage_slot_equals_the_twin(tmp_path):
    """The stage slot each contribution lands in over several nodes (kernels/gemm_rs_nodes.cu
    rs_stage_slot against gemm_rs.stage_slot, which the interpreter's twins use), for every
    reducer, contributor and owner of every split of W <= 8 into N >= 2 nodes; and the slots a
    reducer reads are distinct and within its W - 1."""
    exe = _host_binary(
        tmp_path,
        "stage_slot",
        '#include "kernels/gemm_rs_nodes.cu"\n#include <cstdio>\n'
        "int main() {\n  int R, N, me, src, o;\n"
        '  while (std::scanf(" %d %d %d %d %d", &R, &N, &me, &src, &o) == 5)\n'
        '    std::printf("%d\\n", mk::rs_stage_slot(R, N, me, src, o));\n}\n',
    )
    queries, want = [], []
    for W in range(2, 9):
        for N in (n for n in range(2, W + 1) if W % n == 0):
            R = W // N
            for me in range(W):
                rails = [(me // R + j) % N * R + me % R for j in range(N)]  # me first
                slots = []
                for o in rails:  # what me reduces: its own rows, then for each rail peer's
                    senders = [me - me % R + (me % R + j) % R for j in range(1, R)]
                    if o == me:
                        senders += [q for q in rails if q != me]  # the other nodes' sums
                    for s in senders:
                        slots.append(rs_mod.stage_slot(R, N, me, s, o))
                        queries.append(f"{R} {N} {me} {s} {o}")
                        want.append(str(slots[-1]))
                assert sorted(slots) == list(range(W - 1))
                assert slots[: R + N - 2] == list(range(R + N - 2))  # the owner's run, in order
    out = subprocess.run([exe], input="\n".join(queries), capture_output=True, text=True).stdout
    assert out.split("\n")[: len(want)] == want


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_broken_hook_contract_fails_with_a_readable_message(tmp_path):
    src = (ROOT / "kernels/gemm_rs.cu").read_text().replace("comm_move(", "comm_mvoe(")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels/broken.cu").write_text(src)
    cmd = [NVCC, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", f"-I{ROOT}", "-c"]
    res = subprocess.run(
        [*cmd, str(tmp_path / "kernels/broken.cu"), "-o", str(tmp_path / "b.o")],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0
    assert "Op needs 'static __device__ void comm_move(" in res.stdout + res.stderr


def test_an_ops_constants_are_emitted_in_its_namespace():
    """OpSpec.constants reach the device side once, from the Python value (ring attention's tag
    layout: the plan packs with TAG_KEY, the kernel decodes with spec::ring_attention::kTagKey)."""
    from mkernel import codegen
    from mkernel.ops import ring_attention as ra

    text = codegen.layouts_header()
    ns = text[text.index("namespace ring_attention {") :]
    assert f"constexpr int kTagKey = {ra.TAG_KEY};" in ns[: ns.index("struct Layout")]
    assert ra.unpack_tag(ra.pack_tag(5, ra.STEP_MASK, True, False, True)) == (
        5, ra.STEP_MASK, True, False, True
    )  # fmt: skip
