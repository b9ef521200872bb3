// ds_odc scatter-accumulate: a pusher adds its gradient slice straight into the owner's fp32/fp64
// accumulator through the CUDA IPC mapping of the owner's memory.
//
// Why reductions: several ranks add into the same owner elements at the same time, and nothing
// orders them. `red.relaxed.sys.global.add` is an atomic add at system scope (other processes,
// other GPUs over NVLink) that returns nothing, so the issuing warp never waits for the remote
// memory: the kernel streams reductions at link speed. Visibility to the owner is established at
// the step fence, where every rank synchronises its streams before the host rendezvous.
#include "odc_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace odc {
namespace {

__device__ __forceinline__ void red_add(float* address, float value) {
  asm volatile("red.relaxed.sys.global.add.f32 [%0], %1;" ::"l"(address), "f"(value) : "memory");
}

__device__ __forceinline__ void red_add(double* address, double value) {
  asm volatile("red.relaxed.sys.global.add.f64 [%0], %1;" ::"l"(address), "d"(value) : "memory");
}

// Four consecutive fp32 elements, `address` 16-byte aligned: one vector reduction on sm_90+.
__device__ __forceinline__ void red_add4(float* address, const float (&v)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.relaxed.sys.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(address), "f"(v[0]), "f"(v[1]),
               "f"(v[2]), "f"(v[3])
               : "memory");
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

// Load 4 source elements as float; one vector load when the caller guarantees alignment.
template <bool kVector>
__device__ __forceinline__ void load4(const float* src, float (&v)[4]) {
  if (kVector) {
    const float4 x = *reinterpret_cast<const float4*>(src);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = src[k];
  }
}

template <bool kVector, typename Half>
__device__ __forceinline__ void load4_16bit(const Half* src, float (&v)[4]) {
  if (kVector) {
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
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
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = thread; g < groups; g += stride) {
    const int64_t i = head + 4 * g;
    float v[4];
    load4<kVector>(src + i, v);
    red_add4(dst + i, v);
  }
  const int64_t tail_start = head + 4 * groups;
  const int64_t edges = head + (numel - tail_start);
  for (int64_t e = thread; e < edges; e += stride) {
    const int64_t i = e < head ? e : tail_start + (e - head);
    red_add(dst + i, static_cast<Acc>(to_float(src[i])));
  }
}

template <typename Src, typename Acc>
cudaError_t launch_typed(Acc* dst, const Src* src, int64_t numel, int64_t head, int64_t groups, bool vector_loads,
                         int blocks, int threads, cudaStream_t stream) {
  if (vector_loads) {
    scatter_add_kernel<Src, Acc, true><<<blocks, threads, 0, stream>>>(dst, src, numel, head, groups);
  } else {
    scatter_add_kernel<Src, Acc, false><<<blocks, threads, 0, stream>>>(dst, src, numel, head, groups);
  }
  return cudaGetLastError();
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
