// ds_odc scatter-accumulate: a pusher adds its gradient slice straight into the owner's fp32/fp64
// accumulator through the CUDA IPC mapping of the owner's memory.
//
// Why reductions: several ranks add into the same owner elements at the same time, and nothing
// orders them. `red.relaxed.sys.global.add` is an atomic add at system scope (other processes,
// other GPUs over NVLink) that returns nothing, so the issuing warp never waits for the remote
// memory. Visibility to the owner is established at the step fence, where every rank synchronises
// its streams before the host rendezvous.
//
// Why the loop is shaped as it is (the push must run at memory bandwidth, not at memory latency):
//  * each thread first issues kUnroll independent source loads (16 bytes each for fp32, 8 for 16-bit
//    sources), then their reductions: kUnroll loads in flight per thread instead of one. The reduction
//    asm has no "memory" clobber, which would be a compiler barrier in front of every reduction and
//    keep the next tile's loads behind it; `volatile` alone keeps it from being removed or merged, and
//    nothing else in the kernel touches the accumulator, so no ordering is lost;
//  * a block covers a tile of kUnroll * blockDim groups, thread t taking groups t, t + blockDim, ...
//    (every load instruction coalesced across the warp), and blocks stride over tiles;
//  * the grid is one wave of the device (kBlocksPerSm blocks per multiprocessor, fewer if the kernel's
//    occupancy is lower), read off the device at the first launch: with kUnroll 16-byte loads per
//    thread that is ~32 KB of loads in flight per SM, above what HBM3 needs to stream (~3.3 TB/s x
//    ~1 us over 132 SMs ~ 25 KB). The host's plan may ask for fewer blocks (push_max_blocks); never more.
// `python scripts/check_push_kernel.py` compiles this file and checks, in the PTX and (with cuobjdump)
// the SASS, that the loads really are all issued before the first reduction.
#include "odc_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <mutex>

namespace odc {
namespace {

constexpr int kUnroll = 4;       // groups of 4 elements per thread per tile: loads in flight per thread
constexpr int kBlocksPerSm = 2;  // the device-sized grid: blocks per multiprocessor (see the file comment)

__device__ __forceinline__ void red_add(float* address, float value) {
  asm volatile("red.relaxed.sys.global.add.f32 [%0], %1;" ::"l"(address), "f"(value));
}

__device__ __forceinline__ void red_add(double* address, double value) {
  asm volatile("red.relaxed.sys.global.add.f64 [%0], %1;" ::"l"(address), "d"(value));
}

// Four consecutive fp32 elements, `address` 16-byte aligned: one vector reduction on sm_90+.
__device__ __forceinline__ void red_add4(float* address, const float (&v)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.relaxed.sys.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(address), "f"(v[0]), "f"(v[1]),
               "f"(v[2]), "f"(v[3]));
#else
#pragma unroll
  for (int k = 0; k < 4; ++k) red_add(address + k, v[k]);
#endif
}

__device__ __forceinline__ void red_add4(double* address, const float (&v)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) red_add(address + k, static_cast<double>(v[k]));
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Load 4 source elements as float; one vector load when the caller guarantees alignment. The source
// is read once: streaming loads (evict-first), so it does not push the accumulator lines out of L2.
template <bool kVector>
__device__ __forceinline__ void load4(const float* src, float (&v)[4]) {
  if (kVector) {
    const float4 x = __ldcs(reinterpret_cast<const float4*>(src));
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = __ldcs(src + k);
  }
}

template <bool kVector, typename Half>
__device__ __forceinline__ void load4_16bit(const Half* src, float (&v)[4]) {
  if (kVector) {
    const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(src));
    const Half* h = reinterpret_cast<const Half*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = to_float(h[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = to_float(src[k]);
  }
}

template <bool kVector>
__device__ __forceinline__ void load4(const __nv_bfloat16* src, float (&v)[4]) {
  load4_16bit<kVector>(src, v);
}

template <bool kVector>
__device__ __forceinline__ void load4(const __half* src, float (&v)[4]) {
  load4_16bit<kVector>(src, v);
}

template <typename Src, typename Acc, bool kVector>
__global__ void scatter_add_kernel(Acc* __restrict__ dst, const Src* __restrict__ src, int64_t numel, int64_t head,
                                   int64_t groups) {
  const int64_t tile_groups = static_cast<int64_t>(kUnroll) * blockDim.x;
  const Src* body_src = src + head;
  Acc* body_dst = dst + head;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * tile_groups + threadIdx.x; first - threadIdx.x < groups;
       first += static_cast<int64_t>(gridDim.x) * tile_groups) {
    float v[kUnroll][4];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {  // every load of the tile first ...
      const int64_t g = first + static_cast<int64_t>(k) * blockDim.x;
      if (g < groups) load4<kVector>(body_src + 4 * g, v[k]);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {  // ... then their reductions
      const int64_t g = first + static_cast<int64_t>(k) * blockDim.x;
      if (g < groups) red_add4(body_dst + 4 * g, v[k]);
    }
  }
  // head and tail: at most 3 + 3 elements, one scalar reduction each, by the first threads of block 0
  const int64_t tail_start = head + 4 * groups;
  const int64_t edges = head + (numel - tail_start);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (thread < edges) {
    const int64_t i = thread < head ? thread : tail_start + (thread - head);
    red_add(dst + i, static_cast<Acc>(to_float(src[i])));
  }
}

// One wave of the device for this kernel: multiprocessors x min(kBlocksPerSm, its occupancy at
// `threads`). Read once per (device, kernel, threads) and kept: a push launches often.
template <typename Kernel>
int device_wave(Kernel kernel, int threads) {
  struct Entry {
    int device, threads;
    const void* kernel;
    int wave;
  };
  constexpr int kSlots = 64;
  static Entry entries[kSlots];
  static int used = 0;
  static std::mutex mutex;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  const void* key = reinterpret_cast<const void*>(kernel);
  std::lock_guard<std::mutex> lock(mutex);
  for (int i = 0; i < used; ++i) {
    if (entries[i].device == device && entries[i].threads == threads && entries[i].kernel == key) {
      return entries[i].wave;
    }
  }
  int sms = 1, per_sm = 1;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms < 1) sms = 1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess || per_sm < 1) {
    per_sm = 1;
  }
  const int wave = sms * (per_sm < kBlocksPerSm ? per_sm : kBlocksPerSm);
  if (used < kSlots) entries[used++] = Entry{device, threads, key, wave};
  return wave;
}

template <typename Src, typename Acc, bool kVector>
cudaError_t launch_kernel(Acc* dst, const Src* src, int64_t numel, int64_t head, int64_t groups, int blocks,
                          int threads, cudaStream_t stream) {
  auto kernel = scatter_add_kernel<Src, Acc, kVector>;
  const int wave = device_wave(kernel, threads);
  kernel<<<blocks < wave ? blocks : wave, threads, 0, stream>>>(dst, src, numel, head, groups);
  return cudaGetLastError();
}

template <typename Src, typename Acc>
cudaError_t launch_typed(Acc* dst, const Src* src, int64_t numel, int64_t head, int64_t groups, bool vector_loads,
                         int blocks, int threads, cudaStream_t stream) {
  if (vector_loads) return launch_kernel<Src, Acc, true>(dst, src, numel, head, groups, blocks, threads, stream);
  return launch_kernel<Src, Acc, false>(dst, src, numel, head, groups, blocks, threads, stream);
}

template <typename Acc>
cudaError_t launch_for_acc(Acc* dst, const void* src, SrcKind src_kind, int64_t numel, int64_t head, int64_t groups,
                           bool vector_loads, int blocks, int threads, cudaStream_t stream) {
  switch (src_kind) {
    case SrcKind::kFloat32:
      return launch_typed(dst, static_cast<const float*>(src), numel, head, groups, vector_loads, blocks, threads,
                          stream);
    case SrcKind::kBFloat16:
      return launch_typed(dst, static_cast<const __nv_bfloat16*>(src), numel, head, groups, vector_loads, blocks,
                          threads, stream);
    case SrcKind::kFloat16:
      return launch_typed(dst, static_cast<const __half*>(src), numel, head, groups, vector_loads, blocks, threads,
                          stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_scatter_add(void* dst, AccKind acc, const void* src, SrcKind src_kind, int64_t numel, int64_t head,
                               int64_t groups, bool vector_loads, int blocks, int threads, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  if (blocks < 1 || threads < 32 || threads > 1024) return cudaErrorInvalidConfiguration;
  switch (acc) {
    case AccKind::kFloat32:
      return launch_for_acc(static_cast<float*>(dst), src, src_kind, numel, head, groups, vector_loads, blocks,
                            threads, stream);
    case AccKind::kFloat64:
      return launch_for_acc(static_cast<double*>(dst), src, src_kind, numel, head, groups, vector_loads, blocks,
                            threads, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace odc
