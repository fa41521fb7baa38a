#!/usr/bin/env python3
"""What 8-bit instead of 16-bit products would add to a turbo codec's own
attention error: the question that decides whether the CPU scan may use 8-bit
multiply-adds (vpdpbusd, vpmaddubsw), which do twice the work per instruction.

A model of the codecs, not turbokv's kernels: Gaussian coordinates (what the
random rotation makes of a head's vector), each vector quantized to the
Lloyd-Max centroids of the normal distribution for 3 or 4 bits after scaling
by its RMS. Four query rows per kv head (GQA 32/8), d = 128. The scan's
roundings are modelled in numpy:

- query: each row rounded to a grid of its largest |value|, +-127 steps for
  8-bit products, +-8191 for the scan's 16-bit ones (kQueryMax);
- weights: each row's softmax weights rounded to a grid of the largest weight
  of their tile of 64 tokens, 255 steps for 8-bit products, 8191 for the
  scan's (kWeightMax; the scan also folds each token's block scale in, which
  the model leaves out).

Each cell is the worst, over softmax scales of 0.01 to 100 times 1/sqrt(d)
and a few draws, of RelativeL2(rounded, decoded) / RelativeL2(decoded,
original), where decoded is attention in floats over the quantized vectors
and original over the unquantized ones: the share of the codec's own error
that the rounding adds, as the CPU scan's accuracy test measures it and holds
to 2% (tests/kernels/attention_test.cc,
TheIntegerScanAddsLittleToTheCodecsError).

  .venv/bin/python bench/product_precision.py [--tokens 600] [--draws 3] [--seed 1]
"""
import argparse

import numpy as np

# Lloyd-Max centroids of N(0, 1), the positive half.
CENTROIDS = {
    "turbo3": [0.2451, 0.7560, 1.3439, 2.1519],
    "turbo4": [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326],
}
D, ROWS, TILE = 128, 4, 64
SCALES = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0)


def quantize(x, centroids):
    rms = np.sqrt((x * x).mean(-1, keepdims=True))
    index = np.abs(x[..., None] / rms[..., None] - centroids).argmin(-1)
    return centroids[index] * rms


def attend(q, k, v, scale, round_weights=None):
    logits = scale * q @ k.T
    w = np.exp(logits - logits.max(-1, keepdims=True))
    if round_weights is not None:
        w = round_weights(w)
    return (w @ v) / w.sum(-1, keepdims=True)


def relative(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def round_rows(q, steps):
    largest = np.abs(q).max(-1, keepdims=True)
    return np.round(q * steps / largest) * largest / steps


def round_tiles(w, steps):
    out = w.copy()
    for t in range(0, w.shape[1], TILE):
        tile = w[:, t:t + TILE]
        largest = tile.max(-1, keepdims=True)
        largest[largest == 0] = 1  # a row's tile whose weights all underflowed stays 0
        out[:, t:t + TILE] = np.round(tile * steps / largest) * largest / steps
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    # Each: (rounded queries, rounding of the weights or None).
    roundings = {
        "8-bit query": lambda q: (round_rows(q, 127), None),
        "the scan's query": lambda q: (round_rows(q, 8191), None),
        "8-bit weights": lambda q: (q, lambda w: round_tiles(w, 255)),
        "the scan's weights": lambda q: (q, lambda w: round_tiles(w, 8191)),
    }
    print(f"d = {D}, {ROWS} query rows, {args.tokens} tokens, {args.draws} draws; worst share of the codec's error")
    print()
    print("| codec | " + " | ".join(roundings) + " |")
    print("|---|" + "---:|" * len(roundings))
    for name, half in CENTROIDS.items():
        centroids = np.array([-c for c in reversed(half)] + half)
        worst = dict.fromkeys(roundings, 0.0)
        for _ in range(args.draws):
            k = rng.standard_normal((args.tokens, D))
            v = rng.standard_normal((args.tokens, D))
            q = rng.standard_normal((ROWS, D))
            kd, vd = quantize(k, centroids), quantize(v, centroids)
            for multiple in SCALES:
                scale = multiple / np.sqrt(D)
                decoded = attend(q, kd, vd, scale)
                codec = relative(decoded, attend(q, k, v, scale))
                for label, rounding in roundings.items():
                    rq, rw = rounding(q)
                    added = relative(attend(rq, kd, vd, scale, rw), decoded) / codec
                    worst[label] = max(worst[label], added)
        print(f"| {name} | " + " | ".join(f"{100 * worst[r]:.2f}%" for r in roundings) + " |")


if __name__ == "__main__":
    main()
