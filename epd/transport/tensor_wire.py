"""Tensors on the wire: dtype + shape + raw bytes, split into chunks under the message limit.

No pickle. A tensor is sent as TensorChunk messages; the first carries dtype, shape and
total size, every chunk carries its byte offset. The receiver preallocates the whole buffer
and copies each chunk into place once.

`WireTensor` is a tensor in that wire form (dtype name, shape, bytes), without torch: the gateway
relays the encoder's visual embeddings to prefill as one, and never imports torch (its start-up
stays short). The services turn it into a torch.Tensor (`WireTensor.to_torch`, sharing the bytes)
and send torch tensors straight; torch is imported inside the functions that need it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epd.stages.errors import InvalidRequest, ResourceExhausted
from epd.stages.server_config import CHUNK_BYTES
from epd.v1 import common_pb2

if TYPE_CHECKING:
    import torch

ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}
"""Bytes per element of each dtype the wire carries, by its wire name (torch's dtype name)."""

_ARRAY_CODES = {"int64": "q", "int32": "i", "uint8": "B", "bool": "B"}
"""`array` type codes of the dtypes `WireTensor.tolist` / `from_list` handle (index and mask data)."""


@dataclass(frozen=True)
class WireTensor:
    """A tensor as the wire carries it: dtype name, shape, row-major bytes in this machine's byte
    order (the services run on one architecture). Holds no torch object."""

    dtype: str
    """A key of ITEM_BYTES ("float32", "bfloat16", "int64", "bool", ...)."""
    shape: tuple[int, ...]
    data: bytes | bytearray
    """numel * ITEM_BYTES[dtype] bytes."""

    @property
    def num_bytes(self) -> int:
        return len(self.data)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def to_torch(self) -> torch.Tensor:
        """The tensor, sharing `data` when it is a bytearray (no copy)."""
        import torch

        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        buf = self.data if isinstance(self.data, bytearray) else bytearray(self.data)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(self.shape)

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> WireTensor:
        if str(tensor.dtype).removeprefix("torch.") not in ITEM_BYTES:
            raise TypeError(f"cannot send dtype {tensor.dtype}")
        return cls(_dtype_name(tensor), tuple(tensor.shape), _tensor_bytes(tensor).tobytes())

    @classmethod
    def from_list(cls, values: list[int] | list[bool], dtype: str) -> WireTensor:
        """A 1-D integer or bool tensor ([len(values)]) from Python values."""
        code = _ARRAY_CODES[dtype]
        return cls(dtype, (len(values),), array(code, [int(v) for v in values]).tobytes())

    def tolist(self) -> list[Any]:
        """Python values, nested by shape like torch.Tensor.tolist(); integer and bool dtypes only
        (the index and mask data of the boundary types, never embeddings)."""
        if self.dtype not in _ARRAY_CODES:
            raise TypeError(f"tolist of a {self.dtype} wire tensor needs torch; use to_torch()")
        flat: list[Any] = array(_ARRAY_CODES[self.dtype], self.data).tolist()
        if self.dtype == "bool":
            flat = [bool(v) for v in flat]
        for d in reversed(self.shape[1:]):
            flat = [flat[i : i + d] for i in range(0, len(flat), d)] if d else []
        return flat if self.shape else flat[0]


if TYPE_CHECKING:
    AnyTensor = torch.Tensor | WireTensor


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, row-major, as a memoryview of a CPU copy (or of the tensor itself)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)  # [num_bytes]
    return memoryview(flat.numpy())  # type: ignore[arg-type]


def tensor_bytes(tensor: AnyTensor) -> bytes:
    """Raw bytes of a torch.Tensor or a WireTensor."""
    return bytes(tensor.data) if isinstance(tensor, WireTensor) else _tensor_bytes(tensor).tobytes()


def tensor_num_bytes(tensor: AnyTensor) -> int:
    """Payload bytes of a torch.Tensor or a WireTensor: what `tensor_to_chunks` sends of it."""
    return tensor.num_bytes if isinstance(tensor, WireTensor) else tensor.numel() * tensor.element_size()


def tensor_to_chunks(
    name: str, tensor: AnyTensor, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[common_pb2.TensorChunk]:
    """Yields the chunks of one tensor, torch or wire form (at least one, even when empty)."""
    if isinstance(tensor, WireTensor):
        dtype, shape, raw = tensor.dtype, tensor.shape, memoryview(tensor.data)
    else:
        dtype, shape = _dtype_name(tensor), tuple(tensor.shape)
        if dtype not in ITEM_BYTES:
            raise TypeError(f"cannot send dtype {tensor.dtype}")
        raw = _tensor_bytes(tensor)
    total = len(raw)
    offset = 0
    while True:
        piece = raw[offset : offset + chunk_bytes]
        msg = common_pb2.TensorChunk(name=name, offset_bytes=offset, data=piece.tobytes())
        if offset == 0:
            msg.dtype = dtype
            msg.shape.extend(shape)
            msg.total_bytes = total
        yield msg
        offset += len(piece)
        if offset >= total:
            return


class TensorAssembler:
    """Rebuilds named tensors from chunks, enforcing a total byte budget."""

    def __init__(self, max_total_bytes: int) -> None:
        self.max_total_bytes = max_total_bytes
        self._buffers: dict[str, tuple[bytearray, str, tuple[int, ...]]] = {}
        self._received: dict[str, int] = {}
        self.total_bytes = 0

    def add(self, chunk: common_pb2.TensorChunk) -> None:
        if chunk.name not in self._buffers:
            if chunk.offset_bytes != 0 or chunk.dtype not in ITEM_BYTES:
                raise InvalidRequest(f"tensor {chunk.name!r} must start with a header chunk")
            numel = 1
            for d in chunk.shape:
                if d < 0:
                    raise InvalidRequest(f"tensor {chunk.name!r} has a negative dimension")
                numel *= d
            if numel * ITEM_BYTES[chunk.dtype] != chunk.total_bytes:
                raise InvalidRequest(f"tensor {chunk.name!r}: shape and total_bytes disagree")
            self.total_bytes += chunk.total_bytes
            if self.total_bytes > self.max_total_bytes:
                raise ResourceExhausted(
                    f"tensors exceed this server's transfer limit of {self.max_total_bytes} bytes; "
                    "send fewer frames or enable token dropping"
                )
            self._buffers[chunk.name] = (bytearray(chunk.total_bytes), chunk.dtype, tuple(chunk.shape))
            self._received[chunk.name] = 0
        buf, _, _ = self._buffers[chunk.name]
        end = chunk.offset_bytes + len(chunk.data)
        if chunk.offset_bytes != self._received[chunk.name] or end > len(buf):
            raise InvalidRequest(
                f"tensor {chunk.name!r}: chunk at offset {chunk.offset_bytes} is out of order"
            )
        buf[chunk.offset_bytes : end] = chunk.data
        self._received[chunk.name] = end

    def wire_tensors(self) -> dict[str, WireTensor]:
        """The tensors in wire form (no torch), each complete; the gateway relays these."""
        out = {}
        for name, (buf, dtype, shape) in self._buffers.items():
            if self._received[name] != len(buf):
                raise InvalidRequest(
                    f"tensor {name!r} ended after {self._received[name]} of {len(buf)} bytes"
                )
            out[name] = WireTensor(dtype, shape, buf)
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as torch tensors sharing the received buffers (the services)."""
        return {name: t.to_torch() for name, t in self.wire_tensors().items()}


def assemble(chunks: Iterable[common_pb2.TensorChunk], max_total_bytes: int) -> dict[str, torch.Tensor]:
    asm = TensorAssembler(max_total_bytes)
    for c in chunks:
        asm.add(c)
    return asm.tensors()
