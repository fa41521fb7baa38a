"""Client.decode_stream() against the real turbokvd: a Decode message over B
sessions gives exactly what B Step (or Attend) calls give on twin sessions
(same config, rotation seed and tokens); items fail alone; a malformed
message ends the stream."""

import unittest

import grpc
import numpy as np

import turbokv
from daemon import DaemonTestCase

LAYERS, KV, Q, D = 2, 2, 8, 128


class DecodeStreamTest(DaemonTestCase):
    def setUp(self):
        self.rng = np.random.default_rng(11)
        self.stream = self.client.decode_stream()
        self.addCleanup(self.stream.close)

    def twins(self, lengths, codec="turbo3"):
        """Two groups of sessions, one per length, twin by twin alike: one for
        Step or Attend, one for Decode."""
        groups = ([], [])
        for i, n in enumerate(lengths):
            keys, values = (self.rng.standard_normal((LAYERS, n, KV, D), dtype=np.float32) for _ in range(2))
            for group in groups:
                s = self.client.create_session(LAYERS, KV, Q, D, key_codec=codec, value_codec=codec,
                                               rotation_seed=100 + i)
                s.append(None, 0, keys, values)
                self.addCleanup(s.delete)
                group.append(s)
        return groups

    def random(self, *shape):
        return self.rng.standard_normal(shape, dtype=np.float32)

    def test_a_batch_step_equals_session_steps(self):
        lengths = [63, 64, 130]  # the new token starts a page, fills one, goes into one
        single, batch = self.twins(lengths)
        positions = np.array(lengths)
        for layer in (0, 1, 0, 1):
            keys, values, queries = self.random(3, KV, D), self.random(3, KV, D), self.random(3, Q, D)
            result = self.stream.step(layer, batch, keys, values, queries, positions, top_k=2)
            self.assertEqual(result.errors, [None] * 3)
            self.assertTrue(result.ok)
            self.assertEqual(result.session_ids, [s.id for s in batch])
            self.assertEqual(result.output.shape, (3, 1, Q, D))
            self.assertEqual(result.top_k_tokens.shape, (3, 1, Q, 2))
            for i, s in enumerate(single):
                tokens, expected = s.step(layer, int(positions[i]), keys[i], values[i], queries[i], top_k=2)
                self.assertEqual(result.tokens[i], tokens)
                np.testing.assert_array_equal(result.output[i], expected.output)
                np.testing.assert_array_equal(result.lse[i], expected.lse)
                np.testing.assert_array_equal(result.top_k_tokens[i], expected.top_k_tokens)
                np.testing.assert_array_equal(result.top_k_logits[i], expected.top_k_logits)
            if layer == 1:  # the next token
                positions = positions + 1
        for s, t in zip(batch, single):
            self.assertEqual(list(s.info().layer_tokens), list(t.info().layer_tokens))

    def test_k_queries_per_item_with_rank_4_tensors(self):
        lengths = [10, 64]
        single, batch = self.twins(lengths, codec="f16")
        keys, values, queries = self.random(2, 2, KV, D), self.random(2, 2, KV, D), self.random(2, 2, Q, D)
        result = self.stream.step(1, [s.id for s in batch], keys, values, queries, [[10, 11], [64, 65]], window=5)
        self.assertTrue(result.ok)
        self.assertEqual(result.output.shape, (2, 2, Q, D))
        self.assertEqual(result.lse.shape, (2, 2, Q))
        self.assertEqual(list(result.tokens), [12, 66])
        for i, s in enumerate(single):
            for j in range(2):
                _, expected = s.step(1, lengths[i] + j, keys[i, j], values[i, j], queries[i, j], window=5)
                np.testing.assert_array_equal(result.output[i, j], expected.output[0])
                np.testing.assert_array_equal(result.lse[i, j], expected.lse[0])
        # positions [B]: each item's first position; stored ones are acknowledged.
        again = self.stream.step(1, batch, keys, values, queries, [10, 64], window=5)
        np.testing.assert_array_equal(again.output, result.output)
        self.assertEqual(list(again.tokens), [12, 66])
        np.testing.assert_array_equal(again.item(1).output, result.output[1])

    def test_an_unknown_session_fails_alone(self):
        single, batch = self.twins([40, 50])
        keys, values, queries = self.random(3, KV, D), self.random(3, KV, D), self.random(3, Q, D)
        result = self.stream.step(0, [batch[0], "no-such-session", batch[1]], keys, values, queries, [40, 0, 50])
        self.assertFalse(result.ok)
        self.assertEqual(result.failed, 1)
        self.assertIsNone(result.errors[0])
        self.assertIsNone(result.errors[2])
        self.assertIsInstance(result.errors[1], turbokv.SessionNotFound)  # a TurbokvError by its code
        self.assertEqual(result.errors[1].code, grpc.StatusCode.NOT_FOUND)
        self.assertIn("no-such-session", result.errors[1].message)
        self.assertEqual(list(result.tokens), [41, 0, 51])
        self.assertFalse(result.output[1].any())
        self.assertTrue(np.isneginf(result.lse[1]).all())
        for i, item in ((0, 0), (1, 2)):
            _, expected = single[i].step(0, [40, 50][i], keys[item], values[item], queries[item])
            np.testing.assert_array_equal(result.output[item], expected.output)
            np.testing.assert_array_equal(result.lse[item], expected.lse)
        with self.assertRaises(turbokv.TurbokvError) as raised:
            result.raise_for_status()
        self.assertEqual(raised.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertTrue(self.stream.attend(0, batch, queries[:2], [40, 50]).ok)  # the stream goes on

    def test_attention_only(self):
        single, batch = self.twins([30, 90])
        queries = self.random(2, 3, Q, D)
        positions = [[0, 29, 10], [89, 64, 63]]
        result = self.stream.attend(1, batch, queries, positions, softcap=20.0, top_k=3)
        self.assertTrue(result.raise_for_status().ok)
        self.assertEqual(list(result.tokens), [30, 90])
        for i, s in enumerate(single):
            expected = s.attend(1, queries[i], positions=positions[i], softcap=20.0, top_k=3)
            np.testing.assert_array_equal(result.output[i], expected.output)
            np.testing.assert_array_equal(result.lse[i], expected.lse)
            np.testing.assert_array_equal(result.top_k_tokens[i], expected.top_k_tokens)
        self.assertEqual([list(s.info().layer_tokens) for s in batch], [[30, 30], [90, 90]])
        past = self.stream.attend(0, batch, queries[:, 0], [30, 89])
        self.assertEqual(past.errors[0].code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIsNone(past.errors[1])

    def test_pipelined_messages_are_answered_in_order(self):
        _, batch = self.twins([20, 20], codec="f16")
        queries = self.random(5, 2, Q, D)
        for n in range(5):
            self.stream.send(0, batch, queries[n], [n, 19 - n])
        self.assertEqual(self.stream.pending, 5)
        with self.assertRaises(RuntimeError):
            self.stream.attend(0, batch, queries[0], [0, 0])
        for n in range(5):
            expected = batch[0].attend(0, queries[n, :1], positions=[n])
            np.testing.assert_array_equal(self.stream.receive().output[0], expected.output)
        self.assertEqual(self.stream.pending, 0)

    def test_bad_arguments_raise_before_sending_and_a_malformed_message_ends_the_stream(self):
        _, batch = self.twins([8, 8])
        keys, queries = self.random(2, KV, D), self.random(2, Q, D)
        for args in ((batch, queries[:1], [8, 8]),  # queries for 1 session
                     (batch, queries, [8, 8, 8]),  # positions
                     (batch, queries, [8, -1]),
                     ([], queries[:0], [])):  # no sessions
            with self.assertRaises(ValueError):
                self.stream.attend(0, *args)
        for args in ((batch, queries, [8.0, 8.0]),  # positions of another dtype
                     (batch, queries.astype(np.int32), [8, 8]),
                     (["", batch[1]], queries, [8, 8])):
            with self.assertRaises(TypeError):
                self.stream.attend(0, *args)
        with self.assertRaises(ValueError):
            self.stream.attend(-1, batch, queries, [0, 0])
        with self.assertRaises(ValueError):
            self.stream.step(0, batch, keys, keys[:, None], queries, [8, 8])  # values of another rank
        with self.assertRaises(ValueError):
            self.stream.send(0, batch, queries, [8, 8], keys=keys)  # keys without values
        self.assertTrue(self.stream.step(0, batch, keys, keys, queries, [8, 8]).ok)
        odd = self.random(2, 3, D)  # 3 kv heads do not divide 8 q heads: the whole message is refused
        with self.assertRaises(turbokv.TurbokvError) as ended:
            self.stream.step(0, batch, odd, odd, queries, [9, 9])
        self.assertEqual(ended.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("keys.shape", ended.exception.message)
        with self.assertRaises(turbokv.TurbokvError) as later:
            self.stream.attend(0, batch, queries, [0, 0])
        self.assertEqual(later.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual([list(s.info().layer_tokens) for s in batch], [[9, 8], [9, 8]])

    def test_context_manager_and_float16(self):
        _, batch = self.twins([16], codec="f16")
        with self.client.decode_stream() as stream:
            key = self.random(1, KV, D).astype(np.float16)
            result = stream.step(0, batch, key, key, self.random(1, Q, D).astype(np.float16), [16])
            self.assertEqual(result.output.dtype, np.float32)
            self.assertEqual(list(result.tokens), [17])
        with self.assertRaises(RuntimeError):
            stream.attend(0, batch, self.random(1, Q, D), [0])


if __name__ == "__main__":
    unittest.main()
