// NcclTransport without NCCL (the CPU build, or a CUDA build that found no
// nccl.h): every call says how to get it. The real one is core/cuda/nccl.cu.
#include "embedcore/embedcore.h"

namespace embedcore {

struct NcclTransport::Impl {};

namespace {
[[noreturn]] void NoNccl() {
  throw NotCompiled(
      "this embedcore was built without NCCL: the nccl communicator needs the CUDA build "
      "(EMBEDCORE_CUDA=ON) with NCCL's headers (pip install nvidia-nccl-cu13)");
}
}  // namespace

std::string NcclTransport::UniqueId(const std::string&) { NoNccl(); }
NcclTransport::NcclTransport(const std::string&, const std::string&, int, int, int) { NoNccl(); }
NcclTransport::~NcclTransport() = default;
int NcclTransport::size() const { NoNccl(); }
int NcclTransport::rank() const { NoNccl(); }
int NcclTransport::device() const { NoNccl(); }
void NcclTransport::AllToAllV(const void*, const std::vector<uint64_t>&, void*, const std::vector<uint64_t>&,
                              uintptr_t) {
  NoNccl();
}
void NcclTransport::AllToAllVHost(const void*, const std::vector<uint64_t>&, void*, const std::vector<uint64_t>&) {
  NoNccl();
}

}  // namespace embedcore
