"""turbokv.Client and turbokv.Session: numpy arrays in and out over gRPC."""

from __future__ import annotations

import collections
import dataclasses
import queue
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np
from google.protobuf import duration_pb2

from turbokv.v1 import turbokv_pb2 as pb
from turbokv.v1 import turbokv_pb2_grpc as pb_grpc

_CODECS = {
    "f16": pb.CODEC_F16,
    "q8_0": pb.CODEC_Q8_0,
    "q4_0": pb.CODEC_Q4_0,
    "turbo2": pb.CODEC_TURBO2,
    "turbo3": pb.CODEC_TURBO3,
    "turbo4": pb.CODEC_TURBO4,
}
_DTYPES = {np.dtype(np.float32): pb.DTYPE_F32, np.dtype(np.float16): pb.DTYPE_F16}
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class TurbokvError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `message` the daemon's words."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def _item_errors(status) -> list:
    """A batch's per-item statuses: None for OK, else the TurbokvError."""
    return [None if item.code == 0 else TurbokvError(_STATUS_CODES.get(item.code, grpc.StatusCode.UNKNOWN), item.message)
            for item in status]


def _raise(error: grpc.RpcError) -> None:
    raise TurbokvError(error.code(), error.details()) from None


def _tensor(array, rank: int, name: str) -> pb.Tensor:
    array = np.asarray(array)
    if array.dtype not in _DTYPES:
        array = array.astype(np.float32)
    if array.ndim != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {array.shape}")
    array = np.ascontiguousarray(array)
    return pb.Tensor(dtype=_DTYPES[array.dtype], shape=list(array.shape), data=array.tobytes())


def _array(tensor: pb.Tensor) -> np.ndarray:
    dtype = {pb.DTYPE_F32: np.float32, pb.DTYPE_F16: np.float16}.get(tensor.dtype)
    if dtype is None:  # bf16: the high half of an f32
        bits = np.frombuffer(tensor.data, dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(tuple(tensor.shape))
    return np.frombuffer(tensor.data, dtype=dtype).reshape(tuple(tensor.shape))


@dataclasses.dataclass
class AttentionResult:
    output: np.ndarray  # [n, q_heads, head_dim] float32
    lse: np.ndarray  # [n, q_heads] natural-log log-sum-exp of the logits
    top_k_tokens: Optional[np.ndarray] = None  # [n, q_heads, k] with top_k
    top_k_logits: Optional[np.ndarray] = None


def _result(result, top_k: int, cls=AttentionResult, **fields) -> AttentionResult:
    """A pb.AttentionResult (or a pb.DecodeResponse: the same fields, a batch
    dimension more) as a `cls` with numpy arrays; fields: cls's others."""
    out = cls(output=_array(result.output), lse=_array(result.lse), **fields)
    if top_k > 0:
        shape = out.lse.shape + (top_k,)
        out.top_k_tokens = np.array(result.top_k_tokens, dtype=np.int64).reshape(shape)
        out.top_k_logits = np.array(result.top_k_logits, dtype=np.float32).reshape(shape)
    return out


def merge_attention(a: AttentionResult, b: AttentionResult) -> AttentionResult:
    """Attention over two disjoint token sets merged exactly through their log-sum-exps."""
    m = np.maximum(a.lse, b.lse)
    wa, wb = np.exp(a.lse - m), np.exp(b.lse - m)
    output = (wa[..., None] * a.output + wb[..., None] * b.output) / (wa + wb)[..., None]
    return AttentionResult(output=output.astype(np.float32), lse=(m + np.log(wa + wb)).astype(np.float32))


class Session:
    """One session's calls. Keys and values are [tokens, kv_heads, head_dim]
    (float32 or float16); with layer=None, [layers, tokens, kv_heads, head_dim]."""

    def __init__(self, client: "Client", session_id: str, config: pb.SessionConfig):
        self._client = client
        self._stub = client._stub
        self.id = session_id
        self.config = config
        self.layers = config.shape.layers
        self.kv_heads = config.shape.kv_heads
        self.q_heads = config.shape.q_heads
        self.head_dim = config.shape.head_dim

    def _request(self, layer: Optional[int], start: int, keys, values) -> pb.AppendRequest:
        rank = 3 if layer is not None else 4
        request = pb.AppendRequest(
            session_id=self.id, start=start, keys=_tensor(keys, rank, "keys"), values=_tensor(values, rank, "values")
        )
        if layer is None:
            request.all_layers = True
        else:
            request.layer = layer
        return request

    def append(self, layer: Optional[int], start: int, keys, values) -> int:
        """Stores tokens [start, start + n); returns the layer's new length."""
        return self.append_stream([(layer, start, keys, values)])

    def append_stream(self, chunks: Iterable[Tuple[Optional[int], int, np.ndarray, np.ndarray]]) -> int:
        """Sends (layer, start, keys, values) chunks on one Append stream
        without waiting for each acknowledgement; returns the length after the
        last one. The first failing chunk raises; the ones before it stay."""
        requests: Iterator[pb.AppendRequest] = (self._request(*chunk) for chunk in chunks)
        tokens = 0
        try:
            for response in self._stub.Append(requests, timeout=self._client._timeout, metadata=self._client._metadata):
                tokens = response.tokens
        except grpc.RpcError as error:
            _raise(error)
        return tokens

    def attend(self, layer: int, queries, positions: Optional[Sequence[int]] = None, softmax_scale: float = 0.0,
               softcap: float = 0.0, window: int = 0, top_k: int = 0) -> AttentionResult:
        """queries [n, q_heads, head_dim]; a query at position p sees tokens
        [0, p] (no positions: every stored token)."""
        request = pb.AttendRequest(
            session_id=self.id, layer=layer, queries=_tensor(queries, 3, "queries"),
            positions=list(positions) if positions is not None else [],
            options=pb.AttentionOptions(softmax_scale=softmax_scale, softcap=softcap, window=window, top_k=top_k),
        )
        try:
            for response in self._stub.Attend(iter([request]), timeout=self._client._timeout, metadata=self._client._metadata):
                return _result(response.result, top_k)
        except grpc.RpcError as error:
            _raise(error)
        raise TurbokvError(grpc.StatusCode.UNAVAILABLE, "the Attend stream ended without a response")

    def step(self, layer: int, position: int, key, value, query, softmax_scale: float = 0.0, softcap: float = 0.0,
             window: int = 0, top_k: int = 0) -> Tuple[int, AttentionResult]:
        """Appends one token ([kv_heads, head_dim] or [1, ...]) at `position`
        and attends with its query; returns (layer length, result)."""
        key, value, query = (np.asarray(x).reshape((1,) + np.shape(x)[-2:]) for x in (key, value, query))
        request = pb.StepRequest(
            session_id=self.id, layer=layer, position=position, key=_tensor(key, 3, "key"),
            value=_tensor(value, 3, "value"), query=_tensor(query, 3, "query"),
            options=pb.AttentionOptions(softmax_scale=softmax_scale, softcap=softcap, window=window, top_k=top_k),
        )
        try:
            response = self._stub.Step(request, timeout=self._client._timeout, metadata=self._client._metadata)
        except grpc.RpcError as error:
            _raise(error)
        return response.tokens, _result(response.result, top_k)

    def read_kv(self, layer: int, start: int = 0, end: int = 0, dtype=np.float32) -> Tuple[np.ndarray, np.ndarray]:
        """Decoded keys and values of tokens [start, end) (end 0: to the end)."""
        if np.dtype(dtype) not in _DTYPES:
            raise ValueError(f"dtype must be float32 or float16, got {np.dtype(dtype)}")
        request = pb.ReadKvRequest(session_id=self.id, layers=[layer], start=start, end=end,
                                   dtype=_DTYPES[np.dtype(dtype)])
        keys, values = [], []
        try:
            for response in self._stub.ReadKv(request, timeout=self._client._timeout, metadata=self._client._metadata):
                keys.append(_array(response.keys))
                values.append(_array(response.values))
        except grpc.RpcError as error:
            _raise(error)
        empty = np.zeros((0, self.kv_heads, self.head_dim), dtype=dtype)
        return (np.concatenate(keys) if keys else empty), (np.concatenate(values) if values else empty)

    def fork(self, prefix_tokens: int) -> "Session":
        """A new session sharing the first prefix_tokens tokens (no copy)."""
        try:
            response = self._stub.ForkSession(
                pb.ForkSessionRequest(source_session_id=self.id, prefix_tokens=prefix_tokens),
                timeout=self._client._timeout, metadata=self._client._metadata)
        except grpc.RpcError as error:
            _raise(error)
        return Session(self._client, response.session_id, response.session.config)

    def truncate(self, tokens: int) -> pb.SessionInfo:
        """Every layer keeps its first `tokens` tokens."""
        try:
            return self._stub.TruncateSession(pb.TruncateSessionRequest(session_id=self.id, tokens=tokens),
                                              timeout=self._client._timeout, metadata=self._client._metadata)
        except grpc.RpcError as error:
            _raise(error)

    def info(self) -> pb.SessionInfo:
        return self._client.get_session(self.id)

    def delete(self) -> None:
        self._client.delete_session(self.id)


@dataclasses.dataclass
class DecodeResult(AttentionResult):
    """One Decode message's results: AttentionResult's arrays with a batch
    dimension first (B items of k queries each), so merge_attention takes a
    DecodeResult as it is, plus each item's outcome.

    output [B, k, q_heads, head_dim] float32, lse [B, k, q_heads] and, with
    top_k, top_k_tokens / top_k_logits [B, k, q_heads, top_k]. tokens [B]: the
    layer's length after the step (a failed item: its length as it stands, 0
    when its session was not found). errors [B]: None for an item that
    succeeded, else a TurbokvError with the item's gRPC code and message. A
    failed item changed nothing of its session; its output is zeros and its
    lse -inf."""

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
        """Raises the first failed item's TurbokvError; returns self when all succeeded."""
        for error in self.errors:
            if error is not None:
                raise error
        return self

    def item(self, i: int) -> AttentionResult:
        """Item i's k queries as an AttentionResult: output [k, q_heads, head_dim]."""
        return AttentionResult(output=self.output[i], lse=self.lse[i],
                               top_k_tokens=None if self.top_k_tokens is None else self.top_k_tokens[i],
                               top_k_logits=None if self.top_k_logits is None else self.top_k_logits[i])


class DecodeStream:
    """One Decode stream (Client.decode_stream()): each call is one layer's
    decode step for a batch of B sessions, sent as one message and answered in
    order. Items fail alone (DecodeResult.errors); a malformed message ends the
    stream, raising TurbokvError from that call and every later one. Arguments
    the daemon would refuse for their shapes raise ValueError here, before
    anything is sent, and leave the stream open.

    step() and attend() send one message and wait for its result. To keep
    several messages in flight, send() each and receive() their results in
    the same order. One thread at a time; close() it (or use `with`)."""

    def __init__(self, client: "Client", timeout: Optional[float] = None):
        self._requests: "queue.SimpleQueue[Optional[pb.DecodeRequest]]" = queue.SimpleQueue()
        self._responses = client._stub.Decode(iter(self._requests.get, None), timeout=timeout,
                                              metadata=client._metadata)
        self._pending = collections.deque()  # (session ids, top_k) of messages sent and not received
        self._error: Optional[TurbokvError] = None
        self._closed = False

    def step(self, layer: int, sessions: Sequence[Union[Session, str]], keys, values, queries, positions, *,
             softmax_scale: float = 0.0, softcap: float = 0.0, window: int = 0, top_k: int = 0) -> DecodeResult:
        """Stores each item's k new tokens and attends with its k queries.

        sessions: B Session objects or session ids, each once, all of one
        shape. keys, values [B, kv_heads, head_dim] (k = 1) or
        [B, k, kv_heads, head_dim], float32 or float16; queries the same rank:
        [B, q_heads, head_dim] or [B, k, q_heads, head_dim]. positions [B, k]:
        query j of item i is at positions[i][j] and sees tokens [0, position];
        item i's tokens go to positions[i][0] + 0 .. k - 1 (consecutive, the
        first at most the layer's length; positions already stored are
        acknowledged, not stored twice). positions [B] means each item's
        first position, the others following it. Options as in Session.attend."""
        if keys is None or values is None:
            raise ValueError("step needs keys and values; attend() sends queries alone")
        return self._call(layer, sessions, queries, positions, keys, values, softmax_scale, softcap, window, top_k)

    def attend(self, layer: int, sessions: Sequence[Union[Session, str]], queries, positions,
               **options) -> DecodeResult:
        """Attention only: as step() without keys and values; every position
        must be stored already, and positions [B, k] need not be consecutive."""
        return self._call(layer, sessions, queries, positions, None, None, **options)

    def send(self, layer: int, sessions: Sequence[Union[Session, str]], queries, positions, keys=None,
             values=None, *, softmax_scale: float = 0.0, softcap: float = 0.0, window: int = 0,
             top_k: int = 0) -> None:
        """Sends a message without waiting for its result: receive() it
        later. With keys and values (both or neither) it is a step(), without
        them an attend(); the arguments mean what they mean there."""
        request = self._request(layer, sessions, queries, positions, keys, values,
                                pb.AttentionOptions(softmax_scale=softmax_scale, softcap=softcap, window=window,
                                                    top_k=top_k))
        self._check_open()
        self._pending.append((list(request.session_ids), top_k))
        self._requests.put(request)

    def receive(self) -> DecodeResult:
        """The result of the oldest message sent and not yet received."""
        self._check_open()
        if not self._pending:
            raise RuntimeError("receive() with no message awaiting its result")
        session_ids, top_k = self._pending.popleft()
        try:
            response = next(self._responses)
        except grpc.RpcError as error:
            self._fail(TurbokvError(error.code(), error.details()))
        except StopIteration:
            self._fail(TurbokvError(grpc.StatusCode.UNAVAILABLE, "the Decode stream ended without a response"))
        errors = _item_errors(response.status)
        return _result(response, top_k, DecodeResult, session_ids=session_ids,
                       tokens=np.array(response.tokens, dtype=np.int64), errors=errors)

    @property
    def pending(self) -> int:
        """Messages sent whose results are not received yet."""
        return len(self._pending)

    def close(self) -> None:
        """Ends the stream once the daemon has answered what was sent; results
        not received are dropped, and so is an error ending the stream."""
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        self._requests.put(None)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass

    def __enter__(self) -> "DecodeStream":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self._responses.cancel()  # no need to wait for what was sent
        self.close()

    def _call(self, layer, sessions, queries, positions, keys, values, softmax_scale: float = 0.0,
              softcap: float = 0.0, window: int = 0, top_k: int = 0) -> DecodeResult:
        if self._pending:
            raise RuntimeError(f"{len(self._pending)} results of send() are not received yet: receive() them first")
        self.send(layer, sessions, queries, positions, keys, values, softmax_scale=softmax_scale, softcap=softcap,
                  window=window, top_k=top_k)
        return self.receive()

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError("the Decode stream is closed")

    def _fail(self, error: TurbokvError) -> None:
        self._error = error
        self._pending.clear()
        raise error

    @staticmethod
    def _request(layer, sessions, queries, positions, keys, values, options) -> pb.DecodeRequest:
        if layer < 0:
            raise ValueError(f"layer must be >= 0, got {layer}")
        ids = [s.id if isinstance(s, Session) else s for s in sessions]
        if not ids or not all(isinstance(i, str) and i for i in ids):
            raise ValueError("sessions must be one or more Session objects or session ids")
        b = len(ids)
        queries = np.asarray(queries)
        if queries.ndim not in (3, 4) or queries.shape[0] != b:
            raise ValueError(f"queries must be [{b}, q_heads, head_dim] or [{b}, k, q_heads, head_dim] for "
                             f"{b} sessions, got shape {queries.shape}")
        k = queries.shape[1] if queries.ndim == 4 else 1
        positions = np.asarray(positions)
        if positions.dtype.kind not in "iu":
            raise ValueError(f"positions must be integers, got {positions.dtype}")
        if positions.shape == (b,):
            positions = positions[:, None] + np.arange(k)
        if positions.shape != (b, k):
            raise ValueError(f"positions must be [{b}] or [{b}, {k}] for queries {queries.shape}, "
                             f"got shape {positions.shape}")
        request = pb.DecodeRequest(layer=layer, session_ids=ids, positions=positions.astype(np.int64).ravel().tolist(),
                                   queries=_tensor(queries, queries.ndim, "queries"), options=options)
        if (keys is None) != (values is None):
            raise ValueError("keys and values: send both or neither")
        if keys is not None:
            keys, values = np.asarray(keys), np.asarray(values)
            if (keys.shape != values.shape or keys.shape[:-2] != queries.shape[:-2]
                    or keys.shape[-1:] != queries.shape[-1:]):
                expected = "[B, kv_heads, head_dim]" if queries.ndim == 3 else "[B, k, kv_heads, head_dim]"
                raise ValueError(f"keys and values must both be {expected} like queries {queries.shape}, "
                                 f"got {keys.shape} and {values.shape}")
            request.keys.CopyFrom(_tensor(keys, queries.ndim, "keys"))
            request.values.CopyFrom(_tensor(values, queries.ndim, "values"))
        return request


class Client:
    """A channel to turbokvd: unix:///path or host:port.

    token: sent as "authorization: Bearer TOKEN" (turbokvd --auth-tokens-file).
    root_certificates: PEM bytes of the CA that signed turbokvd's certificate,
    for TLS to a TCP listener; private_key and certificate_chain: this
    client's, for mTLS."""

    def __init__(self, target: str = "unix:///tmp/turbokv.sock", max_message_bytes: int = 64 << 20,
                 timeout: Optional[float] = None, token: Optional[str] = None,
                 root_certificates: Optional[bytes] = None, private_key: Optional[bytes] = None,
                 certificate_chain: Optional[bytes] = None):
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
        ]
        if root_certificates is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.KvCacheServiceStub(self._channel)
        self._timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_until_ready(self, timeout: float = 10.0) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TurbokvError(grpc.StatusCode.UNAVAILABLE, f"turbokvd not reachable within {timeout} s") from None

    def create_session(self, layers: int, kv_heads: int, q_heads: int, head_dim: int, key_codec: str = "turbo3",
                       value_codec: str = "turbo3", rotation_seed: Optional[int] = None, max_tokens: int = 0,
                       idle_ttl: Optional[float] = None, pinned: bool = False) -> Session:
        """pinned: never demoted to turbokvd's --spill-dir while idle."""
        for name in (key_codec, value_codec):
            if name not in _CODECS:
                raise ValueError(f"unknown codec {name!r}: use one of {', '.join(_CODECS)}")
        config = pb.SessionConfig(
            shape=pb.ModelShape(layers=layers, kv_heads=kv_heads, q_heads=q_heads, head_dim=head_dim),
            key_codec=_CODECS[key_codec], value_codec=_CODECS[value_codec], max_tokens=max_tokens, pinned=pinned,
        )
        if rotation_seed is not None:
            config.rotation_seed = rotation_seed
        if idle_ttl is not None:
            config.idle_ttl.CopyFrom(duration_pb2.Duration(seconds=int(idle_ttl), nanos=int(idle_ttl % 1 * 1e9)))
        try:
            response = self._stub.CreateSession(pb.CreateSessionRequest(config=config), timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            _raise(error)
        return Session(self, response.session_id, response.config)

    def session(self, session_id: str) -> Session:
        """A handle on an existing session."""
        return Session(self, session_id, self.get_session(session_id).config)

    def get_session(self, session_id: str) -> pb.SessionInfo:
        try:
            return self._stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            _raise(error)

    def list_sessions(self) -> list:
        try:
            return list(self._stub.ListSessions(pb.ListSessionsRequest(), timeout=self._timeout, metadata=self._metadata).sessions)
        except grpc.RpcError as error:
            _raise(error)

    def delete_session(self, session_id: str) -> None:
        try:
            self._stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id), timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            _raise(error)

    def decode_stream(self, timeout: Optional[float] = None) -> DecodeStream:
        """A Decode stream for batched decoding, held open across steps:

            with client.decode_stream() as stream:
                result = stream.step(layer, sessions, keys, values, queries, positions)

        timeout: a deadline for the whole stream in seconds (the client's
        timeout is for single calls and does not apply); None: no deadline."""
        return DecodeStream(self, timeout)

    def snapshot(self) -> pb.SnapshotResponse:
        """Writes every session to turbokvd's --snapshot-dir now."""
        try:
            return self._stub.Snapshot(pb.SnapshotRequest(), timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            _raise(error)

    def prefetch(self, sessions: Sequence[Union[Session, str]]) -> list:
        """Brings sessions demoted to turbokvd's --spill-dir back into memory
        ahead of use. Returns, per session, None when it is in memory or the
        TurbokvError saying why not (NOT_FOUND, RESOURCE_EXHAUSTED, ...)."""
        ids = [s.id if isinstance(s, Session) else s for s in sessions]
        try:
            response = self._stub.Prefetch(pb.PrefetchRequest(session_ids=ids), timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            _raise(error)
        return _item_errors(response.status)

    def stats(self) -> pb.StatsResponse:
        try:
            return self._stub.Stats(pb.StatsRequest(), timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            _raise(error)
