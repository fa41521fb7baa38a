"""torch tensors in and out against the real turbokvd: float32, float16 and
bfloat16 CPU tensors (CUDA ones when a GPU is there), results as torch tensors
on the input's device, and the package working without torch."""

import os
import subprocess
import sys
import unittest

import numpy as np

from daemon import DaemonTestCase

try:
    import torch
except ImportError:
    torch = None

LAYERS, KV, Q, D = 2, 2, 8, 64


def exact(shape, generator):
    """Values exact in float16 and bfloat16 alike: multiples of 1/16 in [-4, 4)."""
    return torch.randint(-64, 64, shape, generator=generator).float() / 16


class WithoutTorchTest(unittest.TestCase):
    def test_the_package_never_imports_torch_itself(self):
        code = ("import sys, numpy as np, turbokv, turbokv.aio\n"
                "turbokv.merge_attention(turbokv.AttentionResult(np.zeros((1, 1, 64), np.float32), np.zeros((1, 1))),"
                " turbokv.AttentionResult(np.zeros((1, 1, 64), np.float32), np.zeros((1, 1))))\n"
                "assert 'torch' not in sys.modules, 'turbokv imported torch'\n")
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
        self.assertEqual(run.returncode, 0, run.stderr)


@unittest.skipIf(torch is None, "torch is not installed (Debian: python3-torch)")
class TorchTest(DaemonTestCase):
    def setUp(self):
        self.generator = torch.Generator().manual_seed(5)

    def session(self):
        s = self.client.create_session(LAYERS, KV, Q, D, key_codec="f16", value_codec="f16")
        self.addCleanup(s.delete)
        return s

    def test_float32_float16_bfloat16_in_give_what_numpy_gives(self):
        keys, values = exact((LAYERS, 48, KV, D), self.generator), exact((LAYERS, 48, KV, D), self.generator)
        queries = exact((3, Q, D), self.generator)
        reference = self.session()
        reference.append(None, 0, keys.numpy(), values.numpy())
        expected = reference.attend(1, queries.numpy(), positions=[10, 30, 47], top_k=2)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):  # bf16 raised TypeError before
            with self.subTest(dtype=dtype):
                s = self.session()
                self.assertEqual(s.append_stream((None, start, keys[:, start:start + 16].to(dtype),
                                                  values[:, start:start + 16].to(dtype)) for start in (0, 16, 32)), 48)
                result = s.attend(1, queries.to(dtype), positions=torch.tensor([10, 30, 47]), top_k=2)
                self.assertIsInstance(result.output, torch.Tensor)
                self.assertEqual(result.output.dtype, torch.float32)
                self.assertEqual(result.top_k_tokens.dtype, torch.int64)
                np.testing.assert_array_equal(result.output.numpy(), expected.output)
                np.testing.assert_array_equal(result.lse.numpy(), expected.lse)
                np.testing.assert_array_equal(result.top_k_tokens.numpy(), expected.top_k_tokens)
                result.output[0, 0, 0] = 1.0  # writable, the caller's own
                stored_k, stored_v = s.read_kv(None, dtype=dtype)
                self.assertEqual(stored_k.dtype, dtype)
                self.assertTrue(torch.equal(stored_k, keys.to(dtype)))
                self.assertTrue(torch.equal(stored_v, values.to(dtype)))

    def test_step_and_decode_stream_take_torch(self):
        s = self.session()
        keys = exact((LAYERS, 8, KV, D), self.generator)
        s.append(None, 0, keys, keys)
        key, query = exact((KV, D), self.generator).bfloat16(), exact((Q, D), self.generator).bfloat16()
        tokens, stepped = s.step(0, 8, key, key, query)
        self.assertEqual(tokens, 9)
        self.assertEqual(tuple(stepped.output.shape), (1, Q, D))
        with self.client.decode_stream() as stream:
            batch = stream.attend(0, [s], query[None], [8]).raise_for_status()
        self.assertIsInstance(batch.output, torch.Tensor)
        self.assertTrue(torch.equal(batch.output[0], stepped.output))
        with self.assertRaisesRegex(TypeError, "keys must be a floating-point tensor"):
            s.append(0, 9, torch.zeros((1, KV, D), dtype=torch.int32), torch.zeros((1, KV, D)))
        with self.assertRaisesRegex(ValueError, "keys must be"):
            s.append(0, 9, torch.zeros((1, KV + 1, D)), torch.zeros((1, KV + 1, D)))
        numpy_keys, _ = s.read_kv(0)
        self.assertIsInstance(numpy_keys, np.ndarray)  # numpy dtype: numpy out
        self.assertIsInstance(s.read_kv(0, device="cpu")[0], torch.Tensor)

    @unittest.skipUnless(torch is not None and torch.cuda.is_available(), "no CUDA device for torch")
    def test_cuda_tensors_go_through_the_host_and_come_back_on_their_device(self):
        s = self.session()
        keys = exact((16, KV, D), self.generator).cuda().half()
        s.append(0, 0, keys, keys)
        result = s.attend(0, exact((2, Q, D), self.generator).cuda())
        self.assertEqual(result.output.device, keys.device)
        stored, _ = s.read_kv(0, dtype=torch.float16, device=keys.device)
        self.assertTrue(torch.equal(stored, keys))


if __name__ == "__main__":
    unittest.main()
