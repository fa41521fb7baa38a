"""turbokv.vllm.TurbokvConnector end to end: vLLM's CPU build (.venv-vllm,
`make vllm-deps`) runs SmolLM2-135M through examples/vllm_offload.py, in its
own processes, against a real turbokvd. vLLM's own prefix cache is off, so a
run's cached tokens come from turbokvd only.

Skips, saying why, when .venv-vllm or the model directory is missing."""

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import unittest

from daemon import Daemon

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
EXAMPLE = os.path.join(HERE, "..", "examples", "vllm_offload.py")
EVENTS = os.path.join(HERE, "vllm_events.py")
ABORT = os.path.join(HERE, "vllm_abort.py")
PYTHON = os.environ.get("TURBOKV_VLLM_PYTHON", os.path.join(REPO, ".venv-vllm", "bin", "python"))
MODEL = os.path.join(REPO, ".models", "smollm2-135m")


def missing() -> str:
    if not os.path.exists(PYTHON):
        return f"no vLLM venv at {PYTHON} (make vllm-deps)"
    if not os.path.exists(os.path.join(MODEL, ".turbokv-model")):
        return f"no model directory {MODEL} (make vllm-deps)"
    return ""


@unittest.skipIf(missing(), missing())
class VllmConnectorTest(unittest.TestCase):
    def engine(self, target, *flags, env=None, script=EXAMPLE):
        """examples/vllm_offload.py (or `script`) in a process of its own: its runs as JSON."""
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            environment = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [os.environ.get("TURBOKV_PACKAGE_DIR", os.path.join(HERE, "..")), HERE]), **(env or {}))
            output = ["--json", out.name] if script == EXAMPLE else ["--out", out.name]
            text = [] if script == EXAMPLE else ["--text", os.path.join(REPO, "docs", "OPERATIONS.md")]
            run = subprocess.run([PYTHON, script, "--target", target, "--model", MODEL, *output, *text, *flags],
                                 capture_output=True, text=True, timeout=600, env=environment)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr[-6000:])
            with open(out.name) as f:
                result = json.load(f)
        result["stdout"], result["stderr"] = run.stdout, run.stderr
        return result

    def test_f16_prefix_is_reused_exactly_in_the_engine_and_by_a_fresh_one(self):
        daemon = Daemon()
        try:
            first = self.engine(daemon.target, "--check")
            self.assertIn("check passed", first["stdout"])
            cold, warm = first["runs"]
            self.assertEqual(cold["cached_tokens"], 0)
            # 1,000 prompt tokens: whole blocks of 128 (vLLM's) short of the last token.
            self.assertEqual(warm["cached_tokens"], 896)
            self.assertEqual(warm["tokens"], cold["tokens"])
            self.assertEqual(first["metrics"]["vllm:turbokv_loaded_tokens"], 896)
            self.assertEqual(first["metrics"]["vllm:turbokv_save_errors"], 0)
            fresh = self.engine(daemon.target, "--runs", "1")
            self.assertEqual(fresh["runs"][0]["cached_tokens"], 896)
            self.assertEqual(fresh["runs"][0]["tokens"], cold["tokens"])
            # Another salt: another engine's prefixes are not its own.
            other = self.engine(daemon.target, "--runs", "1", "--salt", "another deployment")
            self.assertEqual(other["runs"][0]["cached_tokens"], 0)
            self.assertEqual(other["runs"][0]["tokens"], cold["tokens"])
            self.assertEqual(daemon.stop(), 0)
        finally:
            daemon.close()

    def test_bf16_prefix_is_reused_exactly(self):
        daemon = Daemon()
        try:
            result = self.engine(daemon.target, "--dtype", "bfloat16", "--check")
            cold, warm = result["runs"]
            self.assertEqual(warm["cached_tokens"], 896)
            self.assertEqual(warm["tokens"], cold["tokens"])
        finally:
            daemon.close()

    def test_default_preset_keeps_the_first_tokens(self):
        daemon = Daemon()
        try:
            result = self.engine(daemon.target, "--codec", "k4v4", "--rotation-seed", "1")
            cold, warm = result["runs"]
            self.assertEqual(warm["cached_tokens"], 896)
            self.assertEqual(warm["tokens"][:8], cold["tokens"][:8])
            # The first token's distribution, renormalized over the tokens in both runs' top 20.
            common = sorted(set(cold["first_logprobs"]) & set(warm["first_logprobs"]))
            p = [math.exp(cold["first_logprobs"][t]) for t in common]
            q = [math.exp(warm["first_logprobs"][t]) for t in common]
            kl = sum(a / sum(p) * math.log((a / sum(p)) / (b / sum(q))) for a, b in zip(p, q))
            print(f"k4v4: first token KL {kl:.5f} over the {len(common)} tokens in both runs' top 20; "
                  f"{sum(a == b for a, b in zip(cold['tokens'], warm['tokens']))} of {len(cold['tokens'])} "
                  f"greedy tokens equal")
        finally:
            daemon.close()

    def test_a_wrong_layout_changes_the_output(self):
        daemon = Daemon()
        try:
            result = self.engine(daemon.target, "--connector", "vllm_faults:ScrambledLoadConnector")
            cold, warm = result["runs"]
            self.assertEqual(warm["cached_tokens"], 896)
            self.assertNotEqual(warm["tokens"], cold["tokens"])
        finally:
            daemon.close()

    def test_the_engine_steps_while_a_prefix_loads(self):
        daemon = Daemon()
        try:
            result = self.engine(daemon.target, "--connector", "vllm_faults:SteppingWhileLoadingConnector")
        finally:
            daemon.close()
        cold, warm = result["runs"]
        self.assertEqual(warm["cached_tokens"], 896, result["stderr"][-3000:])
        self.assertEqual(warm["tokens"], cold["tokens"])
        self.assertEqual(result["metrics"]["vllm:turbokv_load_errors"], 0)

    def test_a_request_aborted_while_it_loads_gives_its_blocks_back(self):
        daemon = Daemon()
        try:
            result = self.engine(daemon.target, script=ABORT)
        finally:
            daemon.close()
        self.assertTrue(result["load_started"])
        # vLLM holds the aborted request's 7 blocks until the load is
        # reported finished (its session is not deleted under the load).
        self.assertEqual(result["free_while_loading"], result["free_before"] - 7)
        self.assertEqual(result["free_after"], result["free_before"])
        self.assertEqual(result["again"]["cached_tokens"], 896)
        self.assertEqual(result["again"]["tokens"], result["first"]["tokens"])
        self.assertEqual(result["metrics"]["vllm:turbokv_load_errors"], 0)

    reference_tokens = None

    def reference(self):
        """The greedy tokens vLLM computes itself (no daemon where the connector looks)."""
        cls = type(self)
        if cls.reference_tokens is None:
            with tempfile.TemporaryDirectory() as folder:
                absent = self.engine(f"unix://{folder}/nothing-listens.sock")
            runs = absent["runs"]
            self.assertEqual([r["cached_tokens"] for r in runs], [0, 0])
            self.assertEqual(runs[0]["tokens"], runs[1]["tokens"])
            self.assertGreaterEqual(absent["metrics"]["vllm:turbokv_lookup_errors"], 1)
            self.assertIn("computes its prompt: turbokvd", absent["stderr"])
            cls.reference_tokens = runs[0]["tokens"]
        return cls.reference_tokens

    def test_an_absent_daemon_is_a_miss(self):
        self.assertEqual(len(self.reference()), 16)

    def test_a_daemon_killed_between_lookup_and_load_is_recomputed(self):
        daemon = Daemon()
        try:
            killed = self.engine(daemon.target, "--connector", "vllm_faults:KillDaemonBeforeLoadConnector",
                                 env={"TURBOKV_TEST_DAEMON_PID": str(daemon._process.pid)})
        finally:
            daemon.close()
        self.assertEqual([r["tokens"] for r in killed["runs"]], [self.reference()] * 2)
        self.assertGreaterEqual(killed["metrics"]["vllm:turbokv_load_errors"], 1)
        self.assertEqual(killed["metrics"]["vllm:turbokv_hits"], 0)
        self.assertIn("not loaded, vLLM computes them", killed["stderr"])

    def test_a_session_deleted_between_lookup_and_load_is_recomputed(self):
        daemon = Daemon()
        try:
            deleted = self.engine(daemon.target, "--connector", "vllm_faults:DeleteBeforeLoadConnector")
        finally:
            daemon.close()
        self.assertEqual([r["tokens"] for r in deleted["runs"]], [self.reference()] * 2)
        self.assertGreaterEqual(deleted["metrics"]["vllm:turbokv_load_errors"], 1)

    def test_a_paused_daemon_is_a_miss_after_the_timeout(self):
        daemon = Daemon()
        try:
            socket = daemon.target[len("unix://"):]
            deadline = time.monotonic() + 30
            while not os.path.exists(socket) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertTrue(os.path.exists(socket), daemon.log())
            daemon.pause()
            paused = self.engine(daemon.target)
            daemon.resume()
        finally:
            daemon.close()
        self.assertEqual([r["tokens"] for r in paused["runs"]], [self.reference()] * 2)
        self.assertGreaterEqual(paused["metrics"]["vllm:turbokv_lookup_errors"], 1)
        # A daemon that hangs before the connection is up: gRPC gives up on the connection.
        self.assertIn("computes its prompt: turbokvd", paused["stderr"])
        self.assertIn("timed out", paused["stderr"])

    def test_a_layout_it_cannot_learn_turns_it_off(self):
        daemon = Daemon()
        try:
            off = self.engine(daemon.target, "--connector", "vllm_faults:UnknownLayoutConnector")
        finally:
            daemon.close()
        self.assertEqual([r["tokens"] for r in off["runs"]], [self.reference()] * 2)
        self.assertEqual([r["cached_tokens"] for r in off["runs"]], [0, 0])
        self.assertEqual(off["metrics"].get("vllm:turbokv_saved_tokens", 0), 0)
        self.assertIn("off for this engine, every load fails over to computing: vLLM's KV buffer: "
                      "this test's buffer", off["stderr"])

    def test_vllms_events_and_turbokvds_name_the_same_blocks(self):
        # Issue 53 item 3: vLLM's stream (its own blocks, and the connector's
        # stores through take_events) and turbokvd's, both decoded with
        # vLLM's decoder, carry the same integers for the prompt's blocks
        # (turbokvd's names are vLLM's hashes after 16 bytes of the salt's).
        with tempfile.TemporaryDirectory() as folder:
            daemon = Daemon(f"--kv-events-endpoint=ipc://{folder}/turbokvd-events", "--kv-events-hashes=int")
            try:
                streams = self.engine(daemon.target, "--daemon-events", f"ipc://{folder}/turbokvd-events",
                                      script=EVENTS)
            finally:
                daemon.close()

        def stored(stream):
            media = {}
            for batch in streams[stream]:
                self.assertEqual(batch["dp_rank"], 0)
                for event in batch["events"]:
                    if event["type"] == "BlockStored":
                        media.setdefault(event["medium"], []).append(event)
            return media

        engine, daemon_media = stored("vllm"), stored("turbokvd")
        self.assertEqual(set(daemon_media), {"memory"}, streams["turbokvd"])
        self.assertIn("memory", engine, streams["vllm"])  # the connector's stores, as turbokvd's medium
        own = [m for m in engine if m != "memory"]
        self.assertEqual(len(own), 1, sorted(engine))

        def chain(events):
            hashes = [h for e in events for h in e["hashes"]]
            self.assertTrue(all(isinstance(h, int) for h in hashes))
            self.assertIsNone(events[0]["parent"])
            for before, after in zip(events, events[1:]):
                self.assertEqual(after["parent"], before["hashes"][-1])
            return hashes

        # 1,000 prompt and 16 generated tokens: 15 full blocks of 64.
        vllms = chain(engine[own[0]])
        self.assertEqual(len(vllms), 15)
        self.assertEqual(chain(engine["memory"]), vllms)
        self.assertEqual(chain(daemon_media["memory"]), vllms)
        for event in engine["memory"]:
            self.assertEqual((event["block_size"], event["tokens"]), (64, 64 * len(event["hashes"])))


if __name__ == "__main__":
    unittest.main()
