#!/usr/bin/python3
"""Calls on sessions that live on the disk tier, from several clients at once.

Starts turbokvd with a disk tier and a 3 MiB memory budget (--spill-dir,
--memory-budget=3MiB, --eviction=lru), makes six f16 sessions of 1,500
tokens x 2 layers (kv 1, d 64: 0.8 MB each, the budget holds three;
--kv-heads 2: 1.6 MB, it holds one), then, in each of --rounds rounds, runs
six client threads (--clients) of 25 random calls each (--calls): ReadKv of
a whole layer (checked against what was appended), Prefetch, or Attend of
one query. Most calls need their session back in memory, which means
demoting another. Prints, per round, the calls and their outcomes; a
RESOURCE_EXHAUSTED while the disk has room is what must not happen.

  PYTHONPATH=build/client/python/package /usr/bin/python3 bench/promotion_mix.py \\
      --turbokvd build/service/turbokvd
"""

import argparse
import collections
import json
import random
import signal
import sys
import tempfile
import threading

import numpy as np

import turbokv
from turbokv.v1 import turbokv_pb2 as pb
from hostile_load import start_daemon

SESSIONS, TOKENS, LAYERS, Q_HEADS, HEAD_DIM = 6, 1500, 2, 4, 64


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turbokvd", required=True)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--calls", type=int, default=25, help="calls per client and round")
    parser.add_argument("--kv-heads", type=int, default=1,
                        help="1: 0.8 MB a session, the budget holds three; 2: 1.6 MB, it holds one")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    spill = tempfile.TemporaryDirectory(prefix="turbokv-promotion-spill-")
    work, target, _, daemon = start_daemon(
        args.turbokvd, "promotion", {"mix-token": "mix"},
        [f"--spill-dir={spill.name}", "--memory-budget=3MiB", "--eviction=lru", "--metrics-listen="])
    rounds = []
    try:
        client = turbokv.Client(target, token="mix-token")
        client.wait_until_ready(20)
        rng = np.random.default_rng(0)
        sessions, data = [], []
        for _ in range(SESSIONS):
            session = client.create_session(LAYERS, args.kv_heads, Q_HEADS, HEAD_DIM, key_codec="f16",
                                            value_codec="f16")
            # f16 values: stored exactly, so what comes back must equal them.
            kv = rng.standard_normal((LAYERS, TOKENS, args.kv_heads, HEAD_DIM)).astype(np.float16).astype(np.float32)
            for layer in range(LAYERS):
                session.append(layer, 0, kv[layer], -kv[layer])
            sessions.append(session)
            data.append(kv)
        query = rng.standard_normal((1, Q_HEADS, HEAD_DIM)).astype(np.float32)

        for _ in range(args.rounds):
            outcomes = collections.Counter()
            messages = []
            lock = threading.Lock()

            def client_thread(seed):
                pick = random.Random(seed)
                for _ in range(args.calls):
                    i = pick.randrange(SESSIONS)
                    what = pick.choice(("read_kv", "prefetch", "attend"))
                    try:
                        if what == "read_kv":
                            layer = pick.randrange(LAYERS)
                            keys, values = sessions[i].read_kv(layer, timeout=60)
                            if not (np.array_equal(keys, data[i][layer]) and np.array_equal(values, -data[i][layer])):
                                raise AssertionError(f"session {i} layer {layer} came back different")
                            outcome = "OK"
                        elif what == "prefetch":
                            error = client.prefetch([sessions[i]], timeout=60)[0]
                            if error is not None:
                                raise error
                            outcome = "OK"
                        else:
                            sessions[i].attend(pick.randrange(LAYERS), query, [TOKENS - 1], timeout=60)
                            outcome = "OK"
                    except turbokv.TurbokvError as e:
                        outcome = e.code.name
                        with lock:
                            messages.append(f"{what}: {e}")
                    with lock:
                        outcomes[f"{what} {outcome}"] += 1

            threads = [threading.Thread(target=client_thread, args=(len(rounds) * 100 + c,))
                       for c in range(args.clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            failed = sum(n for key, n in outcomes.items() if not key.endswith(" OK"))
            rounds.append({"calls": sum(outcomes.values()), "failed": failed, "outcomes": dict(outcomes),
                           "messages": sorted(set(messages))[:5]})
        tiers = collections.Counter(pb.Residency.Name(s.info().residency) for s in sessions)
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(timeout=120)
        work.cleanup()
        spill.cleanup()
    result = {"rounds": rounds, "daemon_exit": code}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for i, r in enumerate(rounds, 1):
            print(f"round {i}: {r['calls']} calls, {r['failed']} failed: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items())))
            for message in r["messages"]:
                print(f"  {message}")
        print(f"sessions by residency at the end: {dict(tiers)}; daemon exit {code}")
    return 0 if code == 0 and all(r["failed"] == 0 for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
