#!/usr/bin/python3
"""A well-behaved Decode client, alone and then next to a hostile tenant.

Starts turbokvd with two tenants, measures the `turbokv decode-random`
client's per-step latency alone, then again while the other tenant runs the
patterns of the second hardening round at once: heavy Attends queued on one
session, heavy Attends abandoned by their client, Attend streams that send
large requests and never read, sessions created up to the tenant's cap, LRU
churn, malformed and non-UTF-8 messages, and idle connections to /metrics.
Prints the latencies, their ratio, the daemon's peak resident memory
against its budget, and whether the good client lost anything.

  PYTHONPATH=build/client/python/package /usr/bin/python3 bench/hostile_load.py \\
      --turbokvd build/service/turbokvd --cli build/client/cpp/turbokv
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import numpy as np

import turbokv
from turbokv.v1 import turbokv_pb2 as pb
from turbokv.v1 import turbokv_pb2_grpc as pb_grpc

MIB = 1 << 20


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def decode_client(cli, target, token, steps):
    """The well-behaved client: its p50 and p99 per layer-step, in us."""
    out = subprocess.run([cli, f"--target={target}", f"--token={token}", "decode-random", "--batch=8",
                          "--layers=4", f"--steps={steps}", "--kv-heads=8", "--q-heads=32"],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"the well-behaved client failed: {out.stderr.strip()}")
    match = re.search(r"p50 (\d+) us, p99 (\d+) us", out.stdout)
    return float(match.group(1)), float(match.group(2))


def tensor(array):
    array = np.ascontiguousarray(array, dtype=np.float32)
    return pb.Tensor(dtype=pb.DTYPE_F32, shape=list(array.shape), data=array.tobytes())


class Hostile:
    """The other tenant's patterns, each on its own threads, until stop()."""

    PATTERNS = ("queued", "abandoned", "never-read", "empty-sessions", "churn", "malformed", "idle-metrics")

    def __init__(self, target, token, metrics, patterns):
        self.target, self.metrics, self.patterns = target, metrics, patterns
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.client = turbokv.Client(target, token=token)
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 * MIB),
                                                              ("grpc.max_receive_message_length", 64 * MIB)])
        self.stub = pb_grpc.KvCacheServiceStub(self.channel)
        self.stopping = threading.Event()
        self.threads = []
        self.counts = {}
        self.lock = threading.Lock()

    def count(self, what):
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def loop(self, name, body, threads=1, pause=0.01):
        """body() in a loop on `threads` threads, `pause` seconds apart (so
        that this process, one core's worth of Python, does not compete with
        the daemon for the CPU more than the patterns need)."""
        if name not in self.patterns:
            return
        def run():
            while not self.stopping.is_set():
                try:
                    body()
                    self.count(name)
                    time.sleep(pause)
                except grpc.RpcError as e:
                    self.count(f"{name}:{e.code().name}")
                    time.sleep(pause)
                except turbokv.TurbokvError as e:
                    self.count(f"{name}:{e.code.name}")
                    time.sleep(pause)
        for _ in range(threads):
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            self.threads.append(thread)

    def heavy_request(self, session_id, queries):
        rng = np.random.default_rng(1)
        return pb.AttendRequest(session_id=session_id, layer=0,
                                queries=tensor(rng.standard_normal((queries, 32, 128))))

    def start(self):
        rng = np.random.default_rng(0)
        heavy = self.client.create_session(layers=1, kv_heads=8, q_heads=32, head_dim=128)
        for start in range(0, 16384, 2048):
            kv = rng.standard_normal((2048, 8, 128)).astype(np.float32)
            heavy.append(0, start, kv, kv)
        request = self.heavy_request(heavy.id, 64)
        big = self.heavy_request(heavy.id, 1024)  # 16 MiB of queries

        def attend(timeout=None):
            responses = self.stub.Attend(iter([request]), metadata=self.metadata, timeout=timeout)
            for _ in responses:
                pass

        # Row 6: eight heavy Attends always queued on one session.
        self.loop("queued", attend, threads=8)

        # Row 7: fifteen heavy Attends whose client gives up at once.
        def vanish():
            threads = [threading.Thread(target=lambda: self._quiet(lambda: attend(0.05))) for _ in range(15)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            time.sleep(0.5)
        self.loop("abandoned", vanish)

        # Row 8: forty streams that send large requests and never read.
        def never_read():
            def requests():
                while not self.stopping.is_set():
                    yield big
            call = self.stub.Attend(requests(), metadata=self.metadata)
            self.stopping.wait()
            call.cancel()
        for _ in range(40 if "never-read" in self.patterns else 0):
            thread = threading.Thread(target=lambda: self._quiet(never_read), daemon=True)
            thread.start()
            self.threads.append(thread)

        # Row 9: empty 1,024-layer sessions, up to the tenant's cap.
        def empty_session():
            self.client.create_session(layers=1024, kv_heads=8, q_heads=8, head_dim=128)
        self.loop("empty-sessions", empty_session)

        # Row 1: LRU churn, new sessions filled with 4 MB each.
        churn_kv = rng.standard_normal((512, 8, 128)).astype(np.float32)

        def churn():
            session = self.client.create_session(layers=8, kv_heads=8, q_heads=8, head_dim=128)
            for layer in range(8):
                session.append(layer, 0, churn_kv, churn_kv)
        self.loop("churn", churn)

        # Rows 5 and 12: messages that do not parse.
        garbage = self.channel.unary_unary("/turbokv.v1.KvCacheService/GetSession",
                                           request_serializer=lambda b: b, response_deserializer=lambda b: b)

        def malformed():
            garbage(b"\x0a\x02\xc3\x28", metadata=self.metadata)
        self.loop("malformed", malformed)

        # Row 16: connections to /metrics that never send a request.
        host, port = self.metrics.rsplit(":", 1)
        self.idle = [socket.create_connection((host, int(port))) for _ in range(6 if "idle-metrics" in self.patterns else 0)]

    def _quiet(self, fn):
        try:
            fn()
        except grpc.RpcError:
            pass

    def stop(self):
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=30)
        for s in self.idle:
            s.close()
        self.channel.close()


def scrape(address):
    with socket.create_connection(address.rsplit(":", 1), timeout=5) as s:
        s.sendall(f"GET /metrics HTTP/1.0\r\nHost: {address}\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data.decode()


def start_daemon(turbokvd, name, tokens, flags):
    """turbokvd on a unix socket in a new temporary directory (--device=cpu
    --threads=2), with `tokens` ({token: tenant}) as its --auth-tokens-file
    and `flags` besides; (the directory, the target, its log file, the
    process)."""
    work = tempfile.TemporaryDirectory(prefix=f"turbokv-{name}-")
    path = os.path.join(work.name, "tokens")
    with open(path, "w") as f:
        f.writelines(f"{token} {tenant}\n" for token, tenant in tokens.items())
    target = f"unix://{work.name}/turbokv.sock"
    log = open(os.path.join(work.name, "turbokvd.log"), "w+")
    daemon = subprocess.Popen([turbokvd, f"--listen={target}", "--device=cpu", "--threads=2",
                               f"--auth-tokens-file={path}", *flags], stderr=log)
    return work, target, log, daemon


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turbokvd", required=True)
    parser.add_argument("--cli", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--budget-mib", type=int, default=512)
    parser.add_argument("--patterns", default=",".join(Hostile.PATTERNS),
                        help="comma-separated subset of: " + ", ".join(Hostile.PATTERNS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    work, target, log, daemon = start_daemon(
        args.turbokvd, "hostile", {"good-token": "good", "evil-token": "evil"},
        [f"--memory-budget={args.budget_mib}MiB", "--eviction=lru", "--metrics-listen=127.0.0.1:0",
         "--max-tenant-sessions=200", "--tenant-max-inflight-bytes=256MiB"])
    try:
        turbokv.Client(target, token="good-token").wait_until_ready(20)
        log.seek(0)
        metrics = re.search(r"metrics on http://([^/]+)/metrics", log.read()).group(1)
        alone = decode_client(args.cli, target, "good-token", args.steps)
        rss_alone = rss_bytes(daemon.pid)

        hostile = Hostile(target, "evil-token", metrics, args.patterns.split(","))
        hostile.start()
        peak = [0]
        sampling = threading.Event()

        def sample():
            while not sampling.is_set():
                peak[0] = max(peak[0], rss_bytes(daemon.pid))
                time.sleep(0.1)
        sampler = threading.Thread(target=sample)
        sampler.start()
        time.sleep(3)  # every pattern under way
        loaded = decode_client(args.cli, target, "good-token", args.steps)
        scraped = "turbokv_sessions" in scrape(metrics)
        sampling.set()
        sampler.join()
        hostile.stop()
        result = {
            "alone_p50_us": alone[0], "alone_p99_us": alone[1],
            "loaded_p50_us": loaded[0], "loaded_p99_us": loaded[1],
            "p99_ratio": loaded[1] / alone[1],
            "rss_alone_mib": rss_alone / MIB, "rss_peak_mib": peak[0] / MIB, "budget_mib": args.budget_mib,
            "metrics_answered_under_load": scraped,
            "good_client_lost_nothing": True,  # decode_client exits on any failed item or error
            "hostile_calls": hostile.counts,
        }
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(timeout=120)
    result["daemon_exit"] = code
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"good client, 8 sessions x 4 layers, per layer-step: alone p50 {alone[0]:.0f} us p99 {alone[1]:.0f} us; "
              f"under attack p50 {loaded[0]:.0f} us p99 {loaded[1]:.0f} us ({result['p99_ratio']:.2f}x)")
        print(f"daemon RSS: {result['rss_alone_mib']:.0f} MiB alone, peak {result['rss_peak_mib']:.0f} MiB under "
              f"attack (budget {args.budget_mib} MiB); /metrics answered: {scraped}; exit {code}")
        print("hostile calls:", ", ".join(f"{k} {v}" for k, v in sorted(hostile.counts.items())))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
