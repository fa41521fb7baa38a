#!/usr/bin/python3
"""How long a Redis Cluster master's failure keeps turbokvd's tier down
under write load, per cluster-node-timeout and cluster-replica-validity-factor.

For each setting: a Redis Cluster of 3 masters with one replica each on
loopback ports (appendonly, appendfsync always, as the tests run it), a
turbokvd whose tier it is (--redis-url with every node as a seed), and
--writers client threads appending 64 tokens at a time (4 layers, 8 kv
heads, d 128, the default preset: a page per layer per append) to sessions
of their own, as fast as the daemon acknowledges them. After --warmup
seconds the master serving slot 0 is killed (SIGKILL). Printed per setting:
when its replica was promoted, when every node saw the cluster healthy
again, how long turbokv_tier_up read 0, and the longest a writer went
without an acknowledged append from the kill on. A replica that did not
take over within --wait seconds says why in its log (quoted).

  PYTHONPATH=build/client/python/package /usr/bin/python3 bench/redis_failover.py \\
      --turbokvd build/service/turbokvd --settings 1000:10,1000:0,5000:10,5000:0
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

import numpy as np

import turbokv
from hostile_load import scrape, start_daemon

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, CHUNK, SESSION_TOKENS = 4, 8, 32, 128, 64, 2048


def free_port():
    """A loopback port whose cluster bus port (10000 above) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue


def cli(port, *command, timeout=2):
    done = subprocess.run(["redis-cli", "-p", str(port), *command], capture_output=True, text=True, timeout=timeout)
    return done.stdout


class Cluster:
    def __init__(self, node_timeout_ms, validity_factor, work):
        self.ports, self.processes, self.dirs = [], [], []
        for i in range(6):
            port = free_port()
            while port in self.ports:
                port = free_port()
            directory = os.path.join(work, f"node{i}")
            os.makedirs(directory)
            self.ports.append(port)
            self.dirs.append(directory)
            self.processes.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(node_timeout_ms),
                 "--cluster-replica-validity-factor", str(validity_factor), "--dir", directory, "--save", "",
                 "--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "noeviction",
                 "--logfile", os.path.join(directory, "redis.log")]))
        for port in self.ports:
            self.wait(lambda: cli(port, "PING").strip() == "PONG", 10, f"redis-server on {port}")
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                        "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True)
        self.wait(self.healthy, 30, "the cluster healthy")
        for port in self.ports:
            if "role:slave" in cli(port, "INFO", "replication"):
                self.wait(lambda: "master_link_status:up" in cli(port, "INFO", "replication"), 30,
                          f"replica {port} in sync")

    @staticmethod
    def wait(condition, seconds, what):
        until = time.monotonic() + seconds
        while not condition():
            if time.monotonic() > until:
                raise RuntimeError(f"not within {seconds} s: {what}")
            time.sleep(0.1)

    def live(self):
        return [i for i, p in enumerate(self.processes) if p.poll() is None]

    def healthy(self):
        for i in self.live():
            try:
                if "cluster_state:ok" not in cli(self.ports[i], "CLUSTER", "INFO", timeout=1):
                    return False
            except subprocess.TimeoutExpired:
                return False
        return True

    def master_of_slot0(self, asked):
        """The node serving slot 0 as master, as `asked` sees it (None: none)."""
        try:
            out = cli(self.ports[asked], "CLUSTER", "NODES", timeout=1)
        except subprocess.TimeoutExpired:
            return None
        for line in out.splitlines():
            fields = line.split()
            if len(fields) < 9 or "master" not in fields[2] or "fail" in fields[2]:
                continue
            if any(slot == "0" or slot.startswith("0-") for slot in fields[8:]):
                port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                return self.ports.index(port) if port in self.ports else None
        return None

    def stop(self):
        for p in self.processes:
            if p.poll() is None:
                p.kill()
                p.wait()


class Writers:
    def __init__(self, target, count):
        self.client = turbokv.Client(target, token="failover-token")
        self.client.wait_until_ready(20)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acks = [[] for _ in range(count)]  # monotonic times of acknowledged appends
        self.refused = 0
        self.errors = {}
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(count)]
        for t in self.threads:
            t.start()

    def run(self, index):
        rng = np.random.default_rng(index)
        keys = rng.standard_normal((LAYERS, CHUNK, KV_HEADS, HEAD_DIM)).astype(np.float32)
        session, length = None, 0
        while not self.stop.is_set():
            try:
                if session is None or length >= SESSION_TOKENS:
                    if session is not None:
                        session.delete(timeout=5)
                    session = self.client.create_session(LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, timeout=5)
                    length = 0
                session.append(None, length, keys, keys, timeout=5)
                length += CHUNK
                with self.lock:
                    self.acks[index].append(time.monotonic())
            except turbokv.errors.TurbokvError as error:
                with self.lock:
                    self.refused += 1
                    key = type(error).__name__
                    self.errors[key] = self.errors.get(key, 0) + 1
                time.sleep(0.05)

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join()


def tier_up(metrics):
    match = re.search(r"^turbokv_tier_up(?:\{[^}]*\})? (\S+)$", scrape(metrics), re.M)
    return None if match is None else float(match.group(1))


def measure(args, node_timeout_ms, validity_factor):
    work = tempfile.mkdtemp(prefix="turbokv-failover-")
    cluster = Cluster(node_timeout_ms, validity_factor, work)
    daemon = writers = None
    try:
        seeds = ",".join(f"127.0.0.1:{p}" for p in cluster.ports)
        _, target, log, daemon = start_daemon(
            args.turbokvd, "failover", {"failover-token": "bench"},
            [f"--redis-url=redis://{seeds}", "--metrics-listen=127.0.0.1:0", "--memory-budget=2GiB"])
        turbokv.Client(target, token="failover-token").wait_until_ready(20)
        log.seek(0)
        metrics = re.search(r"metrics on http://([^/]+)/metrics", log.read()).group(1)
        writers = Writers(target, args.writers)
        time.sleep(args.warmup)
        failed = cluster.master_of_slot0(0)
        asked = next(i for i in range(6) if i != failed)
        with writers.lock:
            acks_before = sum(len(a) for a in writers.acks)
        killed = time.monotonic()
        cluster.processes[failed].kill()
        cluster.processes[failed].wait()
        promoted = healthy = None
        samples = []  # (time, turbokv_tier_up)
        until = killed + args.wait
        while time.monotonic() < until:
            now = time.monotonic()
            if promoted is None:
                master = cluster.master_of_slot0(asked)
                if master is not None and master != failed:
                    promoted = now - killed
            if promoted is not None and healthy is None and cluster.healthy():
                healthy = now - killed
            samples.append((now, tier_up(metrics)))
            if healthy is not None and now - killed > healthy + 3 and samples[-1][1] == 1:
                break
            time.sleep(0.1)
        writers.close()
        end = time.monotonic()
        gaps = []
        for acks in writers.acks:
            after = [t for t in acks if t >= killed]
            before = [t for t in acks if t < killed]
            start = before[-1] if before else killed
            times = [start] + after + [end]
            gaps.append(max(b - a for a, b in zip(times, times[1:])))
        replica_says = []
        if promoted is None:
            for i in cluster.live():
                with open(os.path.join(cluster.dirs[i], "redis.log")) as f:
                    replica_says += [line.strip() for line in f if re.search(r"[Ff]ailover|too old|[Dd]ata age", line)]
        return {
            "cluster_node_timeout_ms": node_timeout_ms,
            "replica_validity_factor": validity_factor,
            "writers": args.writers,
            "appends_before_kill": acks_before,
            "replica_promoted_s": None if promoted is None else round(promoted, 1),
            "cluster_healthy_s": None if healthy is None else round(healthy, 1),
            "tier_down_s": round(sum(b[0] - a[0] for a, b in zip(samples, samples[1:]) if a[1] == 0), 1),
            "tier_flips": sum(1 for a, b in zip(samples, samples[1:]) if a[1] != b[1]),
            "tier_up_again_s": next((round(t - killed, 1) for t, up in reversed(samples) if up != 1), None),
            "longest_writer_gap_s": round(max(gaps), 1),
            "refused_appends": writers.refused,
            "refusals": writers.errors,
            "replica_log": replica_says[-4:],
        }
    finally:
        if writers is not None and not writers.stop.is_set():
            writers.close()
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
        cluster.stop()
        subprocess.run(["rm", "-rf", work])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turbokvd", required=True)
    parser.add_argument("--settings", default="1000:10,1000:0",
                        help="comma-separated NODE_TIMEOUT_MS:VALIDITY_FACTOR pairs")
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--warmup", type=float, default=10)
    parser.add_argument("--wait", type=float, default=60, help="seconds after the kill to wait for a failover")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    for setting in args.settings.split(","):
        timeout, factor = (int(x) for x in setting.split(":"))
        result = measure(args, timeout, factor)
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            never = f"none within {args.wait:.0f} s"
            print(f"node-timeout {timeout} ms, validity factor {factor}: replica promoted "
                  f"{result['replica_promoted_s'] if result['replica_promoted_s'] is not None else never} s, "
                  f"cluster ok {result['cluster_healthy_s']} s, tier down {result['tier_down_s']} s in all "
                  f"({result['tier_flips']} changes, last down at {result['tier_up_again_s']} s), "
                  f"longest writer gap {result['longest_writer_gap_s']} s, {result['refused_appends']} appends "
                  f"refused {result['refusals']}", flush=True)
            for line in result["replica_log"]:
                print("   ", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
