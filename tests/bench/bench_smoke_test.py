"""Every turbokv-bench subcommand once, on a small shape and a model-sized
one: each exits 0 and prints valid JSON with the fields the README tables
are made from. Timings are not checked (benchmarks measure, tests assert)."""

import json
import os
import subprocess
import unittest

BENCH = os.environ["TURBOKV_BENCH"]

MODEL = ["--kv-heads", "8", "--q-heads", "32", "--head-dim", "128"]
RUNS = {
    "codec_small": (["codec", "--codec", "turbo2", "--head-dim", "64", "--vectors", "100"], "rel_mse"),
    "codec_model": (["codec", "--codec", "turbo3", "--head-dim", "128", "--vectors", "20000"], "rel_mse"),
    "attend_small": (["attend", "--k-codec", "q8_0", "--v-codec", "turbo4", "--tokens", "100", "--kv-heads", "1",
                      "--q-heads", "2", "--head-dim", "64"], "us_per_call"),
    "attend_model": (["attend", "--k-codec", "turbo3", "--v-codec", "turbo3", "--tokens", "4096", "--threads", "2"]
                     + MODEL, ("speedup_vs_f16", "multiply_add_floor_us")),
    "e2e_small": (["e2e", "--tokens", "64", "--layers", "2", "--kv-heads", "2", "--q-heads", "4", "--calls", "10"],
                  "step_p50_us"),
    # 32 layers: one all-layers chunk is larger than the old 4M-value input pool.
    "e2e_model": (["e2e", "--tokens", "128", "--layers", "32", "--calls", "10"] + MODEL, "step_p50_us"),
    "e2e_batch_small": (["e2e", "--batch", "2", "--tokens", "32", "--layers", "2", "--kv-heads", "2", "--q-heads",
                         "4", "--steps", "1"], "service_overhead"),
    "e2e_batch_model": (["e2e", "--batch", "4", "--tokens", "64", "--layers", "32", "--steps", "1"] + MODEL,
                        "decode_speedup_over_unary"),
    "quality_small": (["quality", "--layers", "8", "--kv-heads", "1", "--q-heads", "2", "--head-dim", "64",
                       "--tokens", "256", "--queries", "1", "--sample-layers", "1"], "bits_per_value"),
    "prefix_small": (["prefix", "--sessions", "3", "--tokens", "256", "--layers", "2", "--kv-heads", "2",
                      "--q-heads", "4"], "memory_ratio"),
}


# takeover starts a redis-server of its own (make deps installs it) and this
# build's turbokvd.
REDIS_SERVER = "/usr/bin/redis-server"
TAKEOVER_SMALL = (["takeover", "--layers", "2", "--tokens", "256", "--repeats", "1", "--seconds", "1"],
                  "step_p99_paused_over_answering")


class BenchSmokeTest(unittest.TestCase):
    pass


def _make(name, args, field):
    def test(self):
        run = subprocess.run([BENCH] + args + ["--json"], capture_output=True, text=True, timeout=240)
        self.assertEqual(run.returncode, 0, f"{name}: exit {run.returncode}\n{run.stderr}")
        lines = [line for line in run.stdout.splitlines() if line.strip()]
        self.assertTrue(lines, f"{name}: no output")
        for line in lines:
            record = json.loads(line)
            for key in (field,) if isinstance(field, str) else field:
                self.assertIn(key, record)
    return test


for _name, (_args, _field) in RUNS.items():
    setattr(BenchSmokeTest, "test_" + _name, _make(_name, _args, _field))
BenchSmokeTest.test_takeover_small = unittest.skipUnless(
    os.access(REDIS_SERVER, os.X_OK), f"{REDIS_SERVER} is not installed (make deps installs it)")(
        _make("takeover_small", *TAKEOVER_SMALL))

if __name__ == "__main__":
    unittest.main()
