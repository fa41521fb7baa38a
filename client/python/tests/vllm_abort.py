"""Run by vllm_connector_test.py with .venv-vllm's Python: a request aborted
while turbokv.vllm loads its prefix. vLLM runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) with vllm_faults.HeldLoadConnector, whose
loads wait for a file. One run stores the prompt; a second request of it is
aborted while its load waits; the load is let go; the prompt is run again.
Writes as JSON (--out) the scheduler's free blocks at each point, both
runs' tokens and cached tokens, and the connector's counters."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--text", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory(prefix="turbokv-vllm-abort-") as hold:
        os.environ["TURBOKV_TEST_HOLD"] = hold
        llm = LLM(model=args.model, dtype="float16", enforce_eager=True, enable_prefix_caching=False,
                  disable_log_stats=False, max_model_len=2048,
                  kv_transfer_config=KVTransferConfig(
                      kv_connector="HeldLoadConnector", kv_connector_module_path="vllm_faults", kv_role="kv_both",
                      kv_connector_extra_config={"target": args.target, "key_codec": "f16", "value_codec": "f16"}))
        engine = llm.llm_engine
        pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        with open(args.text) as f:
            prompt = TokensPrompt(prompt_token_ids=llm.get_tokenizer().encode(f.read())[:1000])
        sampling = SamplingParams(max_tokens=8, temperature=0.0)

        def run():
            out = llm.generate([prompt], sampling, use_tqdm=False)[0]
            return {"tokens": list(out.outputs[0].token_ids), "cached_tokens": out.num_cached_tokens or 0}

        open(os.path.join(hold, "release"), "w").close()
        result = {"first": run(), "free_before": pool.get_num_free_blocks()}
        os.remove(os.path.join(hold, "release"))
        engine.add_request("aborted", prompt, sampling)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(hold, "started")) and time.monotonic() < deadline:
            engine.step()
        result["load_started"] = os.path.exists(os.path.join(hold, "started"))
        engine.abort_request(["aborted"])
        for _ in range(3):
            engine.step()
        result["free_while_loading"] = pool.get_num_free_blocks()
        open(os.path.join(hold, "release"), "w").close()
        deadline = time.monotonic() + 60
        while pool.get_num_free_blocks() < result["free_before"] and time.monotonic() < deadline:
            engine.step()
            time.sleep(0.01)
        result["free_after"] = pool.get_num_free_blocks()
        result["again"] = run()
        result["metrics"] = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:turbokv_")}
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
