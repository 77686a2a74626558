// The layout phase: an op whose task counts only the kernel knows (MoE routing: how many tokens go
// to which expert is data) fills its role tables at the start of the launch, then every CTA runs
// them like host-built ones. The plan gives each device-filled role a per-rank capacity
// (mkernel/protocol.py Capacity): rank r appends into region r of the tables and publishes
// task_span[r]; rows, waits and raises have the same format as the host's (one executor).
//
//   thread 0 of CTA slot 0 of each served rank:  Op::layout(args, cta, compute, comm) -> finish()
//                                                -> fence -> layout flag := 1 (release)
//   thread 0 of every other CTA of the rank:     wait for the flag (bounded, named), count itself;
//                                                the last of them resets flag and counter
//
// Flag and counter are the rank's own barrier[slot 0, rank] and barrier[slot 1, rank] entries, which
// the entry barrier never uses (it writes barrier[slot, sender] on the peers' pads). Kernels on one
// stream do not overlap, so the next launch's writer finds both back at 0.
#pragma once

#include "primitives/protocol_gen.h"
#include "primitives/signal.cuh"

namespace mk {

// Appends one rank's tasks to a device-filled role's tables (the rank's region). Every call checks
// the capacity; a task that does not fit is dropped and `overflow` set, and the layout phase then
// stops the kernel (the plan's capacity is a bound the op promised).
struct TableWriter {
  int* task_span;  // [W, 2]
  int* args;       // [W * rows, kTaskArgs]
  int* wait_span;  // [W * rows, 2]
  int* waits;      // [W * waits, kWaitFields]
  int* raise_span;
  int* raises;  // [W * raises, kRaiseFields]
  int* tiles;   // compute role: the plan's tile table, one row per table row (else null)
  int rank, first, row, row_end, wait, wait_end, raise, raise_end;
  bool overflow;

  __device__ bool fail() {
    overflow = true;
    return false;
  }

  // Starts a task with its arguments (args[0] names it in timelines and timeouts, as in host-built
  // tables; for compute tasks it is the tile id); its waits and raises follow. False if full.
  __device__ bool task(int a0, int a1 = 0, int a2 = 0, int a3 = 0) {
    if (row == row_end) return fail();
    int* a = args + (long long)row * kTaskArgs;
    a[0] = a0;
    a[1] = a1;
    a[2] = a2;
    a[3] = a3;
    wait_span[2 * row] = wait_span[2 * row + 1] = wait;
    raise_span[2 * row] = raise_span[2 * row + 1] = raise;
    ++row;
    return true;
  }
  // A compute task and its tile (m0, n0, rows, cols, tag): the tile goes to the tile table's row of
  // the same index as the task's table row, which args[0] (the tile id) then names; row ids are
  // unique across ranks (rank r's region), so no two ranks' tiles share a row.
  __device__ bool tile_task(int m0, int n0, int rows, int cols, int tag) {
    if (row == row_end || tiles == nullptr) return fail();
    int* t = tiles + 5LL * row;
    t[0] = m0;
    t[1] = n0;
    t[2] = rows;
    t[3] = cols;
    t[4] = tag;
    return task(row);
  }
  // A wait of the current task: pad id, the rank whose pad, flat index, value, reset policy
  // (consumers; counter pad id when > 1, else -1), patience (timeout multiplier), peer (raiser).
  __device__ bool add_wait(int pad, int on_rank, int index, int value, int consumers = 1,
                           int counter = -1, int patience = 1, int peer = -1) {
    if (row == first || wait == wait_end) return fail();
    int* w = waits + (long long)wait * kWaitFields;
    w[kWPad] = pad;
    w[kWRank] = on_rank;
    w[kWIndex] = index;
    w[kWValue] = value;
    w[kWConsumers] = consumers;
    w[kWCounter] = counter;
    w[kWPatience] = patience;
    w[kWPeer] = peer;
    wait_span[2 * (row - 1) + 1] = ++wait;
    return true;
  }
  // A raise of the current task: pad id, the rank whose pad, flat index, value, kRaiseSet/Add.
  __device__ bool add_raise(int pad, int on_rank, int index, int value = 1, int op = kRaiseSet) {
    if (row == first || raise == raise_end) return fail();
    int* r = raises + (long long)raise * kRaiseFields;
    r[kRPad] = pad;
    r[kRRank] = on_rank;
    r[kRIndex] = index;
    r[kRValue] = value;
    r[kROp] = op;
    raise_span[2 * (row - 1) + 1] = ++raise;
    return true;
  }
  __device__ void finish() {
    task_span[2 * rank] = first;
    task_span[2 * rank + 1] = row;
  }
};

}  // namespace mk
