// The layout phase: an op whose task counts only the kernel knows (MoE routing: how many tokens go
// to which expert is data) fills its role tables at the start of the launch, then every CTA runs
// them like host-built ones. The plan gives each device-filled role a per-rank capacity
// (mkernel/protocol.py Capacity): rank r writes into region r of the tables and publishes
// task_span[r]; rows, waits and raises have the same format as the host's (one executor).
//
//   every thread of CTA slot 0 of each served rank:  Op::layout(args, cta, compute, comm, smem)
//                           (the CTA's shared memory is its scratch: the engine has not started)
//                           -> any writer overflowed? trap -> thread 0: finish() -> fence
//                           -> layout flag := 1 (release)
//   thread 0 of every other CTA of the rank:     wait for the flag (bounded, named), count itself;
//                                                the last of them resets flag and counter
//
// Two ways to write, both through a TableWriter (each thread holds its own copy):
//   appending  task / add_wait / add_raise, one thread (thread 0: its copy's row count is the one
//              finish() publishes);
//   indexed    put_task / put_tile / put_wait / put_raise at positions the op computed (prefix
//              sums), by any thread, then count(n) on every thread (thread 0's is published).
// A role's writer uses one of the two: indexed positions count from the region's start, which an
// append has moved past.
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

  // -- appending writes (one thread), on the indexed ones at the region's append cursor --------

  // Starts a task with its arguments (args[0] names it in timelines and timeouts, as in host-built
  // tables); its waits and raises follow. False if full.
  __device__ bool task(int a0, int a1 = 0, int a2 = 0, int a3 = 0) {
    if (!put_task(row - first, a0, a1, a2, a3, 0, 0, 0, 0)) return false;
    ++row;
    return true;
  }
  // A wait of the current task: pad id, the rank whose pad, flat index, value, reset policy
  // (consumers; counter pad id when > 1, else -1), patience (timeout multiplier), peer (raiser).
  __device__ bool add_wait(int pad, int on_rank, int index, int value, int consumers = 1,
                           int counter = -1, int patience = 1, int peer = -1) {
    if (row == first ||
        !put_wait(0, pad, on_rank, index, value, consumers, counter, patience, peer))
      return fail();
    wait_span[2 * (row - 1) + 1] = ++wait;
    return true;
  }
  // A raise of the current task: pad id, the rank whose pad, flat index, value, kRaiseSet/Add.
  __device__ bool add_raise(int pad, int on_rank, int index, int value = 1, int op = kRaiseSet) {
    if (row == first || !put_raise(0, pad, on_rank, index, value, op)) return fail();
    raise_span[2 * (row - 1) + 1] = ++raise;
    return true;
  }
  // -- indexed writes: positions relative to the rank's region (task i, wait w, raise r) --------

  // Task i with its arguments, its waits at [w0, w0 + nw) and raises at [r0, r0 + nr).
  __device__ bool put_task(int i, int a0, int a1, int a2, int a3, int w0, int nw, int r0, int nr) {
    if (i < 0 || first + i >= row_end || wait + w0 + nw > wait_end || raise + r0 + nr > raise_end)
      return fail();
    const long long at = first + i;
    int* a = args + at * kTaskArgs;
    a[0] = a0;
    a[1] = a1;
    a[2] = a2;
    a[3] = a3;
    wait_span[2 * at] = wait + w0;
    wait_span[2 * at + 1] = wait + w0 + nw;
    raise_span[2 * at] = raise + r0;
    raise_span[2 * at + 1] = raise + r0 + nr;
    return true;
  }
  // A compute task and its tile (m0, n0, rows, cols, tag): the tile goes to the tile table's row of
  // the task's table row, which args[0] (the tile id) then names; row ids are unique across ranks
  // (rank r's region), so no two ranks' tiles share a row.
  __device__ bool put_tile(int i, int m0, int n0, int rows, int cols, int tag, int w0, int nw,
                           int r0, int nr) {
    if (tiles == nullptr || i < 0 || first + i >= row_end) return fail();
    int* t = tiles + 5LL * (first + i);
    t[0] = m0;
    t[1] = n0;
    t[2] = rows;
    t[3] = cols;
    t[4] = tag;
    return put_task(i, first + i, 0, 0, 0, w0, nw, r0, nr);
  }
  __device__ bool put_wait(int w, int pad, int on_rank, int index, int value, int consumers = 1,
                           int counter = -1, int patience = 1, int peer = -1) {
    if (w < 0 || wait + w >= wait_end) return fail();
    int* f = waits + (long long)(wait + w) * kWaitFields;
    f[kWPad] = pad;
    f[kWRank] = on_rank;
    f[kWIndex] = index;
    f[kWValue] = value;
    f[kWConsumers] = consumers;
    f[kWCounter] = counter;
    f[kWPatience] = patience;
    f[kWPeer] = peer;
    return true;
  }
  __device__ bool put_raise(int r, int pad, int on_rank, int index, int value = 1,
                            int op = kRaiseSet) {
    if (r < 0 || raise + r >= raise_end) return fail();
    int* f = raises + (long long)(raise + r) * kRaiseFields;
    f[kRPad] = pad;
    f[kRRank] = on_rank;
    f[kRIndex] = index;
    f[kRValue] = value;
    f[kROp] = op;
    return true;
  }
  // The rank's tasks are 0 .. n - 1 (indexed writes): what finish() publishes.
  __device__ bool count(int n) {
    if (n < 0 || first + n > row_end) return fail();
    row = first + n;
    return true;
  }

  __device__ void finish() {
    task_span[2 * rank] = first;
    task_span[2 * rank + 1] = row;
  }
};

}  // namespace mk
