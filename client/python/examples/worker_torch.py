"""The worker of worker.py with a torch model: torch tensors in and out of turbokvd.

A small torch transformer (random weights) decodes one sequence token by
token, keeping its keys and values in --dtype (bfloat16 by default, as a bf16
model would) on --device. Each layer keeps its most recent `--local` tokens
itself and sends older ones to turbokvd in chunks, as torch tensors; turbokvd's
attention over them comes back as torch tensors on the same device and is
merged with the worker's own attention through the log-sum-exp. Until a layer
has offloaded anything its past is empty (lse -inf), which merge_attention
merges exactly. The merged output is checked against full attention.

    python3 worker_torch.py --target unix:///tmp/turbokv.sock --tokens 512 --dtype bfloat16 --codec turbo3
"""

import argparse
import math
import sys

import torch

import turbokv

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def local_attention(q, keys, values):
    """q [q_heads, d], keys/values [t, kv_heads, d] -> AttentionResult of one
    query: output [1, q_heads, d] float32, lse [1, q_heads]."""
    group = q.shape[0] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # [t, q_heads, d]
    v = values.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("hd,thd->ht", q.float(), k) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(logits, dim=1)
    out = torch.einsum("ht,thd->hd", torch.exp(logits - lse[:, None]), v)
    return turbokv.AttentionResult(output=out[None], lse=lse[None])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="unix:///tmp/turbokv.sock")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--local", type=int, default=64, help="recent tokens each layer keeps itself")
    parser.add_argument("--chunk", type=int, default=64, help="tokens offloaded per Append message")
    parser.add_argument("--codec", default="turbo3")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="of the keys, values and queries")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-error", type=float, default=None,
                        help="fail when the mean relative error exceeds this (default: 0.02 for f16, 0.25 otherwise)")
    args = parser.parse_args()
    dtype, device = DTYPES[args.dtype], torch.device(args.device)

    layers, d_model, q_heads, kv_heads, head_dim = 2, 256, 8, 2, 64
    generator = torch.Generator().manual_seed(0)

    def weights(*shape):
        return (torch.randn(shape, generator=generator) / math.sqrt(d_model)).to(device)
    wq, wk, wv = (weights(layers, d_model, heads * head_dim) for heads in (q_heads, kv_heads, kv_heads))
    wo = weights(layers, q_heads * head_dim, d_model)
    embed = torch.randn((1000, d_model), generator=generator).to(device)

    client = turbokv.Client(args.target)
    client.wait_until_ready(20)
    session = client.create_session(layers, kv_heads, q_heads, head_dim, key_codec=args.codec, value_codec=args.codec)
    all_k = torch.zeros((layers, args.tokens, kv_heads, head_dim), dtype=dtype, device=device)
    all_v = torch.zeros_like(all_k)
    nothing = turbokv.AttentionResult(output=torch.zeros((1, q_heads, head_dim), device=device),
                                      lse=torch.full((1, q_heads), -math.inf, device=device))
    offloaded = [0] * layers  # tokens [0, offloaded) of each layer live in turbokvd
    errors = []
    token = 1
    for t in range(args.tokens):
        x = embed[token]
        for l in range(layers):
            q = (x @ wq[l]).reshape(q_heads, head_dim).to(dtype)
            all_k[l, t] = (x @ wk[l]).reshape(kv_heads, head_dim)
            all_v[l, t] = (x @ wv[l]).reshape(kv_heads, head_dim)
            if t + 1 - offloaded[l] >= args.local + args.chunk:  # offload the oldest chunk
                start, end = offloaded[l], offloaded[l] + args.chunk
                session.append(l, start, all_k[l, start:end], all_v[l, start:end])
                offloaded[l] = end
            past = session.attend(l, q[None], positions=[offloaded[l] - 1]) if offloaded[l] else nothing
            if past.output.device != device:
                raise AssertionError(f"turbokvd's result is on {past.output.device}, the queries on {device}")
            recent = local_attention(q, all_k[l, offloaded[l]:t + 1], all_v[l, offloaded[l]:t + 1])
            merged = turbokv.merge_attention(past, recent)
            if offloaded[l]:
                full = local_attention(q, all_k[l, :t + 1], all_v[l, :t + 1])
                errors.append(float(torch.linalg.norm(merged.output - full.output) / torch.linalg.norm(full.output)))
            x = x + merged.output.reshape(-1) @ wo[l]
        token = int(torch.argmax(x @ embed.T)) % len(embed)

    info = session.info()
    session.delete()
    client.close()
    mean = sum(errors) / len(errors)
    bound = args.max_error if args.max_error is not None else (0.02 if args.codec == "f16" else 0.25)
    print(f"worker_torch: {args.tokens} tokens, {layers} layers, {args.dtype} on {device}, {offloaded[0]} tokens per "
          f"layer offloaded to turbokvd ({args.codec}, {info.bytes_used} bytes vs {info.fp16_bytes} in fp16), "
          f"{args.local}+ kept locally")
    print(f"worker_torch: merged attention vs full attention, relative L2 error: mean {mean:.4f}, "
          f"max {max(errors):.4f} over {len(errors)} steps (bound {bound})")
    return 0 if mean <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
