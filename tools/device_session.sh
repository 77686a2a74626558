#!/usr/bin/env bash
# One device-machine session: unpack the carried JIT cache, run the given steps, pack the cache.
# Usage (on the device machine, repo root): bash tools/device_session.sh "<cmd1>" "<cmd2>" ...
# Each step's output goes to $OUT/<n>.log; a summary table is printed last. CARRY names the carried
# folder (default .carry: mkcache.tgz, snapshot.tar); steps see the repo root as $MKERNEL_REPO_ROOT.
set -u
CARRY=${CARRY:-.carry}
export MKERNEL_REPO_ROOT=$PWD
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MKERNEL_CACHE_DIR=$PWD/.mkcache
export MKERNEL_BENCH_DIR=${OUT:-/tmp/out}  # benchmark JSON comes back with the run
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" .mkcache && chmod 700 .mkcache
if [ -f "$CARRY/mkcache.tgz" ]; then tar xzf "$CARRY/mkcache.tgz" && chmod -R go-w .mkcache; fi
# Run from a snapshot of committed work when one was packed (git archive HEAD > .carry/snapshot.tar):
# other engineers' uncommitted edits in the working tree then cannot break the build.
if [ -f "$CARRY/snapshot.tar" ]; then
  rm -rf /tmp/snap && mkdir -p /tmp/snap && tar xf "$CARRY/snapshot.tar" -C /tmp/snap
  cd /tmp/snap && export PYTHONPATH=/tmp/snap
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
summary=()
i=0
for cmd in "$@"; do
  i=$((i + 1))
  t0=$(date +%s)
  echo "=== step $i: $cmd"
  bash -c "$cmd" >"$OUT/step$i.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/step$i.log"
  summary+=("step $i rc=$rc $(($(date +%s) - t0))s: $cmd")
done
# Only the newest build of each extension goes back (files come back at most 16 MiB each).
(cd "$(dirname "$MKERNEL_CACHE_DIR")" &&
  keep=$(ls -td .mkcache/*/ | awk -F/ '{n=$2; sub(/-[0-9a-f]+$/, "", n); if (!(n in s)) {s[n]=1; print}}') &&
  tar czf "$OUT/mkcache.tgz" $keep 2>/dev/null)
echo "=== summary"
printf '%s\n' "${summary[@]}"
