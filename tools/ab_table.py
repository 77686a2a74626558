"""The A/B tools' summary (tools/ab_ring_bwd.sh, tools/ab_taskgraph.sh): reads the ``TAG <tree>
<case> <ms>`` lines of a file and prints per case the min-max ms of each tree, in the order given.
argv: file tree..."""

import collections
import sys

d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    if not line.startswith("TAG "):
        continue
    _, t, n, ms = line.split()
    d[(n, t)].append(float(ms))
order = sys.argv[2:]
width = max([14] + [len(t) + 2 for t in order])
print("case".ljust(16), *[t.rjust(width) for t in order])
for n in sorted({n for n, _ in d}):
    cells = [f"{min(d[n, t]):.3f}-{max(d[n, t]):.3f}" if d[n, t] else "-" for t in order]
    print(n.ljust(16), *[c.rjust(width) for c in cells])
