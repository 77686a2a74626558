"""Mutation run over the plan builders, twins, interpreter and references: plant one real bug at a
time (tools/mutations.py) in a copy of the repository, run the tests that should catch it, and
report which test killed it. A mutation nobody kills is a hole in the tests, unless it is argued
equivalent (it cannot change observable behaviour).

    python tools/mutate.py                    # every mutation, 2 at a time; JSON next to this file
    python tools/mutate.py --only rs_w1_rows  # some of them
    python tools/mutate.py --check            # every snippet still applies (no tests run)

Each mutation runs in /tmp/mkmut/<id>: a copy of the tracked and untracked-not-ignored files (the
working tree as it is), the edits applied (each old snippet must occur exactly once: a stale
mutation is an error, never a silent pass), then ``python -m pytest -x`` over its test files with
CI=1 (the derandomized Hypothesis profile of tests/conftest.py), shrinking off (this file is also
the pytest plugin that turns it off: a kill needs one failing example, not the smallest one).

Outcomes: killed (a test failed), killed-collection (pytest could not import or collect: rc 2-4),
killed-timeout (a hang), survived. Exit status 1 if a non-equivalent mutation survived.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/mkmut")
MAX_JOBS = 2  # the CPU machine has 2 cores: more would only slow each run down
WRONG_IMPORT = 99  # the plugin's exit status when mkernel is not the copy's (never a kill)


# -- the pytest plugin (loaded with -p tools.mutate inside each copy) ------------------------------


def pytest_configure(config) -> None:
    """Inside a mutation run: the tests must import the copy's mkernel, and Hypothesis stops at
    the first failing example (the "ci" profile with the shrink phase left out)."""
    import pytest
    from hypothesis import Phase, settings

    import mkernel

    here = Path.cwd().resolve()
    if here not in Path(mkernel.__file__).resolve().parents:
        pytest.exit(f"mutate: mkernel imported from {mkernel.__file__}, not {here}", WRONG_IMPORT)
    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    settings.register_profile("mutate", settings.get_profile("ci"), phases=phases)
    settings.load_profile("mutate")


# -- one mutation ----------------------------------------------------------------------------------


class StaleMutation(Exception):
    """An old snippet that does not occur exactly once: the mutation no longer fits the code."""


def repo_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]  # skip staged deletions


def edits_of(m) -> list[tuple[str, str, str]]:
    return [(m.file, m.old, m.new), *m.also]


def apply_edits(m, root: Path) -> None:
    for file, old, new in edits_of(m):
        path = root / file
        text = path.read_text()
        n = text.count(old)
        if n != 1:
            raise StaleMutation(f"{m.id}: the old snippet occurs {n} times in {file}: {old!r}")
        path.write_text(text.replace(old, new))


def snapshot(dest: Path, files: list[str], commit: str | None) -> None:
    """The working tree as it is now (or ``commit``'s tree), once: every mutation starts from this
    copy, so edits other people make while the run goes on cannot mix into it."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    if commit is not None:
        tar = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=tar.stdout, check=True)
        return
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)


def read_source(file: str, commit: str | None) -> str:
    if commit is None:
        return (ROOT / file).read_text()
    show = ["git", "show", f"{commit}:{file}"]
    return subprocess.run(show, cwd=ROOT, check=True, capture_output=True, text=True).stdout


def first_failure(output: str) -> str:
    """The first FAILED / ERROR node id of pytest's short summary (-rfE)."""
    for line in output.splitlines():
        hit = re.match(r"(FAILED|ERROR) (\S+)", line)
        if hit:
            return hit.group(2)
    return ""


def run_tests(cwd: Path, tests: list[str], timeout: float) -> tuple[int | None, str]:
    """pytest over ``tests`` in ``cwd``: (exit status or None on timeout, output)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider"]
    cmd += ["-p", "tools.mutate", *tests]
    env = {**os.environ, "CI": "1", "PYTHONPATH": str(cwd), "PYTHONDONTWRITEBYTECODE": "1"}
    # One thread per run: two runs share two cores, and oversubscribed BLAS threads only spin.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("HYPOTHESIS_PROFILE", None)
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group: a timeout ends pytest and its children
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def outcome(rc: int | None) -> str:
    if rc is None:
        return "killed-timeout"
    if rc == WRONG_IMPORT:
        raise RuntimeError("the tests imported another mkernel than the copy's")
    return {0: "survived", 1: "killed", 5: "no-tests"}.get(rc, "killed-collection")


def run_one(m, base: Path, timeout: float, keep: bool) -> dict:
    dest = WORK / m.id
    t0 = time.monotonic()
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(base, dest)
    apply_edits(m, dest)
    rc, out = run_tests(dest, list(m.tests), timeout)
    got = outcome(rc)
    if got == "no-tests":
        raise RuntimeError(f"{m.id}: no tests collected from {m.tests}")
    if not keep:
        shutil.rmtree(dest, ignore_errors=True)
    return {
        "id": m.id,
        "file": m.file,
        "bug": m.bug,
        "equivalent": m.equivalent,
        "tests": list(m.tests),
        "outcome": got,
        "killed_by": first_failure(out) if got != "survived" else "",
        "rc": rc,
        "seconds": round(time.monotonic() - t0, 1),
        "tail": "" if got == "killed" else out[-2000:],  # hangs, collection errors, survivors
    }


# -- the whole run ---------------------------------------------------------------------------------


def verdict(r: dict) -> str:
    """What a result means: a kill, a hole in the tests, or an argued equivalence (that a test
    then contradicts, if it was killed)."""
    killed = r["outcome"] != "survived"
    if r["equivalent"]:
        return "EQUIVALENT BUT KILLED" if killed else "equivalent"
    return r["outcome"] if killed else "SURVIVED"


def table(results: list[dict]) -> str:
    rows = [("id", "file", "result", "killed by", "s")]
    for r in results:
        where = r["file"].removeprefix("mkernel/")
        by = r["killed_by"] or (r["equivalent"] or "")[:60]
        rows.append((r["id"], where, verdict(r), by, f"{r['seconds']:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
        for row in rows
    )


def git_commit(commit: str | None) -> tuple[str, list[str]]:
    """The commit tested and the files that differ from it (the working tree as it was)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout
    if commit is not None:
        return git("rev-parse", commit).strip(), []
    changed = [line[3:] for line in git("status", "--porcelain").splitlines()]
    return git("rev-parse", "HEAD").strip(), changed


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "tools"))
    from mutations import DEFAULT_TESTS, MUTATIONS, ORDER

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="ID", help="run these mutations only")
    p.add_argument(
        "--json",
        help="where to write the results (default: tools/"
        "mutation_results.json for a full run; a run with --only writes only here)",
    )
    p.add_argument("--jobs", type=int, default=MAX_JOBS, help=f"parallel runs (<= {MAX_JOBS})")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mutation")
    p.add_argument("--check", action="store_true", help="check every snippet applies, run nothing")
    p.add_argument("--keep", action="store_true", help="keep the mutated copies in /tmp/mkmut")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmutated test run")
    p.add_argument(
        "--commit", help="mutate this commit's tree instead of the working tree (others' edits)"
    )
    args = p.parse_args(argv)

    ids = [m.id for m in MUTATIONS]
    if len(set(ids)) != len(ids):
        raise SystemExit("mutation ids must be unique")
    chosen = MUTATIONS
    if args.only:
        unknown = sorted(set(args.only) - set(ids))
        if unknown:
            raise SystemExit(f"unknown mutation ids: {unknown}")
        chosen = [m for m in MUTATIONS if m.id in args.only]
    if args.check:
        for m in chosen:  # against the working tree (or the commit), in memory
            for file, old, _ in edits_of(m):
                n = read_source(file, args.commit).count(old)
                if n != 1:
                    raise StaleMutation(f"{m.id}: the old snippet occurs {n} times in {file}")
        print(f"{len(chosen)} mutations apply")
        return 0

    t0 = time.monotonic()
    commit, changed = git_commit(args.commit)
    base = WORK / "_base"
    snapshot(base, repo_files(), args.commit)
    missing = sorted(t for t in {t for m in chosen for t in m.tests} if not (base / t).is_file())
    if missing:  # pytest would fail on them: every mutation would look killed
        raise SystemExit(f"test files not in the tree tested: {missing}")
    for m in chosen:  # a stale snippet fails the run before anything is spent on it
        for file, old, _ in edits_of(m):
            if (base / file).read_text().count(old) != 1:
                raise StaleMutation(f"{m.id}: the old snippet does not occur once in {file}")
    jobs = max(1, min(args.jobs, MAX_JOBS))
    if not args.no_baseline:  # the unmutated snapshot must pass, or every kill means nothing
        tests = sorted({t for m in chosen for t in m.tests}, key=ORDER.index)
        rc, out = run_tests(base, tests, args.timeout)
        if rc != 0:
            print(out[-3000:])
            raise SystemExit(f"baseline: the unmutated tests fail (rc {rc}): {first_failure(out)}")
        print(f"baseline passes ({len(tests)} test files, {time.monotonic() - t0:.0f} s)")
    with ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(run_one, m, base, args.timeout, args.keep) for m in chosen]
        results = []
        for f in futures:
            r = f.result()
            results.append(r)
            print(f"{r['id']}: {verdict(r)} {r['killed_by']} ({r['seconds']:.0f} s)", flush=True)
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    total = round(time.monotonic() - t0, 1)
    print()
    print(table(results))
    holes = [r["id"] for r in results if verdict(r) in ("SURVIVED", "EQUIVALENT BUT KILLED")]
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "changed_files": changed,  # uncommitted at the start of the run: part of what was tested
        "default_tests": list(DEFAULT_TESTS),
        "seconds": total,
        "jobs": jobs,
        "mutations": len(results),
        "killed": sum(r["outcome"] != "survived" and not r["equivalent"] for r in results),
        "equivalent": sum(bool(r["equivalent"]) for r in results),
        "survived": [r["id"] for r in results if verdict(r) == "SURVIVED"],
        "results": results,
    }
    for r in results:  # the JSON names only the tests beyond the default set
        r["extra_tests"] = [t for t in r.pop("tests") if t not in DEFAULT_TESTS]
    out = args.json or (None if args.only else ROOT / "tools" / "mutation_results.json")
    if out is not None:
        Path(out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n{summary['killed']} killed, {summary['equivalent']} equivalent, ", end="")
    print(f"{len(summary['survived'])} survived in {total:.0f} s; JSON: {out}")
    return 1 if holes else 0


if __name__ == "__main__":
    sys.exit(main())
