"""What turbokv.Client and turbokv.aio.Client share: results, merge_attention,
the retry policy, and the requests each call sends, built and checked before
anything goes on the wire."""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import hashlib
import os
import random
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np
from google.protobuf import duration_pb2

from turbokv import _shm, _tensors
from turbokv.errors import TurbokvError, error_for
from turbokv.v1 import turbokv_pb2 as pb
from turbokv.v1 import turbokv_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import torch

Array = Union[np.ndarray, "torch.Tensor"]
"""A numpy array, or a torch tensor when the input was one."""

CODECS = {
    "f16": pb.CODEC_F16,
    "q8_0": pb.CODEC_Q8_0,
    "q4_0": pb.CODEC_Q4_0,
    "turbo2": pb.CODEC_TURBO2,
    "turbo3": pb.CODEC_TURBO3,
    "turbo4": pb.CODEC_TURBO4,
}
PRESETS = ("k8v4", "k4v4", "k4v3", "k3v4", "k3v3", "k2v2")
"""The named codec choices of CreateSession (docs/API.md "Choosing a codec")."""
KEY_TRANSFORMS = {
    "none": pb.KEY_TRANSFORM_NONE,
    "center": pb.KEY_TRANSFORM_CENTER,
    "center_scale": pb.KEY_TRANSFORM_CENTER_SCALE,
}
"""How a session stores its keys before their codec (docs/API.md "Keys made safe")."""
SINK_CODECS = ("f16", "q8_0")
DEFAULT_TIMEOUT = 60.0


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How idempotent calls (GetSession, ListSessions, Stats, ReadKv, Attend,
    Prefetch) are retried when turbokvd is UNAVAILABLE: at most max_attempts
    tries in all, waiting initial_backoff seconds before the second, then
    multiplier times longer each time up to max_backoff (each wait drawn
    between half and all of that, so that clients spread out). Retries stop
    at the call's deadline. Calls that change a session (Append, Step,
    CreateSession, ForkSession, TruncateSession, DeleteSession, Decode) are
    never retried. RetryPolicy(max_attempts=1) turns retries off."""

    max_attempts: int = 4
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        _tensors.index(self.max_attempts, "max_attempts", low=1)
        for name in ("initial_backoff", "max_backoff", "multiplier"):
            _tensors.number(getattr(self, name), name)
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1 the first)."""
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return random.uniform(ceiling / 2, ceiling)


@dataclasses.dataclass
class AttentionResult:
    """Attention of n queries over a set of tokens.

    output [n, q_heads, head_dim] float32; lse [n, q_heads], the natural-log
    log-sum-exp of the logits (-inf for a query that saw no token); with
    top_k, top_k_tokens (int64) and top_k_logits [n, q_heads, top_k]. numpy
    arrays, or torch tensors on the queries' device when the queries were
    torch tensors; always writable, owned by the caller."""

    output: Array
    lse: Array
    top_k_tokens: Optional[Array] = None
    top_k_logits: Optional[Array] = None


@dataclasses.dataclass
class DecodeResult(AttentionResult):
    """One Decode message's results: AttentionResult's arrays with a batch
    dimension first (B items of k queries each), so merge_attention takes a
    DecodeResult as it is, plus each item's outcome.

    output [B, k, q_heads, head_dim] float32, lse [B, k, q_heads] and, with
    top_k, top_k_tokens / top_k_logits [B, k, q_heads, top_k]. tokens [B]
    (int64, numpy): the layer's length after the step (a failed item: its
    length as it stands, 0 when its session was not found). errors [B]: None
    for an item that succeeded, else the TurbokvError subclass of the item's
    gRPC code (SessionNotFound, FailedPrecondition, ...). A failed item
    changed nothing of its session; its output is zeros and its lse -inf."""

    session_ids: List[str] = dataclasses.field(default_factory=list)
    tokens: Optional[np.ndarray] = None
    errors: List[Optional[TurbokvError]] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every item succeeded."""
        return all(error is None for error in self.errors)

    @property
    def failed(self) -> int:
        """How many items failed."""
        return sum(error is not None for error in self.errors)

    def raise_for_status(self) -> "DecodeResult":
        """Raises the first failed item's error; returns self when all succeeded."""
        for error in self.errors:
            if error is not None:
                raise error
        return self

    def item(self, i: int) -> AttentionResult:
        """Item i's k queries as an AttentionResult: output [k, q_heads, head_dim]."""
        return AttentionResult(output=self.output[i], lse=self.lse[i],
                               top_k_tokens=None if self.top_k_tokens is None else self.top_k_tokens[i],
                               top_k_logits=None if self.top_k_logits is None else self.top_k_logits[i])


def merge_attention(a: AttentionResult, b: AttentionResult) -> AttentionResult:
    """Attention over two disjoint token sets, merged exactly through their
    log-sum-exps (numpy or torch, as the inputs are).

    A side over no tokens has lse -inf (its output is not read: it may be
    zeros or NaN): merged with the other side it gives that side exactly;
    two empty sides give output zeros and lse -inf."""
    if tuple(a.output.shape) != tuple(b.output.shape) or tuple(a.lse.shape) != tuple(b.lse.shape):
        raise ValueError(f"merge_attention needs results of one shape, got output {tuple(a.output.shape)} and "
                         f"{tuple(b.output.shape)}, lse {tuple(a.lse.shape)} and {tuple(b.lse.shape)}")
    if _tensors.is_torch(a.output):
        xp = _tensors.torch_module()
        f32 = xp.float32
        lse_a, lse_b, out_a, out_b = (x.to(f32) for x in (a.lse, b.lse, a.output, b.output))
    else:
        xp = np
        f32 = np.float32
        lse_a, lse_b, out_a, out_b = (np.asarray(x, dtype=f32) for x in (a.lse, b.lse, a.output, b.output))
    m = xp.maximum(lse_a, lse_b)
    m = xp.where(xp.isneginf(m), xp.zeros_like(m), m)  # both sides empty: no shift (the weights are 0)
    wa, wb = xp.exp(lse_a - m), xp.exp(lse_b - m)
    total = wa + wb
    with np.errstate(divide="ignore", invalid="ignore"):
        mixed = (wa[..., None] * out_a + wb[..., None] * out_b) / total[..., None]
        lse = m + xp.log(total)
    empty_a, empty_b = (wa == 0)[..., None], (wb == 0)[..., None]
    output = xp.where(empty_a & empty_b, xp.zeros_like(mixed),
                      xp.where(empty_a, out_b, xp.where(empty_b, out_a, mixed)))
    return AttentionResult(output=output, lse=lse)


def item_errors(status: Iterable[pb.ItemStatus]) -> List[Optional[TurbokvError]]:
    """A batch's per-item statuses: None for OK, else the error of the item's code."""
    return [None if item.code == 0 else error_for(item.code, item.message) for item in status]


def shape_of(x: Any) -> Tuple[int, ...]:
    """The shape of an array, a tensor or nested lists."""
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def session_ids(sessions: Sequence[Any], name: str = "sessions") -> List[str]:
    """Session objects or ids as ids; ValueError / TypeError naming what is wrong."""
    if isinstance(sessions, (str, bytes)) or not isinstance(sessions, collections.abc.Iterable):
        raise TypeError(f"{name} must be a sequence of Session objects or session ids, got {type(sessions).__name__}")
    ids = []
    for i, s in enumerate(sessions):
        sid = getattr(s, "id", s)
        if not isinstance(sid, str) or not sid:
            raise TypeError(f"{name}[{i}] must be a Session or a session id, got {s!r}")
        ids.append(sid)
    return ids


def options(softmax_scale: float, softcap: float, window: int, top_k: int) -> pb.AttentionOptions:
    return pb.AttentionOptions(softmax_scale=_tensors.number(softmax_scale, "softmax_scale"),
                               softcap=_tensors.number(softcap, "softcap"),
                               window=_tensors.index(window, "window"), top_k=_tensors.index(top_k, "top_k"))


def result(message: Any, top_k: int, kind: _tensors.Kind, cls: type = AttentionResult, *,
           block: Optional[_shm.Block] = None, **fields: Any) -> Any:
    """A pb.AttentionResult (or a pb.DecodeResponse: the same fields, a batch
    dimension more) as `cls` with arrays of `kind`, its tensors read from the
    message or from the call's shared `block`; fields: cls's others."""
    out = cls(output=_tensors.decode(message.output, kind, _shm.result_bytes(message.output, block)),
              lse=_tensors.decode(message.lse, kind, _shm.result_bytes(message.lse, block)), **fields)
    if top_k > 0:
        shape = tuple(out.lse.shape) + (top_k,)
        out.top_k_tokens = _tensors.wrap(np.array(message.top_k_tokens, dtype=np.int64).reshape(shape), kind)
        out.top_k_logits = _tensors.wrap(np.array(message.top_k_logits, dtype=np.float32).reshape(shape), kind)
    return out


def read_kv_dtype(dtype: Any, device: Any) -> Tuple[int, _tensors.Kind]:
    """ReadKv's dtype and the Kind of its results: a numpy dtype (float32,
    float16) gives numpy arrays, a torch dtype (float32, float16, bfloat16)
    or a device gives torch tensors."""
    torch = _tensors.torch_module()
    if torch is not None and isinstance(dtype, torch.dtype):
        wire = {torch.float32: pb.DTYPE_F32, torch.float16: pb.DTYPE_F16, torch.bfloat16: pb.DTYPE_BF16}.get(dtype)
        if wire is None:
            raise TypeError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
        return wire, _tensors.Kind(torch.device(device if device is not None else "cpu"))
    try:
        wire = {np.dtype(np.float32): pb.DTYPE_F32, np.dtype(np.float16): pb.DTYPE_F16}.get(np.dtype(dtype))
    except TypeError:
        wire = None
    if wire is None:
        raise TypeError(f"dtype must be float32 or float16 (numpy), or a torch dtype, got {dtype!r}")
    if device is None:
        return wire, _tensors.NUMPY
    if torch is None:
        raise TypeError("device needs torch: import torch first")
    return wire, _tensors.Kind(torch.device(device))


class SessionBase:
    """What Session and turbokv.aio.Session share: the session's shape and the requests of its calls."""

    def __init__(self, client: Any, session_id: str, config: pb.SessionConfig):
        self._client = client
        self.id = session_id
        self.config = config
        # Leaving a `with` block deletes the session unless this is True.
        self.keep = False
        # Tokens per layer it started with (create_session's prefix_blocks;
        # 0 for a handle from Client.session or fork), and the daemon's
        # block size (also Client.stats().block_tokens).
        self.prefix_tokens = 0
        self.block_tokens = 0
        self.layers = config.shape.layers
        self.kv_heads = config.shape.kv_heads
        self.q_heads = config.shape.q_heads
        self.head_dim = config.shape.head_dim

    @property
    def session_id(self) -> str:
        """The session's id, as `id`."""
        return self.id

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.id!r}, layers={self.layers}, kv_heads={self.kv_heads}, "
                f"q_heads={self.q_heads}, head_dim={self.head_dim})")

    def _layer(self, layer: Any) -> int:
        return _tensors.index(layer, "layer", 0, self.layers)

    def _placed(self, build: Callable[[Optional[Dict[str, Any]]], Tuple[Any, Any]], fields: Tuple[str, ...],
                result_values: int) -> Tuple[Any, Any, Optional[_shm.Block]]:
        """build(values_of)'s request and kind, with the request's tensors
        (and room for result_values f32 results) in the client's shared
        memory where it has some: the block, or None. build gets a dict for
        the values of the tensors it leaves without bytes
        (_tensors.encode_into), or None when they need their bytes."""
        shared = self._client._shared_memory  # type: ignore[attr-defined]
        values_of: Optional[Dict[str, Any]] = {} if shared is not None else None
        request, kind = build(values_of)
        return request, kind, _shm.place(shared, request, fields, result_values, 2 if result_values else 0, values_of)

    def _region_lost(self, error: BaseException, block: Optional[_shm.Block]) -> bool:
        """Whether a call failed only because the daemon no longer holds the
        region of its block (it restarted): the client registers a new one
        next time, and the caller makes the call again in the messages."""
        lost = _shm.region_lost(error, block)
        if lost:
            self._client._shared_memory.forget()  # type: ignore[attr-defined]
        return lost

    def _result_values(self, queries: Any) -> int:
        """f32 values of the result (output and lse) of queries [n, q_heads, head_dim]."""
        shape = shape_of(queries)
        return (shape[0] if shape else 0) * self.q_heads * (self.head_dim + 1)

    def _append_request(self, layer: Optional[int], start: int, keys: Any, values: Any,
                        queries: Any = None, values_of: Optional[Dict[str, Any]] = None) -> pb.AppendRequest:
        dims = [("tokens", None), ("kv_heads", self.kv_heads), ("head_dim", self.head_dim)]
        if layer is None:
            dims.insert(0, ("layers", self.layers))
        request = pb.AppendRequest(session_id=self.id, start=_tensors.index(start, "start"))
        request.keys.CopyFrom(_tensors.encode_into(values_of, keys, "keys", dims)[0])
        request.values.CopyFrom(_tensors.encode_into(values_of, values, "values", dims)[0])
        if tuple(request.keys.shape) != tuple(request.values.shape):
            raise ValueError(f"keys and values must have one shape, got {tuple(request.keys.shape)} and "
                             f"{tuple(request.values.shape)}")
        if queries is not None:
            query_dims = [d if d[0] != "kv_heads" else ("q_heads", self.q_heads) for d in dims]
            request.queries.CopyFrom(_tensors.encode_into(values_of, queries, "queries", query_dims)[0])
            tokens = len(request.keys.shape) - 3
            if request.queries.shape[tokens] != request.keys.shape[tokens]:
                raise ValueError(f"queries must have the keys' {request.keys.shape[tokens]} tokens, got "
                                 f"{request.queries.shape[tokens]}")
        if layer is None:
            request.all_layers = True
        else:
            request.layer = self._layer(layer)
        return request

    def _chunk_request(self, chunk: Any, values_of: Optional[Dict[str, Any]] = None) -> pb.AppendRequest:
        if not isinstance(chunk, tuple) or len(chunk) not in (4, 5):
            raise TypeError("each chunk must be a tuple (layer, start, keys, values) or (layer, start, keys, values, "
                            f"queries), got {type(chunk).__name__}")
        return self._append_request(*chunk, values_of=values_of)

    def _attend_request(self, layer: int, queries: Any, positions: Optional[Any], softmax_scale: float,
                        softcap: float, window: int, top_k: int,
                        values_of: Optional[Dict[str, Any]] = None) -> Tuple[pb.AttendRequest, _tensors.Kind]:
        tensor, kind = _tensors.encode_into(values_of, queries, "queries",
                                            [("n", None), ("q_heads", self.q_heads), ("head_dim", self.head_dim)])
        request = pb.AttendRequest(session_id=self.id, layer=self._layer(layer), queries=tensor,
                                   options=options(softmax_scale, softcap, window, top_k))
        if positions is not None:
            positions = _tensors.integers(positions, "positions")
            if positions.shape != (tensor.shape[0],):
                raise ValueError(f"positions must be [n={tensor.shape[0]}] (one per query), got shape {positions.shape}")
            request.positions.extend(positions.tolist())
        return request, kind

    def _step_request(self, layer: int, position: int, key: Any, value: Any, query: Any, softmax_scale: float,
                      softcap: float, window: int, top_k: int,
                      values_of: Optional[Dict[str, Any]] = None) -> Tuple[pb.StepRequest, _tensors.Kind]:
        def one(x: Any, name: str, heads: Tuple[str, int]) -> Tuple[pb.Tensor, _tensors.Kind]:
            dims = [heads, ("head_dim", self.head_dim)]
            if len(shape_of(x)) == 2:
                tensor, kind = _tensors.encode_into(values_of, x, name, dims)
                tensor.shape.insert(0, 1)
                return tensor, kind
            return _tensors.encode_into(values_of, x, name, [("1", 1)] + dims)

        request = pb.StepRequest(session_id=self.id, layer=self._layer(layer),
                                 position=_tensors.index(position, "position"),
                                 key=one(key, "key", ("kv_heads", self.kv_heads))[0],
                                 value=one(value, "value", ("kv_heads", self.kv_heads))[0],
                                 options=options(softmax_scale, softcap, window, top_k))
        query_tensor, kind = one(query, "query", ("q_heads", self.q_heads))
        request.query.CopyFrom(query_tensor)
        return request, kind

    def _read_kv_request(self, layer: Optional[int], start: int, end: int, dtype: Any,
                         device: Any) -> Tuple[pb.ReadKvRequest, _tensors.Kind]:
        wire, kind = read_kv_dtype(dtype, device)
        start, end = _tensors.index(start, "start"), _tensors.index(end, "end")
        if end != 0 and end < start:
            raise ValueError(f"end must be 0 (to the end) or >= start = {start}, got {end}")
        layers = [] if layer is None else [self._layer(layer)]
        return pb.ReadKvRequest(session_id=self.id, layers=layers, start=start, end=end, dtype=wire), kind

    def _read_kv_result(self, layer: Optional[int], messages: List[pb.ReadKvResponse], dtype: int,
                        kind: _tensors.Kind) -> Tuple[Array, Array]:
        """The messages of a ReadKv as (keys, values): [tokens, kv_heads,
        head_dim] for one layer, [layers, tokens, kv_heads, head_dim] for all."""
        layers = [layer] if layer is not None else list(range(self.layers))
        parts = {l: ([], []) for l in layers}
        for message in messages:
            parts[message.layer][0].append(_tensors.decode(message.keys, kind))
            parts[message.layer][1].append(_tensors.decode(message.values, kind))
        lengths = {l: sum(int(x.shape[0]) for x in parts[l][0]) for l in layers}
        if len(set(lengths.values())) > 1:
            counts = ", ".join(f"layer {l}: {n}" for l, n in lengths.items())
            raise ValueError(f"read_kv(None) returns every layer as one array, but the layers hold different numbers "
                             f"of tokens in the range ({counts}): read them one layer at a time, or pass end")
        if kind.torch:
            torch = _tensors.torch_module()
            xp, cat = torch, torch.cat
            torch_dtype = {pb.DTYPE_F32: torch.float32, pb.DTYPE_F16: torch.float16}.get(dtype, torch.bfloat16)

            def empty() -> Array:
                return torch.zeros((0, self.kv_heads, self.head_dim), device=kind.device, dtype=torch_dtype)
        else:
            xp, cat = np, np.concatenate
            np_dtype = np.float32 if dtype == pb.DTYPE_F32 else np.float16

            def empty() -> Array:
                return np.zeros((0, self.kv_heads, self.head_dim), dtype=np_dtype)
        keys, values = ([cat(parts[l][i]) if parts[l][i] else empty() for l in layers] for i in (0, 1))
        if layer is not None:
            return keys[0], values[0]
        return xp.stack(keys), xp.stack(values)


def block_hashes(token_ids: Iterable[int], block_tokens: int, salt: Union[str, bytes] = b"") -> List[bytes]:
    """The chained hashes naming the full blocks of `token_ids`, as
    Session.name_blocks and create_session(prefix_blocks=) take them (the
    C++ client's BlockHashes computes the same): hash i = SHA-256(hash i-1 +
    block i's ids as little-endian int32), hash -1 = SHA-256(salt). A salt
    (e.g. the model's name and revision) keeps equal ids of different models
    apart. block_tokens: the daemon's (Session.block_tokens, Client.stats())."""
    block = _tensors.index(block_tokens, "block_tokens", 1)
    ids = np.asarray(list(token_ids) if not isinstance(token_ids, np.ndarray) else token_ids)
    if ids.size and (ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= 1 << 31):
        raise ValueError("token_ids: expected a sequence of token ids in [0, 2**31)")
    ids = ids.astype("<i4")
    previous = hashlib.sha256(salt.encode() if isinstance(salt, str) else bytes(salt)).digest()
    hashes = []
    for start in range(0, ids.size - block + 1, block):
        previous = hashlib.sha256(previous + ids[start:start + block].tobytes()).digest()
        hashes.append(previous)
    return hashes


def hash_list(hashes: Optional[Sequence[bytes]], name: str) -> List[bytes]:
    """Block hashes as a request takes them: bytes of 1 to 64."""
    out = []
    for i, h in enumerate(hashes or ()):
        if not isinstance(h, (bytes, bytearray)) or not 1 <= len(h) <= 64:
            raise ValueError(f"{name}[{i}]: expected bytes of length 1 to 64 (block_hashes())")
        out.append(bytes(h))
    return out


def create_request(layers: int, kv_heads: int, q_heads: int, head_dim: int, key_codec: Optional[str],
                   value_codec: Optional[str], rotation_seed: Optional[int], max_tokens: int,
                   idle_ttl: Optional[float], pinned: bool, preset: Optional[str] = None,
                   layer_codecs: Optional[Sequence[Tuple[int, int, Optional[str], Optional[str]]]] = None,
                   key_transform: Optional[str] = None, center_values: bool = False,
                   sink_tokens: Optional[int] = None, sink_codec: Optional[str] = None,
                   prefix_blocks: Optional[Sequence[bytes]] = None) -> pb.CreateSessionRequest:
    shape = pb.ModelShape(layers=_tensors.index(layers, "layers", 1), kv_heads=_tensors.index(kv_heads, "kv_heads", 1),
                          q_heads=_tensors.index(q_heads, "q_heads", 1), head_dim=_tensors.index(head_dim, "head_dim", 1))

    def codec_of(codec: Optional[str], name: str) -> int:
        if codec is None:
            return pb.CODEC_UNSPECIFIED
        if codec not in CODECS:
            raise ValueError(f"{name}: unknown codec {codec!r}: use one of {', '.join(CODECS)}")
        return CODECS[codec]

    config = pb.SessionConfig(shape=shape, key_codec=codec_of(key_codec, "key_codec"),
                              value_codec=codec_of(value_codec, "value_codec"),
                              max_tokens=_tensors.index(max_tokens, "max_tokens"), pinned=bool(pinned))
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"preset: unknown preset {preset!r}: use one of {', '.join(PRESETS)}")
        if key_codec is not None or value_codec is not None:
            raise ValueError("preset: give it without key_codec and value_codec (layer_codecs may override it)")
        config.preset = preset
    for i, entry in enumerate(layer_codecs or ()):
        if len(entry) != 4:
            raise ValueError(f"layer_codecs[{i}]: expected (first_layer, last_layer, key_codec, value_codec)")
        first, last, key, value = entry
        config.layer_codecs.add(first_layer=_tensors.index(first, f"layer_codecs[{i}] first_layer", 0, layers),
                                last_layer=_tensors.index(last, f"layer_codecs[{i}] last_layer", first, layers),
                                key_codec=codec_of(key, f"layer_codecs[{i}] key_codec"),
                                value_codec=codec_of(value, f"layer_codecs[{i}] value_codec"))
    if key_transform is not None:
        if key_transform not in KEY_TRANSFORMS:
            raise ValueError(f"key_transform: unknown {key_transform!r}: use one of {', '.join(KEY_TRANSFORMS)}")
        config.key_transform = KEY_TRANSFORMS[key_transform]
    config.center_values = bool(center_values)
    if sink_tokens is not None:
        config.sink_tokens = _tensors.index(sink_tokens, "sink_tokens", 0, 65)
    if sink_codec is not None:
        if sink_codec not in SINK_CODECS:
            raise ValueError(f"sink_codec: use one of {', '.join(SINK_CODECS)}, not {sink_codec!r}")
        config.sink_codec = CODECS[sink_codec]
    if rotation_seed is not None:
        config.rotation_seed = _tensors.index(rotation_seed, "rotation_seed", 0, 1 << 64)
    if idle_ttl is not None:
        seconds = _tensors.number(idle_ttl, "idle_ttl")
        config.idle_ttl.CopyFrom(duration_pb2.Duration(seconds=int(seconds), nanos=int(seconds % 1 * 1e9)))
    return pb.CreateSessionRequest(config=config, prefix_blocks=hash_list(prefix_blocks, "prefix_blocks"))


def started(session: SessionBase, response: pb.CreateSessionResponse) -> SessionBase:
    """A new session with what its CreateSession response says of its start."""
    session.prefix_tokens = response.prefix_tokens
    session.block_tokens = response.block_tokens
    return session


class DecodeBase:
    """What DecodeStream and turbokv.aio.DecodeStream share: the messages and the results in flight."""

    def __init__(self, shared: Optional[_shm.SharedMemory] = None) -> None:
        self._shared = shared
        self._pending: Deque[Tuple[List[str], int, _tensors.Kind, Optional[_shm.Block]]] = collections.deque()
        self._error: Optional[TurbokvError] = None
        self._closed = False

    @property
    def pending(self) -> int:
        """Messages sent whose results are not received yet."""
        return len(self._pending)

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError("the Decode stream is closed")

    def _check_idle(self) -> None:
        if self._pending:
            raise RuntimeError(f"{len(self._pending)} results of send() are not received yet: receive() them first")

    def _drop_pending(self) -> None:
        for *_, block in self._pending:
            _shm.release(block)
        self._pending.clear()

    def _fail(self, error: TurbokvError) -> None:
        self._error = error
        self._drop_pending()
        raise error

    def _request(self, layer: int, sessions: Sequence[Any], queries: Any, positions: Any, keys: Any, values: Any,
                 softmax_scale: float, softcap: float, window: int, top_k: int) -> pb.DecodeRequest:
        """Builds and checks a message, and records it as pending (the caller sends it next)."""
        layer = _tensors.index(layer, "layer")
        ids = session_ids(sessions)
        if not ids:
            raise ValueError("sessions must name one or more sessions")
        b = len(ids)
        rank = len(shape_of(queries))
        if rank not in (3, 4):
            raise ValueError(f"queries must be [B={b}, q_heads, head_dim] or [B={b}, k, q_heads, head_dim], "
                             f"got shape {shape_of(queries)}")
        dims = [("B", b)] + ([("k", None)] if rank == 4 else []) + [("q_heads", None), ("head_dim", None)]
        values_of: Dict[str, Any] = {}
        query_tensor, kind = _tensors.encode_into(values_of, queries, "queries", dims)
        k = query_tensor.shape[1] if rank == 4 else 1
        positions = _tensors.integers(positions, "positions")
        if positions.shape == (b,):
            positions = positions[:, None] + np.arange(k)
        if positions.shape != (b, k):
            raise ValueError(f"positions must be [B={b}] or [B={b}, k={k}] for queries {tuple(query_tensor.shape)}, "
                             f"got shape {positions.shape}")
        request = pb.DecodeRequest(layer=layer, session_ids=ids, positions=positions.ravel().tolist(),
                                   queries=query_tensor,
                                   options=options(softmax_scale, softcap, window, top_k))
        if (keys is None) != (values is None):
            raise ValueError("keys and values: send both or neither")
        if keys is not None:
            expected = "[B, kv_heads, head_dim]" if rank == 3 else "[B, k, kv_heads, head_dim]"
            kv_dims = dims[:-2] + [("kv_heads", None), ("head_dim", query_tensor.shape[-1])]
            if rank == 4:
                kv_dims[1] = ("k", k)
            for name, x in (("keys", keys), ("values", values)):
                shape = shape_of(x)
                if len(shape) != rank:
                    raise ValueError(f"{name} must be {expected} like queries {tuple(query_tensor.shape)}, got {shape}")
            for field, x in (("keys", keys), ("values", values)):
                getattr(request, field).CopyFrom(_tensors.encode_into(values_of, x, field, kv_dims)[0])
            if tuple(request.keys.shape) != tuple(request.values.shape):
                raise ValueError(f"keys and values must have one shape, got {tuple(request.keys.shape)} and "
                                 f"{tuple(request.values.shape)}")
        rows = int(np.prod(query_tensor.shape[:-1]))
        block = _shm.place(self._shared, request, ("queries", "keys", "values"), rows * (query_tensor.shape[-1] + 1), 2,
                           values_of)
        self._pending.append((ids, request.options.top_k, kind, block))
        return request

    def _result(self, response: pb.DecodeResponse) -> DecodeResult:
        ids, top_k, kind, block = self._pending.popleft()
        try:
            return result(response, top_k, kind, DecodeResult, block=block, session_ids=ids,
                          tokens=np.array(response.tokens, dtype=np.int64), errors=item_errors(response.status))
        finally:
            _shm.release(block)


def channel_options(max_message_bytes: int) -> List[Tuple[str, int]]:
    max_message_bytes = _tensors.index(max_message_bytes, "max_message_bytes", 1)
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        # Reconnect within RetryPolicy's waits once turbokvd is back (gRPC's default grows to 120 s).
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


class Requests:
    """The requests of a client stream, built from the caller's items as gRPC
    asks for them. An exception building one (a bad chunk, or one raised by
    the caller's generator) ends the stream there, so that what was sent
    before it is applied, and is kept to be raised to the caller as itself
    (gRPC would report it as UNKNOWN "Exception iterating requests!")."""

    def __init__(self, items: Iterable[Any], build: Callable[[Any], Any]):
        self._items = items
        self._build = build
        self.error: Optional[BaseException] = None

    def __iter__(self) -> Iterator[Any]:
        try:
            for item in self._items:
                yield self._build(item)
        except Exception as error:  # noqa: BLE001 (re-raised in the caller's thread)
            self.error = error

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


class SharedChunks:
    """The chunks of one Append stream with their tensors in the client's
    shared memory where it has room, as Session.append places them. A
    chunk's block is given back once the daemon acknowledges the chunk
    (acknowledgements come in order) and every block once the stream ends.
    When the daemon failed the stream because it no longer holds the region
    (it restarted), nothing from the first chunk it did not know on was
    applied, and the next call registers a new region."""

    def __init__(self, session: "SessionBase"):
        self._session = session
        self._blocks: Deque[Optional[_shm.Block]] = collections.deque()
        self._closed = False
        self._lock = threading.Lock()  # gRPC may build requests on its own thread

    def request(self, chunk: Any) -> pb.AppendRequest:
        with self._lock:
            closed = self._closed
        if closed:  # gRPC asked for one more after the stream ended: it is never sent
            return self._session._chunk_request(chunk)
        request, _, block = self._session._placed(
            lambda values_of: (self._session._chunk_request(chunk, values_of), None), ("keys", "values", "queries"), 0)
        with self._lock:
            if not self._closed:
                self._blocks.append(block)
                return request
        _shm.release(block)
        return request

    def acknowledged(self) -> None:
        with self._lock:
            block = self._blocks.popleft() if self._blocks else None
        _shm.release(block)

    def close(self, error: Optional[BaseException] = None) -> bool:
        """Gives every block back; whether `error` (the stream's) says that
        the daemon no longer holds the region."""
        with self._lock:
            blocks, self._blocks = list(self._blocks), collections.deque()
            self._closed = True
        held = next((block for block in blocks if block is not None), None)
        lost = error is not None and self._session._region_lost(error, held)
        for block in blocks:
            _shm.release(block)
        return lost


DEFAULT_TARGET = "unix:///tmp/turbokv.sock"
# Bytes of shared memory a client connected over a unix socket passes its tensors through (docs/API.md).
SHARED_MEMORY_BYTES = 64 << 20


class Connection:
    """What turbokv.Client and turbokv.aio.Client set up alike: the channel
    (from `channels`, grpc or grpc.aio; target None: $TURBOKV_TARGET when
    set, else DEFAULT_TARGET; an absolute path: the unix socket there), the
    stub, the call metadata, the default deadline, the retry policy and,
    over a unix socket, the shared memory (`shared_memory` bytes, 0: none)."""

    def __init__(self, channels: Any, target: Optional[str], max_message_bytes: int, timeout: Optional[float],
                 token: Optional[str], root_certificates: Optional[bytes], private_key: Optional[bytes],
                 certificate_chain: Optional[bytes], retry: RetryPolicy, shared_memory: int):
        if target is None:
            target = os.environ.get("TURBOKV_TARGET") or DEFAULT_TARGET
        if target.startswith("/"):
            # gRPC would look a bare path up as a host name.
            target = "unix://" + target
        self.target = target
        options = channel_options(max_message_bytes)
        self.timeout = timeout_value(timeout)
        if not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a turbokv.RetryPolicy, got {type(retry).__name__}")
        self.retry = retry
        if root_certificates is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            self.channel = channels.secure_channel(target, credentials, options=options)
        else:
            self.channel = channels.insecure_channel(target, options=options)
        self.stub = pb_grpc.KvCacheServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.shared = _shm.SharedMemory.for_target(target, _tensors.index(shared_memory, "shared_memory"), token)


def timeout_value(timeout: Optional[float], name: str = "timeout") -> Optional[float]:
    return None if timeout is None else _tensors.number(timeout, name)


class Attempts:
    """The tries of one call: the deadline they share and whether to retry after a failure."""

    def __init__(self, policy: RetryPolicy, timeout: Optional[float], idempotent: bool):
        self._policy = policy
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._tries = policy.max_attempts if idempotent else 1
        self.count = 0

    def remaining(self) -> Optional[float]:
        """The deadline of the next try, in seconds from now (None: no deadline)."""
        self.count += 1
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def retry_after(self, error: Any) -> Optional[float]:
        """Seconds to wait before trying again after `error` (a grpc.RpcError), or None to give up."""
        if error.code() != grpc.StatusCode.UNAVAILABLE or self.count >= self._tries:
            return None
        wait = self._policy.backoff(self.count)
        if self._deadline is not None and time.monotonic() + wait >= self._deadline:
            return None
        return wait

    def error(self, error: Any) -> TurbokvError:
        return error_for(error.code(), error.details(), self.count)
