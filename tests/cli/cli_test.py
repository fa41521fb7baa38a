"""The `turbokv` CLI binary against a real turbokvd on a unix socket: strict
flags (exit 2 naming the flag), per-command help, --timeout against a dead
target, --output json parsed with every field and int64s as numbers, and the
documented exit statuses. Needs $TURBOKVD and $TURBOKV_CLI."""

import json
import os
import subprocess
import tempfile
import time
import unittest

CLI = os.environ.get("TURBOKV_CLI", "")
TURBOKVD = os.environ.get("TURBOKVD", "")
BUDGET = 1 << 30


class CliTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="turbokv-cli-")
        cls.target = f"unix://{cls.tmp.name}/turbokv.sock"
        cls.log = open(os.path.join(cls.tmp.name, "turbokvd.log"), "w+")
        cls.daemon = subprocess.Popen([TURBOKVD, f"--listen={cls.target}", "--device=cpu", "--threads=1",
                                       "--memory-budget=1GiB", "--metrics-listen=127.0.0.1:0",
                                       f"--snapshot-dir={cls.tmp.name}/snapshots"], stderr=cls.log)
        # The CLI waits (--wait) for the daemon to come up, within its --timeout.
        ready = cls.run_cli(cls, "stats", "--timeout=30s", "--wait")
        if ready.returncode != 0:
            cls.tearDownClass()
            raise RuntimeError(f"turbokvd did not come up: {ready.stderr}")

    @classmethod
    def tearDownClass(cls):
        cls.daemon.terminate()
        cls.daemon.wait(timeout=60)
        cls.log.close()
        cls.tmp.cleanup()

    def run_cli(self, *args, target=None):
        return subprocess.run([CLI, f"--target={target or self.target}", *args], capture_output=True, text=True,
                              timeout=120)

    def ok(self, *args):
        out = self.run_cli(*args)
        self.assertEqual(out.returncode, 0, f"turbokv {' '.join(args)}: {out.stderr}")
        return out.stdout

    def json(self, *args):
        return json.loads(self.ok(*args, "--output=json"))

    def usage_error(self, args, *named):
        out = self.run_cli(*args)
        self.assertEqual(out.returncode, 2, f"turbokv {' '.join(args)}: {out.stdout} {out.stderr}")
        for text in named:
            self.assertIn(text, out.stderr)
        return out.stderr

    def session(self, *flags):
        return self.ok("create", "--layers=2", "--kv-heads=2", "--q-heads=4", "--head-dim=128", *flags).strip()

    def sessions(self):
        return {s["session_id"] for s in self.json("list")["sessions"]}

    def test_an_unknown_flag_exits_2_naming_it_and_does_nothing(self):
        before = self.ok("list").splitlines()
        stderr = self.usage_error(["create", "--layer", "2"], "unknown flag --layer", "did you mean --layers?")
        self.assertNotIn("warning", stderr)
        self.assertEqual(self.ok("list").splitlines(), before)  # no session was made
        self.usage_error(["stats", "--layers=2"], "unknown flag --layers")
        self.usage_error(["list", "-x"], "-x")
        # Rejected before any call: a dead target is not even tried.
        out = self.run_cli("create", "--layer=2", target=f"unix://{self.tmp.name}/nobody.sock")
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("unknown flag --layer", out.stderr)

    def test_bad_values_exit_2_with_the_range(self):
        session = self.session()
        self.usage_error(["append-random", session, "--chunk", "0"], "--chunk=0", "from 1 to")
        self.usage_error(["append-random", session, "--tokens", "-5"], "--tokens=-5", "from 1 to")
        self.usage_error(["append-random", session, "--tokens=many"], "--tokens=many", "not an integer")
        self.usage_error(["attend-random", session, "--layer", "-3"], "--layer=-3", "from 0 to")
        self.usage_error(["append-random", session, "--layer=2"], "--layer=2", "the session has 2 layers")
        self.usage_error(["attend-random", session, "--layer=5"], "--layer=5", "the session has 2 layers")
        self.usage_error(["create", "--layers=0"], "--layers=0", "from 1 to 1024")
        self.usage_error(["create", "--head-dim=8192"], "--head-dim=8192", "from 64 to 4096")
        self.usage_error(["create", "--key-codec=turbo9"], "--key-codec=turbo9", "turbo3")
        self.usage_error(["create", "--ttl=-1s"], "--ttl=-1s")
        self.usage_error(["create", "--pinned=maybe"], "--pinned=maybe", "true or false")
        self.usage_error(["stats", "--timeout=5"], "--timeout=5", "duration")
        self.usage_error(["stats", "--timeout=0s"], "--timeout=0s", "from 1ms")
        self.usage_error(["stats", "--output=yaml"], "--output=yaml", "table or json")
        self.usage_error(["create", "--layers=2", "--layers=3"], "--layers is given twice")
        self.usage_error(["get"], "expected one session id")
        self.usage_error(["list", "extra"], "takes no arguments")
        self.usage_error(["frobnicate"], "unknown command 'frobnicate'")
        # A value only the daemon can judge: INVALID_ARGUMENT is a usage error too.
        self.usage_error(["create", "--head-dim=96"], "INVALID_ARGUMENT", "head_dim")
        self.usage_error(["create", "--key-transform=whiten"], "--key-transform=whiten", "center_scale")
        self.usage_error(["create", "--sink-tokens=65"], "--sink-tokens=65")
        self.usage_error(["create", "--sink-codec=turbo3"], "INVALID_ARGUMENT", "sink_codec")
        # None of them stored anything.
        self.assertEqual(self.json("get", session)["layer_tokens"], [0, 0])
        self.assertEqual(self.sessions() & {session}, {session})

    def test_a_dead_target_fails_within_the_timeout(self):
        for target in (f"unix://{self.tmp.name}/nobody.sock", "127.0.0.1:1"):
            start = time.monotonic()
            out = self.run_cli("stats", "--timeout=1s", "--wait", target=target)
            elapsed = time.monotonic() - start
            self.assertEqual(out.returncode, 3, out.stderr)
            self.assertRegex(out.stderr, "DEADLINE_EXCEEDED|UNAVAILABLE")
            self.assertIn(target, out.stderr)
            self.assertLess(elapsed, 10, out.stderr)  # it waited a fixed 30 s
        # Without --wait a unix socket that is not there fails at once, naming
        # it, the bare path too (a unix socket, never a host name).
        for target in (f"unix://{self.tmp.name}/nobody.sock", f"{self.tmp.name}/nobody.sock"):
            start = time.monotonic()
            out = self.run_cli("stats", target=target)
            self.assertEqual(out.returncode, 3, out.stderr)
            self.assertIn(f"UNAVAILABLE: no socket at {self.tmp.name}/nobody.sock", out.stderr)
            self.assertLess(time.monotonic() - start, 1.0, out.stderr)
        # With it, a daemon that comes up while the CLI waits is reached.
        late = f"unix://{self.tmp.name}/late.sock"
        waiting = subprocess.Popen([CLI, f"--target={late}", "stats", "--timeout=30s", "--wait", "--output=json"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)
        daemon = subprocess.Popen([TURBOKVD, f"--listen={late}", "--device=cpu", "--threads=1",
                                   "--metrics-listen=127.0.0.1:0"], stderr=subprocess.DEVNULL)
        try:
            stdout, stderr = waiting.communicate(timeout=60)
            self.assertEqual(waiting.returncode, 0, stderr)
            self.assertEqual(json.loads(stdout)["sessions"], 0)
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)
        # The default is a few seconds too.
        start = time.monotonic()
        out = self.run_cli("list", target=f"unix://{self.tmp.name}/nobody.sock")
        self.assertEqual(out.returncode, 3, out.stderr)
        self.assertIn("No such file or directory", out.stderr)
        self.assertLess(time.monotonic() - start, 20)

    def test_json_has_every_field_with_int64_as_numbers(self):
        created = self.json("create", "--layers=2", "--kv-heads=2", "--q-heads=4", "--max-tokens=4096")
        config = created["config"]
        self.assertEqual(config["shape"], {"layers": 2, "kv_heads": 2, "q_heads": 4, "head_dim": 128})
        self.assertIs(config["pinned"], False)
        self.assertEqual(config["max_tokens"], 4096)
        self.assertIsInstance(config["rotation_seed"], int)
        self.assertEqual(config["key_codec"], "CODEC_TURBO4")
        self.assertEqual(config["preset"], "k4v4")  # neither codecs nor a preset: the daemon's default
        session = created["session_id"]
        preset = self.json("create", "--layers=32", "--kv-heads=1", "--q-heads=1", "--preset=k3v4")["config"]
        self.assertEqual((preset["preset"], preset["key_codec"]), ("k3v4", "CODEC_TURBO3"))
        # Storage: the daemon's defaults, or what the flags ask.
        self.assertEqual((config["key_transform"], config["sink_tokens"], config["sink_codec"]),
                         ("KEY_TRANSFORM_CENTER_SCALE", 4, "CODEC_F16"))
        stored = self.json("create", "--layers=2", "--key-transform=none", "--sink-tokens=0", "--center-values")["config"]
        self.assertEqual((stored["key_transform"], stored["sink_tokens"], stored["center_values"]),
                         ("KEY_TRANSFORM_NONE", 0, True))
        self.assertEqual([(r["first_layer"], r["last_layer"], r["key_codec"]) for r in preset["layer_codecs"]],
                         [(0, 1, "CODEC_TURBO4"), (30, 31, "CODEC_TURBO4")])

        info = self.json("get", session)
        self.assertEqual(info["layer_tokens"], [0, 0])
        for field in ("bytes_used", "fp16_bytes", "disk_bytes"):
            self.assertEqual(info[field], 0, field)
            self.assertIsInstance(info[field], int, field)
        self.assertIsInstance(info["age"], (int, float))
        self.assertEqual(info["residency"], "RESIDENCY_MEMORY")

        appended = self.json("append-random", session, "--tokens=100", "--chunk=32", "--layer=1")
        self.assertEqual((appended["layer"], appended["tokens"], appended["layer_tokens"]), (1, 100, 100))
        info = self.json("get", session)
        self.assertEqual(info["layer_tokens"], [0, 100])
        self.assertIsInstance(info["bytes_used"], int)
        self.assertGreater(info["bytes_used"], 0)
        self.assertEqual(info["fp16_bytes"], 100 * 2 * 128 * 2 * 2)
        self.assertIn(session, self.sessions())

        attended = self.json("attend-random", session, "--layer=1", "--calls=2", "--queries=3")
        self.assertEqual((attended["layer"], attended["calls"], attended["queries"]), (1, 2, 3))
        self.assertGreater(attended["p50_us"], 0)

        stats = self.json("stats")
        self.assertEqual(stats["budget_bytes"], BUDGET)
        for field in ("evictions", "demoted_sessions", "demotions", "promotions", "spill_bytes", "spill_budget_bytes"):
            self.assertEqual(stats[field], 0, field)
        self.assertGreaterEqual(stats["tokens"], 100)
        # The tables say which tokens they count: per layer (list), token-layers (stats).
        row = next(line.split() for line in self.ok("list").splitlines() if line.startswith(session))
        header = self.ok("list").splitlines()[0].split()
        self.assertEqual(row[header.index("TOKENS/LAYER")], "0..100")  # one layer of the two filled
        self.assertIn("# tokens: summed over sessions and layers", self.ok("stats").splitlines()[0])

        decoded = self.json("decode-random", "--batch=2", "--layers=2", "--steps=2", "--kv-heads=2", "--q-heads=4")
        self.assertEqual((decoded["batch"], decoded["layers"], decoded["steps"]), (2, 2, 2))
        self.assertGreater(decoded["p99_us"], 0)
        long = self.json("decode-random", "--batch=2", "--layers=2", "--steps=2", "--kv-heads=2", "--q-heads=4",
                         "--prefill=300")
        self.assertEqual(long["prefill"], 300)

        snapshot = self.json("snapshot")
        self.assertGreaterEqual(snapshot["sessions"], 1)
        self.assertIsInstance(snapshot["bytes"], int)
        self.assertIsInstance(snapshot["duration"], (int, float))

        prefetched = self.json("prefetch", session)
        self.assertEqual(prefetched, {"results": [{"session_id": session, "code": "OK", "message": ""}]})

    def test_blocks_named_by_token_ids_start_a_later_session(self):
        session = self.session()
        self.json("append-random", session, "--tokens=150", "--chunk=64")
        tokens = os.path.join(self.tmp.name, "tokens.txt")
        with open(tokens, "w") as f:
            f.write(" ".join(str(1000 + i) for i in range(150)))
        named = self.json("name-blocks", session, f"--tokens={tokens}", "--salt=model-a")
        self.assertEqual((named["named_blocks"], named["reusable_from_blocks"], named["block_tokens"]), (2, 1, 64))
        shape = ("--layers=2", "--kv-heads=2", "--q-heads=4", "--head-dim=128")
        started = self.json("create", *shape, f"--prefix-tokens={tokens}", "--salt=model-a")
        self.assertEqual(started["prefix_tokens"], 128)
        self.assertEqual(self.json("get", started["session_id"])["layer_tokens"], [128, 128])
        other = self.json("create", *shape, f"--prefix-tokens={tokens}", "--salt=model-b")
        self.assertEqual(other["prefix_tokens"], 0)
        # The Python client's hashes of the same ids are the C++ client's.
        import turbokv
        with turbokv.Client(self.target) as client:
            python = client.create_session(2, 2, 4, 128, prefix_blocks=turbokv.block_hashes(
                [1000 + i for i in range(150)], 64, salt="model-a"))
            self.assertEqual(python.prefix_tokens, 128)
        with open(tokens, "w") as f:
            f.write("1, 2, x")
        out = self.run_cli("create", *shape, f"--prefix-tokens={tokens}")
        self.assertEqual(out.returncode, 2, out.stderr)  # INVALID_ARGUMENT
        self.assertIn("'x' is not a token id", out.stderr)

    def test_version_and_the_target_from_the_environment(self):
        out = subprocess.run([CLI, "--version"], capture_output=True, text=True, timeout=30)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertRegex(out.stdout, r"^turbokv \d+\.\d+\.\d+\n$")
        env = dict(os.environ, TURBOKV_TARGET=self.target)
        out = subprocess.run([CLI, "stats", "--output=json"], capture_output=True, text=True, timeout=60, env=env)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("sessions", json.loads(out.stdout))
        help_text = subprocess.run([CLI, "help", "stats"], capture_output=True, text=True, timeout=30, env=env).stdout
        self.assertIn(f"(default {self.target})", help_text)
        # The daemon's socket by its bare path.
        out = self.run_cli("stats", "--output=json", target=self.target[len("unix://"):])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("sessions", json.loads(out.stdout))

    def test_the_demo_takes_a_preset_and_defaults_to_the_daemons(self):
        small = ["demo", "--layers=2", "--kv-heads=1", "--q-heads=2", "--head-dim=64", "--tokens=64", "--chunk=32",
                 "--steps=2"]
        self.assertIn("preset k4v4 (CODEC_TURBO4 keys", self.ok(*small))  # the daemon's default
        self.assertIn("preset k3v4 (CODEC_TURBO3 keys", self.ok(*small, "--preset=k3v4"))

    def test_help_per_command(self):
        top = self.run_cli("--help")
        self.assertEqual(top.returncode, 0)
        for command in ("create", "list", "get", "delete", "stats", "snapshot", "prefetch", "append-random",
                        "attend-random", "decode-random", "demo"):
            self.assertRegex(top.stdout, rf"\n  {command}\b")
        self.assertIn("exit status", top.stdout)
        for args in (["create", "--help"], ["help", "create"]):
            out = self.run_cli(*args)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertTrue(out.stdout.startswith("usage: turbokv create"), out.stdout)
            self.assertRegex(out.stdout, r"--layers=N .*1 to 1024 \(default 32\)")
            self.assertRegex(out.stdout, r"--preset=PRESET .*k3v4.*\(default none\)")
            self.assertRegex(out.stdout, r"--key-codec=CODEC .*\(default none\)")
            self.assertRegex(out.stdout, r"--timeout=DURATION .*\(default 5s\)")
            self.assertNotIn("--batch", out.stdout)  # decode-random's
        append = self.ok("append-random", "--help")
        self.assertRegex(append, r"--chunk=N .*\(default 128\)")
        self.assertRegex(append, r"--layer=L\|all .*\(default all\)")
        self.assertRegex(self.ok("help", "snapshot"), r"--timeout=DURATION .*\(default 60s\)")
        self.assertNotIn("--output", self.ok("help", "delete"))
        self.usage_error(["help", "frobnicate"], "unknown command 'frobnicate'")

    def test_exit_statuses(self):
        out = self.run_cli("get", "nosuchsession")
        self.assertEqual(out.returncode, 4, out.stderr)
        self.assertIn("NOT_FOUND", out.stderr)
        self.assertEqual(self.run_cli("delete", "nosuchsession").returncode, 4)
        # Past the session's max_tokens: RESOURCE_EXHAUSTED, a call failure.
        small = self.session("--max-tokens=64")
        out = self.run_cli("append-random", small, "--tokens=128", "--chunk=64")
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertIn("RESOURCE_EXHAUSTED", out.stderr)
        self.assertEqual(self.ok("delete", small), "")
        self.assertNotIn(small, self.sessions())
        # An unknown preset: the daemon's INVALID_ARGUMENT, naming the presets.
        out = self.run_cli("create", "--preset=k9v9")
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("config.preset = 'k9v9' is not a preset: use one of k8v4", out.stderr)


if __name__ == "__main__":
    unittest.main()
