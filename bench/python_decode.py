#!/usr/bin/python3
"""The Python client's Decode stream against the C++ client's, on one daemon.

Starts turbokvd (--device=cpu --threads=2) on a unix socket, then in each of
--rounds rounds runs, one after the other (the order alternates by round):

- C++: `turbokv decode-random --batch B --layers L --prefill T --steps S
  --codec turbo3 --output=json` (the C++ client; shared memory over the socket);
- Python: the same work through turbokv.Client: B new sessions of L layers
  (kv 8, q 32, d 128, turbo3 keys and values, the daemon's other defaults),
  T random tokens appended to every layer, then S decode steps of one Decode
  message per layer, each session one new token and one query. Tensors go
  through shared memory (the client's default over a unix socket), or in the
  messages with --no-shared-memory.

Both time each message from its send to its answer; the table gives each
side's p50 and p99 per layer-step and Python's p50 over C++'s in the same
round. The Python side's random data are drawn before the timed loop.

  PYTHONPATH=build/client/python/package /usr/bin/python3 bench/python_decode.py \\
      --turbokvd build/service/turbokvd --cli build/client/cpp/turbokv
"""

import argparse
import json
import signal
import subprocess
import sys
import time

import numpy as np

import turbokv
from hostile_load import start_daemon

KV_HEADS, Q_HEADS, HEAD_DIM = 8, 32, 128
PREFILL_CHUNK = 128


def percentiles(us):
    us = sorted(us)
    return us[len(us) // 2], us[min(len(us) - 1, len(us) * 99 // 100)]


def run_cli(args, target, token):
    out = subprocess.run([args.cli, f"--target={target}", f"--token={token}", "decode-random",
                          f"--batch={args.batch}", f"--layers={args.layers}", f"--prefill={args.tokens}",
                          f"--steps={args.steps}", f"--kv-heads={KV_HEADS}", f"--q-heads={Q_HEADS}",
                          f"--head-dim={HEAD_DIM}", "--codec=turbo3", "--output=json"],
                         capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise SystemExit(f"turbokv decode-random failed: {out.stderr.strip()}")
    result = json.loads(out.stdout)
    return result["p50_us"], result["p99_us"]


def run_python(args, target, token):
    options = {"shared_memory": 0} if args.no_shared_memory else {}
    client = turbokv.Client(target, token=token, **options)
    rng = np.random.default_rng(13)
    sessions = []
    try:
        for _ in range(args.batch):
            sessions.append(client.create_session(args.layers, KV_HEADS, Q_HEADS, HEAD_DIM, key_codec="turbo3",
                                                  value_codec="turbo3"))
        for start in range(0, args.tokens, PREFILL_CHUNK):
            n = min(PREFILL_CHUNK, args.tokens - start)
            chunk = rng.standard_normal((args.layers, n, KV_HEADS, HEAD_DIM), dtype=np.float32)
            for session in sessions:
                session.append(None, start, chunk, chunk)
        # A few sets of inputs, drawn before the timed loop and taken in turn.
        inputs = [(rng.standard_normal((args.batch, KV_HEADS, HEAD_DIM), dtype=np.float32),
                   rng.standard_normal((args.batch, KV_HEADS, HEAD_DIM), dtype=np.float32),
                   rng.standard_normal((args.batch, Q_HEADS, HEAD_DIM), dtype=np.float32)) for _ in range(4)]
        us = []
        with client.decode_stream() as stream:
            for step in range(args.steps):
                positions = np.full(args.batch, args.tokens + step, dtype=np.int64)
                for layer in range(args.layers):
                    keys, values, queries = inputs[(step * args.layers + layer) % len(inputs)]
                    start = time.perf_counter()
                    stream.step(layer, sessions, keys, values, queries, positions).raise_for_status()
                    us.append((time.perf_counter() - start) * 1e6)
    finally:
        for session in sessions:
            session.delete()
        client.close()
    return percentiles(us)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turbokvd", required=True)
    parser.add_argument("--cli", required=True, help="the turbokv command-line client")
    parser.add_argument("--batch", type=int, default=32, help="sessions a Decode message")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128, help="tokens prefilled into every layer")
    parser.add_argument("--steps", type=int, default=4, help="decode steps a round, each over every layer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-shared-memory", action="store_true",
                        help="the Python client sends its tensors in the messages")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    work, target, _, daemon = start_daemon(args.turbokvd, "python-decode", {"token": "bench"}, ["--metrics-listen="])
    rounds = []
    try:
        with turbokv.Client(target, token="token") as ready:
            ready.wait_until_ready(20)
        for i in range(args.rounds):
            order = ("python", "cli") if i % 2 == 0 else ("cli", "python")
            result = {}
            for side in order:
                result[side] = (run_python if side == "python" else run_cli)(args, target, "token")
            rounds.append({"python_p50_us": result["python"][0], "python_p99_us": result["python"][1],
                           "cpp_p50_us": result["cli"][0], "cpp_p99_us": result["cli"][1],
                           "python_over_cpp": result["python"][0] / result["cli"][0]})
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(timeout=120)
        work.cleanup()
    if args.json:
        print(json.dumps({"rounds": rounds, "daemon_exit": code}, indent=2))
    else:
        print(f"{args.batch} sessions x {args.tokens} tokens, {args.layers} layers, turbo3, kv {KV_HEADS}, "
              f"q {Q_HEADS}, d {HEAD_DIM}, {args.steps} steps a round; Python tensors "
              f"{'in the messages' if args.no_shared_memory else 'through shared memory'}")
        print("| round | Python p50 / p99 | C++ p50 / p99 | Python / C++ (p50) |")
        print("|---|---:|---:|---:|")
        for i, r in enumerate(rounds, 1):
            print(f"| {i} | {r['python_p50_us']:,.0f} / {r['python_p99_us']:,.0f} us | "
                  f"{r['cpp_p50_us']:,.0f} / {r['cpp_p99_us']:,.0f} us | {r['python_over_cpp']:.2f}x |")
        print(f"daemon exit {code}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
