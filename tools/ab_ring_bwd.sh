#!/usr/bin/env bash
# Issue 34's A/B on the device machine (inside tools/device_session.sh, cwd the snapshot): the
# fused ring backward of the snapshot (head), the snapshot with its producer warpgroup at 40 and
# 56 registers (MK_RING_BWD_PRODUCER_REGS; its fused producer spills ~840 bytes at 24), and an old
# tree carried as .carry/t_<rev>.tar (git archive <rev>; default 36dec36, before the regression).
# Builds every tree in parallel, then alternates one process per tree in ROUNDS rounds; prints
# per version the min-max ms over the rounds of each tree.
set -u
OLD=${OLD:-36dec36}
ROUNDS=${ROUNDS:-3}
R=$MKERNEL_REPO_ROOT
T=$PWD/tools/ring_bwd_time.py
for p in 40 56; do
  rm -rf /tmp/v$p && cp -r "$PWD" /tmp/v$p
  sed -i "s/define MK_RING_BWD_PRODUCER_REGS 24/define MK_RING_BWD_PRODUCER_REGS $p/" \
    /tmp/v$p/kernels/ring_attention_backward.cu
done
rm -rf /tmp/old && mkdir -p /tmp/old && tar xf "$R/.carry/t_$OLD.tar" -C /tmp/old
declare -A TREE=([head]=$PWD [p40]=/tmp/v40 [p56]=/tmp/v56 [old]=/tmp/old)
ORDER=(head p40 p56 old)
for t in "${ORDER[@]}"; do
  (cd "${TREE[$t]}" && WARM=1 PYTHONPATH=${TREE[$t]} timeout 300 python "$T" $t >"$OUT/warm_$t.log" 2>&1
   echo "warm $t rc=$?") &
done
wait
for r in $(seq "$ROUNDS"); do
  for t in "${ORDER[@]}"; do
    (cd "${TREE[$t]}" && PYTHONPATH=${TREE[$t]} timeout 60 python "$T" $t 1 2>&1 | grep TAG)
  done
done | tee "$OUT/ab.txt"
python - "$OUT/ab.txt" "${ORDER[@]}" <<'PY'
import collections
import sys

d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    _, t, n, ms = line.split()
    d[(n, t)].append(float(ms))
order = sys.argv[2:]
print("version".ljust(16), *[t.rjust(14) for t in order])
for n in sorted({n for n, _ in d}):
    cells = [f"{min(d[n, t]):.3f}-{max(d[n, t]):.3f}" if d[n, t] else "-" for t in order]
    print(n.ljust(16), *[c.rjust(14) for c in cells])
PY
