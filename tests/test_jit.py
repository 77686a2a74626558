"""The JIT build: cache key, cache folder safety, build/load/reuse, races, and build errors."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import stat
from pathlib import Path

import pytest

from mkernel import jit

HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
needs_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="nvcc not installed")

TINY_CU = """\
#include "primitives/tiny.cuh"
__global__ void tiny_kernel(int* out) { *out = tiny_add(1, 2); }
int tiny_launch(int* out) { tiny_kernel<<<1, 1>>>(out); return 0; }
int add_impl(int a, int b) { return tiny_add(a, b); }
"""
TINY_CUH = "#pragma once\n__host__ __device__ inline int tiny_add(int a, int b) { return a + b; }\n"
BINDING = """\
#include <pybind11/pybind11.h>
int add_impl(int a, int b);
PYBIND11_MODULE(_tiny_ext, m) { m.def("add", &add_impl); }
"""


def _tiny_root(base: Path, cu: str = TINY_CU) -> Path:
    """Write a source root shaped like the repo's: kernels/ and primitives/."""
    (base / "kernels").mkdir(parents=True)
    (base / "primitives").mkdir()
    (base / "kernels" / "tiny.cu").write_text(cu)
    (base / "kernels" / "binding.cpp").write_text(BINDING)
    (base / "primitives" / "tiny.cuh").write_text(TINY_CUH)
    return base


def _spec(root: Path, **kw: object) -> jit.ExtensionSpec:
    fields: dict = dict(
        name="_tiny_ext",
        sources=("kernels/*.cu", "kernels/*.cpp"),
        headers=("primitives/**/*.cuh",),
        root=str(root),
    )
    return jit.ExtensionSpec(**(fields | kw))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(path))
    monkeypatch.delenv("MKERNEL_NO_BUILD", raising=False)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[jit.ExtensionSpec, Path]:
    """One tiny extension built once, shared by the tests that only load it."""
    if not HAS_NVCC:
        pytest.skip("nvcc not installed")
    base = tmp_path_factory.mktemp("built")
    spec, cache = _spec(_tiny_root(base / "src")), base / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MKERNEL_CACHE_DIR", str(cache))
        jit.load(spec)
    return spec, cache


# ----------------------------------------------------------------------------- key


def test_key_follows_bytes_not_mtimes(tmp_path: Path) -> None:
    spec = _spec(_tiny_root(tmp_path))
    header = tmp_path / "primitives" / "tiny.cuh"
    key = jit.cache_key(spec)
    os.utime(header, (1_000_000, 1_000_000))
    assert jit.cache_key(spec) == key
    header.write_bytes(header.read_bytes().replace(b"a + b", b"a - b"))
    assert jit.cache_key(spec) != key


def test_key_follows_defines_arch_and_flags(tmp_path: Path) -> None:
    spec = _spec(_tiny_root(tmp_path))
    keys = {
        jit.cache_key(spec),
        jit.cache_key(_spec(tmp_path, defines=(("BLOCK_M", "128"),))),
        jit.cache_key(_spec(tmp_path, arch="sm_100a")),
        jit.cache_key(_spec(tmp_path, extra_cuda_flags=("-G",))),
    }
    assert len(keys) == 4


def test_key_ignores_where_the_root_lies(tmp_path: Path) -> None:
    a = jit.cache_key(_spec(_tiny_root(tmp_path / "a")))
    b = jit.cache_key(_spec(_tiny_root(tmp_path / "b")))
    assert a == b  # so a cache carried to another machine still hits


# ----------------------------------------------------------------------------- cache folder


def test_cache_dir_is_private(cache: Path) -> None:
    assert jit.cache_dir() == cache
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_cache_dir_defaults_under_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MKERNEL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jit.cache_dir() == tmp_path / "xdg" / "mkernel"


def test_world_writable_cache_is_refused(cache: Path, tmp_path: Path) -> None:
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o777)
    with pytest.raises(PermissionError, match="writable by group or others"):
        jit.cache_dir()
    with pytest.raises(PermissionError):
        jit.load(_spec(_tiny_root(tmp_path / "src")))


def test_no_build_with_empty_cache_raises(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MKERNEL_NO_BUILD", "1")
    with pytest.raises(jit.BuildError, match="MKERNEL_NO_BUILD=1"):
        jit.load(_spec(_tiny_root(tmp_path / "src")))
    assert not [p for p in cache.iterdir() if p.name.startswith("_tiny_ext")]


# ----------------------------------------------------------------------------- build and load


@needs_nvcc
def test_tiny_extension_builds_and_runs(built: tuple[jit.ExtensionSpec, Path]) -> None:
    spec, cache = built
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MKERNEL_CACHE_DIR", str(cache))
        assert jit.load(spec).add(2, 3) == 5
    folders = [p for p in cache.iterdir() if p.name.startswith("_tiny_ext-")]
    assert [p.name for p in folders] == [f"_tiny_ext-{jit.cache_key(spec)[:16]}"]
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp")]


@needs_nvcc
def test_second_load_does_not_rebuild(
    built: tuple[jit.ExtensionSpec, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, cache = built
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(cache))
    first = jit.load(spec)
    assert jit.load(spec) is first  # memoised in-process
    so = next(cache.glob("_tiny_ext-*/_tiny_ext*"))
    mtime = so.stat().st_mtime_ns

    def no_build(*args: object) -> None:
        raise AssertionError("rebuilt although the cache holds the module")

    monkeypatch.setattr(jit, "_build", no_build)
    monkeypatch.setattr(jit, "_LOADED", {})  # as a fresh process would start
    monkeypatch.setenv("MKERNEL_NO_BUILD", "1")
    assert jit.load(spec).add(20, 22) == 42
    assert so.stat().st_mtime_ns == mtime


def _race_child(spec: jit.ExtensionSpec, cache: str, barrier: object) -> None:
    os.environ["MKERNEL_CACHE_DIR"] = cache
    barrier.wait()  # type: ignore[attr-defined]
    assert jit.load(spec).add(2, 3) == 5


@needs_nvcc
def test_concurrent_builds_both_succeed(cache: Path, tmp_path: Path) -> None:
    # A define no other test uses gives a fresh key, so both processes really build.
    spec = _spec(_tiny_root(tmp_path / "src"), defines=(("MKERNEL_RACE", "1"),))
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_race_child, args=(spec, str(cache), barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(list(cache.glob("_tiny_ext-*"))) == 1
    assert not list(cache.glob(".tmp*"))  # the loser's folder was discarded


@needs_nvcc
def test_syntax_error_names_the_file(cache: Path, tmp_path: Path) -> None:
    root = _tiny_root(tmp_path / "src", cu="__global__ void broken( { }\n")
    spec = _spec(root, sources=("kernels/tiny.cu",))  # skip the slow binding: fail fast
    with pytest.raises(jit.BuildError, match="kernels/tiny.cu") as info:
        jit.load(spec)
    assert info.value.command is not None and "nvcc" in info.value.command
    assert "error" in info.value.output
    assert not list(cache.glob(".tmp*"))


# ----------------------------------------------------------------------------- compile check


@needs_nvcc
def test_compile_check_reports_only_the_broken_header(tmp_path: Path) -> None:
    root = _tiny_root(tmp_path)
    (root / "templates").mkdir()
    (root / "templates" / "bad.cuh").write_text("#pragma once\nint f() { return undefined_x; }\n")
    (root / "kernels" / "binding.cpp").unlink()  # its pybind11 compile is slow and not tested here
    failures = jit.compile_check(root=root, spec=_spec(root))
    assert failures == ["templates/bad.cuh"]


def test_compile_check_covers_every_built_source_and_header(tmp_path: Path) -> None:
    root = _tiny_root(tmp_path)
    labels = [label for label, _ in jit._check_targets(_spec(root), root, None)]
    assert labels == ["kernels/binding.cpp", "kernels/tiny.cu", "primitives/tiny.cuh"]
    # The package's own extension: every translation unit the build compiles (.cpp included) and
    # every header it hashes, each checked once.
    real = jit.source_root()
    labels = [label for label, _ in jit._check_targets(jit.EXTENSION, real, None)]
    assert len(labels) == len(set(labels))
    sources = jit._source_files(jit.EXTENSION)
    assert [s for s in sources if s.endswith(".cpp")], sources
    headers = set(jit._glob(real, jit.EXTENSION.headers)) - set(jit.EXTERNAL_HEADERS)
    assert set(sources) | headers <= set(labels)
    # the headers of a library found at run time: checked with their extension's flags only
    assert not set(jit.EXTERNAL_HEADERS) & set(labels)


@needs_nvcc
def test_compile_check_reports_a_broken_cpp_source(tmp_path: Path) -> None:
    root = _tiny_root(tmp_path)
    # A copy of the binding with a syntax error planted; the intact binding must pass, which needs
    # the build's pybind11 and Python include flags.
    (root / "kernels" / "broken.cpp").write_text(BINDING + "int broken( {\n")
    results = dict(jit._iter_check(None, root, _spec(root)))  # what compile_check and --check run
    assert [label for label, err in results.items() if err] == ["kernels/broken.cpp"]
    err = results["kernels/broken.cpp"]
    assert "broken.cpp" in err and "error" in err and "pybind11" in err  # names file and command


# ----------------------------------------------------------------------------- rdc and libraries

RDC_CALLER = """\
__device__ int twice(int x);  // defined in the other unit: links only with -rdc
__global__ void caller(int* out) { *out = twice(*out); }
int lib_add(int a, int b);    // from the static library named in extra_link_flags
// (the kernel is referenced, never launched: the test may run beside a GPU)
int add_impl(int a, int b) { return lib_add(a, b) + (caller != nullptr ? 0 : 1); }
"""
RDC_CALLEE = "__device__ int twice(int x) { return 2 * x; }\n"


@needs_nvcc
def test_rdc_extension_links_across_units_and_a_static_library(cache: Path, tmp_path: Path) -> None:
    """ExtensionSpec(rdc=True): a kernel calling a __device__ function of another unit links (nvcc's
    device link), and a static library of extra_link_flags, named after the objects, resolves."""
    import subprocess

    root = _tiny_root(tmp_path / "src", cu=RDC_CALLER)
    (root / "kernels" / "callee.cu").write_text(RDC_CALLEE)
    # NOTE: its own module name: a process imports one extension module per name
    (root / "kernels" / "binding.cpp").write_text(BINDING.replace("_tiny_ext", "_tiny_rdc"))
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "add.cpp").write_text("int lib_add(int a, int b) { return a + b + 100; }\n")
    obj = lib / "add.o"
    subprocess.run(["g++", "-fPIC", "-c", str(lib / "add.cpp"), "-o", str(obj)], check=True)
    subprocess.run(["ar", "rcs", str(lib / "libtinyadd.a"), str(obj)], check=True)
    libs = (f"-L{lib}", "-ltinyadd")
    spec = _spec(root, name="_tiny_rdc", rdc=True, extra_link_flags=libs)
    assert jit.load(spec).add(2, 3) == 105
    without = _spec(root, name="_tiny_rdc", rdc=False, extra_link_flags=libs)
    with pytest.raises(jit.BuildError):  # the device call cannot link without -rdc
        jit.load(without)


def test_key_follows_rdc_and_link_libraries(tmp_path: Path) -> None:
    root = _tiny_root(tmp_path / "src")
    keys = {
        jit.cache_key(_spec(root)),
        jit.cache_key(_spec(root, rdc=True)),
        jit.cache_key(_spec(root, extra_link_flags=("-lm",))),
    }
    assert len(keys) == 3
