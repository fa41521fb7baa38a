#!/usr/bin/env python3
"""The README's CPU attention table: `turbokv-bench attend` for every Highway
target this CPU supports (forced with --target) and a few codec pairs, one run
each, printed as a Markdown table. Standard library only.

  python3 bench/attend_targets.py [--bench build/bench/turbokv-bench]
      [--tokens 16384,65536] [--threads 2] [--targets AVX2,SSE4]
      [--codecs turbo3/turbo3,turbo4/turbo4,q8_0/turbo4]

Each run measures, in turns over seven rounds (medians), the compressed path,
the f16 path on an f16 cache of the same vectors, a streaming read of as
many bytes as the compressed cache, and the integer scan's 16-bit
multiply-adds alone at the core's peak rate for them (the arithmetic floor of
the scan), with the same threads.
"""
import argparse
import json
import platform
import subprocess
import sys


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def supported_targets(bench):
    # The bench names this CPU's targets when asked for one it does not have.
    out = subprocess.run([bench, "attend", "--target", "none", "--tokens", "64"],
                         capture_output=True, text=True)
    text = out.stderr + out.stdout
    marker = "it has "
    if marker not in text:
        sys.exit("could not list the SIMD targets: " + text.strip())
    return [t.strip() for t in text.split(marker, 1)[1].splitlines()[0].split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", default="build/bench/turbokv-bench")
    parser.add_argument("--tokens", default="16384,65536")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--targets", default="", help="default: every target this CPU supports")
    parser.add_argument("--codecs", default="turbo3/turbo3")
    args = parser.parse_args()

    targets = args.targets.split(",") if args.targets else supported_targets(args.bench)
    print(f"CPU: {cpu_name()}, {args.threads} threads; "
          f"8 kv heads, 32 query heads, d = 128, one query")
    print()
    print("| target | keys/values | tokens | compressed µs | f16 µs | speed-up | compressed read | "
          "f16 read | streaming read | compressed / stream | f16 / stream | multiply-add floor µs | "
          "floor / compressed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for target in targets:
        for codecs in args.codecs.split(","):
            k, v = codecs.split("/")
            for tokens in args.tokens.split(","):
                cmd = [args.bench, "attend", "--k-codec", k, "--v-codec", v, "--tokens", tokens,
                       "--kv-heads", "8", "--q-heads", "32", "--head-dim", "128",
                       "--threads", str(args.threads), "--target", target, "--json"]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    sys.exit(f"{' '.join(cmd)}: {out.stderr.strip()}")
                r = json.loads(out.stdout)
                f16_rate = r["f16_cache_bytes"] / (r["f16_us_per_call"] * 1e-6) / 1e9
                stream = r["stream_read_gb_per_s"]
                floor = r["multiply_add_floor_us"]  # None where the scan multiplies floats (SCALAR, f16)
                floor_cells = "- | -" if floor is None else f"{floor:,.0f} | {100 * floor / r['us_per_call']:.0f}%"
                print(f"| {r['implementation'].split(':', 1)[1]} | {k}/{v} | {int(tokens):,} | "
                      f"{r['us_per_call']:,.0f} | {r['f16_us_per_call']:,.0f} | {r['speedup_vs_f16']:.2f}x | "
                      f"{r['cache_gb_per_s']:.1f} GB/s | {f16_rate:.1f} GB/s | {stream:.1f} GB/s | "
                      f"{100 * r['fraction_of_stream_read']:.0f}% | {100 * f16_rate / stream:.0f}% | "
                      f"{floor_cells} |",
                      flush=True)


if __name__ == "__main__":
    main()
