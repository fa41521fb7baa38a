"""An inference worker that offloads its long past to turbokvd.

A small numpy transformer (random weights) decodes a sequence token by token.
Each layer keeps its most recent `--local` tokens' keys and values itself and
sends older ones to turbokvd in chunks. Attention at every step is the exact
merge, through log-sum-exp, of turbokvd's attention over the offloaded past and
the worker's own attention over its recent tokens. The worker also keeps every
key and value in float32 to check the merged output against full attention.

    python3 worker.py --target unix:///tmp/turbokv.sock --tokens 512 --local 64 --codec turbo3
"""

import argparse
import sys

import numpy as np

import turbokv


def local_attention(q, keys, values):
    """q [q_heads, d], keys/values [t, kv_heads, d] -> AttentionResult for one query."""
    q_heads, d = q.shape
    group = q_heads // keys.shape[1]
    k = np.repeat(keys, group, axis=1).transpose(1, 0, 2)  # [q_heads, t, d]
    v = np.repeat(values, group, axis=1).transpose(1, 0, 2)
    logits = np.einsum("hd,htd->ht", q, k) / np.sqrt(d)
    m = logits.max(axis=1, keepdims=True)
    w = np.exp(logits - m)
    out = np.einsum("ht,htd->hd", w, v) / w.sum(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(w.sum(axis=1))
    return turbokv.AttentionResult(output=out[None].astype(np.float32), lse=lse[None].astype(np.float32))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="unix:///tmp/turbokv.sock")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--local", type=int, default=64, help="recent tokens each layer keeps itself")
    parser.add_argument("--chunk", type=int, default=64, help="tokens offloaded per Append message")
    parser.add_argument("--codec", default="turbo3")
    parser.add_argument("--max-error", type=float, default=None,
                        help="fail when the mean relative error exceeds this (default: 0.02 for f16, 0.25 otherwise)")
    args = parser.parse_args()

    layers, d_model, q_heads, kv_heads, head_dim = 2, 256, 8, 2, 64
    rng = np.random.default_rng(0)
    scale = 1 / np.sqrt(d_model)
    wq = rng.standard_normal((layers, d_model, q_heads * head_dim), dtype=np.float32) * scale
    wk = rng.standard_normal((layers, d_model, kv_heads * head_dim), dtype=np.float32) * scale
    wv = rng.standard_normal((layers, d_model, kv_heads * head_dim), dtype=np.float32) * scale
    wo = rng.standard_normal((layers, q_heads * head_dim, d_model), dtype=np.float32) * scale
    embed = rng.standard_normal((1000, d_model), dtype=np.float32)

    client = turbokv.Client(args.target)
    client.wait_until_ready(20)
    session = client.create_session(layers, kv_heads, q_heads, head_dim, key_codec=args.codec, value_codec=args.codec)
    all_k = np.zeros((layers, args.tokens, kv_heads, head_dim), np.float32)
    all_v = np.zeros_like(all_k)
    offloaded = [0] * layers  # tokens [0, offloaded) of each layer live in turbokvd
    errors = []
    token = 1
    for t in range(args.tokens):
        x = embed[token]
        for l in range(layers):
            q = (x @ wq[l]).reshape(q_heads, head_dim)
            all_k[l, t] = (x @ wk[l]).reshape(kv_heads, head_dim)
            all_v[l, t] = (x @ wv[l]).reshape(kv_heads, head_dim)
            # Offload the oldest chunk once the local window overflows.
            if t + 1 - offloaded[l] >= args.local + args.chunk:
                start, end = offloaded[l], offloaded[l] + args.chunk
                offloaded[l] = session.append(l, start, all_k[l, start:end], all_v[l, start:end])
            recent = local_attention(q, all_k[l, offloaded[l]:t + 1], all_v[l, offloaded[l]:t + 1])
            if offloaded[l] > 0:
                past = session.attend(l, q[None], positions=[offloaded[l] - 1])
                merged = turbokv.merge_attention(past, recent)
            else:
                merged = recent
            full = local_attention(q, all_k[l, :t + 1], all_v[l, :t + 1])
            if offloaded[l] > 0:
                errors.append(np.linalg.norm(merged.output - full.output) / np.linalg.norm(full.output))
            x = x + merged.output[0].reshape(-1) @ wo[l]
        token = int(np.argmax(embed @ x)) % len(embed)

    info = session.info()
    session.delete()
    client.close()
    mean = float(np.mean(errors))
    bound = args.max_error if args.max_error is not None else (0.02 if args.codec == "f16" else 0.25)
    print(f"worker: {args.tokens} tokens, {layers} layers, {offloaded[0]} tokens per layer offloaded to turbokvd "
          f"({args.codec}, {info.bytes_used} bytes vs {info.fp16_bytes} in fp16), {args.local}+ kept locally")
    print(f"worker: merged attention vs full attention, relative L2 error: mean {mean:.4f}, "
          f"max {max(errors):.4f} over {len(errors)} steps (bound {bound})")
    return 0 if mean <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
