"""Tensors through shared memory (docs/API.md, "Shared memory") against the
real turbokvd: a client over the unix socket passes them through its memfd
region and gets, bit for bit, what a client sending them in the messages
gets; a daemon without shared memory, and one restarted under the client,
are served in the messages."""

import asyncio
import time
import unittest

import numpy as np

import turbokv
import turbokv._common
import turbokv.aio
import turbokv.errors
from daemon import Daemon, DaemonTestCase, socket_target

LAYERS, KV, Q, D = 2, 2, 8, 128


def region_of(client):
    """The client's registered region, or None."""
    shared = client._shared_memory
    return None if shared is None else shared._region


class SharedMemoryTest(DaemonTestCase):
    def setUp(self):
        self.rng = np.random.default_rng(5)
        self.bytes_client = turbokv.Client(self.daemon.target, shared_memory=0)
        self.addCleanup(self.bytes_client.close)

    def random(self, *shape, dtype=np.float32):
        return self.rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    def twins(self, n):
        keys, values, queries = self.random(LAYERS, n, KV, D), self.random(LAYERS, n, KV, D), self.random(LAYERS, n, Q, D)
        sessions = []
        for client in (self.client, self.bytes_client):
            s = client.create_session(LAYERS, KV, Q, D, key_codec="turbo4", value_codec="turbo3", rotation_seed=9)
            self.addCleanup(s.delete)
            self.assertEqual(s.append(None, 0, keys, values, queries=queries), n)
            sessions.append(s)
        return sessions

    def test_every_call_gives_the_same_bits_either_way(self):
        for dtype in (np.float32, np.float16):
            shared, plain = self.twins(200)
            self.assertIsNotNone(region_of(self.client), "the shared-memory client registered no region")
            self.assertIsNone(region_of(self.bytes_client))
            queries = self.random(3, Q, D, dtype=dtype)
            a, b = (s.attend(1, queries, [199, 50, 3], top_k=2) for s in (shared, plain))
            np.testing.assert_array_equal(a.output, b.output)
            np.testing.assert_array_equal(a.lse, b.lse)
            np.testing.assert_array_equal(a.top_k_tokens, b.top_k_tokens)
            key, value, query = self.random(KV, D, dtype=dtype), self.random(KV, D, dtype=dtype), self.random(Q, D, dtype=dtype)
            (ta, a), (tb, b) = (s.step(0, 200, key, value, query) for s in (shared, plain))
            self.assertEqual(ta, tb)
            np.testing.assert_array_equal(a.output, b.output)
            np.testing.assert_array_equal(a.lse, b.lse)
            keys, values, queries = (self.random(1, 2, h, D, dtype=dtype) for h in (KV, KV, Q))
            results = []
            for client, session in ((self.client, shared), (self.bytes_client, plain)):
                with client.decode_stream() as stream:
                    results.append(stream.step(1, [session], keys, values, queries, [200]))
            np.testing.assert_array_equal(results[0].output, results[1].output)
            np.testing.assert_array_equal(results[0].lse, results[1].lse)
            self.assertEqual(list(results[0].tokens), list(results[1].tokens))
            for layer in range(LAYERS):
                for got, expected in zip(shared.read_kv(layer), plain.read_kv(layer)):
                    np.testing.assert_array_equal(got, expected)

    def test_calls_larger_than_the_region_go_in_the_messages(self):
        small = turbokv.Client(self.daemon.target, shared_memory=64 * 1024)
        self.addCleanup(small.close)
        keys, values = self.random(LAYERS, 300, KV, D), self.random(LAYERS, 300, KV, D)  # 614 KB a tensor
        sessions = []
        for client in (small, self.bytes_client):
            s = client.create_session(LAYERS, KV, Q, D, key_codec="turbo4", value_codec="turbo3", rotation_seed=9)
            self.addCleanup(s.delete)
            self.assertEqual(s.append(None, 0, keys, values), 300)
            sessions.append(s)
        self.assertIsNotNone(region_of(small), "the small client registered no region")
        queries = self.random(40, Q, D)  # 160 KB
        a, b = (s.attend(0, queries) for s in sessions)
        np.testing.assert_array_equal(a.output, b.output)
        np.testing.assert_array_equal(a.lse, b.lse)
        for got, expected in zip(sessions[0].read_kv(None), sessions[1].read_kv(None)):
            np.testing.assert_array_equal(got, expected)
        self.assertEqual(region_of(small)._free, [[0, 64 * 1024]], "a block was kept")

    def test_append_streams_pass_their_chunks_through_it_and_give_every_block_back(self):
        keys, values = self.random(LAYERS, 300, KV, D), self.random(LAYERS, 300, KV, D)
        chunks = [(layer, start, keys[layer, start:start + 60], values[layer, start:start + 60])
                  for layer in range(LAYERS) for start in range(0, 300, 60)]
        sessions = []
        for client in (self.client, self.bytes_client):
            s = client.create_session(LAYERS, KV, Q, D, key_codec="turbo4", value_codec="turbo3", rotation_seed=9,
                                      key_transform="none", sink_tokens=0)
            self.addCleanup(s.delete)
            sessions.append(s)
        sessions[0].append(0, 0, keys[0, :1], values[0, :1])  # registers the region
        region = region_of(self.client)
        self.assertIsNotNone(region)
        taken = []
        take = region.take
        region.take = lambda size: taken.append(size) or take(size)
        self.assertEqual(sessions[0].append_stream(iter(chunks)), 300)
        self.assertEqual(len(taken), len(chunks), "every chunk took a block")
        self.assertEqual(region._free, [[0, region.memory.size()]], "a block was not given back")
        self.assertEqual(sessions[1].append_stream(chunks), 300)

        async def stream_more():
            async with turbokv.aio.Client(self.daemon.target) as client:
                s = await client.session(sessions[0].id)
                more = [(None, 300, self.random(LAYERS, 20, KV, D), self.random(LAYERS, 20, KV, D))]
                tokens = await s.append_stream(more)
                self.assertEqual(region_of(client)._free, [[0, region_of(client).memory.size()]])
                return tokens, more
        tokens, more = asyncio.run(stream_more())
        self.assertEqual(tokens, 320)
        self.assertEqual(sessions[1].append_stream(more), 320)
        for layer in range(LAYERS):
            for got, expected in zip(sessions[0].read_kv(layer), sessions[1].read_kv(layer)):
                np.testing.assert_array_equal(got, expected)

    def test_a_chunk_built_after_its_stream_ended_holds_no_block(self):
        # gRPC may ask for one more request after a stream failed: it is
        # never sent, so it must not take (and keep) a part of the region.
        session = self.client.create_session(1, KV, Q, D)
        self.addCleanup(session.delete)
        kv = self.random(4, KV, D)
        session.append(0, 0, kv, kv)  # registers the region
        region = region_of(self.client)
        chunks = turbokv._common.SharedChunks(session)
        self.assertTrue(chunks.request((0, 4, kv, kv)).keys.HasField("shared"))
        chunks.close()
        late = chunks.request((0, 8, kv, kv))
        self.assertFalse(late.keys.HasField("shared"))
        self.assertEqual(region._free, [[0, region.memory.size()]])

    def test_asyncio_gives_the_same_bits(self):
        shared, plain = self.twins(70)
        key, value, query = self.random(KV, D), self.random(KV, D), self.random(Q, D)

        async def steps():
            async with turbokv.aio.Client(self.daemon.target) as client:
                s = await client.session(shared.id)
                tokens, result = await s.step(0, 70, key, value, query)
                self.assertIsNotNone(region_of(client))
                async with client.decode_stream() as stream:
                    batch = await stream.attend(1, [s], self.random(1, Q, D), [69])
                return tokens, result, batch
        tokens, a, batch = asyncio.run(steps())
        tb, b = plain.step(0, 70, key, value, query)
        self.assertEqual(tokens, tb)
        np.testing.assert_array_equal(a.output, b.output)
        self.assertEqual(batch.errors, [None])


def serving(client, timeout=20.0):
    """Waits until a (re)started daemon answers the client."""
    end = time.monotonic() + timeout
    while True:
        try:
            client.stats(timeout=1)
            return
        except turbokv.errors.Unavailable:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


class WithoutSharedMemoryTest(unittest.TestCase):
    def test_a_daemon_without_it_and_one_restarted_are_served_in_the_messages(self):
        at = socket_target()
        daemon = Daemon("--shared-memory-socket=", at=at)
        self.addCleanup(at[0].cleanup)
        client = turbokv.Client(at[1])
        self.addCleanup(client.close)
        serving(client)
        rng = np.random.default_rng(1)
        s = client.create_session(1, KV, Q, D)
        tokens, result = s.step(0, 0, rng.standard_normal((KV, D)), rng.standard_normal((KV, D)),
                                rng.standard_normal((Q, D)))
        self.assertEqual(tokens, 1)
        self.assertIsNone(region_of(client))

        def restart(daemon):
            """The daemon stopped and started again (with shared memory),
            and a new session on it."""
            self.assertEqual(daemon.stop(), 0)
            daemon = Daemon(at=at)
            self.addCleanup(daemon.stop)
            serving(client)
            return daemon, client.create_session(1, KV, Q, D)

        # A daemon with shared memory: the client registers on its next call
        # (after its retry interval) or sends bytes meanwhile; both answer.
        daemon, s = restart(daemon)
        client._shared_memory._retry_after = 0.0
        s.step(0, 0, rng.standard_normal((KV, D)), rng.standard_normal((KV, D)), rng.standard_normal((Q, D)))
        self.assertIsNotNone(region_of(client))
        first = region_of(client).id
        # Restarted under the client: the region is gone there; the call is
        # made again in the messages, and the next registers a new region.
        daemon, s = restart(daemon)
        tokens, _ = s.step(0, 0, rng.standard_normal((KV, D)), rng.standard_normal((KV, D)),
                           rng.standard_normal((Q, D)))
        self.assertEqual(tokens, 1)
        s.step(0, 1, rng.standard_normal((KV, D)), rng.standard_normal((KV, D)), rng.standard_normal((Q, D)))
        self.assertIsNotNone(region_of(client))
        self.assertNotEqual(region_of(client).id, first)
        # An Append stream of a list, the same: sent again in the messages
        # after a restart, and the next call registers a new region.
        second = region_of(client).id
        daemon, s = restart(daemon)
        kv = rng.standard_normal((1, 8, KV, D)).astype(np.float32)
        self.assertEqual(s.append_stream([(0, 0, kv[0, :5], kv[0, :5]), (0, 5, kv[0, 5:], kv[0, 5:])]), 8)
        np.testing.assert_array_equal(s.read_kv(0)[0].shape, (8, KV, D))
        s.append_stream([(0, 8, kv[0, :1], kv[0, :1])])
        self.assertIsNotNone(region_of(client))
        self.assertNotEqual(region_of(client).id, second)


if __name__ == "__main__":
    unittest.main()
