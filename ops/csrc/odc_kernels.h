// Launchers of ds_odc's CUDA kernels. Plain CUDA (no torch headers), so the kernels compile with
// nvcc alone; odc_ops.cpp binds them to Python.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace odc {

// Element types the scatter-accumulate accepts.
enum class AccKind : int { kFloat32 = 0, kFloat64 = 1 };
enum class SrcKind : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Adds src[0:numel) (converted to the accumulator type) into dst[0:numel) with system-scope
// reduction stores (red.relaxed.sys.global.add): correct under concurrent pushes from other
// processes and GPUs, no return value, no lock, no acknowledgement.
//
// Work split (computed on the host by ds_odc.comm.push_plan, which documents and tests it):
//   * body:  `groups` groups of 4 elements starting at `head`; for an fp32 accumulator,
//            dst + head is 16-byte aligned, so each group is one vector reduction on sm_90+;
//            `vector_loads` says src + head is aligned for one 4-element vector load;
//   * edges: elements [0, head) and [head + 4 * groups, numel), one scalar reduction each.
// Launched on `stream` with `blocks` x `threads` (grid-stride loops; blocks bound the SMs used).
cudaError_t launch_scatter_add(void* dst, AccKind acc, const void* src, SrcKind src_kind, int64_t numel,
                               int64_t head, int64_t groups, bool vector_loads, int blocks, int threads,
                               cudaStream_t stream);

}  // namespace odc
