"""turbokv.aio: the client on asyncio (grpc.aio), with the API of turbokv.Client.

    import turbokv.aio
    async with turbokv.aio.Client("unix:///tmp/turbokv.sock") as client:
        session = await client.create_session(layers=32, kv_heads=8, q_heads=32, head_dim=128)
        await session.append(0, 0, k, v)
        result = await session.attend(0, q)
        async with client.decode_stream() as stream:
            batch = await stream.step(0, [session], k_b, v_b, q_b, positions)

Every call of turbokv.Client and turbokv.Session is here a coroutine taking
the same arguments and returning the same results; append_stream also takes
an async iterable of chunks. Create the client inside the running event loop.
"""

from __future__ import annotations

import asyncio
import collections.abc
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Dict, Iterable, List, Optional, Sequence, \
    Tuple, TypeVar, Union

import grpc
import numpy as np

from turbokv import _common, _shm, _tensors
from turbokv._common import DEFAULT_TIMEOUT, Array, AttentionResult, DecodeResult, RetryPolicy
from turbokv.errors import SessionNotFound, TurbokvError, Unavailable, error_for
from turbokv.v1 import turbokv_pb2 as pb

__all__ = ["Client", "Session", "DecodeStream"]

T = TypeVar("T")
Chunk = Tuple[Optional[int], int, Any, Any]


class _Requests(_common.Requests):
    """As _common.Requests, for iterables and async iterables: an exception
    building a request ends the stream there and is raised to the caller as
    itself."""

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            if hasattr(self._items, "__aiter__"):
                async for item in self._items:  # type: ignore[union-attr]
                    yield self._build(item)
            else:
                for item in self._items:  # type: ignore[union-attr]
                    yield self._build(item)
        except Exception as error:  # noqa: BLE001 (re-raised in the caller's task)
            self.error = error


class Session(_common.SessionBase):
    """turbokv.Session on asyncio: the same calls, as coroutines."""

    _client: "Client"

    async def append(self, layer: Optional[int], start: int, keys: Any, values: Any, *, queries: Any = None,
                     timeout: Optional[float] = None) -> int:
        """As turbokv.Session.append."""
        async def call(request: pb.AppendRequest, kind: Any, block: Optional[_shm.Block]) -> int:
            return await self._append([request], timeout)
        return await self._shared(
            lambda values_of: (self._append_request(layer, start, keys, values, queries, values_of), None),
            ("keys", "values", "queries"), 0, call)

    async def append_stream(self, chunks: Union[Iterable[Chunk], AsyncIterable[Chunk]], *,
                            timeout: Optional[float] = None) -> int:
        """As turbokv.Session.append_stream; chunks may be an async iterable."""
        shared = _common.SharedChunks(self)
        requests = _Requests(chunks, shared.request)
        try:
            tokens = await self._append(requests, timeout, shared.acknowledged)
        except TurbokvError as error:
            if not (shared.close(error) and isinstance(chunks, collections.abc.Sequence)):
                raise
            # The daemon restarted under the client: a sequence of chunks is
            # sent again in the messages (positions stored are acknowledged,
            # not stored twice).
            requests = _Requests(chunks, self._chunk_request)
            tokens = await self._append(requests, timeout)
        finally:
            shared.close()
        requests.raise_error()
        return tokens

    async def _append(self, requests: Any, timeout: Optional[float],
                      acknowledged: Optional[Callable[[], None]] = None) -> int:
        async def attempt(deadline: Optional[float]) -> int:
            tokens = 0
            async for response in self._client._stub.Append(requests, timeout=deadline,
                                                            metadata=self._client._metadata):
                tokens = response.tokens
                if acknowledged is not None:
                    acknowledged()
            return tokens
        return await self._client._invoke(attempt, timeout, idempotent=False)

    async def attend(self, layer: int, queries: Any, positions: Optional[Sequence[int]] = None,
                     softmax_scale: float = 0.0, softcap: float = 0.0, window: int = 0, top_k: int = 0, *,
                     timeout: Optional[float] = None) -> AttentionResult:
        """As turbokv.Session.attend (retried on UNAVAILABLE)."""
        async def call(request: pb.AttendRequest, kind: _tensors.Kind,
                       block: Optional[_shm.Block]) -> AttentionResult:
            async def attempt(deadline: Optional[float]) -> AttentionResult:
                async for response in self._client._stub.Attend([request], timeout=deadline,
                                                                metadata=self._client._metadata):
                    return _common.result(response.result, top_k, kind, block=block)
                raise Unavailable(grpc.StatusCode.UNAVAILABLE, "the Attend stream ended without a response")
            return await self._client._invoke(attempt, timeout, idempotent=True)
        return await self._shared(
            lambda values_of: self._attend_request(layer, queries, positions, softmax_scale, softcap, window, top_k,
                                                    values_of),
            ("queries",), self._result_values(queries), call)

    async def step(self, layer: int, position: int, key: Any, value: Any, query: Any, softmax_scale: float = 0.0,
                   softcap: float = 0.0, window: int = 0, top_k: int = 0, *,
                   timeout: Optional[float] = None) -> Tuple[int, AttentionResult]:
        """As turbokv.Session.step."""
        async def call(request: pb.StepRequest, kind: _tensors.Kind,
                       block: Optional[_shm.Block]) -> Tuple[int, AttentionResult]:
            response = await self._client._invoke(
                lambda deadline: self._client._stub.Step(request, timeout=deadline, metadata=self._client._metadata),
                timeout, idempotent=False)
            return response.tokens, _common.result(response.result, top_k, kind, block=block)
        return await self._shared(
            lambda values_of: self._step_request(layer, position, key, value, query, softmax_scale, softcap, window,
                                                  top_k, values_of),
            ("key", "value", "query"), self.q_heads * (self.head_dim + 1), call)

    async def _shared(self, build: Callable[[Optional[Dict[str, Any]]], Tuple[Any, Any]], fields: Tuple[str, ...],
                      result_values: int, call: Callable[[Any, Any, Optional[_shm.Block]], Awaitable[T]]) -> T:
        """As turbokv.Session._shared, awaiting call."""
        request, kind, block = self._placed(build, fields, result_values)
        try:
            return await call(request, kind, block)
        except SessionNotFound as error:
            if not self._region_lost(error, block):
                raise
        finally:
            _shm.release(block)
        return await call(*build(None), None)

    async def read_kv(self, layer: Optional[int], start: int = 0, end: int = 0, dtype: Any = np.float32, *,
                      device: Any = None, timeout: Optional[float] = None) -> Tuple[Array, Array]:
        """As turbokv.Session.read_kv (retried on UNAVAILABLE)."""
        request, kind = self._read_kv_request(layer, start, end, dtype, device)

        async def attempt(deadline: Optional[float]) -> List[pb.ReadKvResponse]:
            return [m async for m in self._client._stub.ReadKv(request, timeout=deadline,
                                                               metadata=self._client._metadata)]
        messages = await self._client._invoke(attempt, timeout, idempotent=True)
        return self._read_kv_result(layer, messages, request.dtype, kind)

    async def fork(self, prefix_tokens: int, *, timeout: Optional[float] = None) -> "Session":
        """As turbokv.Session.fork."""
        request = pb.ForkSessionRequest(source_session_id=self.id,
                                        prefix_tokens=_tensors.index(prefix_tokens, "prefix_tokens"))
        response = await self._client._invoke(
            lambda deadline: self._client._stub.ForkSession(request, timeout=deadline, metadata=self._client._metadata),
            timeout, idempotent=False)
        fork = Session(self._client, response.session_id, response.session.config)
        fork.block_tokens = response.session.block_tokens
        return fork

    async def name_blocks(self, first_block: int, hashes: Sequence[bytes], *,
                    timeout: Optional[float] = None) -> pb.NameBlocksResponse:
        """As turbokv.Session.name_blocks."""
        request = pb.NameBlocksRequest(session_id=self.id, first_block=_tensors.index(first_block, "first_block"),
                                       block_hashes=_common.hash_list(hashes, "hashes"))
        return await self._client._invoke(
            lambda deadline: self._client._stub.NameBlocks(request, timeout=deadline, metadata=self._client._metadata),
            timeout, idempotent=True)

    async def truncate(self, tokens: int, *, timeout: Optional[float] = None) -> pb.SessionInfo:
        """As turbokv.Session.truncate."""
        request = pb.TruncateSessionRequest(session_id=self.id, tokens=_tensors.index(tokens, "tokens"))
        return await self._client._invoke(
            lambda deadline: self._client._stub.TruncateSession(request, timeout=deadline,
                                                                metadata=self._client._metadata),
            timeout, idempotent=False)

    async def info(self, *, timeout: Optional[float] = None) -> pb.SessionInfo:
        return await self._client.get_session(self.id, timeout=timeout)

    async def delete(self, *, timeout: Optional[float] = None) -> None:
        await self._client.delete_session(self.id, timeout=timeout)

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        """As turbokv.Session.__exit__."""
        if not self.keep:
            try:
                await self.delete()
            except SessionNotFound:
                pass


class DecodeStream(_common.DecodeBase):
    """turbokv.DecodeStream on asyncio: step(), attend(), send(), receive()
    and close() are coroutines; use `async with`. One task at a time."""

    def __init__(self, client: "Client", timeout: Optional[float] = None):
        super().__init__(client._shared_memory)
        self._call = client._stub.Decode(timeout=_common.timeout_value(timeout), metadata=client._metadata)

    async def step(self, layer: int, sessions: Sequence[Union[Session, str]], keys: Any, values: Any, queries: Any,
                   positions: Any, *, softmax_scale: float = 0.0, softcap: float = 0.0, window: int = 0,
                   top_k: int = 0) -> DecodeResult:
        """As turbokv.DecodeStream.step."""
        if keys is None or values is None:
            raise ValueError("step needs keys and values; attend() sends queries alone")
        self._check_idle()
        await self.send(layer, sessions, queries, positions, keys, values, softmax_scale=softmax_scale,
                        softcap=softcap, window=window, top_k=top_k)
        return await self.receive()

    async def attend(self, layer: int, sessions: Sequence[Union[Session, str]], queries: Any, positions: Any, *,
                     softmax_scale: float = 0.0, softcap: float = 0.0, window: int = 0,
                     top_k: int = 0) -> DecodeResult:
        """As turbokv.DecodeStream.attend."""
        self._check_idle()
        await self.send(layer, sessions, queries, positions, softmax_scale=softmax_scale, softcap=softcap,
                        window=window, top_k=top_k)
        return await self.receive()

    async def send(self, layer: int, sessions: Sequence[Union[Session, str]], queries: Any, positions: Any,
                   keys: Any = None, values: Any = None, *, softmax_scale: float = 0.0, softcap: float = 0.0,
                   window: int = 0, top_k: int = 0) -> None:
        """As turbokv.DecodeStream.send."""
        self._check_open()
        request = self._request(layer, sessions, queries, positions, keys, values, softmax_scale, softcap, window,
                                top_k)
        try:
            await self._call.write(request)
        except grpc.RpcError as error:
            self._fail(error_for(error.code(), error.details()))

    async def receive(self) -> DecodeResult:
        """As turbokv.DecodeStream.receive."""
        self._check_open()
        if not self._pending:
            raise RuntimeError("receive() with no message awaiting its result")
        try:
            response = await self._call.read()
        except grpc.RpcError as error:
            self._fail(error_for(error.code(), error.details()))
        if response is grpc.aio.EOF:
            self._fail(Unavailable(grpc.StatusCode.UNAVAILABLE, "the Decode stream ended without a response"))
        return self._result(response)

    async def close(self) -> None:
        """As turbokv.DecodeStream.close."""
        if self._closed:
            return
        self._closed = True
        self._drop_pending()
        try:
            await self._call.done_writing()
            while await self._call.read() is not grpc.aio.EOF:
                pass
        except grpc.RpcError:
            pass

    async def __aenter__(self) -> "DecodeStream":
        return self

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self._call.cancel()
        await self.close()


class Client:
    """turbokv.Client on grpc.aio: the same arguments (target, an absolute
    path taken as unix://PATH; timeout, retry, token, TLS); every call is a
    coroutine. Use `async with` or await close()."""

    def __init__(self, target: Optional[str] = None, max_message_bytes: int = 64 << 20,
                 timeout: Optional[float] = DEFAULT_TIMEOUT, token: Optional[str] = None,
                 root_certificates: Optional[bytes] = None, private_key: Optional[bytes] = None,
                 certificate_chain: Optional[bytes] = None, retry: RetryPolicy = RetryPolicy(),
                 shared_memory: int = _common.SHARED_MEMORY_BYTES):
        connection = _common.Connection(grpc.aio, target, max_message_bytes, timeout, token, root_certificates,
                                        private_key, certificate_chain, retry, shared_memory)
        self._target, self._timeout, self._retry = connection.target, connection.timeout, connection.retry
        self._channel, self._stub, self._metadata = connection.channel, connection.stub, connection.metadata
        self._shared_memory = connection.shared

    async def _invoke(self, attempt: Callable[[Optional[float]], Awaitable[T]], timeout: Optional[float],
                      idempotent: bool) -> T:
        attempts = _common.Attempts(self._retry, self._timeout if timeout is None else _common.timeout_value(timeout),
                                    idempotent)
        while True:
            try:
                return await attempt(attempts.remaining())
            except grpc.RpcError as error:
                wait = attempts.retry_after(error)
                if wait is None:
                    raise attempts.error(error) from None
            await asyncio.sleep(wait)

    async def close(self) -> None:
        await self._channel.close()
        if self._shared_memory is not None:
            self._shared_memory.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def wait_until_ready(self, timeout: float = 10.0) -> None:
        """As turbokv.Client.wait_until_ready."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise Unavailable(grpc.StatusCode.UNAVAILABLE,
                              f"turbokvd at {self._target} not reachable within {timeout} s") from None

    async def create_session(self, layers: int, kv_heads: int, q_heads: int, head_dim: int,
                             key_codec: Optional[str] = None, value_codec: Optional[str] = None,
                             rotation_seed: Optional[int] = None, max_tokens: int = 0,
                             idle_ttl: Optional[float] = None, pinned: bool = False, *,
                             preset: Optional[str] = None,
                             layer_codecs: Optional[Sequence[Tuple[int, int, Optional[str], Optional[str]]]] = None,
                             key_transform: Optional[str] = None, center_values: bool = False,
                             sink_tokens: Optional[int] = None, sink_codec: Optional[str] = None,
                             prefix_blocks: Optional[Sequence[bytes]] = None,
                             timeout: Optional[float] = None) -> Session:
        """As turbokv.Client.create_session."""
        request = _common.create_request(layers, kv_heads, q_heads, head_dim, key_codec, value_codec, rotation_seed,
                                         max_tokens, idle_ttl, pinned, preset, layer_codecs,
                                         key_transform, center_values, sink_tokens, sink_codec, prefix_blocks)
        response = await self._invoke(
            lambda deadline: self._stub.CreateSession(request, timeout=deadline, metadata=self._metadata),
            timeout, idempotent=False)
        return _common.started(Session(self, response.session_id, response.config), response)

    async def session(self, session_id: str, *, timeout: Optional[float] = None) -> Session:
        """As turbokv.Client.session."""
        info = await self.get_session(session_id, timeout=timeout)
        session = Session(self, session_id, info.config)
        session.block_tokens = info.block_tokens
        return session

    async def get_session(self, session_id: str, *, timeout: Optional[float] = None) -> pb.SessionInfo:
        request = pb.GetSessionRequest(session_id=_common.session_ids([session_id], "session_id")[0])
        return await self._invoke(
            lambda deadline: self._stub.GetSession(request, timeout=deadline, metadata=self._metadata),
            timeout, idempotent=True)

    async def list_sessions(self, *, timeout: Optional[float] = None) -> List[pb.SessionInfo]:
        response = await self._invoke(
            lambda deadline: self._stub.ListSessions(pb.ListSessionsRequest(), timeout=deadline,
                                                     metadata=self._metadata),
            timeout, idempotent=True)
        return list(response.sessions)

    async def delete_session(self, session_id: str, *, timeout: Optional[float] = None) -> None:
        request = pb.DeleteSessionRequest(session_id=_common.session_ids([session_id], "session_id")[0])
        await self._invoke(lambda deadline: self._stub.DeleteSession(request, timeout=deadline,
                                                                     metadata=self._metadata),
                           timeout, idempotent=False)

    def decode_stream(self, timeout: Optional[float] = None) -> DecodeStream:
        """As turbokv.Client.decode_stream (not a coroutine: `async with client.decode_stream() as stream`)."""
        return DecodeStream(self, timeout)

    async def snapshot(self, *, timeout: Optional[float] = None) -> pb.SnapshotResponse:
        return await self._invoke(
            lambda deadline: self._stub.Snapshot(pb.SnapshotRequest(), timeout=deadline, metadata=self._metadata),
            timeout, idempotent=False)

    async def prefetch(self, sessions: Sequence[Union[Session, str]], *,
                       timeout: Optional[float] = None) -> List[Optional[TurbokvError]]:
        """As turbokv.Client.prefetch."""
        request = pb.PrefetchRequest(session_ids=_common.session_ids(sessions))
        response = await self._invoke(
            lambda deadline: self._stub.Prefetch(request, timeout=deadline, metadata=self._metadata),
            timeout, idempotent=True)
        return _common.item_errors(response.status)

    async def stats(self, *, timeout: Optional[float] = None) -> pb.StatsResponse:
        return await self._invoke(
            lambda deadline: self._stub.Stats(pb.StatsRequest(), timeout=deadline, metadata=self._metadata),
            timeout, idempotent=True)
