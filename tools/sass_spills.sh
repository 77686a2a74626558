#!/usr/bin/env bash
# Where the fused ring backward (D = 128) spills, per source line (nvdisasm -gi), for every
# built _mkernel extension in the cache; writes $OUT/spills.txt. On the device machine (needs
# cuobjdump and nvdisasm), inside tools/device_session.sh after a build.
set -u
for so in $MKERNEL_CACHE_DIR/_mkernel_ext-*/*.so; do
  d=/tmp/sp_$(basename $(dirname $so)); rm -rf $d; mkdir -p $d; (cd $d && cuobjdump -xelf all "$so" >/dev/null 2>&1)
  for c in $d/*.cubin; do
    nvdisasm -gi $c 2>/dev/null | awk '/\.text\./ {on = ($0 ~ /RingAttentionBwdILi128/)} on' > $c.ring
    [ -s $c.ring ] || continue
    echo "== $so $(wc -l < $c.ring) lines; STL $(grep -c STL $c.ring) LDL $(grep -c LDL $c.ring)"
    awk '/File "/ {loc=$0} /STL|LDL/ {print loc}' $c.ring | sed 's/.*File "\([^"]*\)", line \([0-9]*\).*/\1:\2/' | sed 's#.*/\(primitives\|kernels\|templates\)/#\1/#' | sort | uniq -c | sort -rn | head -25
  done
done 2>&1 | tee $OUT/spills.txt | head -120
