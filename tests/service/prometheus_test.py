"""Debian's real Prometheus server scrapes a running turbokvd; the metrics are
read back through Prometheus' HTTP API, and `promtool check metrics` accepts
the exposition. Needs $TURBOKVD, $TURBOKV_CLI, prometheus and promtool."""

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.parse
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


class PrometheusTest(unittest.TestCase):
    def test_prometheus_scrapes_turbokvd(self):
        with tempfile.TemporaryDirectory(prefix="turbokv-prom-") as tmp:
            target = f"unix://{tmp}/turbokv.sock"
            metrics_port = free_port()
            log = open(os.path.join(tmp, "turbokvd.log"), "w")
            daemon = subprocess.Popen([os.environ["TURBOKVD"], f"--listen={target}", "--device=cpu",
                                       f"--metrics-listen=127.0.0.1:{metrics_port}"], stderr=log)
            prometheus = None
            try:
                # One session with 1,024 tokens in each of its 2 layers (enough that its
                # metadata, sink tokens and key transforms among it, weighs little).
                cli = os.environ["TURBOKV_CLI"]
                session = subprocess.run([cli, f"--target={target}", "--wait", "create", "--layers=2", "--kv-heads=2",
                                          "--q-heads=4", "--head-dim=128", "--key-codec=turbo3",
                                          "--value-codec=turbo3"], capture_output=True, text=True,
                                         timeout=60, check=True).stdout.strip()
                subprocess.run([cli, f"--target={target}", "append-random", session, "--tokens=1024"],
                               capture_output=True, text=True, timeout=60, check=True)

                exposition = get(f"http://127.0.0.1:{metrics_port}/metrics")
                check = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True,
                                       text=True, timeout=60)
                self.assertEqual(check.returncode, 0, check.stdout + check.stderr)

                web_port = free_port()
                config = os.path.join(tmp, "prometheus.yml")
                with open(config, "w") as f:
                    f.write("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: turbokvd\n"
                            f"    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n")
                prometheus = subprocess.Popen(
                    ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                     f"--web.listen-address=127.0.0.1:{web_port}"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

                def query(expression: str):
                    url = f"http://127.0.0.1:{web_port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
                    try:
                        result = json.loads(get(url))["data"]["result"]
                    except OSError:
                        return None
                    return float(result[0]["value"][1]) if result else None

                deadline = time.time() + 60
                while time.time() < deadline and query("turbokv_tokens_stored") is None:
                    time.sleep(0.5)
                self.assertEqual(query("turbokv_sessions"), 1)
                self.assertEqual(query("turbokv_tokens_stored"), 2048)
                self.assertEqual(query("turbokv_appended_tokens_total"), 2048)
                self.assertEqual(query('turbokv_memory_budget_bytes{device="cpu"}'), 4 * 2**30)
                self.assertGreater(query("turbokv_compression_ratio"), 4.5)
                self.assertEqual(query('sum(turbokv_rpc_duration_seconds_count{method="CreateSession"})'), 1)
                self.assertEqual(query('up{job="turbokvd"}'), 1)
                # Every series is the daemon's or the process collector's (no exposer_* of the HTTP library).
                names = set(re.findall(r"^([a-z_:]+)[{ ]", exposition, re.M))
                self.assertEqual({n for n in names if not n.startswith(("turbokv_", "process_"))}, set())
                self.assertEqual(query('count({__name__=~"exposer_.*"})'), None)
                # No series carries the session id.
                self.assertNotIn(session, exposition)
                self.assertTrue(re.search(r"^turbokv_evictions_total\{reason=\"lru\"\} 0", exposition, re.M))
            finally:
                if prometheus:
                    prometheus.terminate()
                    prometheus.wait(timeout=30)
                daemon.terminate()
                self.assertEqual(daemon.wait(timeout=30), 0)
                log.close()


if __name__ == "__main__":
    unittest.main()
