#!/usr/bin/env bash
# Issue 34's A/B on the device machine (inside tools/device_session.sh, cwd the snapshot): the
# fused ring backward of the snapshot (head), the snapshot with its producer warpgroup at 40 and
# 56 registers (MK_RING_BWD_PRODUCER_REGS; its fused producer spills ~840 bytes at 24, mostly the
# intra_sm comm warp's code), and old trees carried as .carry/t_<rev>.tar (made here with
# `git archive <rev> > .carry/t_<rev>.tar`; OLD lists the revs, default 36dec36, the last before
# the regression, then 416b661 and e3f2aa0, the commits after it that touch the template).
# Builds every tree in parallel, then alternates one process per tree in ROUNDS rounds; prints
# per version the min-max ms over the rounds of each tree.
set -u
OLD=${OLD:-36dec36 416b661 e3f2aa0}
ROUNDS=${ROUNDS:-2}
PAR=${PAR:-2}
R=$MKERNEL_REPO_ROOT
T=$PWD/tools/ring_bwd_time.py
REGS=${REGS-40 56}  # producer-register variants of the snapshot ("" for none)
for p in $REGS; do
  rm -rf /tmp/v$p && cp -r "$PWD" /tmp/v$p
  sed -i "s/define MK_RING_BWD_PRODUCER_REGS 24/define MK_RING_BWD_PRODUCER_REGS $p/" \
    /tmp/v$p/kernels/ring_attention_backward.cu
done
declare -A TREE=([head]=$PWD)
ORDER=(head)
for p in $REGS; do TREE[p$p]=/tmp/v$p; ORDER+=("p$p"); done
for rev in $OLD; do
  rm -rf "/tmp/t_$rev" && mkdir -p "/tmp/t_$rev" && tar xf "$R/.carry/t_$rev.tar" -C "/tmp/t_$rev"
  TREE[$rev]=/tmp/t_$rev
  ORDER+=("$rev")
done
# builds PAR trees at a time (each build's ninja runs a job per core; nvcc of these kernels takes
# GBs each)
n=0
for t in "${ORDER[@]}"; do
  (cd "${TREE[$t]}" && WARM=1 PYTHONPATH=${TREE[$t]} timeout 300 python "$T" $t >"$OUT/warm_$t.log" 2>&1
   echo "warm $t rc=$?") &
  n=$((n + 1))
  if [ $((n % PAR)) -eq 0 ]; then wait; fi
done
wait
grep -h "^warm" "$OUT"/warm_*.log  # each tree's build (tools/sass_spills.sh lists them by path)
for r in $(seq "$ROUNDS"); do
  for t in "${ORDER[@]}"; do
    (cd "${TREE[$t]}" && PYTHONPATH=${TREE[$t]} timeout 60 python "$T" $t 1 2>&1 | grep TAG)
  done
done | tee "$OUT/ab.txt"
python "$PWD/tools/ab_table.py" "$OUT/ab.txt" "${ORDER[@]}"
