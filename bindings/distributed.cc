// nanobind bindings of the nccl communicator's transport. No engine logic:
// host bytes in and out, the GIL released around the collective.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings.h"
#include "embedcore/embedcore.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace embedcore::bindings {

using Bytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using BytesOut = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void BindDistributed(nb::module_& m) {
  nb::class_<NcclTransport>(m, "NcclTransport")
      .def_static(
          "unique_id", [](const std::string& library) { return nb::bytes(NcclTransport::UniqueId(library).c_str(),
                                                                          128); },
          "library"_a, "A new NCCL unique id (128 bytes) for rank 0 to share with the others.")
      .def(
          "__init__",
          [](NcclTransport* self, const std::string& library, nb::bytes unique_id, int size, int rank, int device) {
            const std::string id(unique_id.c_str(), unique_id.size());
            ReleaseGil release;  // every rank blocks here until all have joined
            new (self) NcclTransport(library, id, size, rank, device);
          },
          "library"_a, "unique_id"_a, "size"_a, "rank"_a, "device"_a)
      .def_prop_ro("size", &NcclTransport::size)
      .def_prop_ro("rank", &NcclTransport::rank)
      .def_prop_ro("device", &NcclTransport::device)
      .def(
          "all_to_all_v_host",
          [](NcclTransport& t, const Bytes& send, const std::vector<uint64_t>& send_bytes, const BytesOut& recv,
             const std::vector<uint64_t>& recv_bytes) {
            uint64_t sn = 0, rn = 0;
            for (uint64_t b : send_bytes) sn += b;
            for (uint64_t b : recv_bytes) rn += b;
            if (sn != send.size() || rn != recv.size())
              throw InvalidArgument("all_to_all_v_host: the counts do not add up to the buffers' sizes");
            ReleaseGil release;
            t.AllToAllVHost(send.data(), send_bytes, recv.data(), recv_bytes);
          },
          "send"_a.noconvert(), "send_bytes"_a, "recv"_a.noconvert(), "recv_bytes"_a,
          "Sends send_bytes[p] bytes of `send` to each rank p and receives recv_bytes[p] into `recv`, in rank order.");
}

}  // namespace embedcore::bindings
