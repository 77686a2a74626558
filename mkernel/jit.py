"""Just-in-time build of the device code into one pybind11 extension, cached on disk.

Contract (``load``): hash every input into a key; try to import ``<cache>/<name>-<key16>/``; on a
miss build it with ninja + nvcc into a fresh temporary folder inside the cache and publish it with
one atomic ``os.rename``. Ranks that race all build, the first rename wins, the others discard their
copy and import the winner's. ``MKERNEL_NO_BUILD=1`` turns a miss into an error.

The cache folder is private (0700). A module is only imported from folders that the current user
owns and nobody else can write, because importing a module runs its code.

``python -m mkernel.jit --check`` compile-checks, with nvcc and no GPU, every source the build
compiles (the spec's .cu and .cpp files, with the build's own flags: pybind11 and Python includes)
and every header alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import errno
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from mkernel import codegen
from mkernel._paths import source_root
from mkernel.runtime import registry

__all__ = [
    "main_extension",
    "BuildError",
    "ExtensionSpec",
    "cache_dir",
    "cache_key",
    "compile_check",
    "find_nvcc",
    "load",
]

# Bump when the build recipe below changes in a way the key would not otherwise see.
_RECIPE_VERSION = "1"
_SOURCE_SUFFIXES = (".cu", ".cpp", ".cc")
# Headers the compile check covers besides the spec's own (which the cache key hashes).
_HEADER_GLOBS = (
    "primitives/**/*.cuh",
    "primitives/**/*.h",
    "templates/**/*.cuh",
    "templates/**/*.h",
)
_TAIL_CHARS = 4000


@dataclass(frozen=True)
class ExtensionSpec:
    """What to build: sources and headers are globs relative to the source root."""

    name: str
    sources: tuple[str, ...]
    headers: tuple[str, ...] = ()  # hashed only: they are reached through #include
    defines: tuple[tuple[str, str], ...] = ()
    arch: str = "sm_90a"
    extra_cuda_flags: tuple[str, ...] = ()
    root: str | None = None  # None: mkernel._paths.source_root()
    # relocatable device code, linked with a device library (NVSHMEM's device calls live in
    # libnvshmem_device.a): -rdc=true on every unit, and nvcc's device link at the link step
    rdc: bool = False
    extra_link_flags: tuple[str, ...] = ()


def _fused_op_sources() -> tuple[str, ...]:
    """kernels/<op>.cu of every fused op (mkernel/runtime/registry.py: the registered ops)."""
    return tuple(f"kernels/{name}.cu" for name in registry.kernel_names())


# The headers every source of the package's extension may include (a change to one rebuilds it).
MAIN_HEADERS = (
    "primitives/**/*.cuh",
    "primitives/**/*.h",
    "templates/**/*.cuh",
    "kernels/**/*.h",
    "kernels/**/*.cuh",
)


@functools.cache
def main_extension() -> ExtensionSpec:
    """The package's extension (``EXTENSION``). Built on first use, not at import: its sources
    come from the op registry, complete once the ops are imported (importing mkernel imports
    them), which happens after this module is imported."""
    return ExtensionSpec(
        name="_mkernel_ext",
        # NOTE: listed, not globbed: a fused op's kernel joins the extension when its Python
        # module declares a SPEC (the binding binds every op of MK_FUSED_OPS, generated from the
        # same list), and a half-written kernel elsewhere in kernels/ cannot break the build.
        sources=(
            "kernels/binding.cpp",
            "kernels/gemm.cu",
            "kernels/gemm_binding.cpp",
            "kernels/grouped_gemm.cu",
            "kernels/p2p.cu",
            "kernels/poison.cu",
            *_fused_op_sources(),
        ),
        headers=MAIN_HEADERS,
    )


def __getattr__(name: str) -> ExtensionSpec:  # ``jit.EXTENSION``, resolved on first use
    if name == "EXTENSION":
        return main_extension()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Extensions built apart from EXTENSION, by the module that declares their SPEC: `--check` compiles
# their sources too. NOTE: module names, imported on use (those modules import this one).
SEPARATE_EXTENSIONS = (
    "mkernel.attention_ext",
    "mkernel.rdma_ext",
    "mkernel.nvshmem_ext",
    "mkernel.taskgraph.kernel_ext",  # the TaskGraph kernel (_mkernel_taskgraph)
)
# Headers that need a library found at run time (NVSHMEM): never checked alone with the main
# extension's flags; checked with their extension's when it has a SPEC (the library was found).
# (header -> the extension whose flags find the library)
EXTERNAL_HEADERS = {"primitives/rdma/put_nvshmem.cuh": "_mkernel_nvshmem"}


def _external_headers(spec: ExtensionSpec) -> set[str]:
    return {h for h, name in EXTERNAL_HEADERS.items() if name == spec.name}


def _separate_specs() -> list[ExtensionSpec]:
    """The separate extensions' specs; one whose library is absent here has SPEC None (and says
    why in its ABSENT)."""
    specs = [importlib.import_module(m).SPEC for m in SEPARATE_EXTENSIONS]
    return [s for s in specs if s is not None]


def _absent_notices() -> list[str]:
    mods = [importlib.import_module(m) for m in SEPARATE_EXTENSIONS]
    return [f"NOTICE: {m.ABSENT}: its sources are not checked" for m in mods if m.SPEC is None]


class BuildError(RuntimeError):
    """A compile or link step failed, or building is forbidden (``MKERNEL_NO_BUILD=1``)."""

    def __init__(self, message: str, command: str | None = None, output: str = "") -> None:
        super().__init__(message)
        self.command = command
        self.output = output


# ----------------------------------------------------------------------------- tools


def find_nvcc() -> str | None:
    """Return the nvcc to use: ``$CUDA_HOME/bin/nvcc``, ``/usr/local/cuda/bin/nvcc``, then PATH."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for path in candidates:
        if os.access(path, os.X_OK):
            return str(path)
    return shutil.which("nvcc")


def _require_nvcc() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found: set CUDA_HOME, or put nvcc on PATH")
    return nvcc


def _find_ninja() -> str:
    try:
        import ninja  # the pip package ships its own binary; prefer it to whatever PATH has

        exe = Path(ninja.BIN_DIR) / "ninja"
        if os.access(exe, os.X_OK):
            return str(exe)
    except (ImportError, AttributeError):
        pass
    exe = shutil.which("ninja")
    if exe is None:
        raise BuildError("ninja not found: pip install ninja")
    return exe


@functools.cache
def _nvcc_version(nvcc: str | None) -> str:
    if nvcc is None:
        return "nvcc: absent"
    proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
    return proc.stdout + proc.stderr


def _pybind11_include() -> list[str]:
    try:
        import pybind11
    except ImportError:  # the compile check of device code does not need it
        return []
    return [f"-I{pybind11.get_include()}"]


def _pybind11_version() -> str:
    try:
        import pybind11
    except ImportError:
        return "pybind11: absent"
    return pybind11.__version__


def _ext_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


# ----------------------------------------------------------------------------- cache folder


def _check_private(path: Path) -> None:
    """Refuse a path another user owns or can write: we are about to import code from it."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        raise PermissionError(f"mkernel cache: {path} is a symbolic link; refusing to use it")
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"mkernel cache: {path} is owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); "
            "point MKERNEL_CACHE_DIR at a folder of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"mkernel cache: {path} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}); fix it with `chmod go-w {shlex.quote(str(path))}`"
        )


def cache_dir() -> Path:
    """Return the private cache folder, creating it with mode 0700.

    ``$MKERNEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/mkernel``, else ``~/.cache/mkernel``.
    Raises PermissionError if it is owned by someone else or writable by group or others.
    """
    if os.environ.get("MKERNEL_CACHE_DIR"):
        path = Path(os.environ["MKERNEL_CACHE_DIR"])
    elif os.environ.get("XDG_CACHE_HOME"):
        path = Path(os.environ["XDG_CACHE_HOME"]) / "mkernel"
    else:
        path = Path.home() / ".cache" / "mkernel"
    path = path.expanduser().absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask; state it exactly
    except FileExistsError:
        pass  # an existing folder is checked, never silently re-moded
    _check_private(path)
    return path


# ----------------------------------------------------------------------------- hashing


def _root(spec: ExtensionSpec) -> Path:
    return Path(spec.root).absolute() if spec.root is not None else source_root()


def _glob(root: Path, patterns: Sequence[str]) -> list[str]:
    """Expand globs to sorted, de-duplicated file paths relative to root (posix form)."""
    found: set[str] = set()
    for pattern in patterns:
        for path in root.glob(pattern):
            if path.is_file():
                found.add(path.relative_to(root).as_posix())
    return sorted(found)


def _source_files(spec: ExtensionSpec, root: Path | None = None) -> list[str]:
    """The translation units the build compiles, relative to the root (default: the spec's)."""
    root = root if root is not None else _root(spec)
    return [p for p in _glob(root, spec.sources) if p.endswith(_SOURCE_SUFFIXES)]


def _arch_number(arch: str) -> str:
    if not arch.startswith("sm_"):
        raise ValueError(f"arch must look like 'sm_90a', got {arch!r}")
    return arch[len("sm_") :]


def _compile_flags(spec: ExtensionSpec, root: Path) -> list[str]:
    """Flags shared by every translation unit (nvcc compiles the .cpp files too)."""
    flags = ["-std=c++17", "-O3", _gencode(spec)]
    flags += ["--expt-relaxed-constexpr", "-lineinfo", "-Xcompiler", "-fPIC"]
    # NOTE: pybind11 wants hidden visibility so two extensions never share symbols by accident.
    flags += ["-Xcompiler", "-fvisibility=hidden"]
    flags += [f"-I{root}", *_pybind11_include(), f"-I{sysconfig.get_paths()['include']}"]
    flags += [f"-D{k}={v}" if v != "" else f"-D{k}" for k, v in spec.defines]
    flags += ["-rdc=true"] if spec.rdc else []
    return flags + list(spec.extra_cuda_flags)


def _gencode(spec: ExtensionSpec) -> str:
    num = _arch_number(spec.arch)
    return f"-gencode=arch=compute_{num},code=sm_{num}"


def _link_flags(spec: ExtensionSpec) -> list[str]:
    # Static cudart keeps the module free of a runtime-library version dependency; no libcuda, no
    # torch: tensors cross the boundary as raw pointers. rdc: nvcc's device link needs the arch.
    flags = ["-shared", "-cudart", "static"]
    return flags + (["-rdc=true", _gencode(spec)] if spec.rdc else [])


def cache_key(spec: ExtensionSpec) -> str:
    """Return the sha256 hex digest of every input of the build (never of mtimes)."""
    root = _root(spec)
    h = hashlib.sha256()

    def feed(tag: str, data: bytes) -> None:
        # Length-prefixed so that no two different inputs concatenate to the same stream.
        h.update(f"{tag}:{len(data)}:".encode())
        h.update(data)

    feed("recipe", _RECIPE_VERSION.encode())
    feed("name", spec.name.encode())
    for rel in sorted(set(_glob(root, spec.sources)) | set(_glob(root, spec.headers))):
        feed("path", rel.encode())
        feed("bytes", (root / rel).read_bytes())
    feed("defines", repr(tuple(spec.defines)).encode())
    feed("flags", repr(tuple(spec.extra_cuda_flags)).encode())
    feed("link", repr(tuple(_link_flags(spec))).encode())
    if spec.extra_link_flags:  # (fed only when set: the other extensions' keys stay as they were)
        feed("libs", repr(tuple(spec.extra_link_flags)).encode())
    feed("arch", spec.arch.encode())
    feed("nvcc", _nvcc_version(find_nvcc()).encode())
    feed("ext_suffix", _ext_suffix().encode())
    feed("pybind11", _pybind11_version().encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- build


def _ninja_path(path: str) -> str:
    """Escape a path for a ninja build line."""
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _ninja_cmd(args: Sequence[str]) -> str:
    """Quote arguments for /bin/sh and escape them for a ninja variable."""
    return " ".join(shlex.quote(a) for a in args).replace("$", "$$")


def _object_name(rel: str) -> str:
    return "obj/" + rel.replace("/", "__") + ".o"


def _write_ninja(spec: ExtensionSpec, build: Path, sources: list[str]) -> dict[str, str]:
    """Write build.ninja; return {ninja output: source path relative to the root}."""
    root = _root(spec)
    target = spec.name + _ext_suffix()
    outputs = {_object_name(rel): rel for rel in sources}
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {_ninja_cmd([_require_nvcc()])}",
        f"cflags = {_ninja_cmd(_compile_flags(spec, root))}",
        f"ldflags = {_ninja_cmd(_link_flags(spec))}",
        f"ldlibs = {_ninja_cmd(spec.extra_link_flags)}",
        "rule compile",
        "  command = $nvcc $cflags -c $in -o $out",
        "  description = nvcc $in",
        "rule link",
        "  command = $nvcc $ldflags $in $ldlibs -o $out",
        "  description = link $out",
    ]
    for obj, rel in outputs.items():
        lines.append(f"build {_ninja_path(obj)}: compile {_ninja_path(str(root / rel))}")
    objs = " ".join(_ninja_path(o) for o in outputs)
    lines += [f"build {_ninja_path(target)}: link {objs}", f"default {_ninja_path(target)}", ""]
    (build / "build.ninja").write_text("\n".join(lines))
    return outputs | {target: target}


def _failure(spec: ExtensionSpec, output: str, outputs: dict[str, str]) -> BuildError:
    """Turn ninja's log into a BuildError naming the failing file and its command."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("FAILED:"):
            what = outputs.get(line.split()[-1], line.split()[-1])
            command = lines[i + 1] if i + 1 < len(lines) else None
            tail = "\n".join(lines[i + 2 :])[-_TAIL_CHARS:]
            msg = f"building {spec.name}: {what} failed\ncommand: {command}\n{tail}"
            return BuildError(msg, command=command, output=tail)
    return BuildError(f"building {spec.name}: ninja failed\n{output[-_TAIL_CHARS:]}", output=output)


def _build(spec: ExtensionSpec, final: Path, verbose: bool) -> None:
    """Build into a temporary folder inside the cache, then publish it with one rename."""
    sources = _source_files(spec)
    if not sources:
        raise BuildError(f"building {spec.name}: no sources match {spec.sources} in {_root(spec)}")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        outputs = _write_ninja(spec, tmp, sources)
        t0 = time.perf_counter()
        cmd = [_find_ninja(), "-C", str(tmp)] + (["-v"] if verbose else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if verbose:
            print(proc.stdout + proc.stderr, file=sys.stderr)
        if proc.returncode != 0:
            raise _failure(spec, proc.stdout + proc.stderr, outputs)
        if verbose:
            print(
                f"mkernel.jit: built {final.name} in {time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
            )
        shutil.rmtree(tmp / "obj", ignore_errors=True)
        # NOTE: the linker honours the umask; a umask of 002 would leave the module group-writable
        # and _try_load would then (rightly) refuse it.
        os.chmod(tmp / (spec.name + _ext_suffix()), 0o755)
        _publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, final: Path) -> None:
    try:
        os.rename(tmp, final)
    except OSError as exc:
        # Another rank renamed its identical build first: theirs is as good as ours.
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not final.is_dir():
            raise


# ----------------------------------------------------------------------------- load

_LOADED: dict[str, ModuleType] = {}
_LOCK = threading.Lock()


def _try_load(spec: ExtensionSpec, folder: Path) -> ModuleType | None:
    so = folder / (spec.name + _ext_suffix())
    if not so.is_file():
        return None
    _check_private(folder)
    _check_private(so)
    loader = importlib.machinery.ExtensionFileLoader(spec.name, str(so))
    mspec = importlib.util.spec_from_file_location(spec.name, so, loader=loader)
    assert mspec is not None
    module = importlib.util.module_from_spec(mspec)
    loader.exec_module(module)
    return module


def cached_loader(spec: ExtensionSpec) -> Callable[[], ModuleType]:
    """A ``load()`` of ``spec`` for the per-call paths of a separately built extension: built or
    imported on the first call, then kept (``load`` hashes every source: milliseconds of host time
    that a per-call path cannot afford)."""
    return functools.cache(lambda: load(spec))


def load(spec: ExtensionSpec | None = None, *, verbose: bool = False) -> ModuleType:
    """Return the built extension for ``spec``, building it on a cache miss.

    Raises BuildError on a compile error, on a miss when ``MKERNEL_NO_BUILD=1``, or when the
    generated headers (``python -m mkernel.codegen``) no longer match the Python declarations.
    """
    spec = spec or main_extension()
    _check_generated(spec)
    key = cache_key(spec)
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
        final = cache_dir() / f"{spec.name}-{key[:16]}"
        module = _try_load(spec, final)
        if module is None:
            if os.environ.get("MKERNEL_NO_BUILD") == "1":
                raise BuildError(
                    f"{spec.name} (key {key[:16]}) is not in the cache {final.parent} and "
                    "MKERNEL_NO_BUILD=1 forbids building it"
                )
            _build(spec, final, verbose)
            module = _try_load(spec, final)
            if module is None:
                raise BuildError(
                    f"building {spec.name}: {final} holds no module; delete it and retry"
                )
        _LOADED[key] = module
        return module


def _check_generated(spec: ExtensionSpec) -> None:
    """The device code reads constants and op layouts from headers generated from the Python side:
    building against stale ones would launch kernels that disagree with their plans."""
    if spec.name != main_extension().name:
        return
    stale = codegen.stale(_root(spec))
    if stale:
        raise BuildError(
            f"generated headers are stale ({', '.join(stale)}): run python -m mkernel.codegen"
        )


# ----------------------------------------------------------------------------- compile check


def _check_targets(
    spec: ExtensionSpec, root: Path, paths: Sequence[str] | None
) -> list[tuple[str, Path]]:
    """Return (label, file) pairs; a given relative path is looked up under root, then cwd.

    By default: every source the build of ``spec`` compiles (.cu and .cpp), then every header (the
    spec's and ``_HEADER_GLOBS``), each once. Sources come first: they take longest.
    """
    if paths is None:
        sources = _source_files(spec, root)
        headers = [
            h
            for h in _glob(root, (*spec.headers, *_HEADER_GLOBS))
            if h not in sources and h not in EXTERNAL_HEADERS
        ]
        return [(rel, root / rel) for rel in sources + headers]
    pairs = []
    for p in paths:
        path = Path(p)
        if not path.is_absolute():
            path = root / p if (root / p).exists() else Path.cwd() / p
        pairs.append((p, path))
    return pairs


def _check_one(nvcc: str, spec: ExtensionSpec, root: Path, path: Path, obj: Path) -> str | None:
    """Compile one file as the build would (a header through a one-line .cu); return the error
    text or None."""
    src = path
    if not path.name.endswith(_SOURCE_SUFFIXES):
        src = obj.with_suffix(".cu")
        src.write_text(f'#include "{path}"\n')
    # NOTE: the build's own flags, so a .cpp finds pybind11's and Python's headers as it does there.
    cmd = [nvcc, *_compile_flags(spec, root), "-c", str(src), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        return None
    return f"command: {shlex.join(cmd)}\n{(proc.stdout + proc.stderr)[-_TAIL_CHARS:]}"


def _iter_check(
    paths: Sequence[str] | None, root: Path | None, spec: ExtensionSpec | None = None
) -> Iterator[tuple[str, str | None]]:
    spec = spec or main_extension()
    root = root if root is not None else _root(spec)
    nvcc = _require_nvcc()
    targets = _check_targets(spec, root, paths)
    with tempfile.TemporaryDirectory(prefix="mkernel-check-") as tmp:
        work = Path(tmp)
        # NOTE: one nvcc per file, run side by side: each is single-threaded and mostly front-end.
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            futures = [
                pool.submit(_check_one, nvcc, spec, root, path, work / f"{i}.o")
                for i, (_, path) in enumerate(targets)
            ]
            for (label, _), future in zip(targets, futures, strict=True):
                yield label, future.result()


def compile_check(
    paths: Sequence[str] | None = None,
    *,
    root: str | Path | None = None,
    spec: ExtensionSpec | None = None,
) -> list[str]:
    """Compile every source the build of ``spec`` compiles (.cu and .cpp) with the build's flags,
    and every header alone (``spec.headers`` plus primitives/ and templates/), for ``spec.arch``.

    ``root`` (default: the spec's) is the source root; ``paths`` (relative to the root or the
    current folder, or absolute) narrows the check. Returns the paths that failed, as given (or
    relative to the root).
    """
    base = Path(root).absolute() if root is not None else None
    return [rel for rel, err in _iter_check(paths, base, spec) if err is not None]


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mkernel.jit")
    parser.add_argument("--check", action="store_true", help="compile-check all device sources")
    parser.add_argument("paths", nargs="*", help="files to check (default: all)")
    args = parser.parse_args(argv)
    if not args.check:
        parser.print_help()
        return 2
    failed = checked = 0
    t0 = time.perf_counter()
    runs: list[tuple[ExtensionSpec, Sequence[str] | None]] = [
        (main_extension(), args.paths or None)
    ]
    if args.paths:  # a separate extension's files with its flags (and the main build's, if both)
        main = set(_source_files(main_extension()))
        mine: list[str] = list(args.paths)
        for spec in _separate_specs():
            owned = set(_source_files(spec)) | _external_headers(spec)
            theirs = [p for p in args.paths if p in owned]
            mine = [p for p in mine if p not in owned or p in main]
            if theirs:
                runs.append((spec, theirs))
        runs[0] = (main_extension(), mine)
    if not args.paths:  # their headers are among the main check's (primitives/, kernels/*.h)
        for spec in _separate_specs():
            runs.append((spec, _source_files(spec) + sorted(_external_headers(spec))))
        for notice in _absent_notices():
            print(notice, flush=True)
    for spec, paths in runs:
        for rel, err in _iter_check(paths, None, spec):
            checked += 1
            print(f"{'FAIL' if err else 'ok  '} {rel}", flush=True)
            if err:
                failed += 1
                print(err, flush=True)
    total = time.perf_counter() - t0
    print(f"mkernel.jit --check: {checked} files, {failed} failed ({total:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_main())
