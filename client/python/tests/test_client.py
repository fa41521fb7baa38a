"""The Python client against the real turbokvd: numpy in and out, errors as
TurbokvError with the gRPC code, attention checked against numpy."""

import unittest

import grpc
import numpy as np

import turbokv
from daemon import Daemon, DaemonTestCase

LAYERS, KV, Q, D = 2, 2, 8, 128


def reference_attention(keys, values, queries, positions):
    """Softmax attention in float64: keys/values [t, kv, d], queries [n, q, d]."""
    group = Q // KV
    out = np.zeros(queries.shape, dtype=np.float64)
    lse = np.zeros(queries.shape[:2], dtype=np.float64)
    for i, p in enumerate(positions):
        for h in range(Q):
            k = keys[: p + 1, h // group].astype(np.float64)
            v = values[: p + 1, h // group].astype(np.float64)
            logits = k @ queries[i, h].astype(np.float64) / np.sqrt(D)
            m = logits.max()
            w = np.exp(logits - m)
            out[i, h] = w @ v / w.sum()
            lse[i, h] = m + np.log(w.sum())
    return out, lse


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


class ClientTest(DaemonTestCase):
    def setUp(self):
        self.rng = np.random.default_rng(7)

    def session(self, codec="turbo3"):
        return self.client.create_session(LAYERS, KV, Q, D, key_codec=codec, value_codec=codec)

    def test_attention_matches_numpy_over_what_is_stored(self):
        s = self.session()
        keys = self.rng.standard_normal((300, KV, D), dtype=np.float32)
        values = self.rng.standard_normal((300, KV, D), dtype=np.float32)
        self.assertEqual(s.append_stream((1, start, keys[start:start + 100], values[start:start + 100])
                                         for start in (0, 100, 200)), 300)
        stored_k, stored_v = s.read_kv(1)
        self.assertEqual(stored_k.shape, (300, KV, D))
        self.assertLess(rel(stored_k, keys), 0.2)  # turbo3: relative MSE about 0.034
        queries = self.rng.standard_normal((2, Q, D), dtype=np.float32)
        result = s.attend(1, queries, positions=[99, 299], top_k=3)
        out, lse = reference_attention(stored_k, stored_v, queries, [99, 299])
        self.assertLess(rel(result.output, out), 1e-3)
        self.assertLess(rel(result.lse, lse), 1e-4)
        self.assertEqual(result.top_k_tokens.shape, (2, Q, 3))
        s.delete()

    def test_float16_input_step_fork_truncate(self):
        s = self.session("f16")
        keys = self.rng.standard_normal((LAYERS, 64, KV, D)).astype(np.float16)
        self.assertEqual(s.append(None, 0, keys, keys), 64)
        stored_k, _ = s.read_kv(0)
        np.testing.assert_allclose(stored_k, keys[0].astype(np.float32), rtol=0, atol=0)
        k1 = self.rng.standard_normal((KV, D), dtype=np.float32)
        q1 = self.rng.standard_normal((Q, D), dtype=np.float32)
        tokens, result = s.step(0, 64, k1, k1, q1)
        self.assertEqual(tokens, 65)
        self.assertEqual(result.output.shape, (1, Q, D))
        fork = s.fork(32)
        self.assertEqual(list(fork.info().layer_tokens), [32, 32])
        self.assertEqual(list(s.truncate(10).layer_tokens), [10, 10])
        self.assertEqual(list(fork.info().layer_tokens), [32, 32])
        fork.delete()
        s.delete()

    def test_merge_of_two_halves_equals_the_whole(self):
        s = self.session("f16")
        keys = self.rng.standard_normal((200, KV, D), dtype=np.float32)
        s.append(0, 0, keys, keys)
        other = self.session("f16")
        other.append(0, 0, keys[100:], keys[100:])
        q = self.rng.standard_normal((1, Q, D), dtype=np.float32)
        whole = s.attend(0, q)
        first = s.attend(0, q, positions=[99])
        second = other.attend(0, q)
        merged = turbokv.merge_attention(first, second)
        self.assertLess(rel(merged.output, whole.output), 1e-5)
        self.assertLess(rel(merged.lse, whole.lse), 1e-6)
        s.delete()
        other.delete()

    def test_errors_carry_the_grpc_code_and_message(self):
        with self.assertRaises(turbokv.TurbokvError) as missing:
            self.client.session("no-such-session")
        self.assertEqual(missing.exception.code, grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(turbokv.TurbokvError) as bad:
            self.client.create_session(1, 1, 1, 100)
        self.assertEqual(bad.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("config.shape.head_dim", bad.exception.message)
        s = self.session()
        keys = np.zeros((10, KV, D), dtype=np.float32)
        s.append(0, 0, keys, keys)
        with self.assertRaises(turbokv.TurbokvError) as gap:
            s.append(0, 20, keys, keys)
        self.assertEqual(gap.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        keys[3, 1, 5] = np.nan
        with self.assertRaises(turbokv.TurbokvError) as nan:
            s.append(0, 10, keys, keys)
        self.assertEqual(nan.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("not finite", nan.exception.message)
        self.assertEqual(list(s.info().layer_tokens), [10, 0])
        s.delete()

    def test_stats_and_list(self):
        s = self.session()
        s.append(None, 0, np.ones((LAYERS, 64, KV, D), np.float32), np.ones((LAYERS, 64, KV, D), np.float32))
        self.assertIn(s.id, [info.session_id for info in self.client.list_sessions()])
        info = s.info()
        self.assertGreater(info.fp16_bytes / info.bytes_used, 4.5)
        stats = self.client.stats()
        self.assertGreaterEqual(stats.bytes_used, info.bytes_used)
        self.assertGreaterEqual(stats.sessions, 1)
        self.assertIn("cpu", stats.device)
        s.delete()


class AuthenticatedClientTest(unittest.TestCase):
    def test_tokens_and_tenants(self):
        import os
        import tempfile
        with tempfile.NamedTemporaryFile("w", suffix=".tokens", delete=False) as tokens:
            tokens.write("py-alpha alpha\npy-beta beta\n")
        daemon = Daemon(f"--auth-tokens-file={tokens.name}")
        try:
            alpha = turbokv.Client(daemon.target, token="py-alpha")
            beta = turbokv.Client(daemon.target, token="py-beta")
            nobody = turbokv.Client(daemon.target)
            alpha.wait_until_ready(20)
            s = alpha.create_session(1, 1, 1, 64)
            with self.assertRaises(turbokv.TurbokvError) as missing:
                nobody.stats()
            self.assertEqual(missing.exception.code, grpc.StatusCode.UNAUTHENTICATED)
            with self.assertRaises(turbokv.TurbokvError) as other:
                beta.session(s.id)
            self.assertEqual(other.exception.code, grpc.StatusCode.NOT_FOUND)
            self.assertEqual(len(alpha.list_sessions()), 1)
            for c in (alpha, beta, nobody):
                c.close()
            self.assertEqual(daemon.stop(), 0)
        finally:
            daemon.close()
            os.unlink(tokens.name)


class SpillTierTest(unittest.TestCase):
    def test_demoted_sessions_come_back_and_prefetch_and_pinned(self):
        import tempfile
        with tempfile.TemporaryDirectory(prefix="turbokv-py-spill-") as spill:
            # 2 MiB of memory: the sessions below take about 8 MiB.
            daemon = Daemon("--memory-budget=2MiB", "--eviction=lru", f"--spill-dir={spill}")
            try:
                client = turbokv.Client(daemon.target)
                client.wait_until_ready(20)
                rng = np.random.default_rng(5)
                pinned = client.create_session(LAYERS, KV, Q, D, pinned=True)
                self.assertTrue(pinned.info().config.pinned)
                sessions, stored = [], []
                for _ in range(8):
                    s = client.create_session(LAYERS, KV, Q, D, value_codec="q8_0")
                    k = rng.standard_normal((LAYERS, 512, KV, D), dtype=np.float32)
                    s.append(None, 0, k, k)
                    stored.append(s.read_kv(1))
                    sessions.append(s)
                residency = [s.info().residency for s in sessions]
                self.assertIn(turbokv.RESIDENCY_DISK, residency)
                self.assertEqual(pinned.info().residency, turbokv.RESIDENCY_MEMORY_AND_DISK)
                demoted = [s for s in sessions if s.info().residency == turbokv.RESIDENCY_DISK]
                self.assertEqual(client.prefetch([demoted[0], "no-such-session"])[0], None)
                errors = client.prefetch(["no-such-session"])
                self.assertEqual(errors[0].code, grpc.StatusCode.NOT_FOUND)
                for s, (k, v) in zip(sessions, stored):
                    k2, v2 = s.read_kv(1)
                    np.testing.assert_array_equal(k2, k)
                    np.testing.assert_array_equal(v2, v)
                stats = client.stats()
                self.assertGreater(stats.demotions, 0)
                self.assertGreater(stats.promotions, 0)
                client.close()
                self.assertEqual(daemon.stop(), 0)
            finally:
                daemon.close()


if __name__ == "__main__":
    unittest.main()
