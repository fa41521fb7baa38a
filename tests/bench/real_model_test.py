"""bench/real_model.py's forward pass on tiny random models (no weights to
download): RoPE of both layouts, the wiring through a real turbokvd (the
f16 codec gives the logits of local float attention), decoding through the
Decode stream equal to a whole prefill, and a compressed codec close to f16;
--print-gguf assembling a model's parts. The real-model runs themselves are
benchmarks (README "Choosing a codec")."""

import contextlib
import hashlib
import importlib
import io
import os
import sys
import tempfile
import unittest
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import real_model as rm  # noqa: E402

import turbokv  # noqa: E402


def tiny_model(arch: str, head_dim: int, seed: int) -> rm.Model:
    """Two layers, GQA 2 kv / 4 q heads, random weights of a trained model's scale."""
    rng = np.random.default_rng(seed)
    q_heads, kv_heads, hidden, ffn, vocab = 4, 2, 4 * head_dim, 96, 300
    config = rm.Config(arch=arch, layers=2, hidden=hidden, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                       ffn=ffn, vocab=vocab, rope_theta=10000.0, rms_eps=1e-6,
                       rope_style="neox" if arch == "qwen2" else "interleaved")

    def w(*shape):
        return (rng.normal(size=shape) / np.sqrt(shape[-1])).astype(np.float32)

    def bias(n, scale):
        return (rng.normal(size=n) * scale).astype(np.float32) if arch == "qwen2" else None

    layers = [rm.Layer(attn_norm=np.ones(hidden, np.float32), wq=w(q_heads * head_dim, hidden),
                       wk=w(kv_heads * head_dim, hidden), wv=w(kv_heads * head_dim, hidden),
                       # Qwen-like: a large key bias every token shares.
                       bq=bias(q_heads * head_dim, 0.5), bk=bias(kv_heads * head_dim, 5.0),
                       bv=bias(kv_heads * head_dim, 0.1), wo=w(hidden, q_heads * head_dim),
                       ffn_norm=np.ones(hidden, np.float32), w_gate=w(ffn, hidden), w_up=w(ffn, hidden),
                       w_down=w(hidden, ffn))
              for _ in range(config.layers)]
    embed = rng.normal(size=(vocab, hidden)).astype(np.float32)
    return rm.Model(config, rm.Weights(embed=embed, layers=layers, norm=np.ones(hidden, np.float32), output=embed))


class RopeTest(unittest.TestCase):
    def test_scores_depend_on_the_distance_only(self):
        rng = np.random.default_rng(1)
        q, k = rng.normal(size=(1, 1, 64)).astype(np.float32), rng.normal(size=(1, 1, 64)).astype(np.float32)
        for style in ("neox", "interleaved"):
            def score(m, n):
                return float((rm.rope(q, np.array([m]), 10000.0, style) * rm.rope(k, np.array([n]), 10000.0, style)).sum())
            self.assertAlmostEqual(score(7, 3), score(107, 103), places=3)
            self.assertNotAlmostEqual(score(7, 3), score(7, 4), places=3)

    def test_interleaved_on_permuted_channels_is_neox(self):
        # GGUF's llama converter permutes q and k so that rotating pairs
        # (2i, 2i+1) equals rotating halves (i, i + d/2) of the original.
        rng = np.random.default_rng(2)
        x = rng.normal(size=(5, 2, 64)).astype(np.float32)
        positions = np.arange(10, 15)
        order = np.stack([np.arange(32), np.arange(32) + 32], axis=1).reshape(-1)  # 0, 32, 1, 33, ...
        neox = rm.rope(x, positions, 10000.0, "neox")
        interleaved = rm.rope(x[..., order], positions, 10000.0, "interleaved")
        np.testing.assert_allclose(interleaved, neox[..., order], atol=1e-5)


class ThroughTurbokvdTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = rm.Daemon(threads=2)
        cls.client = turbokv.Client(cls.daemon.target, timeout=120.0)
        cls.client.wait_until_ready(30)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.daemon.close()

    def test_f16_through_turbokvd_gives_the_logits_of_local_attention(self):
        tokens = list(np.random.default_rng(3).integers(0, 300, size=150))
        for arch, head_dim in (("qwen2", 64), ("llama", 128)):
            model = tiny_model(arch, head_dim, 4)
            local = model.logits(rm.run_sequence(model, tokens, rm.LocalAttention(np.float16)))
            served = model.logits(rm.run_sequence(
                model, tokens, rm.ServiceAttention(self.client, rm.config_options("f16")), prefill_block=64))
            span = float(local.max() - local.min())
            self.assertLess(float(np.abs(local - served).max()), 1e-3 * span, arch)

    def test_decoding_through_the_decode_stream_equals_a_whole_prefill(self):
        model = tiny_model("qwen2", 64, 5)
        prompt = list(np.random.default_rng(6).integers(0, 300, size=40))
        attention = rm.ServiceAttention(self.client, rm.config_options("f16"))
        generated = rm.greedy(model, prompt, attention, steps=6, prefill_block=16)
        # The same tokens fed whole: each next token is the argmax there too.
        whole = model.logits(rm.run_sequence(model, prompt + generated[:-1], rm.LocalAttention(np.float16)))
        self.assertEqual([int(t) for t in whole[len(prompt) - 1:].argmax(-1)], generated)

    def test_compressed_codecs_stay_close_to_f16(self):
        model = tiny_model("qwen2", 64, 7)
        tokens = list(np.random.default_rng(8).integers(0, 300, size=200))
        f16 = model.logits(rm.run_sequence(model, tokens, rm.ServiceAttention(self.client, rm.config_options("f16"))))
        cosine = {}
        for name in ("turbo4", "turbo3", "turbo4:none+sinks=0"):
            logits = model.logits(rm.run_sequence(
                model, tokens, rm.ServiceAttention(self.client, rm.config_options(name)), prefill_block=64))
            cosine[name] = float((logits * f16).sum() / np.linalg.norm(logits) / np.linalg.norm(f16))
        self.assertGreater(cosine["turbo4"], 0.99, cosine)
        self.assertGreater(cosine["turbo3"], 0.97, cosine)
        # The key bias every token shares: the transform is what keeps turbo4 close.
        self.assertGreater(cosine["turbo4"], cosine["turbo4:none+sinks=0"], cosine)

    def test_scores_compare_distributions(self):
        ref = rm.log_softmax(np.array([[2.0, 1.0, 0.0]]))
        same, other = rm.Scores(), rm.Scores()
        same.add(ref, ref, np.array([0]))
        other.add(rm.log_softmax(np.array([[0.0, 1.0, 2.0]])), ref, np.array([0]))
        self.assertAlmostEqual(same.kl, 0.0)
        self.assertEqual(same.top1, 1)
        self.assertGreater(other.kl, 0.5)
        self.assertEqual(other.top1, 0)
        self.assertGreater(other.summary(same)["ppl_delta_pct"], 100.0)


class GgufFileTest(unittest.TestCase):
    def test_print_gguf_assembles_the_parts_once_and_prints_the_path(self):
        # A model split across two packages of two data files each, as the real ones are.
        folder = tempfile.TemporaryDirectory(prefix="turbokv-gguf-")
        self.addCleanup(folder.cleanup)
        parts = [[b"GGUF" + bytes(range(60)), b"\x01" * 30], [b"\x02" * 20, b"\x03" * 10]]
        for i, files in enumerate(parts, 1):
            data = os.path.join(folder.name, "packages", f"turbokv_test_model_part{i}", "data")
            os.makedirs(data)
            open(os.path.join(data, "..", "__init__.py"), "w").close()
            for j, content in enumerate(files):
                with open(os.path.join(data, f"model.gguf.{j:02d}"), "wb") as f:
                    f.write(content)
        whole = b"".join(b"".join(files) for files in parts)
        sys.path.insert(0, os.path.join(folder.name, "packages"))
        self.addCleanup(sys.path.remove, os.path.join(folder.name, "packages"))
        importlib.invalidate_caches()
        source = rm.ModelSource("test-model", "two parts", ("part1", "part2"),
                                ("turbokv_test_model_part1", "turbokv_test_model_part2"),
                                hashlib.sha256(whole).hexdigest(), "none")
        cache = os.path.join(folder.name, "cache")
        with mock.patch.dict(rm.MODELS, {"test-model": source}):
            for _ in range(2):  # assembled once, then found
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    self.assertEqual(rm.main(["--model", "test-model", "--print-gguf", "--cache-dir", cache]), 0)
                self.assertEqual(printed.getvalue(), os.path.join(cache, "test-model.gguf") + "\n")
                with open(os.path.join(cache, "test-model.gguf"), "rb") as f:
                    self.assertEqual(f.read(), whole)
            self.assertEqual(os.listdir(cache), ["test-model.gguf"])


if __name__ == "__main__":
    unittest.main()
