#!/usr/bin/python3
"""One tenant's Decode batches against another tenant's Steps.

Starts turbokvd (--device=cpu --threads=2, two tenants) and measures, in
separate client processes:

- tenant B's Step latency (one token appended and attended, 1 query of 32
  heads over a 1,024-token session of kv 8, d 128; --pause-ms between an
  answer and the next Step, 2 ms by default: a worker stepping its layers
  between other work), alone;
- tenant A's Decode throughput, alone: 2 Decode streams, each message 32
  sessions x 4 queries with their keys and values (draft tokens verified at
  once) over 1,024 tokens;
- then, in each of --rounds rounds, both at once.

With --daemon-cpus (say 1), turbokvd runs on those CPUs and every client
process on the others: a sidecar with cores of its own (Kubernetes' static
CPU manager), where without it the clients' processes share the daemon's
cores.

Sessions are truncated back to 1,024 tokens now and then (outside the timed
calls), so every round sees the same lengths. Prints B's p50/p99 alone and in
each round (and their ratio), and A's messages per second alone and in each
round (and their ratio).

  PYTHONPATH=build/client/python/package /usr/bin/python3 bench/decode_fairness.py \\
      --turbokvd build/service/turbokvd
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

import turbokv
from hostile_load import start_daemon

KV_HEADS, Q_HEADS, HEAD_DIM, PREFILL = 8, 32, 128, 1024
ITEMS, QUERIES = 32, 4  # per Decode message
REWIND = 256  # tokens a session grows before it is truncated back


def template(target, token):
    """A one-layer session holding PREFILL random tokens, to fork from."""
    client = turbokv.Client(target, token=token)
    rng = np.random.default_rng(0)
    session = client.create_session(layers=1, kv_heads=KV_HEADS, q_heads=Q_HEADS, head_dim=HEAD_DIM)
    kv = rng.standard_normal((PREFILL, KV_HEADS, HEAD_DIM)).astype(np.float32)
    session.append(0, 0, kv, kv)
    return session.id


def wait_for_go():
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go")


def run_decoder(target, token, source, seconds):
    """Tenant A: one Decode stream; messages in `seconds`."""
    client = turbokv.Client(target, token=token)
    sessions = [client.session(source).fork(PREFILL) for _ in range(ITEMS)]
    rng = np.random.default_rng(os.getpid())
    kv = rng.standard_normal((ITEMS, QUERIES, KV_HEADS, HEAD_DIM)).astype(np.float32)
    queries = rng.standard_normal((ITEMS, QUERIES, Q_HEADS, HEAD_DIM)).astype(np.float32)
    length, messages = PREFILL, 0
    wait_for_go()
    with client.decode_stream() as stream:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if length + QUERIES > PREFILL + REWIND:
                for session in sessions:
                    session.truncate(PREFILL)
                length = PREFILL
            positions = np.tile(np.arange(length, length + QUERIES), (ITEMS, 1))
            stream.step(0, sessions, kv, kv, queries, positions).raise_for_status()
            length += QUERIES
            messages += 1
    for session in sessions:
        session.delete()
    return {"messages": messages, "seconds": seconds}


def run_stepper(target, token, source, seconds, pause):
    """Tenant B: a Step every `pause` seconds after the last one answered,
    for `seconds`; their latencies."""
    client = turbokv.Client(target, token=token)
    session = client.session(source).fork(PREFILL)
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((KV_HEADS, HEAD_DIM)).astype(np.float32)
    query = rng.standard_normal((Q_HEADS, HEAD_DIM)).astype(np.float32)
    position, us = PREFILL, []
    wait_for_go()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if position == PREFILL + REWIND:
            session.truncate(PREFILL)
            position = PREFILL
        start = time.perf_counter()
        session.step(0, position, kv, kv, query)
        us.append((time.perf_counter() - start) * 1e6)
        position += 1
        time.sleep(pause)
    session.delete()
    us.sort()
    return {"steps": len(us), "p50_us": us[len(us) // 2], "p99_us": us[min(len(us) - 1, len(us) * 99 // 100)]}


def phase(args, target, roles):
    """Runs the client processes of one phase at once; their results."""
    procs = []
    for role, token, source in roles:
        procs.append(subprocess.Popen([sys.executable, __file__, f"--role={role}", f"--target={target}",
                                       f"--token={token}", f"--source={source}", f"--seconds={args.seconds}",
                                       f"--pause-ms={args.pause_ms}"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for proc in procs:
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit("a client process failed to start")
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=args.seconds + 120)
        if proc.returncode != 0:
            raise SystemExit(f"a client process failed ({proc.returncode})")
        results.append(json.loads(out))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turbokvd")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    parser.add_argument("--pause-ms", type=float, default=2.0,
                        help="tenant B's pause between an answer and its next Step (0: back to back)")
    parser.add_argument("--daemon-cpus", help="comma-separated CPUs for turbokvd alone; the clients get the rest")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--role", choices=("decoder", "stepper"), help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--token", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        if args.role == "decoder":
            result = run_decoder(args.target, args.token, args.source, args.seconds)
        else:
            result = run_stepper(args.target, args.token, args.source, args.seconds, args.pause_ms / 1000)
        print(json.dumps(result))
        return 0
    if args.turbokvd is None:
        parser.error("--turbokvd is required")

    daemon_cpus = client_cpus = None
    if args.daemon_cpus is not None:
        everything = os.sched_getaffinity(0)
        try:
            daemon_cpus = {int(c) for c in args.daemon_cpus.split(",")}
        except ValueError:
            parser.error(f"--daemon-cpus {args.daemon_cpus!r}: expected CPU numbers separated by commas, e.g. 1 or 2,3")
        if not daemon_cpus < everything:
            parser.error(f"--daemon-cpus must be some, not all, of CPUs {sorted(everything)}")
        client_cpus = everything - daemon_cpus
        os.sched_setaffinity(0, daemon_cpus)  # the daemon's threads inherit it
    work, target, _, daemon = start_daemon(args.turbokvd, "fairness", {"a-token": "decoder", "b-token": "stepper"},
                                           ["--metrics-listen="])
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)  # and the client processes this
    try:
        turbokv.Client(target, token="a-token").wait_until_ready(20)
        a_source, b_source = template(target, "a-token"), template(target, "b-token")
        decoders = [("decoder", "a-token", a_source)] * 2
        stepper = [("stepper", "b-token", b_source)]
        b_alone = phase(args, target, stepper)[0]
        a_alone = sum(r["messages"] for r in phase(args, target, decoders)) / args.seconds
        rounds = []
        for _ in range(args.rounds):
            *a, b = phase(args, target, decoders + stepper)
            rate = sum(r["messages"] for r in a) / args.seconds
            rounds.append({"b_p50_us": b["p50_us"], "b_p99_us": b["p99_us"], "b_steps": b["steps"],
                           "b_p99_ratio": b["p99_us"] / b_alone["p99_us"],
                           "a_messages_per_s": rate, "a_throughput_ratio": rate / a_alone})
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(timeout=120)
        work.cleanup()
    result = {"daemon_cpus": sorted(daemon_cpus) if daemon_cpus else None, "b_alone": b_alone,
              "a_alone_messages_per_s": a_alone, "rounds": rounds, "daemon_exit": code}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        if daemon_cpus is not None:
            print(f"turbokvd on CPUs {sorted(daemon_cpus)}, the clients on {sorted(client_cpus)}")
        print(f"tenant B Step alone: p50 {b_alone['p50_us']:.0f} us, p99 {b_alone['p99_us']:.0f} us "
              f"({b_alone['steps']} steps, {args.pause_ms:g} ms apart); tenant A Decode alone: {a_alone:.1f} messages/s "
              f"({ITEMS} sessions x {QUERIES} queries each)")
        print("| round | B p50 | B p99 | B p99 / alone | A messages/s | A / alone |")
        print("|---|---|---|---|---|---|")
        for i, r in enumerate(rounds, 1):
            print(f"| {i} | {r['b_p50_us'] / 1000:.2f} ms | {r['b_p99_us'] / 1000:.2f} ms | {r['b_p99_ratio']:.1f}x | "
                  f"{r['a_messages_per_s']:.1f} | {r['a_throughput_ratio']:.2f} |")
        print(f"daemon exit {code}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
