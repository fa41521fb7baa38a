"""Run by vllm_connector_test.py with .venv-vllm's Python: one prompt through
vllm.LLM (vLLM's prefix cache and KV events on, blocks of 64 tokens) with
turbokv.vllm.TurbokvConnector naming turbokvd's blocks by vLLM's hashes
(block_names "vllm") and handing its stores to vLLM's publisher as turbokvd's
medium ("memory"). It subscribes to vLLM's event socket and to turbokvd's
(--daemon-events), decodes every batch of both with vLLM's own decoder
(msgspec into vllm.distributed.kv_events.KVEventBatch) and writes what it
decoded as JSON (--out): per stream, the batches' data-parallel ranks and
their events' type, medium, hashes, parent, block size and token count."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--daemon-events", required=True, help="turbokvd's --kv-events-endpoint")
    parser.add_argument("--model", required=True)
    parser.add_argument("--text", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import msgspec
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory(prefix="turbokv-vllm-events-") as folder:
        vllm_events = f"ipc://{folder}/vllm-events"
        llm = LLM(model=args.model, dtype="float16", enforce_eager=True, enable_prefix_caching=True, block_size=64,
                  max_model_len=2048,
                  kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                  endpoint=vllm_events),
                  kv_transfer_config=KVTransferConfig(
                      kv_connector="TurbokvConnector", kv_connector_module_path="turbokv.vllm", kv_role="kv_both",
                      kv_connector_extra_config={"target": args.target, "key_codec": "f16", "value_codec": "f16",
                                                 "block_names": "vllm", "event_medium": "memory"}))
        context = zmq.Context()
        streams = {}
        for name, endpoint in (("vllm", vllm_events), ("turbokvd", args.daemon_events)):
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            streams[name] = sub
        time.sleep(1.0)  # the subscriptions reach the publishers
        with open(args.text) as f:
            ids = llm.get_tokenizer().encode(f.read())[:args.prompt_tokens]
        llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=16, temperature=0.0),
                     use_tqdm=False)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        decoded = {name: [] for name in streams}
        poller = zmq.Poller()
        for sub in streams.values():
            poller.register(sub, zmq.POLLIN)
        quiet_until = time.monotonic() + 5.0
        while time.monotonic() < quiet_until:
            for sub, _ in poller.poll(200):
                name = next(n for n, s in streams.items() if s is sub)
                frames = sub.recv_multipart()
                batch = decoder.decode(frames[-1])
                decoded[name].append({
                    "dp_rank": batch.data_parallel_rank,
                    "events": [{"type": type(e).__name__, "medium": getattr(e, "medium", None),
                                "hashes": list(getattr(e, "block_hashes", [])),
                                "parent": getattr(e, "parent_block_hash", None),
                                "block_size": getattr(e, "block_size", None),
                                "tokens": len(getattr(e, "token_ids", []))} for e in batch.events]})
                quiet_until = time.monotonic() + 2.0
        for sub in streams.values():
            sub.close(linger=0)
        context.term()
    with open(args.out, "w") as f:
        json.dump(decoded, f)


if __name__ == "__main__":
    main()
