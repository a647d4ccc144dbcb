// Communicators for a run whose tensors live in device memory (docs/design.md §6.11): the engine
// keeps one Communicator per group and passes it both kinds of buffer — tensors (activations,
// gradients, parameters) in device memory, and host values (losses, expert loads, counts,
// checkpoint pieces). A routing communicator sends each call to one of two communicators of the
// same group by where its buffers are: device buffers to `device` (NCCL on a GPU), host buffers
// to `host` (MPI). Every member makes the same calls on buffers of the same kind, so both
// communicators see their operations in the same order on every member. A call given one host
// and one device buffer is refused (CommError); a null pointer (an empty buffer) takes the kind
// of the call's other buffer, or the device's when it has none, which keeps the members agreed
// where one of them has nothing to send.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "dstrain/kernels/backend.h"
#include "engine/comm/communicator.h"

namespace dstrain::comm {

// `on_device(p)`: whether p is device memory (kernels::Backend::is_device_memory). name, rank and
// size are the host communicator's; seq() counts the calls of both.
std::unique_ptr<Communicator> make_routing_communicator(std::unique_ptr<Communicator> host,
                                                        std::unique_ptr<Communicator> device,
                                                        std::function<bool(const void*)> on_device);

// A communicator over `inner` for buffers whose host address is to_host(p) (device memory that
// is host memory in fact: kernels::Backend::host_mapping, the device-check backend). Stands in
// for NCCL in tests without a GPU, with NCCL's ordering: an operation is issued to `inner` only
// when the ones issued before it on this communicator have completed (a group's together), so
// a schedule that would hang on NCCL fails here — a wait past `timeout_s` throws CommError
// saying why — where MPI's independent progress would let it pass. Like NCCL it maps no peer
// memory (register_peer_memory is false). to_host(p) of a pointer it cannot map (nullptr) is
// refused with CommError. Each operation's buffers are recorded with record_use (the backend's
// Backend::record_use; may be empty) as one kernels::StreamUse that finishes with the operation,
// as the NCCL communicator records its completion events: the device-check backend's pool then
// keeps a block freed before the operation has finished out of reuse.
std::unique_ptr<Communicator> make_mapped_communicator(
    std::unique_ptr<Communicator> inner, std::function<void*(const void*)> to_host, double timeout_s = 600,
    std::function<void(const void*, std::shared_ptr<kernels::StreamUse>)> record_use = {});

}  // namespace dstrain::comm
