"""turbokvd's KV events, read as a router would: a subscriber written with
Debian's python3-zmq and python3-msgpack, decoding the documented schema
(docs/OPERATIONS.md "KV events"), rebuilds the blocks held per medium while
10,000 random stores, deletes, truncations and prefetches run against the
real binary, under a memory budget that demotes sessions to its disk tier and
a disk budget that drops the oldest. The rebuilt set must equal what the
sessions hold (ListSessions' residency and the blocks the test named), with
sequence numbers gap-free once replays filled what the subscriber missed; a
late subscriber's replay from 0 (older than the batches kept: a snapshot)
must rebuild the same. Needs $TURBOKVD and the turbokv package on the path."""

import os
import random
import socket
import subprocess
import tempfile
import threading
import time
import unittest

import msgpack
import numpy as np
import zmq

import turbokv

BLOCK = 64
MEDIUM = {turbokv.RESIDENCY_MEMORY: "memory", turbokv.RESIDENCY_MEMORY_AND_DISK: "memory",
          turbokv.RESIDENCY_DISK: "disk"}


def free_port():
    """A free TCP port of 127.0.0.1 (for the metrics endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Reconstruction:
    """The blocks held per medium, rebuilt from batches applied in order."""

    def __init__(self):
        self.media = {}
        self.seqs = []

    def apply(self, seq, payload):
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and rank == 0
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                self.check_fields(event, {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                          "lora_id", "medium", "lora_name", "group_idx", "kv_cache_spec_kind"})
                parent = event["parent_block_hash"]
                assert parent is None or isinstance(parent, bytes)
                assert (event["token_ids"], event["block_size"], event["lora_id"], event["lora_name"],
                        event["group_idx"], event["kv_cache_spec_kind"]) == ([], BLOCK, None, None, 0, "full_attention")
                self.media.setdefault(event["medium"], set()).update(event["block_hashes"])
            elif kind == "BlockRemoved":
                self.check_fields(event, {"type", "block_hashes", "medium", "group_idx"})
                assert event["group_idx"] == 0
                held = self.media.setdefault(event["medium"], set())
                missing = set(event["block_hashes"]) - held
                assert not missing, f"BlockRemoved of {len(missing)} blocks not held in {event['medium']}"
                held.difference_update(event["block_hashes"])
            elif kind == "AllBlocksCleared":
                self.check_fields(event, {"type"})
                self.media.clear()
            else:
                raise AssertionError(f"unknown event {kind!r}")
        self.seqs.append(seq)

    @staticmethod
    def check_fields(event, names):
        assert set(event) == names, f"{event['type']} has fields {sorted(event)}, the schema {sorted(names)}"

    def held(self):
        return {medium: blocks for medium, blocks in self.media.items() if blocks}


def replay(context, endpoint, start):
    """(seq, payload) batches from `start` on, through a DEALER socket."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    try:
        while True:
            if not dealer.poll(10000):
                raise AssertionError("the replay did not end within 10 s")
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return batches
            batches.append((seq, payload))
    finally:
        dealer.close(linger=0)


class Subscriber(threading.Thread):
    """Applies every batch in order; a gap is filled by a replay first."""

    def __init__(self, context, endpoint, replay_endpoint):
        super().__init__(daemon=True)
        self.context, self.replay_endpoint = context, replay_endpoint
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        self.sub.connect(endpoint)
        self.state = Reconstruction()
        self.last = -1
        self.replays = 0
        self.last_message = time.monotonic()
        self.stopping = threading.Event()
        self.error = None

    def run(self):
        try:
            while not self.stopping.is_set():
                if not self.sub.poll(50):
                    continue
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == b"kv-events"
                seq = int.from_bytes(seq, "big")
                self.last_message = time.monotonic()
                if seq <= self.last:
                    continue  # a replay already brought it
                if seq > self.last + 1:
                    self.replays += 1
                    for replayed, batch in replay(self.context, self.replay_endpoint, self.last + 1):
                        if replayed > self.last and replayed < seq:
                            self.state.apply(replayed, batch)
                            self.last = replayed
                self.state.apply(seq, payload)
                self.last = seq
        except Exception as e:  # reported by the test
            self.error = e
        finally:
            self.sub.close(linger=0)


class KvEventsTest(unittest.TestCase):
    def test_a_subscriber_rebuilds_the_blocks_held_per_medium(self):
        rng = random.Random(7)
        with tempfile.TemporaryDirectory(prefix="turbokv-events-") as tmp:
            target = f"unix://{tmp}/turbokv.sock"
            events, replay_at = f"ipc://{tmp}/events", f"ipc://{tmp}/replay"
            log = open(os.path.join(tmp, "turbokvd.log"), "w")
            daemon = subprocess.Popen(
                [os.environ["TURBOKVD"], f"--listen={target}", "--device=cpu", "--threads=1", "--metrics-listen=",
                 "--memory-budget=160KiB", "--eviction=lru", f"--spill-dir={tmp}/spill", "--spill-budget=160KiB",
                 "--session-ttl=0", f"--kv-events-endpoint={events}", f"--kv-events-replay-endpoint={replay_at}",
                 "--kv-events-buffer=500"], stderr=log)
            context = zmq.Context()
            subscriber = Subscriber(context, events, replay_at)
            subscriber.start()
            try:
                client = turbokv.Client(target)
                client.wait_until_ready(30)
                self.run_workload(client, rng, subscriber, tmp)
            finally:
                subscriber.stopping.set()
                subscriber.join(10)
                daemon.terminate()
                daemon.wait(60)
                log.close()
                context.term()

    def run_workload(self, client, rng, subscriber, tmp):
        # Documents: chains of block hashes that sessions share prefixes of.
        chains = [turbokv.block_hashes(range(1000 * c, 1000 * c + 12 * BLOCK), BLOCK, salt="events")
                  for c in range(6)]
        held = {}  # session id -> the hashes it holds
        ops = {"store": 0, "delete": 0, "truncate": 0, "prefetch": 0, "gone": 0, "refused": 0}
        # 10,000 random operations on about 70 sessions (more than memory
        # holds), then stores only until the disk is full and the background
        # pass drops the oldest sessions on it.
        for i in range(12000):
            if i < 10000:
                weights = [5, 2, 1, 2] if len(held) < 70 else [2, 5, 1, 2]
                op = rng.choices(["store", "delete", "truncate", "prefetch"], weights)[0] if held else "store"
            elif client.stats().evictions > 0:
                break
            else:
                op = "store"
            sid = None
            try:
                if op == "store":
                    chain = rng.choice(chains)[:rng.randint(1, 6)]
                    s = client.create_session(1, 1, 1, 64, key_codec="turbo2", value_codec="turbo2",
                                              key_transform="none", sink_tokens=0, prefix_blocks=chain)
                    sid = s.id
                    held[sid] = chain[:s.prefix_tokens // BLOCK]
                    start = s.prefix_tokens
                    n = len(chain) * BLOCK - start
                    if n:
                        data = np.ones((n, 1, 64), np.float32)
                        s.append(0, start, data, data)
                    s.name_blocks(0, chain)
                    held[sid] = list(chain)
                elif op == "delete":
                    sid = rng.choice(list(held))
                    del held[sid]
                    client.delete_session(sid)
                elif op == "truncate":
                    sid = rng.choice(list(held))
                    blocks = rng.randint(0, len(held[sid]))
                    client.session(sid).truncate(blocks * BLOCK + rng.randint(0, BLOCK - 1))
                    held[sid] = held[sid][:blocks]
                else:
                    client.prefetch([rng.choice(list(held))])
            except turbokv.SessionNotFound:
                # Dropped from the full disk tier meanwhile: gone with its blocks.
                held.pop(sid, None)
                ops["gone"] += 1
                continue
            except turbokv.BudgetExceeded:
                # Memory and disk both full until the background pass drops
                # some: the call changed nothing (a store may have started
                # its session: it holds what it got).
                ops["refused"] += 1
                time.sleep(0.05)
                continue
            ops[op] += 1

        # Quiet: no batch for a while, and the sessions' state stable.
        def expected():
            want = {}
            live = set()
            for info in client.list_sessions():
                live.add(info.session_id)
                blocks = held.get(info.session_id, [])
                if blocks:
                    want.setdefault(MEDIUM[info.residency], set()).update(blocks)
            return want, live

        deadline = time.monotonic() + 60
        while True:
            want, live = expected()
            time.sleep(0.5)
            if time.monotonic() - subscriber.last_message > 0.4 and expected()[0] == want:
                break
            self.assertLess(time.monotonic(), deadline, "the daemon did not settle")
        self.assertIsNone(subscriber.error)
        for sid in set(held) - live:
            held.pop(sid)  # dropped (disk full) without a call naming it
        want, _ = expected()
        self.assertGreater(len(want.get("disk", ())), 0, "no session was demoted: the budget is too large")
        self.assertEqual(subscriber.state.held(), want)
        self.assertEqual(subscriber.state.seqs, list(range(len(subscriber.state.seqs))))
        self.assertGreater(len(subscriber.state.seqs), 5000)
        stats = client.stats()
        self.assertGreater(stats.demotions, 0)
        self.assertGreater(stats.evictions, 0)  # sessions dropped from the full disk

        # A late subscriber: its replay from 0 begins with a snapshot.
        late = Reconstruction()
        batches = replay(subscriber.context, subscriber.replay_endpoint, 0)
        self.assertGreater(batches[0][0], 0)  # numbered as the last batch it includes
        self.assertEqual(msgpack.unpackb(batches[0][1])[1][0], {"type": "AllBlocksCleared"})
        for seq, batch in batches:
            late.apply(seq, batch)
        self.assertEqual(late.held(), want)
        self.assertEqual(batches[-1][0], subscriber.state.seqs[-1])
        print(f"ops {ops}, batches {len(subscriber.state.seqs)}, replays {subscriber.replays}, "
              f"demotions {stats.demotions}, evictions {stats.evictions}, "
              f"blocks held {({m: len(b) for m, b in want.items()})}")


def metric(port, name):
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class KvEventsBoundsTest(unittest.TestCase):
    """Issue 58 item 5: what peers of the endpoints and the replay buffer
    cost the daemon is bounded."""

    def test_peers_and_the_replay_buffer_are_bounded(self):
        with tempfile.TemporaryDirectory(prefix="turbokv-events-") as tmp:
            target = f"unix://{tmp}/turbokv.sock"
            events, replay_at = f"ipc://{tmp}/events", f"ipc://{tmp}/replay"
            port = free_port()
            log_path = os.path.join(tmp, "turbokvd.log")
            log = open(log_path, "w")
            daemon = subprocess.Popen(
                [os.environ["TURBOKVD"], f"--listen={target}", "--device=cpu", "--threads=1",
                 f"--metrics-listen=127.0.0.1:{port}", f"--kv-events-endpoint={events}",
                 f"--kv-events-replay-endpoint={replay_at}", "--kv-events-buffer-bytes=64KiB"], stderr=log)
            context = zmq.Context()
            try:
                client = turbokv.Client(target)
                client.wait_until_ready(30)
                sub = context.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
                sub.connect(events)
                time.sleep(0.3)
                # One NameBlocks of 2,500 blocks: three batches of at most
                # 1,024 hashes, each chained to the one before.
                chain = turbokv.block_hashes(range(2500 * BLOCK), BLOCK, salt="bounds")
                session = client.create_session(1, 1, 1, 64, key_codec="turbo2", value_codec="turbo2",
                                                key_transform="none", sink_tokens=0)
                data = np.ones((2500 * BLOCK, 1, 64), np.float32)
                for at in range(0, len(data), 16384):
                    session.append(0, at, data[at:at + 16384], data[at:at + 16384])
                session.name_blocks(0, chain)
                stored = []
                while sum(len(e["block_hashes"]) for e in stored) < 2500:
                    self.assertTrue(sub.poll(10000), "the stored blocks did not arrive")
                    _, _, payload = sub.recv_multipart()
                    batch = [e for e in msgpack.unpackb(payload)[1] if e["type"] == "BlockStored"]
                    self.assertLessEqual(sum(len(e["block_hashes"]) for e in batch), 1024)
                    stored += batch
                self.assertEqual([h for e in stored for h in e["block_hashes"]], chain)
                for before, after in zip(stored, stored[1:]):
                    self.assertEqual(after["parent_block_hash"], before["block_hashes"][-1])
                sub.close(linger=0)

                # The buffer holds at most 64 KiB of batches (these three
                # are about 90 KB): a replay from 0 starts with a snapshot.
                deadline = time.time() + 10
                while (metric(port, "turbokv_kv_events_buffer_bytes") or 0) == 0 and time.time() < deadline:
                    time.sleep(0.2)
                kept = metric(port, "turbokv_kv_events_buffer_bytes")
                self.assertGreater(kept, 0)
                self.assertLessEqual(kept, 64 * 1024)
                batches = replay(context, replay_at, 0)
                self.assertEqual(msgpack.unpackb(batches[0][1])[1][0], {"type": "AllBlocksCleared"})

                # 2,000 malformed replay requests: a warning line or two, not 2,000.
                dealer = context.socket(zmq.DEALER)
                dealer.connect(replay_at)
                for _ in range(2000):
                    dealer.send_multipart([b"", b"bad"])
                time.sleep(1)
                dealer.close(linger=0)
                with open(log_path) as f:
                    warnings = [line for line in f if "is not [empty, 8-byte start]" in line]
                self.assertGreaterEqual(len(warnings), 1)
                self.assertLessEqual(len(warnings), 2)

                # A 64 MiB request is refused before it is buffered (it took
                # 384 MiB to 544 MiB of resident memory before).
                before = rss_bytes(daemon.pid)
                big = context.socket(zmq.DEALER)
                big.connect(replay_at)
                big.send_multipart([b"", b"x" * (64 << 20)])
                time.sleep(2)
                big.close(linger=0)
                self.assertLess(rss_bytes(daemon.pid) - before, 16 << 20)
                self.assertTrue(replay(context, replay_at, 0))  # still answering
            finally:
                daemon.terminate()
                self.assertEqual(daemon.wait(60), 0)
                log.close()
                context.term()


class KvEventsVllmIntegersTest(unittest.TestCase):
    """Issue 53 item 3: with --kv-events-hashes=int the hashes are the
    integers vLLM 0.32 publishes for the same names (its
    maybe_convert_block_hash: the last 8 bytes, big-endian), and every batch
    carries --kv-events-dp-rank."""

    def test_hashes_are_vllms_integers_and_batches_carry_the_rank(self):
        with tempfile.TemporaryDirectory(prefix="turbokv-events-") as tmp:
            target, events = f"unix://{tmp}/turbokv.sock", f"ipc://{tmp}/events"
            for flag, why in (("--kv-events-hashes=hex", "--kv-events-hashes=hex: expected bytes or int"),
                              ("--kv-events-dp-rank=-1", "--kv-events-dp-rank=-1: expected a rank >= 0")):
                bad = subprocess.run([os.environ["TURBOKVD"], f"--listen={target}", "--metrics-listen=",
                                      f"--kv-events-endpoint={events}", flag], capture_output=True, text=True,
                                     timeout=60)
                self.assertNotEqual(bad.returncode, 0)
                self.assertIn(why, bad.stderr)
            daemon = subprocess.Popen(
                [os.environ["TURBOKVD"], f"--listen={target}", "--device=cpu", "--threads=1", "--metrics-listen=",
                 f"--kv-events-endpoint={events}", "--kv-events-hashes=int", "--kv-events-dp-rank=3"])
            context = zmq.Context()
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
            try:
                client = turbokv.Client(target)
                client.wait_until_ready(30)
                sub.connect(events)
                time.sleep(0.3)
                # Names of 32 bytes (as vLLM's SHA-256 hashes), 64 (the most),
                # 5 (fewer than 8) and 1.
                chain = turbokv.block_hashes(range(3 * BLOCK), BLOCK, salt="integers") + [
                    bytes(range(64)), b"\x01\x02\x03\x04\x05", b"\xff"]
                session = client.create_session(1, 1, 1, 64, key_codec="turbo2", value_codec="turbo2",
                                                key_transform="none", sink_tokens=0)
                data = np.ones((len(chain) * BLOCK, 1, 64), np.float32)
                session.append(0, 0, data, data)
                session.name_blocks(0, chain)
                client.delete_session(session.id)
                as_int = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in chain]
                self.assertEqual(as_int[3:], [int.from_bytes(bytes(range(56, 64)), "big"), 0x0102030405, 255])
                received = []
                while not any(e["type"] == "BlockRemoved" for e in received):
                    self.assertTrue(sub.poll(10000), "the events did not arrive")
                    _, _, payload = sub.recv_multipart()
                    ts, batch, rank = msgpack.unpackb(payload)
                    self.assertEqual(rank, 3)
                    received += batch
                stored = [e for e in received if e["type"] == "BlockStored"]
                removed = [e for e in received if e["type"] == "BlockRemoved"]
                self.assertEqual([h for e in stored for h in e["block_hashes"]], as_int)
                self.assertIsNone(stored[0]["parent_block_hash"])
                self.assertEqual({h for e in removed for h in e["block_hashes"]}, set(as_int))
                self.assertGreater(min(as_int), 127)  # msgpack's 64-bit form, not a fixint
            finally:
                sub.close(linger=0)
                daemon.terminate()
                self.assertEqual(daemon.wait(60), 0)
                context.term()


if __name__ == "__main__":
    unittest.main()
