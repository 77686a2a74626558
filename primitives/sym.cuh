// Symmetric memory: the same buffer on every rank, addressable by every rank.
// A SymPtr holds the table of every rank's base address (peer mappings from CUDA IPC in a
// distributed world, slices of one allocation in an emulated world); map(rank) turns it into that
// rank's pointer. Whoever holds a SymPtr may write any rank's copy: the protocols in signal.cuh say
// when that is allowed.
#pragma once
#include <cstdint>

namespace mk {

template <class T>
struct SymPtr {
  const unsigned long long* ptrs;  // [W] base address per rank
  __device__ __forceinline__ T* map(int rank) const { return reinterpret_cast<T*>(ptrs[rank]); }
};

// Per-rank plain tensors of an emulated world: rank r's tensor at base + r * rank_stride (elements).
// In a distributed world rank_stride is unused (only the local rank is addressed).
template <class T>
struct RankPtr {
  T* base;
  long long rank_stride;
  __device__ __forceinline__ T* at(int local_rank) const { return base + local_rank * rank_stride; }
};

}  // namespace mk
