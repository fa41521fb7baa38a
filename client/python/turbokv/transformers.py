"""Hugging Face transformers models with their KV cache in turbokvd.

Any decoder model that transformers runs through its attention interface
stores its keys and values in turbokvd and computes attention there::

    import turbokv
    import turbokv.transformers  # registers attn_implementation="turbokv"

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="turbokv")
    with turbokv.transformers.TurbokvCache(turbokv.Client(target), model.config, preset="k4v4") as cache:
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64,
                             **{turbokv.transformers.CACHE_ARGUMENT: cache})

``CACHE_ARGUMENT`` is the keyword the running transformers takes the cache
by: ``cache`` from 5.24 on (``cache=cache``; ``past_key_values=`` still
works there but warns that it is deprecated), ``past_key_values`` before.

Each sequence of the batch is one turbokvd session, created on the cache's
first use and deleted when the cache closes (``keep=True`` keeps them: their
ids are ``cache.sessions``, to Fork or reuse). Padding never reaches
turbokvd: a sequence's session holds its real tokens only, at their own
positions. A prefill stores a sequence's tokens with one Append (its queries
go along: its first chunk fits the key transform) and attends with causal
positions; a decoding step of the whole batch is one Decode message per
layer. Keys arrive after RoPE, as the model computed them; GQA, the model's
softmax scale, sliding-window layers and logit softcapping are passed on.

**Head dims.** turbokvd stores head dims that are multiples of 64 (up to
576). A model whose head_dim is not (Phi-3's 96, the 80 of some Llama
variants) is stored padded with zeros to the next multiple of 64: the
padded channels add nothing to any dot product and their outputs are
dropped, so attention is the model's own, under every codec and on every
device; the cost is the padding's bytes (``stored_head_dim /
head_dim``: 1.33x at 96, 1.6x at 80).

**Shared prefixes.** Given the prompt's token ids (``token_ids=``, one row
per sequence, no padding) and a ``salt`` naming the model, the cache starts
each session with the longest prefix of its prompt that a session of the
tenant still holds (docs/API.md "Reusing prefixes"; blocks go with their
last holder, so give the cache whose prompt later ones share keep=True, or
keep it open), and reports that
length to transformers, so that ``generate`` runs the model on the rest of
the prompt only (a plain forward call must then be given the rest itself:
``ids[:, cache.get_seq_length():]``). Once the prompt is stored, its full
blocks are named for later caches. The first Append of a layer then ends
on a block boundary, at 512 tokens (or the prompt's last full block before
them): the key transform is fitted on it, so every prefix from there on can
be reused. Fitting it on fewer tokens costs quality (one block of 64 instead
of 512 nearly doubled the KL divergence of Qwen2.5-Coder-0.5B: docs/API.md
"Reusing prefixes").

transformers calls the cache's ``update`` with each layer's new keys and
values and then the attention function with them; the cache only counts
tokens (the model's masks need the lengths) and the attention function
stores and attends. Their shapes are checked against the session's on every
call: a transformers version that lays the cache out otherwise fails with
LayoutMismatch, never silently. Daemon errors raise the package's
TurbokvError subclasses.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable, List, Optional, Sequence, TypeVar

import numpy as np
import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from turbokv._common import block_hashes
from turbokv.client import Client, DecodeStream, Session
from turbokv.errors import SessionNotFound, TurbokvError

ATTN_IMPLEMENTATION = "turbokv"
"""The name models load the integration by: ``attn_implementation="turbokv"``."""

SUPPORTED_TRANSFORMERS = ((5, 0), (6, 0))
"""transformers versions [low, high) whose attention and cache interfaces this module follows."""


class LayoutMismatch(RuntimeError):
    """transformers handed over tensors laid out otherwise than this integration
    stores them (another transformers version, or a model that changes its
    cache layout): refused rather than stored wrongly."""


def _version(text: str) -> tuple:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _check_transformers_version() -> None:
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= _version(transformers.__version__) < high:
        raise LayoutMismatch(
            f"turbokv.transformers follows transformers {low[0]}.{low[1]} to before {high[0]}.{high[1]}; "
            f"{transformers.__version__} may lay its cache out otherwise")


CACHE_ARGUMENT = "cache" if _version(transformers.__version__) >= (5, 24) else "past_key_values"
"""The keyword generate() and the models' forward take the cache by in the
running transformers: 5.24 renamed ``past_key_values=`` to ``cache=`` (the
old name still works there, with a FutureWarning). ``**{CACHE_ARGUMENT:
cache}`` passes it on every supported version without a warning."""

_CHUNK = 1024    # tokens per Append message of a prefill
_FIT = 512       # tokens of the first Append of a prefill whose blocks are named (token_ids=)
_QUERIES = 256   # queries per Attend message
_HEAD_DIM_STEP = 64  # turbokvd's head dims are its multiples (padded up to one: TurbokvCache.stored_head_dim)

# The cache whose update() ran last in this thread: the attention function
# that transformers calls right after it finds it here.
_active: contextvars.ContextVar = contextvars.ContextVar("turbokv_transformers_cache", default=None)

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _abandoned_on_failure(method: _Method) -> _Method:
    """A TurbokvCache call that stores: refused once the cache is closed, and
    a failure in it abandons the cache (TurbokvCache._abandon)."""

    @functools.wraps(method)
    def call(cache: "TurbokvCache", *args: Any, **kwargs: Any) -> Any:
        if cache.closed:
            raise RuntimeError("this TurbokvCache is closed (its with block ended, close() was called, or a call of it "
                               "failed): make a new one for each generation")
        try:
            return method(cache, *args, **kwargs)
        except BaseException as failure:
            cache._abandon(failure)
            raise

    return call  # type: ignore[return-value]


class TurbokvLayer(CacheLayerMixin):
    """One layer's length as the model sees it (padding included); the tokens are in turbokvd."""

    is_compileable = False
    is_croppable = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True
        self.dtype, self.device = key_states.dtype, key_states.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> "tuple[torch.Tensor, torch.Tensor]":
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.length += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> "tuple[int, int]":
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("turbokv.transformers does not support beam search: its sequences are sessions")


class TurbokvCache(Cache):
    """A transformers Cache whose layers live in turbokvd, one session per
    sequence of the batch. Session options (preset, key_codec, value_codec,
    layer_codecs, key_transform, sink_tokens, ...) are those of
    Client.create_session. Use it for one generation (or one forward pass
    and its continuation); close() deletes its sessions unless keep=True,
    and a closed cache refuses further use. A call of it that fails (a
    daemon error, a layout it refuses) deletes its sessions even with
    keep=True (their layers may hold different numbers of tokens) and
    closes it: no session is left to its idle TTL."""

    def __init__(self, client: Client, config: Any, *, keep: bool = False, token_ids: Any = None,
                 salt: str = "", **session_options: Any) -> None:
        _check_transformers_version()
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.client = client
        self.keep = keep
        self.session_options = session_options
        self.num_layers = int(text.num_hidden_layers)
        self.q_heads = int(text.num_attention_heads)
        self.kv_heads = int(getattr(text, "num_key_value_heads", None) or self.q_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // self.q_heads)
        self.stored_head_dim = -(-self.head_dim // _HEAD_DIM_STEP) * _HEAD_DIM_STEP
        """The head dim of the sessions: head_dim, or the next multiple of 64 (zeros padding it)."""
        self.sessions: List[Session] = []
        self.closed = False
        # Per sequence, per layer: tokens stored in its session.
        self._stored: Optional[np.ndarray] = None
        self._stream: Optional[DecodeStream] = None
        # With token_ids: per sequence, the hashes of its prompt's full blocks,
        # named once the prompt is stored.
        self._hashes: Optional[List[List[bytes]]] = None
        self._prompt = 0
        self._block = 0
        self._first = _CHUNK
        self.prefix_tokens = 0
        """Tokens of the prompt every sequence started with (token_ids=), from earlier sessions."""
        super().__init__(layers=[TurbokvLayer() for _ in range(self.num_layers)])
        if token_ids is not None:
            self._start_from_prefixes(token_ids, salt)

    @_abandoned_on_failure
    def _start_from_prefixes(self, token_ids: Any, salt: str) -> None:
        rows = token_ids.tolist() if hasattr(token_ids, "tolist") else [list(row) for row in token_ids]
        if not rows or any(len(row) != len(rows[0]) for row in rows) or not rows[0]:
            raise ValueError("token_ids: one row of the prompt's token ids per sequence, all of one length, "
                             "without padding")
        self._block = self.client.stats().block_tokens
        self._prompt = len(rows[0])
        self._first = max(self._block, min(_FIT // self._block, self._prompt // self._block) * self._block)
        self._hashes = [block_hashes(row, self._block, salt) for row in rows]
        for hashes in self._hashes:
            self.sessions.append(self.client.create_session(
                self.num_layers, self.kv_heads, self.q_heads, self.stored_head_dim, prefix_blocks=hashes,
                **self.session_options))
        # One length for the batch, and at least one token left for the model.
        start = min(min(s.prefix_tokens for s in self.sessions), (self._prompt - 1) // self._block * self._block)
        for session in self.sessions:
            if session.prefix_tokens > start:
                session.truncate(start)
        self._stored = np.full((len(rows), self.num_layers), start, dtype=np.int64)
        for layer in self.layers:
            layer.length = start
        self.prefix_tokens = start

    @_abandoned_on_failure
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> "tuple[torch.Tensor, torch.Tensor]":
        if not 0 <= layer_idx < self.num_layers:
            raise LayoutMismatch(f"layer {layer_idx}: the cache has {self.num_layers} layers (num_hidden_layers of "
                                 "the config it was made with): make it with the model's config")
        unattended = _active.get()
        if unattended is not None and unattended[0] is self:
            # The attention function takes the layer's keys and values from
            # here: had it run, the layer's update would not be pending.
            raise RuntimeError(f"layer {unattended[1]}'s attention did not run in turbokvd: TurbokvCache needs the "
                               "model set to attn_implementation='turbokv' (from_pretrained(..., "
                               "attn_implementation='turbokv') or model.set_attn_implementation('turbokv'))")
        _active.set((self, layer_idx))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _sessions_for(self, batch: int) -> List[Session]:
        if not self.sessions:
            for _ in range(batch):
                self.sessions.append(self.client.create_session(
                    self.num_layers, self.kv_heads, self.q_heads, self.stored_head_dim, **self.session_options))
            self._stored = np.zeros((batch, self.num_layers), dtype=np.int64)
        elif len(self.sessions) != batch:
            raise LayoutMismatch(f"the batch has {batch} sequences, the cache {len(self.sessions)}: use one cache "
                                 "per batch (beam search and batch changes are not supported)")
        return self.sessions

    def close(self) -> None:
        """Deletes the sessions (unless keep) and closes the Decode stream;
        the cache then holds no tokens and refuses further use."""
        self.closed = True
        for layer in self.layers:
            layer.reset()
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if not self.keep:
            for session in self.sessions:
                session.delete()
            self.sessions = []

    def _abandon(self, failure: BaseException) -> None:
        """Closes the cache after `failure`, deleting its sessions whatever
        keep says: some of their layers may have stored what others have
        not. A session the daemon could not delete is named in a note of
        the failure, which stays the error raised."""
        sessions, self.sessions = self.sessions, []
        self.close()
        for session in sessions:
            try:
                session.delete()
            except SessionNotFound:
                pass
            except TurbokvError as error:
                failure.add_note(f"turbokv.transformers: session {session.id} not deleted ({error}): it stays until "
                                 "its idle TTL")

    def __enter__(self) -> "TurbokvCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _decode_stream(self) -> DecodeStream:
        if self._stream is None:
            self._stream = self.client.decode_stream()
        return self._stream

    @_abandoned_on_failure
    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               real: Optional[torch.Tensor], scaling: Optional[float], softcap: Optional[float],
               window: Optional[int]) -> torch.Tensor:
        """Stores the new tokens of each sequence and attends with their
        queries: query [B, q_heads, n, d], key and value [B, kv_heads, n, d],
        real [B, n] (which new tokens are not padding; None: all). Returns
        [B, n, q_heads, d] (zeros at padding)."""
        batch, q_heads, n, d = query.shape
        if (q_heads, d) != (self.q_heads, self.head_dim) or tuple(key.shape) != (batch, self.kv_heads, n, d) or \
                tuple(value.shape) != tuple(key.shape):
            raise LayoutMismatch(
                f"layer {layer}: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}; "
                f"expected [batch, {self.q_heads}, tokens, {self.head_dim}] and [batch, {self.kv_heads}, tokens, "
                f"{self.head_dim}]")
        sessions = self._sessions_for(batch)
        pad = self.stored_head_dim - d
        if pad and not scaling:
            scaling = d ** -0.5  # the model's head_dim, not the padded one turbokvd would take
        options = dict(softmax_scale=float(scaling or 0.0), softcap=float(softcap or 0.0), window=int(window or 0))
        # [B, n, heads, stored_head_dim] on the host, in the model's dtype
        # (sent as it is).
        q, k, v = (torch.nn.functional.pad(x.detach().transpose(1, 2).cpu(), (0, pad)) for x in (query, key, value))
        mask = np.ones((batch, n), dtype=bool) if real is None else real.cpu().numpy().astype(bool)
        out = torch.zeros((batch, n, q_heads, d), dtype=torch.float32)
        stored = self._stored[:, layer]
        # With token_ids, a layer's first Append ends on a block boundary: the
        # key transform is fitted on it, and every prefix from there is
        # reusable.
        first = self._first
        if n == 1 and mask.all():
            # A decoding step of every sequence: one Decode message.
            result = self._decode_stream().step(layer, sessions, k[:, 0], v[:, 0], q[:, 0],
                                                stored[:, None].copy(), **options)
            result.raise_for_status()
            out[:, 0] = result.output[:, 0, :, :d].float()
            stored += 1
        else:
            for i, session in enumerate(sessions):
                rows = torch.from_numpy(np.flatnonzero(mask[i]))
                if rows.numel() == 0:
                    continue
                start = int(stored[i])
                ki, vi, qi = k[i, rows], v[i, rows], q[i, rows]
                # Messages of at most _CHUNK tokens; a layer's first carries
                # its queries (it fits the layer's key transform).
                bounds = [0] + list(range(first if start == 0 else 0, rows.numel(), _CHUNK)) + [rows.numel()]
                session.append_stream(
                    (layer, start + c, ki[c:e], vi[c:e], qi[c:e] if start + c == 0 else None)
                    for c, e in zip(bounds, bounds[1:]) if e > c)
                for c in range(0, rows.numel(), _QUERIES):
                    positions = list(range(start + c, start + min(rows.numel(), c + _QUERIES)))
                    result = session.attend(layer, qi[c:c + _QUERIES], positions, **options)
                    out[i, rows[c:c + _QUERIES]] = result.output[..., :d].float()
                stored[i] += rows.numel()
        if self._hashes is not None and layer == self.num_layers - 1 and int(self._stored.min()) >= self._prompt:
            # The prompt is in every layer: its full blocks are named for
            # later sessions (once).
            for session, hashes in zip(sessions, self._hashes):
                if hashes:
                    session.name_blocks(0, hashes)
            self._hashes = None
        return out.to(query.device, query.dtype)


def turbokv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                      dropout: float = 0.0, sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      **kwargs: Any) -> "tuple[torch.Tensor, None]":
    """transformers' attention function for attn_implementation="turbokv":
    the new tokens of the layer (from the TurbokvCache that update() just
    gave them to) stored and attended in turbokvd."""
    active = _active.get()
    _active.set(None)
    layer = getattr(module, "layer_idx", None)
    if active is None or active[1] != layer:
        raise RuntimeError(f"attn_implementation='turbokv' needs {CACHE_ARGUMENT}="
                           "turbokv.transformers.TurbokvCache(...) (and use_cache=True): the keys and values are "
                           "stored in turbokvd through it")
    cache: TurbokvCache = active[0]
    if dropout:
        raise ValueError("turbokv attention is for inference: dropout must be 0 (call model.eval())")
    n = query.shape[-2]
    real = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise LayoutMismatch(f"expected the 2D padding mask of turbokv_mask, got shape {tuple(attention_mask.shape)}")
        real = attention_mask[:, -n:]
    return cache.attend(layer, query, key, value, real, scaling, softcap, sliding_window), None


def turbokv_mask(batch_size: int, q_length: int, kv_length: int, attention_mask: Optional[torch.Tensor] = None,
                 **kwargs: Any) -> Optional[torch.Tensor]:
    """The mask function of attn_implementation="turbokv": the 2D padding mask
    [batch, kv_length] as the model got it (None without padding); causality
    and windows are turbokvd's, by position."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    return attention_mask[:, -kv_length:].bool()


def register() -> None:
    """Registers attn_implementation="turbokv" (done when the module is imported)."""
    _check_transformers_version()
    ALL_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, turbokv_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, turbokv_mask)


register()

__all__: Sequence[str] = ("ATTN_IMPLEMENTATION", "CACHE_ARGUMENT", "LayoutMismatch", "TurbokvCache", "TurbokvLayer",
                          "register", "turbokv_attention", "turbokv_mask")
