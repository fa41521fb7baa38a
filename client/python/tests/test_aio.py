"""turbokv.aio against the real turbokvd: the blocking client's calls as
coroutines, giving the same results; streams, errors and retries as there."""

import unittest

import numpy as np

import turbokv
import turbokv.aio
from daemon import Daemon, socket_target

LAYERS, KV, Q, D = 2, 2, 8, 64


class AioTest(unittest.IsolatedAsyncioTestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon("--memory-budget=64MiB")

    @classmethod
    def tearDownClass(cls):
        assert cls.daemon.stop() == 0
        cls.daemon.close()

    async def asyncSetUp(self):
        self.rng = np.random.default_rng(2)
        self.client = turbokv.aio.Client(self.daemon.target)
        await self.client.wait_until_ready(20)
        self.blocking = turbokv.Client(self.daemon.target)

    async def asyncTearDown(self):
        await self.client.close()
        self.blocking.close()

    def random(self, *shape):
        return self.rng.standard_normal(shape, dtype=np.float32)

    async def test_calls_give_what_the_blocking_client_gives(self):
        s = await self.client.create_session(LAYERS, KV, Q, D, key_codec="f16", value_codec="f16")
        self.assertIsInstance(s, turbokv.aio.Session)
        keys, values = self.random(LAYERS, 40, KV, D), self.random(LAYERS, 40, KV, D)

        async def chunks():
            for start in (0, 20):
                yield None, start, keys[:, start:start + 20], values[:, start:start + 20]
        self.assertEqual(await s.append_stream(chunks()), 40)
        queries = self.random(2, Q, D)
        result = await s.attend(1, queries, positions=[9, 39], top_k=2)
        twin = self.blocking.session(s.id)
        expected = twin.attend(1, queries, positions=[9, 39], top_k=2)
        np.testing.assert_array_equal(result.output, expected.output)
        np.testing.assert_array_equal(result.top_k_tokens, expected.top_k_tokens)
        stored_k, stored_v = await s.read_kv(None)
        self.assertEqual(stored_k.shape, (LAYERS, 40, KV, D))
        np.testing.assert_array_equal(stored_v, values.astype(np.float16).astype(np.float32))
        tokens, stepped = await s.step(0, 40, keys[0, 0], values[0, 0], queries[0])
        self.assertEqual(tokens, 41)
        async with self.client.decode_stream() as stream:
            batch = await stream.attend(0, [s], queries[:1], [40])
            self.assertTrue(batch.ok)
            np.testing.assert_array_equal(batch.output[0], stepped.output)
            await stream.send(0, [s], queries[:1], [39])
            self.assertEqual(stream.pending, 1)
            self.assertEqual((await stream.receive()).tokens.tolist(), [41])
        fork = await s.fork(10)
        self.assertEqual(list((await fork.info()).layer_tokens), [10, 10])
        self.assertEqual(list((await s.truncate(5)).layer_tokens), [5, 5])
        self.assertIn(s.id, [i.session_id for i in await self.client.list_sessions()])
        self.assertGreaterEqual((await self.client.stats()).sessions, 2)
        await fork.delete()
        await s.delete()

    async def test_a_session_is_deleted_on_leaving_its_async_with_block_unless_kept(self):
        async with await self.client.create_session(LAYERS, KV, Q, D) as s:
            self.assertEqual(s.session_id, s.id)
        with self.assertRaises(turbokv.SessionNotFound):
            await self.client.get_session(s.id)
        async with await self.client.create_session(LAYERS, KV, Q, D) as kept:
            kept.keep = True
        self.assertEqual((await self.client.get_session(kept.id)).session_id, kept.id)
        await kept.delete()

    async def test_errors_and_bad_chunks_reach_the_caller_as_themselves(self):
        with self.assertRaises(turbokv.SessionNotFound):
            await self.client.session("no-such-session")
        s = await self.client.create_session(LAYERS, KV, Q, D)
        keys = self.random(10, KV, D)
        with self.assertRaisesRegex(TypeError, "keys must hold floating-point values"):
            await s.append_stream([(0, 0, keys, keys), (0, 10, keys.astype(np.int16), keys)])
        self.assertEqual(list((await s.info()).layer_tokens), [10, 0])
        with self.assertRaises(turbokv.FailedPrecondition):
            await s.append(0, 20, keys, keys)
        with self.assertRaisesRegex(ValueError, "layer must be in"):
            await s.attend(5, self.random(1, Q, D))
        async with self.client.decode_stream() as stream:
            batch = await stream.attend(0, [s, "no-such-session"], self.random(2, Q, D), [9, 0])
            self.assertIsInstance(batch.errors[1], turbokv.SessionNotFound)
            with self.assertRaises(turbokv.InvalidArgument):  # a malformed message ends the stream
                await stream.step(0, [s], self.random(1, 3, D), self.random(1, 3, D), self.random(1, Q, D), [10])
            with self.assertRaises(turbokv.InvalidArgument):
                await stream.attend(0, [s], self.random(1, Q, D), [0])
        await s.delete()

    async def test_a_bare_socket_path_is_a_unix_target(self):
        path = self.daemon.target[len("unix://"):]
        async with turbokv.aio.Client(path, retry=turbokv.RetryPolicy(max_attempts=1)) as client:
            self.assertGreaterEqual((await client.stats(timeout=10)).sessions, 0)

    async def test_unavailable_is_retried_for_reads_only(self):
        folder, target = socket_target()
        self.addCleanup(folder.cleanup)
        client = turbokv.aio.Client(target, retry=turbokv.RetryPolicy(max_attempts=3, initial_backoff=0.01,
                                                                      max_backoff=0.02))
        with self.assertRaises(turbokv.Unavailable) as read:
            await client.stats()
        self.assertEqual(read.exception.attempts, 3)
        with self.assertRaises(turbokv.Unavailable) as write:
            await client.create_session(1, 1, 1, 64)
        self.assertEqual(write.exception.attempts, 1)
        with self.assertRaisesRegex(turbokv.Unavailable, f"turbokvd at {target} not reachable"):
            await client.wait_until_ready(0.1)
        await client.close()


if __name__ == "__main__":
    unittest.main()
