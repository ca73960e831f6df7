// The nccl communicator's transport: NCCL loaded at run time (dlopen), so a
// CUDA build imports without it and finds the library of the nvidia-nccl
// wheel or the system's (STYLE habit 15). Each entry point is typed from
// nccl.h by decltype, so a mismatch with the header fails to compile.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <mutex>
#include <string>
#include <vector>

#include "cuda/cuda_impl.h"
#include "cuda/cuda_util.cuh"

namespace embedcore {
using cuda_impl::AsStream;
using cuda_impl::DeviceGuard;
using cuda_impl::Scratch;

namespace {

struct NcclApi {
  void* handle = nullptr;
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRank) CommInitRank = nullptr;
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  decltype(&ncclSend) Send = nullptr;
  decltype(&ncclRecv) Recv = nullptr;
  decltype(&ncclGroupStart) GroupStart = nullptr;
  decltype(&ncclGroupEnd) GroupEnd = nullptr;
};

template <typename F>
void Resolve(void* handle, const char* name, F* out, const std::string& library) {
  *out = reinterpret_cast<F>(::dlsym(handle, name));
  if (*out == nullptr) throw NotCompiled(library + ": has no " + name + " (an NCCL older than 2.7?)");
}

// Loads NCCL once per process; `library` is a path or a soname.
const NcclApi& Api(const std::string& library) {
  static std::mutex mutex;
  static NcclApi api;
  static std::string loaded;
  std::lock_guard<std::mutex> lock(mutex);
  if (api.handle != nullptr) return api;
  const std::string name = library.empty() ? "libnccl.so.2" : library;
  void* h = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* why = ::dlerror();
    throw NotCompiled("NCCL could not be loaded from '" + name + "': " + (why ? why : "unknown error") +
                      " (pip install nvidia-nccl-cu13, or give the library's path)");
  }
  NcclApi a;
  a.handle = h;
  Resolve(h, "ncclGetUniqueId", &a.GetUniqueId, name);
  Resolve(h, "ncclCommInitRank", &a.CommInitRank, name);
  Resolve(h, "ncclCommDestroy", &a.CommDestroy, name);
  Resolve(h, "ncclCommGetAsyncError", &a.CommGetAsyncError, name);
  Resolve(h, "ncclGetErrorString", &a.GetErrorString, name);
  Resolve(h, "ncclSend", &a.Send, name);
  Resolve(h, "ncclRecv", &a.Recv, name);
  Resolve(h, "ncclGroupStart", &a.GroupStart, name);
  Resolve(h, "ncclGroupEnd", &a.GroupEnd, name);
  api = a;
  loaded = name;
  return api;
}

void CheckNccl(const NcclApi& api, ncclResult_t r, const char* call) {
  if (r != ncclSuccess) throw std::runtime_error(std::string("NCCL error in ") + call + ": " + api.GetErrorString(r));
}

}  // namespace

struct NcclTransport::Impl {
  const NcclApi* api = nullptr;
  ncclComm_t comm = nullptr;
  int size = 0, rank = 0, device = 0;
};

std::string NcclTransport::UniqueId(const std::string& library) {
  const NcclApi& api = Api(library);
  ncclUniqueId id;
  CheckNccl(api, api.GetUniqueId(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

NcclTransport::NcclTransport(const std::string& library, const std::string& unique_id, int size, int rank, int device)
    : impl_(new Impl) {
  if (unique_id.size() != NCCL_UNIQUE_ID_BYTES)
    throw InvalidArgument("nccl: the unique id must be " + std::to_string(NCCL_UNIQUE_ID_BYTES) + " bytes, got " +
                          std::to_string(unique_id.size()));
  if (size < 1 || rank < 0 || rank >= size)
    throw InvalidArgument("nccl: rank " + std::to_string(rank) + " of " + std::to_string(size) + " is impossible");
  if (device < 0 || device >= cuda_impl::DeviceCount())
    throw InvalidArgument("nccl: no CUDA device cuda:" + std::to_string(device));
  impl_->api = &Api(library);
  impl_->size = size;
  impl_->rank = rank;
  impl_->device = device;
  ncclUniqueId id;
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  DeviceGuard guard(device);
  CheckNccl(*impl_->api, impl_->api->CommInitRank(&impl_->comm, size, id, rank), "ncclCommInitRank");
}

NcclTransport::~NcclTransport() {
  if (impl_ && impl_->comm) impl_->api->CommDestroy(impl_->comm);
}

int NcclTransport::size() const { return impl_->size; }
int NcclTransport::rank() const { return impl_->rank; }
int NcclTransport::device() const { return impl_->device; }

void NcclTransport::AllToAllV(const void* send, const std::vector<uint64_t>& send_bytes, void* recv,
                         const std::vector<uint64_t>& recv_bytes, uintptr_t stream) {
  const NcclApi& api = *impl_->api;
  if (send_bytes.size() != size_t(impl_->size) || recv_bytes.size() != size_t(impl_->size))
    throw InvalidArgument("nccl all_to_all_v: one count per rank is needed");
  DeviceGuard guard(impl_->device);
  const cudaStream_t s = AsStream(stream);
  uint64_t so = 0, ro = 0;
  CheckNccl(api, api.GroupStart(), "ncclGroupStart");
  // The group is ended whatever fails inside it: NCCL's group depth is the thread's, and a group left open would
  // swallow the next collective's calls.
  ncclResult_t failed = ncclSuccess;
  const char* failed_call = "";
  for (int peer = 0; peer < impl_->size && failed == ncclSuccess; ++peer) {
    if (send_bytes[peer] > 0) {
      failed = api.Send(static_cast<const char*>(send) + so, send_bytes[peer], ncclUint8, peer, impl_->comm, s);
      failed_call = "ncclSend";
    }
    if (failed == ncclSuccess && recv_bytes[peer] > 0) {
      failed = api.Recv(static_cast<char*>(recv) + ro, recv_bytes[peer], ncclUint8, peer, impl_->comm, s);
      failed_call = "ncclRecv";
    }
    so += send_bytes[peer];
    ro += recv_bytes[peer];
  }
  const ncclResult_t ended = api.GroupEnd();
  CheckNccl(api, failed, failed_call);
  CheckNccl(api, ended, "ncclGroupEnd");
  EC_CUDA(cudaStreamSynchronize(s));
  ncclResult_t async = ncclSuccess;
  CheckNccl(api, api.CommGetAsyncError(impl_->comm, &async), "ncclCommGetAsyncError");
  CheckNccl(api, async, "the all-to-all (asynchronous error)");
}

void NcclTransport::AllToAllVHost(const void* send, const std::vector<uint64_t>& send_bytes, void* recv,
                             const std::vector<uint64_t>& recv_bytes) {
  uint64_t sn = 0, rn = 0;
  for (uint64_t b : send_bytes) sn += b;
  for (uint64_t b : recv_bytes) rn += b;
  DeviceGuard guard(impl_->device);
  cudaStream_t s;
  EC_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  try {
    Scratch<char> dsend(size_t(sn), s), drecv(size_t(rn), s);
    if (sn) EC_CUDA(cudaMemcpyAsync(dsend.get(), send, size_t(sn), cudaMemcpyHostToDevice, s));
    AllToAllV(dsend.get(), send_bytes, drecv.get(), recv_bytes, reinterpret_cast<uintptr_t>(s));
    if (rn) EC_CUDA(cudaMemcpyAsync(recv, drecv.get(), size_t(rn), cudaMemcpyDeviceToHost, s));
    EC_CUDA(cudaStreamSynchronize(s));
  } catch (...) {
    cudaStreamDestroy(s);
    throw;
  }
  EC_CUDA(cudaStreamSynchronize(s));
  cudaStreamDestroy(s);
}

}  // namespace embedcore
