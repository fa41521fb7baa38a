"""Runs examples/worker.py against the real turbokvd: the merged attention
must match full attention (tightly with f16, within codec error with turbo3),
for one sequence and for a batch through one Decode stream; so must
examples/worker_torch.py, its torch variant, when torch is installed."""

import os
import subprocess
import sys
import unittest

from daemon import Daemon

try:
    import torch
except ImportError:
    torch = None

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "worker.py")
TORCH_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "worker_torch.py")


class WorkerExampleTest(unittest.TestCase):
    def test_worker_offloads_and_merges(self):
        daemon = Daemon()
        try:
            for codec in ("f16", "turbo3"):
                run = subprocess.run([sys.executable, EXAMPLE, "--target", daemon.target, "--tokens", "320",
                                      "--codec", codec], capture_output=True, text=True, timeout=300)
                self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
                self.assertIn("offloaded to turbokvd", run.stdout)
            self.assertEqual(daemon.stop(), 0)
        finally:
            daemon.close()

    def test_worker_batch_mode_through_one_decode_stream(self):
        daemon = Daemon()
        try:
            for codec in ("f16", "turbo3"):  # the worker fails past the same bounds as above
                run = subprocess.run([sys.executable, EXAMPLE, "--target", daemon.target, "--tokens", "160",
                                      "--local", "32", "--chunk", "32", "--batch", "3", "--codec", codec],
                                     capture_output=True, text=True, timeout=300)
                self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
                self.assertIn("3 sequences in one Decode stream", run.stdout)
                self.assertIn("x 3 sequences", run.stdout)
            self.assertEqual(daemon.stop(), 0)
        finally:
            daemon.close()

    @unittest.skipIf(torch is None, "torch is not installed (Debian: python3-torch): worker_torch.py needs it")
    def test_torch_worker_with_bfloat16_tensors(self):
        daemon = Daemon()
        try:
            for codec, dtype in (("f16", "bfloat16"), ("turbo3", "bfloat16"), ("turbo3", "float32")):
                run = subprocess.run([sys.executable, TORCH_EXAMPLE, "--target", daemon.target, "--tokens", "200",
                                      "--local", "32", "--chunk", "32", "--codec", codec, "--dtype", dtype],
                                     capture_output=True, text=True, timeout=300)
                self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
                self.assertIn(f"{dtype} on ", run.stdout)
                self.assertIn("offloaded to turbokvd", run.stdout)
            self.assertEqual(daemon.stop(), 0)
        finally:
            daemon.close()


if __name__ == "__main__":
    unittest.main()
