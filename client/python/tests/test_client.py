"""The Python client against the real turbokvd: numpy in and out, errors as
TurbokvError with the gRPC code, attention checked against numpy."""

import inspect
import os
import re
import threading
import unittest

import grpc
import numpy as np

import turbokv
from turbokv.v1 import turbokv_pb2 as pb
from daemon import Daemon, DaemonTestCase, socket_target

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

    def test_a_session_is_deleted_on_leaving_its_with_block_unless_kept(self):
        with self.session() as s:
            self.assertEqual(s.session_id, s.id)
            s.append(0, 0, np.zeros((4, KV, D), np.float32), np.zeros((4, KV, D), np.float32))
        with self.assertRaises(turbokv.SessionNotFound):
            self.client.get_session(s.id)
        with self.assertRaises(RuntimeError):
            with self.session() as failed:
                raise RuntimeError("the worker failed")
        with self.assertRaises(turbokv.SessionNotFound):
            self.client.get_session(failed.id)
        with self.session() as kept:
            kept.keep = True
        self.assertEqual(self.client.session(kept.id).id, kept.id)
        with self.client.session(kept.id) as handle:
            handle.delete()  # already gone on leaving: no error
        with self.assertRaises(turbokv.SessionNotFound):
            self.client.get_session(kept.id)

    def test_the_target_defaults_to_turbokv_target(self):
        previous = os.environ.get("TURBOKV_TARGET")
        os.environ["TURBOKV_TARGET"] = self.daemon.target
        try:
            with turbokv.Client() as client:
                client.wait_until_ready(10)
                self.assertGreaterEqual(client.stats().sessions, 0)
        finally:
            if previous is None:
                del os.environ["TURBOKV_TARGET"]
            else:
                os.environ["TURBOKV_TARGET"] = previous

    def test_a_bare_socket_path_is_a_unix_target(self):
        # Not sent to the resolver as a host name: the unix socket at that path.
        path = self.daemon.target[len("unix://"):]
        with turbokv.Client(path, retry=turbokv.RetryPolicy(max_attempts=1)) as client:
            self.assertGreaterEqual(client.stats(timeout=10).sessions, 0)

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

    def test_a_named_prefix_starts_a_later_session_bit_identical(self):
        ids = list(range(5000, 5000 + 150))
        keys = self.rng.standard_normal((LAYERS, 150, KV, D), dtype=np.float32)
        storer = self.session()
        block = storer.block_tokens
        self.assertEqual(block, self.client.stats().block_tokens)
        storer.append(None, 0, keys[:, :block], keys[:, :block])  # the prefix's first chunk: one block
        storer.append(None, block, keys[:, block:], keys[:, block:])
        hashes = turbokv.block_hashes(ids, block, salt="model")
        self.assertEqual(len(hashes), 150 // block)
        # The documented chain, computed here on its own.
        import hashlib
        previous = hashlib.sha256(b"model").digest()
        previous = hashlib.sha256(previous + np.asarray(ids[:block], "<i4").tobytes()).digest()
        self.assertEqual(hashes[0], previous)
        self.assertEqual(self.client.session(storer.id).block_tokens, block)  # a handle knows it too
        self.assertEqual(storer.fork(block).block_tokens, block)
        named = storer.name_blocks(0, hashes)
        self.assertEqual((named.named_blocks, named.reusable_from_blocks), (len(hashes), 1))
        started = self.client.create_session(LAYERS, KV, Q, D, key_codec="turbo3", value_codec="turbo3",
                                             prefix_blocks=turbokv.block_hashes(ids + [1, 2, 3], block, "model"))
        prefix = len(hashes) * block
        self.assertEqual(started.prefix_tokens, prefix)
        for layer in range(LAYERS):
            for a, b in zip(started.read_kv(layer), storer.read_kv(layer, 0, prefix)):
                np.testing.assert_array_equal(a, b)
        other = self.client.create_session(LAYERS, KV, Q, D, key_codec="turbo3", value_codec="turbo3",
                                           prefix_blocks=turbokv.block_hashes(ids, block, "another model"))
        self.assertEqual(other.prefix_tokens, 0)
        with self.assertRaises(turbokv.FailedPrecondition):
            storer.name_blocks(0, [b"another"])
        with self.assertRaises(ValueError):
            storer.name_blocks(0, [b""])
        with self.assertRaises(ValueError):
            turbokv.block_hashes([1, -2], block)
        for s in (storer, started, other):
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

    def test_presets_and_layer_codecs(self):
        s = self.client.create_session(32, 1, 1, D, preset="k4v3")
        info = s.info()
        self.assertEqual(info.config.preset, "k4v3")
        self.assertEqual([(r.first_layer, r.last_layer, r.value_codec) for r in info.layers],
                         [(0, 1, pb.CODEC_TURBO4), (2, 29, pb.CODEC_TURBO3), (30, 31, pb.CODEC_TURBO4)])
        self.assertAlmostEqual(info.bits_per_value, (28 * 3.625 + 4 * 4.125) / 32)
        # Neither codecs nor a preset: the daemon's default preset.
        self.assertIn(self.client.create_session(LAYERS, KV, Q, D).info().config.preset, turbokv.PRESETS)
        mixed = self.client.create_session(LAYERS, KV, Q, D, key_codec="turbo3", value_codec="turbo3",
                                           layer_codecs=[(1, 1, "q8_0", None)])
        last = mixed.info().layers[-1]
        self.assertEqual((last.first_layer, last.key_codec, last.value_codec), (1, pb.CODEC_Q8_0, pb.CODEC_TURBO3))
        with self.assertRaisesRegex(ValueError, "preset: unknown preset 'k9v9'"):
            self.client.create_session(LAYERS, KV, Q, D, preset="k9v9")
        with self.assertRaisesRegex(ValueError, r"layer_codecs\[0\] last_layer must be in \[0, 2\), got 2"):
            self.client.create_session(LAYERS, KV, Q, D, layer_codecs=[(0, 2, "f16", "f16")])

    def test_key_transform_and_sink_tokens(self):
        rng = np.random.default_rng(5)
        t = 64
        # Keys with a large component every token shares (as a Qwen model's).
        keys = (rng.normal(size=(KV, D)) * 30 + rng.normal(size=(t, KV, D))).astype(np.float32)
        values = rng.normal(size=(t, KV, D)).astype(np.float32)
        queries = rng.normal(size=(t, Q, D)).astype(np.float32)
        safe = self.client.create_session(LAYERS, KV, Q, D, key_codec="turbo3", value_codec="turbo3",
                                          key_transform="center_scale", sink_tokens=2, sink_codec="q8_0")
        self.assertEqual(safe.info().config.sink_tokens, 2)
        self.assertEqual(safe.info().config.sink_codec, pb.CODEC_Q8_0)
        safe.append(0, 0, keys, values, queries=queries)
        self.assertEqual(safe.info().transformed_layers, 1)
        plain = self.client.create_session(LAYERS, KV, Q, D, key_codec="turbo3", value_codec="turbo3",
                                           key_transform="none", sink_tokens=0)
        plain.append(0, 0, keys, values)
        self.assertEqual(plain.info().transformed_layers, 0)
        # What comes back is the keys sent, far closer with the transform.
        self.assertLess(rel(safe.read_kv(0)[0], keys), 0.3 * rel(plain.read_kv(0)[0], keys))
        with self.assertRaisesRegex(ValueError, "key_transform: unknown 'whiten'"):
            self.client.create_session(LAYERS, KV, Q, D, key_transform="whiten")
        with self.assertRaisesRegex(ValueError, "sink_codec: use one of f16, q8_0"):
            self.client.create_session(LAYERS, KV, Q, D, sink_codec="turbo3")
        with self.assertRaisesRegex(ValueError, "queries must have the keys' 64 tokens"):
            safe.append(1, 0, keys, values, queries=queries[:10])

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


class ResultsAndErrorsTest(DaemonTestCase):
    """Defects of issue 15: read_kv(None), read-only results, one exception
    type, client-side errors hidden behind UNKNOWN in a stream."""

    def setUp(self):
        self.rng = np.random.default_rng(3)

    def session(self, codec="f16", **kwargs):
        s = self.client.create_session(LAYERS, KV, Q, D, key_codec=codec, value_codec=codec, **kwargs)
        self.addCleanup(s.delete)
        return s

    def test_read_kv_of_every_layer(self):
        s = self.session()
        keys = self.rng.standard_normal((LAYERS, 40, KV, D)).astype(np.float16)
        values = self.rng.standard_normal((LAYERS, 40, KV, D)).astype(np.float16)
        s.append(None, 0, keys, values)
        stored_k, stored_v = s.read_kv(None)  # docs/API.md: no layer means every layer
        self.assertEqual(stored_k.shape, (LAYERS, 40, KV, D))
        np.testing.assert_array_equal(stored_k, keys.astype(np.float32))
        np.testing.assert_array_equal(stored_v, values.astype(np.float32))
        part, _ = s.read_kv(None, start=10, end=25, dtype=np.float16)
        self.assertEqual(part.dtype, np.float16)
        np.testing.assert_array_equal(part, keys[:, 10:25])
        s.append(0, 40, keys[0, :5], values[0, :5])  # layer 0 now holds 45 tokens, layer 1 40
        with self.assertRaisesRegex(ValueError, "layer 0: 45, layer 1: 40"):
            s.read_kv(None)
        self.assertEqual(s.read_kv(None, end=40)[0].shape, (LAYERS, 40, KV, D))
        empty = self.session()
        self.assertEqual(empty.read_kv(None)[0].shape, (LAYERS, 0, KV, D))

    def test_results_are_writable_arrays_of_their_own(self):
        s = self.session()
        keys = self.rng.standard_normal((20, KV, D), dtype=np.float32)
        s.append(0, 0, keys, keys)
        result = s.attend(0, self.rng.standard_normal((2, Q, D), dtype=np.float32), top_k=2)
        stored_k, stored_v = s.read_kv(0)
        _, stepped = s.step(0, 20, keys[0], keys[0], self.rng.standard_normal((Q, D), dtype=np.float32))
        with self.client.decode_stream() as stream:
            batch = stream.attend(0, [s], self.rng.standard_normal((1, Q, D), dtype=np.float32), [20])
        for array in (result.output, result.lse, result.top_k_tokens, result.top_k_logits, stored_k, stored_v,
                      stepped.output, batch.output, batch.lse):
            self.assertTrue(array.flags.writeable)
            array[...] = 0  # raised "assignment destination is read-only" before
        self.assertFalse(stored_v.any())
        self.assertEqual(stored_k.shape, (20, KV, D))

    def test_exceptions_by_code(self):
        with self.assertRaises(turbokv.SessionNotFound) as missing:
            self.client.session("no-such-session")
        self.assertIsInstance(missing.exception, LookupError)
        self.assertIsInstance(missing.exception, turbokv.TurbokvError)
        self.assertEqual(missing.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertIn("no-such-session", missing.exception.details)
        with self.assertRaises(turbokv.InvalidArgument) as bad:
            self.client.create_session(1, 1, 1, 100)
        self.assertIsInstance(bad.exception, ValueError)
        self.assertIn("config.shape.head_dim", bad.exception.details)
        s = self.session(max_tokens=16)
        keys = np.zeros((10, KV, D), dtype=np.float32)
        s.append(0, 0, keys, keys)
        with self.assertRaises(turbokv.FailedPrecondition):
            s.append(0, 12, keys[:4], keys[:4])  # a gap at 10, 11
        with self.assertRaises(turbokv.BudgetExceeded) as full:
            s.append(0, 10, keys, keys)  # 20 tokens past max_tokens 16
        self.assertEqual(full.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
        with self.client.decode_stream() as stream:
            batch = stream.attend(0, ["no-such-session"], np.zeros((1, Q, D), np.float32), [0])
        self.assertIsInstance(batch.errors[0], turbokv.SessionNotFound)
        self.assertIsInstance(self.client.prefetch(["no-such-session"])[0], turbokv.SessionNotFound)

    def test_a_bad_chunk_in_a_stream_raises_itself_and_the_chunks_before_it_stay(self):
        s = self.session()
        keys = self.rng.standard_normal((30, KV, D), dtype=np.float32)
        with self.assertRaisesRegex(TypeError, "keys must hold floating-point values"):  # was UNKNOWN: Exception iterating requests!
            s.append_stream([(0, 0, keys[:10], keys[:10]), (0, 10, keys[10:20], keys[10:20]),
                             (0, 20, keys[20:].astype(np.int32), keys[20:])])
        self.assertEqual(list(s.info().layer_tokens), [20, 0])

        def chunks():
            yield 1, 0, keys[:10], keys[:10]
            raise RuntimeError("the model failed")
        with self.assertRaisesRegex(RuntimeError, "the model failed"):
            s.append_stream(chunks())
        self.assertEqual(list(s.info().layer_tokens), [20, 10])
        with self.assertRaisesRegex(TypeError, "each chunk must be a tuple"):
            s.append_stream([[0, 20, keys, keys]])
        with self.assertRaisesRegex(ValueError, r"keys must be \[tokens, kv_heads=2, head_dim=128\], got shape \(30, 3, 128\)"):
            s.append(0, 20, np.zeros((30, 3, D), np.float32), np.zeros((30, 3, D), np.float32))

    def test_arguments_are_checked_before_anything_is_sent(self):
        s = self.session()
        keys = np.zeros((4, KV, D), np.float32)
        q = np.zeros((1, Q, D), np.float32)
        bad = [
            (ValueError, "layer must be in \\[0, 2\\), got 2", lambda: s.append(2, 0, keys, keys)),
            (ValueError, "start must be >= 0", lambda: s.append(0, -1, keys, keys)),
            (TypeError, "layer must be an integer", lambda: s.append(0.5, 0, keys, keys)),
            (ValueError, "keys and values must have one shape", lambda: s.append(0, 0, keys, keys[:2])),
            (ValueError, "layers=2", lambda: s.append(None, 0, keys, keys)),
            (ValueError, "queries must be \\[n, q_heads=8", lambda: s.attend(0, np.zeros((1, 4, D), np.float32))),
            (ValueError, "positions must be \\[n=1\\]", lambda: s.attend(0, q, positions=[0, 1])),
            (ValueError, "positions must be >= 0", lambda: s.attend(0, q, positions=[-1])),
            (ValueError, "top_k must be >= 0", lambda: s.attend(0, q, top_k=-1)),
            (ValueError, "softmax_scale must be finite", lambda: s.attend(0, q, softmax_scale=float("nan"))),
            (ValueError, "key must be \\[1, kv_heads=2, head_dim=128\\]", lambda: s.step(0, 0, keys, keys, q)),
            (TypeError, "dtype must be float32 or float16", lambda: s.read_kv(0, dtype=np.int8)),
            (ValueError, "end must be 0 \\(to the end\\) or >= start", lambda: s.read_kv(0, start=5, end=2)),
            (ValueError, "prefix_tokens must be >= 0", lambda: s.fork(-1)),
            (ValueError, "key_codec: unknown codec 'turbo9'", lambda: self.client.create_session(1, 1, 1, 64, "turbo9")),
            (ValueError, "layers must be >= 1", lambda: self.client.create_session(0, 1, 1, 64)),
            (ValueError, "timeout must be finite and >= 0", lambda: self.client.stats(timeout=-1)),
        ]
        sessions = len(self.client.list_sessions())
        for error, pattern, call in bad:
            with self.subTest(pattern):
                with self.assertRaisesRegex(error, pattern) as raised:
                    call()
                self.assertNotIsInstance(raised.exception, turbokv.TurbokvError)  # refused here, not by the daemon
        self.assertEqual(list(s.info().layer_tokens), [0, 0])
        self.assertEqual(len(self.client.list_sessions()), sessions)

    def test_version_is_the_projects(self):
        root = os.path.join(os.path.dirname(__file__), "..", "..", "..")
        with open(os.path.join(root, "CMakeLists.txt")) as f:
            project = re.search(r"project\(turbokv VERSION ([0-9.]+)", f.read()).group(1)
        with open(os.path.join(root, "client", "python", "pyproject.toml")) as f:
            package = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
        self.assertEqual(turbokv.__version__, project)
        self.assertEqual(package, project)


class DeadlineAndRetryTest(unittest.TestCase):
    def test_calls_have_a_deadline_by_default_and_per_call(self):
        default = inspect.signature(turbokv.Client).parameters["timeout"].default
        self.assertGreater(default, 0)  # None before: no deadline
        daemon = Daemon()
        self.addCleanup(daemon.close)
        client = turbokv.Client(daemon.target, timeout=0.5)
        self.addCleanup(client.close)
        client.wait_until_ready(20)
        daemon.pause()  # connected, then hung: calls wait for an answer that does not come
        try:
            with self.assertRaises(turbokv.DeadlineExceeded) as hung:  # hung for ever before
                client.stats()
            self.assertIsInstance(hung.exception, TimeoutError)
            self.assertEqual(hung.exception.attempts, 1)  # DEADLINE_EXCEEDED is not retried
            with self.assertRaises(turbokv.DeadlineExceeded):
                client.create_session(1, 1, 1, 64, timeout=0.2)
        finally:
            daemon.resume()
        self.assertGreaterEqual(client.stats(timeout=20).budget_bytes, 0)  # answers again
        self.assertEqual(daemon.stop(), 0)

    def test_unavailable_is_retried_for_idempotent_calls_only(self):
        folder, target = socket_target()  # nothing listens there
        self.addCleanup(folder.cleanup)
        client = turbokv.Client(target, retry=turbokv.RetryPolicy(max_attempts=3, initial_backoff=0.01,
                                                                  max_backoff=0.02))
        self.addCleanup(client.close)
        for call in (client.stats, client.list_sessions, lambda: client.get_session("x"),
                     lambda: client.prefetch(["x"])):
            with self.assertRaises(turbokv.Unavailable) as down:
                call()
            self.assertEqual(down.exception.attempts, 3)
            self.assertIsInstance(down.exception, ConnectionError)
        session = turbokv.Session(client, "x", pb.SessionConfig(
            shape=pb.ModelShape(layers=1, kv_heads=1, q_heads=1, head_dim=64)))
        for call, attempts in ((lambda: session.attend(0, np.zeros((1, 1, 64), np.float32)), 3),
                               (lambda: session.read_kv(0), 3),
                               (lambda: client.create_session(1, 1, 1, 64), 1),
                               (lambda: session.append(0, 0, np.zeros((1, 1, 64)), np.zeros((1, 1, 64))), 1),
                               (lambda: session.step(0, 0, np.zeros((1, 64)), np.zeros((1, 64)), np.zeros((1, 64))), 1),
                               (lambda: session.fork(0), 1), (lambda: session.truncate(0), 1),
                               (lambda: client.delete_session("x"), 1)):
            with self.assertRaises(turbokv.Unavailable) as down:
                call()
            self.assertEqual(down.exception.attempts, attempts)
        with self.assertRaisesRegex(turbokv.Unavailable, f"turbokvd at {re.escape(target)} not reachable"):
            client.wait_until_ready(0.1)

    def test_a_read_goes_through_once_the_daemon_is_up(self):
        at = socket_target()
        client = turbokv.Client(at[1], retry=turbokv.RetryPolicy(max_attempts=100, initial_backoff=0.05,
                                                                 max_backoff=0.2))
        with self.assertRaises(turbokv.Unavailable):
            client.stats(timeout=1)  # no daemon yet: tries until the deadline
        daemon = []
        starter = threading.Timer(0.2, lambda: daemon.append(Daemon(at=at)))
        starter.start()
        try:
            self.assertEqual(client.stats(timeout=60).sessions, 0)
        finally:
            starter.join()
            client.close()
            self.assertEqual(daemon[0].stop(), 0)
            daemon[0].close()


if __name__ == "__main__":
    unittest.main()
