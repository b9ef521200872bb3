// Python binding of ds_odc's CUDA IPC operators (JIT-built by ds_odc.ops_builder).
//
//   alloc_window(nbytes, device)            -> (uint8 tensor, 64-byte IPC handle)
//   open_window(handle, nbytes, device)     -> uint8 tensor mapping a peer's window
//   scatter_add(dst, src, head, groups, vector_loads, blocks, threads)   on the current stream
//   p2p_attributes(device, peer_device)     -> (access_supported, native_atomic_supported)
//
// Windows are cudaMalloc'ed directly (not from torch's caching allocator) so that an IPC handle
// covers exactly one window, and so that the allocator never hands a window's memory to another
// tensor while peers still have it mapped. The tensors own their memory: the last reference frees
// it (cudaFree for an owner, cudaIpcCloseMemHandle for a peer mapping).
//
// Every window tensor is made with an explicit target device, the device of the rank that uses it
// (window_tensor below). torch::from_blob without one asks the driver which device the pointer
// belongs to, and for a peer's IPC mapping on a multi-GPU node that is likely the *peer's* GPU: ATen
// then refuses the tensor ("Specified device cuda:0 does not match device of data cuda:1"). The
// mapping is addressable from the local device (unified addressing, peer access enabled by
// cudaIpcOpenMemHandle), which is where this rank's pulls and pushes run.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <utility>

#include "odc_kernels.h"

namespace {

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "ds_odc cuda_ipc: ", what, " failed: ", cudaGetErrorString(err));
}

torch::TensorOptions byte_options(int64_t device) {
  return torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA, static_cast<c10::DeviceIndex>(device));
}

// A uint8 tensor of `nbytes` over `ptr`, on the local CUDA device `device` whatever device the driver
// reports for `ptr` (see the file comment); `release` runs when the last reference is gone.
torch::Tensor window_tensor(void* ptr, int64_t nbytes, int64_t device, std::function<void(void*)> release) {
  const c10::Device local(torch::kCUDA, static_cast<c10::DeviceIndex>(device));
  return at::for_blob(ptr, {nbytes})
      .deleter(std::move(release))
      .target_device(local)
      .options(byte_options(device))
      .make_tensor();
}

std::tuple<torch::Tensor, pybind11::bytes> alloc_window(int64_t nbytes, int64_t device) {
  TORCH_CHECK(nbytes >= 0, "ds_odc cuda_ipc: window size must be >= 0, got ", nbytes);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  check_cuda(cudaMalloc(&ptr, nbytes > 0 ? nbytes : 1), "cudaMalloc of a window");
  cudaIpcMemHandle_t handle;
  cudaError_t err = cudaMemset(ptr, 0, nbytes);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();  // peers must see zeros, not stale memory
  if (err == cudaSuccess) err = cudaIpcGetMemHandle(&handle, ptr);
  if (err != cudaSuccess) {
    cudaFree(ptr);
    check_cuda(err, "preparing a window for IPC");
  }
  auto release = [device](void* p) {
    c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device));
    cudaFree(p);
  };
  auto window = window_tensor(ptr, nbytes, device, release);
  return {window, pybind11::bytes(reinterpret_cast<const char*>(&handle), sizeof(handle))};
}

torch::Tensor open_window(const std::string& handle_bytes, int64_t nbytes, int64_t device) {
  TORCH_CHECK(handle_bytes.size() == sizeof(cudaIpcMemHandle_t), "ds_odc cuda_ipc: an IPC handle has ",
              sizeof(cudaIpcMemHandle_t), " bytes, got ", handle_bytes.size());
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, handle_bytes.data(), sizeof(handle));
  void* ptr = nullptr;
  check_cuda(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  auto release = [device](void* p) {
    c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device));
    cudaIpcCloseMemHandle(p);
  };
  return window_tensor(ptr, nbytes, device, release);
}

void scatter_add(torch::Tensor dst, torch::Tensor src, int64_t head, int64_t groups, bool vector_loads, int64_t blocks,
                 int64_t threads) {
  TORCH_CHECK(dst.is_cuda() && src.is_cuda(), "ds_odc scatter_add: both tensors must be on a CUDA device");
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "ds_odc scatter_add: tensors must be contiguous");
  TORCH_CHECK(dst.numel() == src.numel(), "ds_odc scatter_add: ", src.numel(), " source elements for ",
              dst.numel(), " accumulator elements");
  const int64_t numel = dst.numel();
  TORCH_CHECK(head >= 0 && groups >= 0 && head + 4 * groups <= numel, "ds_odc scatter_add: plan (head ", head,
              ", groups ", groups, ") does not fit ", numel, " elements");
  odc::AccKind acc;
  if (dst.scalar_type() == torch::kFloat32) {
    acc = odc::AccKind::kFloat32;
  } else if (dst.scalar_type() == torch::kFloat64) {
    acc = odc::AccKind::kFloat64;
  } else {
    TORCH_CHECK(false, "ds_odc scatter_add: accumulator must be float32 or float64, got ", dst.scalar_type());
  }
  odc::SrcKind src_kind;
  switch (src.scalar_type()) {
    case torch::kFloat32: src_kind = odc::SrcKind::kFloat32; break;
    case torch::kBFloat16: src_kind = odc::SrcKind::kBFloat16; break;
    case torch::kFloat16: src_kind = odc::SrcKind::kFloat16; break;
    default: TORCH_CHECK(false, "ds_odc scatter_add: gradient must be float32, bfloat16 or float16, got ",
                         src.scalar_type());
  }
  // A misaligned vector access is a device fault that kills the context: refuse a wrong plan here.
  const auto dst_addr = reinterpret_cast<uintptr_t>(dst.data_ptr());
  const auto src_addr = reinterpret_cast<uintptr_t>(src.data_ptr());
  if (groups > 0 && acc == odc::AccKind::kFloat32) {
    TORCH_CHECK((dst_addr + head * 4) % 16 == 0, "ds_odc scatter_add: vector body not 16-byte aligned");
  }
  if (groups > 0 && vector_loads) {
    const int64_t width = 4 * src.element_size();
    TORCH_CHECK((src_addr + head * src.element_size()) % width == 0, "ds_odc scatter_add: source not aligned");
  }
  // The local device: the gradient's (`dst` may be a peer's mapping; window_tensor gives it the local
  // device too, but the gradient says unambiguously where this rank computes and which stream is current).
  TORCH_CHECK(dst.device() == src.device(), "ds_odc scatter_add: accumulator on ", dst.device(), ", gradient on ",
              src.device(), ": a push runs on the pushing rank's device");
  c10::cuda::CUDAGuard guard(src.device());
  check_cuda(odc::launch_scatter_add(dst.data_ptr(), acc, src.data_ptr(), src_kind, numel, head, groups, vector_loads,
                                     static_cast<int>(blocks), static_cast<int>(threads),
                                     c10::cuda::getCurrentCUDAStream().stream()),
             "scatter_add kernel launch");
}

std::tuple<bool, bool> p2p_attributes(int64_t device, int64_t peer_device) {
  if (device == peer_device) return {true, true};
  int access = 0, atomics = 0;
  check_cuda(cudaDeviceGetP2PAttribute(&access, cudaDevP2PAttrAccessSupported, static_cast<int>(device),
                                       static_cast<int>(peer_device)),
             "cudaDeviceGetP2PAttribute(AccessSupported)");
  check_cuda(cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, static_cast<int>(device),
                                       static_cast<int>(peer_device)),
             "cudaDeviceGetP2PAttribute(NativeAtomicSupported)");
  return {access != 0, atomics != 0};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_odc CUDA IPC windows and scatter-accumulate";
  m.def("alloc_window", &alloc_window, "cudaMalloc a zeroed window and export its IPC handle");
  m.def("open_window", &open_window, "map a peer's window from its IPC handle");
  m.def("scatter_add", &scatter_add, "add src into dst (fp32/fp64) with system-scope reductions");
  m.def("p2p_attributes", &p2p_attributes, "(peer access supported, native atomics supported)");
}
