"""Point-to-point exchange of payloads (tensors inside dicts, lists and tuples) between ranks.

Each peer gets one payload (whatever the caller groups for it: a list of samples, a dict of
column tensors), sent as one uint8 buffer:

    [pickled header | pad to 16 B | tensor 0 bytes | pad | tensor 1 bytes | pad | ...]

The header holds the payload's structure with its tensors replaced by _TensorRef(i), and each
tensor's dtype, shape, byte offset and whether it lived on a GPU. Tensors are copied into the
buffer raw (no pickling), so on NCCL CUDA tensors go GPU to GPU. Two rounds of batched
isend/irecv: the buffer sizes first, then the buffers. Senders and receivers both know from the
plan which peers exchange anything, so only those pairs talk.

Received tensors are views into their peer's receive buffer (no extra copy): each stays valid,
and the buffer is freed when the last of them is. Tensors are found inside dicts, lists and
tuples; any other object is pickled whole. Autograd history is not carried (tensors are
detached).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

_ALIGN = 16  # bytes; keeps every tensor's offset legal for a view as any dtype


class _TensorRef(NamedTuple):
    index: int


class _TensorSpec(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    is_cuda: bool


def comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device p2p buffers must live on for this group's backend."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange(
    outgoing: dict[int, Any], incoming: Sequence[int], group: dist.ProcessGroup | None
) -> dict[int, Any]:
    """Send outgoing[peer] (one payload) to each peer; return the payload each peer in
    `incoming` sent.

    Peers are ranks within `group`. Every rank must call this with matching arguments (rank a
    sends to b exactly when b expects a payload from a), which the shared plan guarantees.
    """
    device = comm_device(group)
    send = {peer: _encode(payload, device) for peer, payload in outgoing.items()}
    recv_peers = sorted(incoming)

    # Round 1: header and total sizes. Round 2: the buffers themselves.
    send_sizes = {
        peer: torch.tensor(sizes, dtype=torch.int64, device=device)
        for peer, (_, sizes) in send.items()
    }
    recv_sizes = {peer: torch.empty(2, dtype=torch.int64, device=device) for peer in recv_peers}
    _run_p2p(send_sizes, recv_sizes, group)
    recv_bufs = {
        peer: torch.empty(int(sizes[1]), dtype=torch.uint8, device=device)
        for peer, sizes in recv_sizes.items()
    }
    _run_p2p({peer: buf for peer, (buf, _) in send.items()}, recv_bufs, group)
    return {peer: _decode(buf, int(recv_sizes[peer][0])) for peer, buf in recv_bufs.items()}


def _run_p2p(
    sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], group: dist.ProcessGroup | None
) -> None:
    ops = [
        dist.P2POp(dist.isend, t, _global_rank(group, peer), group)
        for peer, t in sorted(sends.items())
    ]
    ops += [
        dist.P2POp(dist.irecv, t, _global_rank(group, peer), group)
        for peer, t in sorted(recvs.items())
    ]
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _encode(payload: Any, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    tensors: list[torch.Tensor] = []
    skeleton = _flatten(payload, tensors)
    specs = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append(_TensorSpec(t.dtype, tuple(t.shape), offset, nbytes, t.is_cuda))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    header = pickle.dumps((skeleton, specs), protocol=pickle.HIGHEST_PROTOCOL)
    start = -(-len(header) // _ALIGN) * _ALIGN
    buf = torch.empty(start + offset, dtype=torch.uint8, device=device)
    buf[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    for t, spec in zip(tensors, specs, strict=True):
        if spec.nbytes:
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[start + spec.offset : start + spec.offset + spec.nbytes].copy_(raw)
    return buf, [len(header), buf.numel()]


def _decode(buf: torch.Tensor, header_nbytes: int) -> Any:
    # Host/device sync on NCCL: the header must come to the CPU to be unpickled.
    header = buf[:header_nbytes].cpu().numpy().tobytes()
    skeleton, specs = pickle.loads(header)
    start = -(-header_nbytes // _ALIGN) * _ALIGN
    tensors = []
    for spec in specs:
        raw = buf[start + spec.offset : start + spec.offset + spec.nbytes]
        t = raw.view(spec.dtype).reshape(spec.shape)
        if spec.is_cuda and not t.is_cuda:
            # Came over a CPU backend from a GPU tensor: put it back on this rank's GPU.
            t = t.to(torch.device("cuda", torch.cuda.current_device()))
        elif not spec.is_cuda and t.is_cuda:
            t = t.cpu()
        tensors.append(t)
    return _unflatten(skeleton, tensors)


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_quantized:
            return obj.detach().cpu()  # rare layouts: pickled whole, through the CPU
        tensors.append(obj)
        return _TensorRef(len(tensors) - 1)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps dict subclasses (OrderedDict, defaultdict's factory)
        for key, value in obj.items():
            out[key] = _flatten(value, tensors)
        return out
    if isinstance(obj, list):
        return [_flatten(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        items = [_flatten(v, tensors) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _unflatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorRef):
        return tensors[obj.index]
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = _unflatten(value, tensors)
        return out
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        items = [_unflatten(v, tensors) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj
