"""turbokv.merge_attention without a daemon: exact, and defined when a side is
empty (an empty local window at the start of decode, a failed batch item)."""

import unittest

import numpy as np

import turbokv

try:
    import torch
except ImportError:
    torch = None


def result(rng, lse=None):
    output = rng.standard_normal((3, 4, 8)).astype(np.float32)
    return turbokv.AttentionResult(output=output, lse=rng.standard_normal((3, 4)).astype(np.float32)
                                   if lse is None else np.full((3, 4), lse, np.float32))


class MergeAttentionTest(unittest.TestCase):
    def setUp(self):
        self.rng = np.random.default_rng(1)

    def test_two_empty_sides_give_zeros_and_minus_infinity(self):
        empty = result(self.rng, -np.inf)
        empty.output[...] = np.nan  # what a softmax over no tokens computes; never read
        merged = turbokv.merge_attention(empty, empty)  # NaN before
        np.testing.assert_array_equal(merged.output, np.zeros((3, 4, 8), np.float32))
        self.assertTrue(np.isneginf(merged.lse).all())

    def test_one_empty_side_gives_the_other_exactly(self):
        empty, full = result(self.rng, -np.inf), result(self.rng)
        empty.output[...] = np.nan
        for merged in (turbokv.merge_attention(empty, full), turbokv.merge_attention(full, empty)):
            np.testing.assert_array_equal(merged.output, full.output)
            np.testing.assert_array_equal(merged.lse, full.lse)

    def test_weights_follow_the_log_sum_exps(self):
        a, b = result(self.rng), result(self.rng)
        merged = turbokv.merge_attention(a, b)
        wa = 1 / (1 + np.exp(b.lse - a.lse))
        np.testing.assert_allclose(merged.output, wa[..., None] * a.output + (1 - wa[..., None]) * b.output,
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(merged.lse, np.logaddexp(a.lse, b.lse), rtol=1e-6)
        with self.assertRaisesRegex(ValueError, "one shape"):
            turbokv.merge_attention(a, turbokv.AttentionResult(output=a.output[:1], lse=a.lse[:1]))

    @unittest.skipIf(torch is None, "torch is not installed (Debian: python3-torch)")
    def test_torch_results_merge_as_numpy_ones(self):
        a, b, empty = result(self.rng), result(self.rng), result(self.rng, -np.inf)
        expected = turbokv.merge_attention(a, b)
        as_torch = [turbokv.AttentionResult(output=torch.from_numpy(r.output), lse=torch.from_numpy(r.lse))
                    for r in (a, b, empty)]
        merged = turbokv.merge_attention(as_torch[0], as_torch[1])
        self.assertIsInstance(merged.output, torch.Tensor)
        np.testing.assert_allclose(merged.output.numpy(), expected.output, rtol=1e-6, atol=1e-7)
        both_empty = turbokv.merge_attention(as_torch[2], as_torch[2])
        self.assertFalse(both_empty.output.any())
        self.assertTrue(torch.isneginf(both_empty.lse).all())
        self.assertTrue(torch.equal(turbokv.merge_attention(as_torch[2], as_torch[0]).output, as_torch[0].output))


if __name__ == "__main__":
    unittest.main()
