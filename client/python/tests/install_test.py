"""`pip install ./client/python` as a user runs it, with no package index:
into a fresh venv made with --system-site-packages (Debian's grpcio,
protobuf and numpy), then `import turbokv` there, from outside the source
tree, and one real call against a real turbokvd ($TURBOKVD)."""

import os
import subprocess
import sys
import tempfile
import unittest

from daemon import Daemon

SOURCE = os.environ.get("TURBOKV_PACKAGE_SOURCE", os.path.join(os.path.dirname(__file__), ".."))
CHECK = """
import importlib.metadata, sys, numpy as np, turbokv
assert turbokv.__file__.startswith(sys.prefix), turbokv.__file__
assert importlib.metadata.version("turbokv") == turbokv.__version__ == sys.argv[2], turbokv.__version__
with turbokv.Client(sys.argv[1]) as client:
    client.wait_until_ready(20)
    s = client.create_session(1, 1, 1, 64, key_codec="f16", value_codec="f16")
    k = np.arange(64, dtype=np.float32).reshape(1, 1, 64) / 64
    assert s.append(0, 0, k, k) == 1
    assert (s.read_kv(0)[0] == k).all()
    print("installed turbokv", turbokv.__version__, "works:", client.stats().sessions, "session")
"""


class PipInstallTest(unittest.TestCase):
    def test_pip_install_into_a_venv_then_a_real_call(self):
        with tempfile.TemporaryDirectory(prefix="turbokv-venv-") as folder:
            venv = os.path.join(folder, "venv")
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
            python = os.path.join(venv, "bin", "python")
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            env["PIP_NO_INDEX"] = "1"  # as offline as the machine: nothing may come from an index
            pip = subprocess.run([python, "-m", "pip", "install", "--no-cache-dir", SOURCE], env=env,
                                 capture_output=True, text=True, timeout=240)
            self.assertEqual(pip.returncode, 0, pip.stdout + pip.stderr)
            daemon = Daemon()
            try:
                run = subprocess.run([python, "-c", CHECK, daemon.target, os.environ.get("TURBOKV_VERSION", "0.1.0")],
                                     env=env, cwd=folder, capture_output=True, text=True, timeout=120)
                self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
                self.assertIn("works: 1 session", run.stdout)
                self.assertEqual(daemon.stop(), 0)
            finally:
                daemon.close()
            installed = subprocess.run([python, "-m", "pip", "show", "-f", "turbokv"], env=env, capture_output=True,
                                       text=True, check=True).stdout
            for shipped in ("turbokv/py.typed", "turbokv/aio.py", "turbokv/v1/turbokv_pb2.py",
                            "turbokv/v1/turbokv_pb2_grpc.py"):
                self.assertIn(shipped, installed)


if __name__ == "__main__":
    unittest.main()
