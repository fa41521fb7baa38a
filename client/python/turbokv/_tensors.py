"""numpy arrays and torch tensors to and from pb.Tensor, and the argument
checks made before anything is sent.

torch is never imported here: a torch tensor can only reach the client from a
program that imported torch already, so it is looked up in sys.modules."""

from __future__ import annotations

import dataclasses
import math
import operator
import sys
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from turbokv.v1 import turbokv_pb2 as pb

_NUMPY_DTYPES = {np.dtype(np.float32): pb.DTYPE_F32, np.dtype(np.float16): pb.DTYPE_F16}
_NUMPY_OF = {pb.DTYPE_F32: np.dtype("<f4"), pb.DTYPE_F16: np.dtype("<f2")}


def torch_module() -> Any:
    """The torch module when the program has imported it, else None."""
    return sys.modules.get("torch")


def is_torch(x: Any) -> bool:
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


@dataclasses.dataclass(frozen=True)
class Kind:
    """What results come back as: numpy arrays (device None), or torch tensors on `device`."""

    device: Any = None

    @property
    def torch(self) -> bool:
        return self.device is not None


NUMPY = Kind()


def kind_of(x: Any) -> Kind:
    return Kind(x.device) if is_torch(x) else NUMPY


def _describe(dims: Sequence[Tuple[str, Optional[int]]]) -> str:
    return "[" + ", ".join(label if size is None or label == str(size) else f"{label}={size}"
                           for label, size in dims) + "]"


def check_shape(name: str, shape: Tuple[int, ...], dims: Sequence[Tuple[str, Optional[int]]]) -> None:
    """Raises ValueError naming `name` unless shape matches dims: (label, size or None for any)."""
    if len(shape) != len(dims) or any(size is not None and n != size for n, (_, size) in zip(shape, dims)):
        raise ValueError(f"{name} must be {_describe(dims)}, got shape {tuple(shape)}")


def encode(x: Any, name: str, dims: Sequence[Tuple[str, Optional[int]]]) -> Tuple[pb.Tensor, Kind]:
    """x (numpy array, torch tensor or nested lists of floats) as a pb.Tensor,
    and the Kind its results come back as. float32, float16 and (torch)
    bfloat16 travel as they are; other floating types as float32. Raises
    TypeError for values that are not floating point and ValueError for a
    shape other than dims."""
    tensor, values, kind = encode_values(x, name, dims)
    tensor.data = values.tobytes()
    return tensor, kind


def encode_values(x: Any, name: str, dims: Sequence[Tuple[str, Optional[int]]]) -> Tuple[pb.Tensor, np.ndarray, Kind]:
    """encode() without the bytes: the tensor's dtype and shape, its values
    as a contiguous array of the dtype they travel in (bfloat16 as its 16-bit
    patterns), which shared memory takes without a copy into bytes, and the
    Kind."""
    if is_torch(x):
        torch = torch_module()
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor (float32, float16 or bfloat16), got {x.dtype}")
        check_shape(name, tuple(x.shape), dims)
        t = x.detach()
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            t = t.float()
        t = t.cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return pb.Tensor(dtype=pb.DTYPE_BF16, shape=list(t.shape)), t.view(torch.int16).numpy(), Kind(x.device)
        dtype = pb.DTYPE_F32 if t.dtype == torch.float32 else pb.DTYPE_F16
        return pb.Tensor(dtype=dtype, shape=list(t.shape)), t.numpy(), Kind(x.device)
    array = np.asarray(x)
    if array.dtype.kind != "f":
        raise TypeError(f"{name} must hold floating-point values (float32, float16 or float64), got {array.dtype}")
    check_shape(name, array.shape, dims)
    dtype = _NUMPY_DTYPES.get(np.dtype(array.dtype.type), pb.DTYPE_F32)
    array = np.ascontiguousarray(array, dtype=_NUMPY_OF[dtype])
    return pb.Tensor(dtype=dtype, shape=list(array.shape)), array, NUMPY


def encode_into(values_of: Optional[Dict[str, np.ndarray]], x: Any, name: str,
                dims: Sequence[Tuple[str, Optional[int]]]) -> Tuple[pb.Tensor, Kind]:
    """encode(), or, given values_of, the tensor without its bytes and its
    values in values_of[name], for shared memory to take (_shm.place)."""
    if values_of is None:
        return encode(x, name, dims)
    tensor, values_of[name], kind = encode_values(x, name, dims)
    return tensor, kind


def decode(tensor: pb.Tensor, kind: Kind = NUMPY, data: Optional[Union[bytes, memoryview]] = None) -> Any:
    """A writable copy of tensor's values (its data, or `data` when given:
    a view of the bytes it names in shared memory): a numpy array (bf16 widened to
    float32), or for a torch Kind a tensor on its device (bf16 kept)."""
    shape = tuple(tensor.shape)
    raw = tensor.data if data is None else data
    if tensor.dtype == pb.DTYPE_BF16:
        bits = np.frombuffer(raw, dtype="<u2").reshape(shape)
        if kind.torch:
            torch = torch_module()
            return _to_device(torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16), kind)
        array = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        array = np.frombuffer(raw, dtype=_NUMPY_OF[tensor.dtype]).reshape(shape).astype(
            _NUMPY_OF[tensor.dtype].newbyteorder("="))
    return wrap(array, kind)


def wrap(array: np.ndarray, kind: Kind) -> Any:
    """A numpy array the client owns as `kind`: itself, or a torch tensor on kind's device."""
    if not kind.torch:
        return array
    return _to_device(torch_module().from_numpy(array), kind)


def _to_device(t: Any, kind: Kind) -> Any:
    return t if kind.device.type == "cpu" else t.to(kind.device)


def index(value: Any, name: str, low: int = 0, high: Optional[int] = None) -> int:
    """An int in [low, high) (no upper bound when high is None), else TypeError / ValueError naming it."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def number(value: Any, name: str) -> float:
    """A finite float >= 0, else TypeError / ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


def integers(values: Any, name: str) -> np.ndarray:
    """values (a sequence, numpy array or torch tensor of integers >= 0) as int64, else TypeError / ValueError."""
    if is_torch(values):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.size == 0:
        return array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got {array.dtype}")
    if (array < 0).any():
        raise ValueError(f"{name} must be >= 0, got {array.min()}")
    return array.astype(np.int64)
