"""An inference worker that offloads its long past to turbokvd.

A small numpy transformer (random weights) decodes a sequence token by token.
Each layer keeps its most recent `--local` tokens' keys and values itself and
sends older ones to turbokvd in chunks. Attention at every step is the exact
merge, through log-sum-exp, of turbokvd's attention over the offloaded past and
the worker's own attention over its recent tokens. The worker also keeps every
key and value in float32 to check the merged output against full attention.

With --batch N it decodes N sequences (one session each) together: turbokvd's
attention for all of them comes from one Decode stream, one message per layer
per step.

    python3 worker.py --target unix:///tmp/turbokv.sock --tokens 512 --local 64 --codec turbo3
    python3 worker.py --target unix:///tmp/turbokv.sock --tokens 512 --batch 4
"""

import argparse
import sys

import numpy as np

import turbokv


def local_attention(q, keys, values):
    """q [n, q_heads, d], keys/values [n, t, kv_heads, d] -> AttentionResult
    of one query per sequence: output [n, 1, q_heads, d], lse [n, 1, q_heads]."""
    d = q.shape[-1]
    group = q.shape[1] // keys.shape[2]
    k = np.repeat(keys, group, axis=2)  # [n, t, q_heads, d]
    v = np.repeat(values, group, axis=2)
    logits = np.einsum("nhd,nthd->nht", q, k) / np.sqrt(d)
    m = logits.max(axis=2, keepdims=True)
    w = np.exp(logits - m)
    out = np.einsum("nht,nthd->nhd", w, v) / w.sum(axis=2, keepdims=True)
    lse = m[..., 0] + np.log(w.sum(axis=2))
    return turbokv.AttentionResult(output=out[:, None].astype(np.float32), lse=lse[:, None].astype(np.float32))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="unix:///tmp/turbokv.sock")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--local", type=int, default=64, help="recent tokens each layer keeps itself")
    parser.add_argument("--chunk", type=int, default=64, help="tokens offloaded per Append message")
    parser.add_argument("--codec", default="turbo3")
    parser.add_argument("--batch", type=int, default=None, metavar="N",
                        help="decode N sequences together through one Decode stream (default: one sequence, Attend)")
    parser.add_argument("--max-error", type=float, default=None,
                        help="fail when the mean relative error exceeds this (default: 0.02 for f16, 0.25 otherwise)")
    args = parser.parse_args()
    if args.batch is not None and args.batch < 1:
        parser.error("--batch must be at least 1")

    layers, d_model, q_heads, kv_heads, head_dim = 2, 256, 8, 2, 64
    n = args.batch or 1  # sequences
    rng = np.random.default_rng(0)
    scale = 1 / np.sqrt(d_model)
    wq = rng.standard_normal((layers, d_model, q_heads * head_dim), dtype=np.float32) * scale
    wk = rng.standard_normal((layers, d_model, kv_heads * head_dim), dtype=np.float32) * scale
    wv = rng.standard_normal((layers, d_model, kv_heads * head_dim), dtype=np.float32) * scale
    wo = rng.standard_normal((layers, q_heads * head_dim, d_model), dtype=np.float32) * scale
    embed = rng.standard_normal((1000, d_model), dtype=np.float32)

    client = turbokv.Client(args.target)
    client.wait_until_ready(20)
    sessions = [client.create_session(layers, kv_heads, q_heads, head_dim, key_codec=args.codec,
                                      value_codec=args.codec) for _ in range(n)]
    stream = client.decode_stream() if args.batch else None

    def past_attention(l, q, end):
        """turbokvd's attention over tokens [0, end) of layer l, q [n, q_heads, d]."""
        if stream is not None:
            return stream.attend(l, sessions, q, [end - 1] * n).raise_for_status()
        past = sessions[0].attend(l, q, positions=[end - 1])  # one sequence: q is [1, q_heads, d]
        return turbokv.AttentionResult(output=past.output[None], lse=past.lse[None])

    all_k = np.zeros((layers, n, args.tokens, kv_heads, head_dim), np.float32)
    all_v = np.zeros_like(all_k)
    offloaded = [0] * layers  # tokens [0, offloaded) of each layer (every sequence) live in turbokvd
    errors = []
    tokens = 1 + np.arange(n)  # each sequence's current token
    for t in range(args.tokens):
        x = embed[tokens]  # [n, d_model]
        for l in range(layers):
            q = (x @ wq[l]).reshape(n, q_heads, head_dim)
            all_k[l, :, t] = (x @ wk[l]).reshape(n, kv_heads, head_dim)
            all_v[l, :, t] = (x @ wv[l]).reshape(n, kv_heads, head_dim)
            # Offload the oldest chunk once the local window overflows.
            if t + 1 - offloaded[l] >= args.local + args.chunk:
                start, end = offloaded[l], offloaded[l] + args.chunk
                for i, session in enumerate(sessions):
                    session.append(l, start, all_k[l, i, start:end], all_v[l, i, start:end])
                offloaded[l] = end
            recent = local_attention(q, all_k[l, :, offloaded[l]:t + 1], all_v[l, :, offloaded[l]:t + 1])
            if offloaded[l] > 0:
                merged = turbokv.merge_attention(past_attention(l, q, offloaded[l]), recent)
                full = local_attention(q, all_k[l, :, :t + 1], all_v[l, :, :t + 1])
                errors += [np.linalg.norm(merged.output[i] - full.output[i]) / np.linalg.norm(full.output[i])
                           for i in range(n)]
            else:
                merged = recent
            x = x + merged.output[:, 0].reshape(n, -1) @ wo[l]
        tokens = np.argmax(x @ embed.T, axis=1) % len(embed)

    if stream is not None:
        stream.close()
    infos = [session.info() for session in sessions]
    for session in sessions:
        session.delete()
    client.close()
    mean = float(np.mean(errors))
    bound = args.max_error if args.max_error is not None else (0.02 if args.codec == "f16" else 0.25)
    sequences = f"{n} sequence{'s' * (n > 1)}"
    batch = f", {sequences} in one Decode stream" if args.batch else ""
    print(f"worker: {args.tokens} tokens, {layers} layers{batch}, {offloaded[0]} tokens per layer offloaded to "
          f"turbokvd ({args.codec}, {sum(i.bytes_used for i in infos)} bytes vs {sum(i.fp16_bytes for i in infos)} "
          f"in fp16), {args.local}+ kept locally")
    print(f"worker: merged attention vs full attention, relative L2 error: mean {mean:.4f}, "
          f"max {max(errors):.4f} over {len(errors) // n} steps{f' x {sequences}' if args.batch else ''} (bound {bound})")
    return 0 if mean <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
