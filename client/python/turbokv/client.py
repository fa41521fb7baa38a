"""turbokv.Client, turbokv.Session and turbokv.DecodeStream: the blocking client.

Arrays go in as numpy arrays or torch tensors and come back the same way
(torch results on the input's device). turbokv.aio has the same API on asyncio.
"""

from __future__ import annotations

import collections.abc
import queue
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

import grpc
import numpy as np

from turbokv import _common, _shm, _tensors
from turbokv._common import DEFAULT_TIMEOUT, Array, AttentionResult, DecodeResult, RetryPolicy
from turbokv.errors import SessionNotFound, TurbokvError, Unavailable, error_for
from turbokv.v1 import turbokv_pb2 as pb

T = TypeVar("T")
Chunk = Tuple[Optional[int], int, Any, Any]


class Session(_common.SessionBase):
    """One session's calls (Client.create_session() or Client.session()).

    Keys and values are [tokens, kv_heads, head_dim]; with layer=None,
    [layers, tokens, kv_heads, head_dim]. Tensors are numpy arrays (float32,
    float16; float64 is sent as float32) or torch tensors (float32, float16,
    bfloat16, on any device). Shapes, dtypes and ranges are checked before
    anything is sent (ValueError / TypeError naming the argument). Every call
    takes timeout= in seconds (None: the client's)."""

    _client: "Client"

    def append(self, layer: Optional[int], start: int, keys: Any, values: Any, *, queries: Any = None,
               timeout: Optional[float] = None) -> int:
        """Stores tokens [start, start + n) of `layer` (None: every layer);
        returns the layer's new length. Positions already stored are
        acknowledged, not stored again. queries (the chunk's, [n, q_heads,
        head_dim] or [layers, n, q_heads, head_dim]): send them with a layer's
        first chunk, whose keys fit the layer's key transform."""
        return self._shared(
            lambda values_of: (self._append_request(layer, start, keys, values, queries, values_of), None),
            ("keys", "values", "queries"), 0,
            lambda request, kind, block: self._append(iter([request]), timeout))

    def append_stream(self, chunks: Iterable[Chunk], *, timeout: Optional[float] = None) -> int:
        """Sends (layer, start, keys, values[, queries]) chunks on one Append stream
        without waiting for each acknowledgement; returns the length after the
        last one. The first failing chunk raises (a chunk refused here raises
        its ValueError or TypeError, as does an exception of the chunks'
        generator); the ones before it stay. timeout covers the whole stream.
        Chunks go through the client's shared memory where it has room; when
        the daemon restarted under the client, a sequence of chunks is sent
        again in the messages, while other iterables raise SessionNotFound
        (naming the shared-memory region) and the next call registers a new
        region."""
        shared = _common.SharedChunks(self)
        requests = _common.Requests(chunks, shared.request)
        try:
            tokens = self._append(iter(requests), timeout, shared.acknowledged)
        except TurbokvError as error:
            if not (shared.close(error) and isinstance(chunks, collections.abc.Sequence)):
                raise
            # The daemon restarted under the client: a sequence of chunks is
            # sent again in the messages (positions stored are acknowledged,
            # not stored twice).
            requests = _common.Requests(chunks, self._chunk_request)
            tokens = self._append(iter(requests), timeout)
        finally:
            shared.close()
        requests.raise_error()
        return tokens

    def _append(self, requests: Iterator[pb.AppendRequest], timeout: Optional[float],
                acknowledged: Optional[Callable[[], None]] = None) -> int:
        def attempt(deadline: Optional[float]) -> int:
            tokens = 0
            for response in self._client._stub.Append(requests, timeout=deadline, metadata=self._client._metadata):
                tokens = response.tokens
                if acknowledged is not None:
                    acknowledged()
            return tokens
        return self._client._invoke(attempt, timeout, idempotent=False)

    def attend(self, layer: int, queries: Any, positions: Optional[Sequence[int]] = None, softmax_scale: float = 0.0,
               softcap: float = 0.0, window: int = 0, top_k: int = 0, *,
               timeout: Optional[float] = None) -> AttentionResult:
        """queries [n, q_heads, head_dim]; a query at position p sees tokens
        [0, p] (no positions: every stored token). softmax_scale 0: 1/sqrt(head_dim);
        softcap > 0: logits become softcap * tanh(logit / softcap); window > 0:
        a query at p sees only tokens (p - window, p]; top_k > 0: also the k
        highest logits per query head. Retried on UNAVAILABLE."""
        def call(request: pb.AttendRequest, kind: _tensors.Kind, block: Optional[_shm.Block]) -> AttentionResult:
            def attempt(deadline: Optional[float]) -> AttentionResult:
                for response in self._client._stub.Attend(iter([request]), timeout=deadline,
                                                          metadata=self._client._metadata):
                    return _common.result(response.result, top_k, kind, block=block)
                raise Unavailable(grpc.StatusCode.UNAVAILABLE, "the Attend stream ended without a response")
            return self._client._invoke(attempt, timeout, idempotent=True)
        return self._shared(
            lambda values_of: self._attend_request(layer, queries, positions, softmax_scale, softcap, window, top_k,
                                                    values_of),
            ("queries",), self._result_values(queries), call)

    def step(self, layer: int, position: int, key: Any, value: Any, query: Any, softmax_scale: float = 0.0,
             softcap: float = 0.0, window: int = 0, top_k: int = 0, *,
             timeout: Optional[float] = None) -> Tuple[int, AttentionResult]:
        """Appends one token (key and value [kv_heads, head_dim] or [1, ...])
        at `position` and attends with its query ([q_heads, head_dim] or
        [1, ...]); returns (layer length, result of 1 query)."""
        def call(request: pb.StepRequest, kind: _tensors.Kind,
                 block: Optional[_shm.Block]) -> Tuple[int, AttentionResult]:
            response = self._client._invoke(
                lambda deadline: self._client._stub.Step(request, timeout=deadline, metadata=self._client._metadata),
                timeout, idempotent=False)
            return response.tokens, _common.result(response.result, top_k, kind, block=block)
        return self._shared(
            lambda values_of: self._step_request(layer, position, key, value, query, softmax_scale, softcap, window,
                                                  top_k, values_of),
            ("key", "value", "query"), self.q_heads * (self.head_dim + 1), call)

    def _shared(self, build: Callable[[Optional[Dict[str, Any]]], Tuple[Any, Any]], fields: Tuple[str, ...],
                result_values: int, call: Callable[[Any, Any, Optional[_shm.Block]], T]) -> T:
        """call(request, kind, block) with the request's tensors (and room for
        its results) in the client's shared memory where it has some. A daemon
        that no longer holds the region (it restarted) applied nothing: the
        call is made again with the tensors in the message."""
        request, kind, block = self._placed(build, fields, result_values)
        try:
            return call(request, kind, block)
        except SessionNotFound as error:
            if not self._region_lost(error, block):
                raise
        finally:
            _shm.release(block)
        return call(*build(None), None)

    def read_kv(self, layer: Optional[int], start: int = 0, end: int = 0, dtype: Any = np.float32, *,
                device: Any = None, timeout: Optional[float] = None) -> Tuple[Array, Array]:
        """Decoded keys and values of tokens [start, end) (end 0: to the end):
        [tokens, kv_heads, head_dim] of one layer, or with layer=None every
        layer's, [layers, tokens, kv_heads, head_dim] (the layers must hold
        the same number of tokens in the range, else ValueError). dtype
        np.float32 or np.float16 gives numpy arrays; a torch dtype
        (torch.float32, torch.float16, torch.bfloat16) or a device gives
        torch tensors (on that device). Retried on UNAVAILABLE."""
        request, kind = self._read_kv_request(layer, start, end, dtype, device)

        def attempt(deadline: Optional[float]) -> List[pb.ReadKvResponse]:
            return list(self._client._stub.ReadKv(request, timeout=deadline, metadata=self._client._metadata))
        messages = self._client._invoke(attempt, timeout, idempotent=True)
        return self._read_kv_result(layer, messages, request.dtype, kind)

    def fork(self, prefix_tokens: int, *, timeout: Optional[float] = None) -> "Session":
        """A new session sharing the first prefix_tokens tokens of every layer (no copy)."""
        request = pb.ForkSessionRequest(source_session_id=self.id,
                                        prefix_tokens=_tensors.index(prefix_tokens, "prefix_tokens"))
        response = self._client._invoke(
            lambda deadline: self._client._stub.ForkSession(request, timeout=deadline, metadata=self._client._metadata),
            timeout, idempotent=False)
        fork = Session(self._client, response.session_id, response.session.config)
        fork.block_tokens = response.session.block_tokens
        return fork

    def name_blocks(self, first_block: int, hashes: Sequence[bytes], *,
                    timeout: Optional[float] = None) -> pb.NameBlocksResponse:
        """Names blocks first_block, first_block + 1, ... (each full in every
        layer) by their hashes (turbokv.block_hashes over the session's token
        ids) so that later sessions of this tenant can start with them
        (Client.create_session(prefix_blocks=)). Blocks are named in order; a
        block named again must get the same hash (FailedPrecondition
        otherwise). Returns named_blocks and reusable_from_blocks: a shorter
        prefix is not reused, its pages depending on tokens past it (append a
        shared prefix as its own first chunk)."""
        request = pb.NameBlocksRequest(session_id=self.id, first_block=_tensors.index(first_block, "first_block"),
                                       block_hashes=_common.hash_list(hashes, "hashes"))
        return self._client._invoke(
            lambda deadline: self._client._stub.NameBlocks(request, timeout=deadline, metadata=self._client._metadata),
            timeout, idempotent=True)

    def truncate(self, tokens: int, *, timeout: Optional[float] = None) -> pb.SessionInfo:
        """Every layer keeps its first `tokens` tokens; returns the session's info."""
        request = pb.TruncateSessionRequest(session_id=self.id, tokens=_tensors.index(tokens, "tokens"))
        return self._client._invoke(
            lambda deadline: self._client._stub.TruncateSession(request, timeout=deadline,
                                                                metadata=self._client._metadata),
            timeout, idempotent=False)

    def info(self, *, timeout: Optional[float] = None) -> pb.SessionInfo:
        """Tokens per layer, bytes held, residency, configuration (Client.get_session)."""
        return self._client.get_session(self.id, timeout=timeout)

    def delete(self, *, timeout: Optional[float] = None) -> None:
        """Frees the session (pages a fork shares stay with the fork)."""
        self._client.delete_session(self.id, timeout=timeout)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        """Deletes the session unless `keep` is set (one already gone is no error)."""
        if not self.keep:
            try:
                self.delete()
            except SessionNotFound:
                pass


class DecodeStream(_common.DecodeBase):
    """One Decode stream (Client.decode_stream()): each call is one layer's
    decode step for a batch of B sessions, sent as one message and answered in
    order. Items fail alone (DecodeResult.errors); a malformed message ends the
    stream, raising its TurbokvError from that call and every later one.
    Arguments the daemon would refuse for their shapes, dtypes or ranges raise
    ValueError / TypeError here, before anything is sent, and leave the
    stream open.

    step() and attend() send one message and wait for its result. To keep
    several messages in flight, send() each and receive() their results in
    the same order. One thread at a time; close() it (or use `with`)."""

    def __init__(self, client: "Client", timeout: Optional[float] = None):
        super().__init__(client._shared_memory)
        self._requests: "queue.SimpleQueue[Optional[pb.DecodeRequest]]" = queue.SimpleQueue()
        self._responses = client._stub.Decode(iter(self._requests.get, None),
                                              timeout=_common.timeout_value(timeout), metadata=client._metadata)

    def step(self, layer: int, sessions: Sequence[Union[Session, str]], keys: Any, values: Any, queries: Any,
             positions: Any, *, softmax_scale: float = 0.0, softcap: float = 0.0, window: int = 0,
             top_k: int = 0) -> DecodeResult:
        """Stores each item's k new tokens and attends with its k queries.

        sessions: B Session objects or session ids, each once, all of one
        shape. keys, values [B, kv_heads, head_dim] (k = 1) or
        [B, k, kv_heads, head_dim] (numpy or torch, as for Session.append);
        queries the same rank: [B, q_heads, head_dim] or
        [B, k, q_heads, head_dim]. positions [B, k]: query j of item i is at
        positions[i][j] and sees tokens [0, position]; item i's tokens go to
        positions[i][0] + 0 .. k - 1 (consecutive, the first at most the
        layer's length; positions already stored are acknowledged, not stored
        twice). positions [B] means each item's first position, the others
        following it. Options as in Session.attend. Results are numpy arrays,
        or torch tensors on the queries' device."""
        if keys is None or values is None:
            raise ValueError("step needs keys and values; attend() sends queries alone")
        self._check_idle()
        self.send(layer, sessions, queries, positions, keys, values, softmax_scale=softmax_scale, softcap=softcap,
                  window=window, top_k=top_k)
        return self.receive()

    def attend(self, layer: int, sessions: Sequence[Union[Session, str]], queries: Any, positions: Any, *,
               softmax_scale: float = 0.0, softcap: float = 0.0, window: int = 0, top_k: int = 0) -> DecodeResult:
        """Attention only: as step() without keys and values; every position
        must be stored already, and positions [B, k] need not be consecutive."""
        self._check_idle()
        self.send(layer, sessions, queries, positions, softmax_scale=softmax_scale, softcap=softcap, window=window,
                  top_k=top_k)
        return self.receive()

    def send(self, layer: int, sessions: Sequence[Union[Session, str]], queries: Any, positions: Any,
             keys: Any = None, values: Any = None, *, softmax_scale: float = 0.0, softcap: float = 0.0,
             window: int = 0, top_k: int = 0) -> None:
        """Sends a message without waiting for its result: receive() it
        later. With keys and values (both or neither) it is a step(), without
        them an attend(); the arguments mean what they mean there."""
        self._check_open()
        self._requests.put(self._request(layer, sessions, queries, positions, keys, values, softmax_scale, softcap,
                                         window, top_k))

    def receive(self) -> DecodeResult:
        """The result of the oldest message sent and not yet received."""
        self._check_open()
        if not self._pending:
            raise RuntimeError("receive() with no message awaiting its result")
        try:
            response = next(self._responses)
        except grpc.RpcError as error:
            self._fail(error_for(error.code(), error.details()))
        except StopIteration:
            self._fail(Unavailable(grpc.StatusCode.UNAVAILABLE, "the Decode stream ended without a response"))
        return self._result(response)

    def close(self) -> None:
        """Ends the stream once the daemon has answered what was sent; results
        not received are dropped, and so is an error ending the stream."""
        if self._closed:
            return
        self._closed = True
        self._drop_pending()
        self._requests.put(None)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass

    def __enter__(self) -> "DecodeStream":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self._responses.cancel()  # no need to wait for what was sent
        self.close()


class Client:
    """A channel to turbokvd: target is unix:///path, host:port, or an
    absolute path, taken as unix://PATH (None: $TURBOKV_TARGET when set, else
    unix:///tmp/turbokv.sock).

    timeout: the default deadline of each call in seconds (a stream's covers
    the whole stream; None: no deadline); each call's timeout= overrides it.
    retry: how idempotent calls are retried on UNAVAILABLE (RetryPolicy).
    token: sent as "authorization: Bearer TOKEN" (turbokvd --auth-tokens-file).
    root_certificates: PEM bytes of the CA that signed turbokvd's certificate,
    for TLS to a TCP listener; private_key and certificate_chain: this
    client's, for mTLS. shared_memory: over a unix socket, the bytes of the
    shared-memory region tensors travel through (docs/API.md "Shared
    memory"; 0: always in the messages). Failures raise TurbokvError
    subclasses by gRPC code (turbokv.errors)."""

    def __init__(self, target: Optional[str] = None, max_message_bytes: int = 64 << 20,
                 timeout: Optional[float] = DEFAULT_TIMEOUT, token: Optional[str] = None,
                 root_certificates: Optional[bytes] = None, private_key: Optional[bytes] = None,
                 certificate_chain: Optional[bytes] = None, retry: RetryPolicy = RetryPolicy(),
                 shared_memory: int = _common.SHARED_MEMORY_BYTES):
        connection = _common.Connection(grpc, target, max_message_bytes, timeout, token, root_certificates,
                                        private_key, certificate_chain, retry, shared_memory)
        self._target, self._timeout, self._retry = connection.target, connection.timeout, connection.retry
        self._channel, self._stub, self._metadata = connection.channel, connection.stub, connection.metadata
        self._shared_memory = connection.shared

    def _invoke(self, attempt: Callable[[Optional[float]], T], timeout: Optional[float], idempotent: bool) -> T:
        """Runs attempt(deadline in seconds) until it succeeds, retrying
        UNAVAILABLE for idempotent calls; a failure raises its TurbokvError."""
        attempts = _common.Attempts(self._retry, self._timeout if timeout is None else _common.timeout_value(timeout),
                                    idempotent)
        while True:
            try:
                return attempt(attempts.remaining())
            except grpc.RpcError as error:
                wait = attempts.retry_after(error)
                if wait is None:
                    raise attempts.error(error) from None
            time.sleep(wait)

    def close(self) -> None:
        self._channel.close()
        if self._shared_memory is not None:
            self._shared_memory.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait_until_ready(self, timeout: float = 10.0) -> None:
        """Waits until the channel is connected; Unavailable after `timeout` seconds."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable(grpc.StatusCode.UNAVAILABLE,
                              f"turbokvd at {self._target} not reachable within {timeout} s") from None

    def create_session(self, layers: int, kv_heads: int, q_heads: int, head_dim: int,
                       key_codec: Optional[str] = None, value_codec: Optional[str] = None,
                       rotation_seed: Optional[int] = None, max_tokens: int = 0,
                       idle_ttl: Optional[float] = None, pinned: bool = False, *,
                       preset: Optional[str] = None,
                       layer_codecs: Optional[Sequence[Tuple[int, int, Optional[str], Optional[str]]]] = None,
                       key_transform: Optional[str] = None, center_values: bool = False,
                       sink_tokens: Optional[int] = None, sink_codec: Optional[str] = None,
                       prefix_blocks: Optional[Sequence[bytes]] = None,
                       timeout: Optional[float] = None) -> Session:
        """A new session of the model shape. Codecs: f16, q8_0, q4_0, turbo2,
        turbo3, turbo4, or a preset (turbokv.PRESETS: k8v4, k4v4, k4v3, k3v4,
        k3v3, k2v2) in their place; with neither, the daemon's default preset.
        layer_codecs: (first_layer, last_layer, key_codec, value_codec) ranges
        in place of the session's codecs (None: the session's). rotation_seed:
        the turbo codecs' (random when None); max_tokens per layer (0: the
        daemon's); idle_ttl in seconds (None: the daemon's --session-ttl);
        pinned: never demoted to --spill-dir. key_transform: how keys are
        stored before their codec (turbokv.KEY_TRANSFORMS: "none", "center",
        "center_scale"; None: the daemon's default, center_scale);
        center_values: values centered too; sink_tokens: the first tokens of
        every layer kept apart in sink_codec ("f16" or "q8_0"; None: the
        daemon's default, 4 in f16). prefix_blocks: the hashes of its first
        blocks (turbokv.block_hashes): it starts with the longest prefix of
        them that a session of this tenant and storage named
        (Session.name_blocks), sharing its pages; session.prefix_tokens says
        how many tokens per layer it got."""
        request = _common.create_request(layers, kv_heads, q_heads, head_dim, key_codec, value_codec, rotation_seed,
                                         max_tokens, idle_ttl, pinned, preset, layer_codecs,
                                         key_transform, center_values, sink_tokens, sink_codec, prefix_blocks)
        response = self._invoke(
            lambda deadline: self._stub.CreateSession(request, timeout=deadline, metadata=self._metadata),
            timeout, idempotent=False)
        return _common.started(Session(self, response.session_id, response.config), response)

    def session(self, session_id: str, *, timeout: Optional[float] = None) -> Session:
        """A handle on an existing session (SessionNotFound when there is none)."""
        info = self.get_session(session_id, timeout=timeout)
        session = Session(self, session_id, info.config)
        session.block_tokens = info.block_tokens
        return session

    def get_session(self, session_id: str, *, timeout: Optional[float] = None) -> pb.SessionInfo:
        """A session's info: layer_tokens, bytes_used, fp16_bytes, residency, config, age, idle."""
        request = pb.GetSessionRequest(session_id=_common.session_ids([session_id], "session_id")[0])
        return self._invoke(lambda deadline: self._stub.GetSession(request, timeout=deadline, metadata=self._metadata),
                            timeout, idempotent=True)

    def list_sessions(self, *, timeout: Optional[float] = None) -> List[pb.SessionInfo]:
        """Every session of this caller's tenant."""
        return list(self._invoke(
            lambda deadline: self._stub.ListSessions(pb.ListSessionsRequest(), timeout=deadline,
                                                     metadata=self._metadata),
            timeout, idempotent=True).sessions)

    def delete_session(self, session_id: str, *, timeout: Optional[float] = None) -> None:
        request = pb.DeleteSessionRequest(session_id=_common.session_ids([session_id], "session_id")[0])
        self._invoke(lambda deadline: self._stub.DeleteSession(request, timeout=deadline, metadata=self._metadata),
                     timeout, idempotent=False)

    def decode_stream(self, timeout: Optional[float] = None) -> DecodeStream:
        """A Decode stream for batched decoding, held open across steps:

            with client.decode_stream() as stream:
                result = stream.step(layer, sessions, keys, values, queries, positions)

        timeout: a deadline for the whole stream in seconds (the client's
        timeout is for single calls and does not apply); None: no deadline."""
        return DecodeStream(self, timeout)

    def snapshot(self, *, timeout: Optional[float] = None) -> pb.SnapshotResponse:
        """Writes every session to turbokvd's --snapshot-dir now."""
        return self._invoke(
            lambda deadline: self._stub.Snapshot(pb.SnapshotRequest(), timeout=deadline, metadata=self._metadata),
            timeout, idempotent=False)

    def prefetch(self, sessions: Sequence[Union[Session, str]], *,
                 timeout: Optional[float] = None) -> List[Optional[TurbokvError]]:
        """Brings sessions demoted to turbokvd's --spill-dir back into memory
        ahead of use. Returns, per session, None when it is in memory or the
        error saying why not (SessionNotFound, BudgetExceeded, ...). Retried
        on UNAVAILABLE."""
        request = pb.PrefetchRequest(session_ids=_common.session_ids(sessions))
        response = self._invoke(
            lambda deadline: self._stub.Prefetch(request, timeout=deadline, metadata=self._metadata),
            timeout, idempotent=True)
        return _common.item_errors(response.status)

    def stats(self, *, timeout: Optional[float] = None) -> pb.StatsResponse:
        """The daemon's totals: sessions, tokens, bytes_used, budget_bytes, compression_ratio, device, ..."""
        return self._invoke(
            lambda deadline: self._stub.Stats(pb.StatsRequest(), timeout=deadline, metadata=self._metadata),
            timeout, idempotent=True)
