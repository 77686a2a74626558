#!/usr/bin/env bash
# Checks a built gemm.o: every gemm kernel's SASS has HGMMA (the wgmma path, not HMMA/FFMA), and the
# ptxas report shows 0 spill bytes and no stack frame.   check_sass.sh <build_dir>
set -uo pipefail
DIR=$1
fail=0
cuobjdump --dump-sass "$DIR/gemm.o" > "$DIR/gemm.sass" || { echo "cuobjdump failed"; exit 1; }
awk '/Function :/ {fn=$3} /HGMMA/ {h[fn]++} /HMMA/ && !/HGMMA/ {m[fn]++} /LDL|STL/ {l[fn]++}
     END {for (f in h) printf "SASS %s: HGMMA=%d HMMA=%d LDL/STL=%d\n", f, h[f], m[f]+0, l[f]+0}' \
     "$DIR/gemm.sass"
n=$(grep -c "Function :" "$DIR/gemm.sass"); nh=$(awk '/Function :/ {fn=$3} /HGMMA/ {h[fn]=1} END {print length(h)}' "$DIR/gemm.sass")
echo "kernels: $n, with HGMMA: $nh"; [ "$n" = "$nh" ] || fail=1
grep -E "spill|stack frame" "$DIR/ptxas.log" | sort | uniq -c
if grep -E "[1-9][0-9]* bytes spill|[1-9][0-9]* bytes stack" "$DIR/ptxas.log"; then fail=1; fi
grep -i "warning" "$DIR/ptxas.log" && fail=1
echo "SASS/spill check: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
