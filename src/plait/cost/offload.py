"""Memory below the GPU: activations swapped to host memory token-wise (MEMO) and model states offloaded to
the host CPU, which runs the optimizer step (ZeRO-Offload, Angel-PTM). Seconds and bytes, per device.

Swapping: a share `swap` of a layer's saved activations (a slice of its tokens) is copied to host memory
during the layer's forward and back during its backward; the copies run on the GPU's copy engines beside
the layer's compute, so only what outlasts that compute is exposed (MEMO, Sec. 4). Device memory keeps the
rest; host memory holds the swapped bytes of every micro-batch in flight.

Offload (`offload="optim"`): the fp32 master weights, Adam moments and fp32 gradients of the device's
optimizer shard live in host memory; each micro-batch's 16-bit gradients stream to the host during backward,
the CPU runs Adam, and the updated 16-bit weights are copied back before the next step.

Parameter paging (`offload="params"`): as "optim", and the device's 16-bit parameter shard lives in host
memory too; it is copied to the device before each layer's forward and again before its backward (ZeRO-Infinity,
FSDP2's CPUOffloadPolicy), beside the previous layer's compute, and the device holds only the layers in flight
(the current and the prefetched one). The updated weights need no copy back after the step.

NVMe (`offload="nvme"`): as "params", and the shard, fp32 gradients and optimizer states live on the node's
NVMe instead of host memory (ZeRO-Infinity); their copies run at the device's share of the NVMe bandwidth
(when below its host link), and the CPU's step reads and writes the states there, overlapped with its Adam
(ZeRO-Infinity's overlap-centric design). NVMe capacity is their budget.

The host link: swap-out (device to host, forward), swap-in (host to device, backward), gradients (device to
host, backward) and weights (host to device, after the step) share each GPU's host link. PCIe and C2C are full
duplex, so only traffic in one direction at the same time contends: in backward the swap-in runs against
nothing else in its direction and the gradients against nothing in theirs; each direction is priced alone.
Paged parameters travel host to device in forward (against the swap-out's other direction) and in backward
(with the swap-in, the same direction: their bytes add). Collectives do not use the link (NVLink inside the node; the NICs reach the GPU through its PCIe switch,
not the host uplink).
"""

from __future__ import annotations

from plait.cost import comm
from plait.cost.precision import PrecisionBytes
from plait.plan import Strategy
from plait.spec.cluster import Cluster

HOST_ADAM_PARAMS_PER_S = 4e9
"""Parameters per second that one node's CPUs update with Adam (fp32 master weights, moments and gradient in
host memory): DeepSpeed's vectorised CPU-Adam, about 0.25 s per billion parameters on a two-socket server
(ZeRO-Offload, Ren et al. USENIX ATC 2021, Sec. 5; DeepSpeed's tutorial: 5-7x torch.optim.Adam on CPU).
Shared by the node's GPUs."""
HOST_GRAD_BYTES = 4
"""Bytes per parameter of the fp32 gradient that offload keeps in host memory (ZeRO-Offload accumulates
gradients on the CPU in fp32)."""
PAGED_LAYERS_IN_FLIGHT = 2
"""Layers whose paged parameters a device holds at once: the one computing and the one prefetched beside it
(FSDP2 prefetches the next unit; ZeRO-Infinity's prefetch of the next sub-module)."""
SWAP_COMPUTE_CONTENTION = 0.0
"""Share of compute throughput lost while a host copy runs beside it: the copy engines move the bytes
without SMs (MEMO hides swapping completely when the link is fast enough)."""


def host_copy_time(nbytes: float, cluster: Cluster) -> float:
    """Seconds to copy `nbytes` one way between one GPU and host memory, every GPU of the node copying."""
    if nbytes <= 0:
        return 0.0
    link = cluster.host_side.link
    return link.latency + nbytes / link.bandwidth


def resident_activation(activation: float, s: Strategy) -> float:
    """Bytes of a layer's `activation` saved bytes that stay on the device under `s` (the rest is swapped)."""
    return activation * (1.0 - s.swap)


def swapped_activation(activation: float, s: Strategy) -> float:
    """Bytes of a layer's `activation` saved bytes that `s` swaps to host memory per micro-batch."""
    return activation * s.swap


def offloaded_states(gradients: float, optimizer: float, s: Strategy, prec: PrecisionBytes
                     ) -> tuple[float, float, float]:
    """(device gradient bytes, device optimizer bytes, host bytes) of a device whose model states would be
    `gradients` and `optimizer` bytes: under offload the optimizer state and an fp32 gradient of the same
    shard move to host memory (the device keeps only the gradient bucket in flight, counted elsewhere)."""
    if s.offload == "none":
        return gradients, optimizer, 0.0
    return 0.0, 0.0, optimizer * (1.0 + HOST_GRAD_BYTES / prec.optimizer)


PAGED = ("params", "nvme")
"""Offload choices that page the parameter shard in per layer."""


def state_copy_time(nbytes: float, s: Strategy, cluster: Cluster) -> float:
    """Seconds to copy `nbytes` of offloaded model state one way for one GPU, every GPU of the node copying:
    over the host link, or under offload="nvme" at the lower of the link and the GPU's share of the node's
    NVMe bandwidth (infinite without NVMe)."""
    if s.offload != "nvme" or nbytes <= 0:
        return host_copy_time(nbytes, cluster)
    host = cluster.host_side
    rate = min(host.link.bandwidth, host.nvme_bandwidth / cluster.gpus_per_node)
    return host.link.latency + nbytes / rate if rate > 0 else float("inf")


def placed(offloaded: float, s: Strategy) -> tuple[float, float]:
    """(host memory, NVMe) bytes of a layer's `offloaded` model-state bytes under `s`."""
    return (0.0, offloaded) if s.offload == "nvme" else (offloaded, 0.0)


def paged_weights(weights: float, s: Strategy) -> tuple[float, float]:
    """(device, offloaded) bytes of a layer's `weights` bytes of parameter shard under `s`: paged in under
    offload="params" or "nvme", else kept on the device."""
    return (0.0, weights) if s.offload in PAGED else (weights, 0.0)


def paged_buffers(params: float, s: Strategy, prec: PrecisionBytes, gathered: float) -> float:
    """Device bytes of a paged layer's parameters in flight (PAGED_LAYERS_IN_FLIGHT unsharded 16-bit copies of
    its `params` parameters), beyond the `gathered` bytes ZeRO-3's all-gather already holds for them."""
    if s.offload not in PAGED:
        return 0.0
    return max(0.0, PAGED_LAYERS_IN_FLIGHT * params * prec.param - gathered)


def link_time(swapped: float, gradients: float, forward_s: float, backward_s: float, s: Strategy,
              cluster: Cluster, prec: PrecisionBytes, paged: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds that a layer's host traffic adds to passes computing for `forward_s` and
    `backward_s`: `swapped` bytes out in forward and back in backward, under offload its 16-bit gradient
    (`gradients` bytes as the device would hold them, fp32-sized) out in backward, and under
    offload="params" its `paged` bytes of parameter shard in before each pass; each beside the pass's compute
    (`comm.overlapped`), the two directions apart (full duplex)."""
    if s.swap == 0 and s.offload == "none":
        return 0.0, 0.0
    page_in = state_copy_time(paged, s, cluster) if s.offload in PAGED else 0.0
    out_f = host_copy_time(swapped, cluster)
    back_in = host_copy_time(swapped, cluster) + page_in
    grads_out = state_copy_time(gradients * prec.param / prec.grad, s, cluster) if s.offload != "none" else 0.0
    fwd = comm.overlapped(max(out_f, page_in), forward_s, SWAP_COMPUTE_CONTENTION)
    bwd = comm.overlapped(max(back_in, grads_out), backward_s, SWAP_COMPUTE_CONTENTION)
    return fwd, bwd


def weights_back_time(params: float, s: Strategy, cluster: Cluster, prec: PrecisionBytes, shards: int
                      ) -> float:
    """Seconds per step copying the updated 16-bit weights of an offloaded optimizer shard (`params`
    parameters over `shards` devices) from host to device, exposed after the CPU's step (paged parameters
    stay on the host: none)."""
    if s.offload != "optim":
        return 0.0
    return host_copy_time(params / shards * prec.param, cluster)


def host_optimizer_time(local_params: float, cluster: Cluster, nvme_bytes: float = 0.0) -> float:
    """Seconds of the CPU's Adam step over one device's `local_params` offloaded parameters, the node's CPUs
    shared by its GPUs (HOST_ADAM_PARAMS_PER_S), overlapped with reading and writing the device's `nvme_bytes`
    of states on the node's NVMe (shared by its GPUs; infinite without NVMe)."""
    adam = local_params * cluster.gpus_per_node / HOST_ADAM_PARAMS_PER_S
    if nvme_bytes <= 0:
        return adam
    bandwidth = cluster.host_side.nvme_bandwidth
    io = 2 * nvme_bytes * cluster.gpus_per_node / bandwidth if bandwidth > 0 else float("inf")
    return max(adam, io)
