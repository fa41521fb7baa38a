"""`pip install ./client/python` as a user runs it: into a fresh, plain venv
(no system site packages), its dependencies from the package index, at both
ends that matter: the floors pyproject.toml declares and the versions of
constraints.txt. Then `import turbokv` there, from outside the source tree,
and a real call against a real turbokvd ($TURBOKVD); torch is not needed.
The extras (torch, transformers, gguf) are not installed here: their
requirements must allow the versions constraints.txt pins, which the
project's venv runs their code with."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import unittest

from daemon import Daemon

SOURCE = os.environ.get("TURBOKV_PACKAGE_SOURCE", os.path.join(os.path.dirname(__file__), ".."))
CONSTRAINTS = os.environ.get("TURBOKV_CONSTRAINTS", os.path.join(SOURCE, "..", "..", "constraints.txt"))
CHECK = """
import importlib.metadata, sys, numpy as np, turbokv
assert turbokv.__file__.startswith(sys.prefix), turbokv.__file__
assert importlib.metadata.version("turbokv") == turbokv.__version__ == sys.argv[2], turbokv.__version__
assert "torch" not in sys.modules
with turbokv.Client(sys.argv[1]) as client:
    client.wait_until_ready(20)
    s = client.create_session(1, 1, 1, 64, key_codec="f16", value_codec="f16")
    k = np.arange(64, dtype=np.float32).reshape(1, 1, 64) / 64
    assert s.append(0, 0, k, k) == 1
    assert (s.read_kv(0)[0] == k).all()
    q = np.ones((1, 1, 64), np.float32)
    assert abs(float(s.attend(0, q).output[0, 0, 5]) - 5 / 64) < 1e-3
    print("installed turbokv", turbokv.__version__, "works:", client.stats().sessions, "session")
"""


def project():
    with open(os.path.join(SOURCE, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def dependencies():
    return project()["dependencies"]


def floors():
    """Each dependency at the lowest version pyproject.toml allows."""
    pins = {}
    for requirement in dependencies():
        name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement).groups()
        pins[name.lower()] = version
    return pins


def constraints():
    """Every version constraints.txt pins, by lowercase name."""
    pins = {}
    with open(CONSTRAINTS) as f:
        for line in f:
            match = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip())
            if match:
                pins[match.group(1).lower()] = match.group(2)
    return pins


def pinned():
    """The dependencies at constraints.txt's versions."""
    wanted = set(floors())
    return {name: version for name, version in constraints().items() if name in wanted}


def release(version):
    """A version's release numbers: "2.9.1" (2, 9, 1), "2026.10.19.post1" (2026, 10, 19)."""
    return tuple(int(part) for part in re.match(r"[0-9.]*[0-9]", version).group().split("."))


def allows(specifiers, version):
    """Whether `version` meets comma-separated >= and < specifiers, the ones pyproject.toml uses."""
    for specifier in specifiers.split(","):
        operator, bound = re.fullmatch(r"(>=|<)([0-9.]+)", specifier.strip()).groups()
        if (release(version) >= release(bound)) != (operator == ">="):
            return False
    return True


class PipInstallTest(unittest.TestCase):
    def install_and_call(self, pins):
        with tempfile.TemporaryDirectory(prefix="turbokv-venv-") as folder:
            venv = os.path.join(folder, "venv")
            subprocess.run([sys.executable, "-m", "venv", venv], check=True)
            python = os.path.join(venv, "bin", "python")
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            constraints = os.path.join(folder, "constraints.txt")
            with open(constraints, "w") as f:
                f.writelines(f"{name}=={version}\n" for name, version in pins.items())
            # From a copy: setuptools builds in the source folder (build/, egg-info).
            source = os.path.join(folder, "source")
            shutil.copytree(SOURCE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
            pip = subprocess.run([python, "-m", "pip", "install", "--disable-pip-version-check", "-c", constraints,
                                  source], env=env, capture_output=True, text=True, timeout=600)
            self.assertEqual(pip.returncode, 0, pip.stdout + pip.stderr)
            listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], env=env, capture_output=True,
                                    text=True, check=True).stdout.lower()
            for name, version in pins.items():
                self.assertIn(f"{name}=={version}", listed)
            self.assertNotIn("torch==", listed)
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
            for shipped in ("turbokv/py.typed", "turbokv/aio.py", "turbokv/transformers.py",
                            "turbokv/v1/turbokv_pb2.py", "turbokv/v1/turbokv_pb2_grpc.py"):
                self.assertIn(shipped, installed)

    def test_at_the_declared_floors(self):
        self.install_and_call(floors())

    def test_at_the_pinned_versions(self):
        pins = pinned()
        self.assertEqual(set(pins), set(floors()), "constraints.txt pins every dependency")
        self.install_and_call(pins)


class ExtrasTest(unittest.TestCase):
    def test_the_extras_allow_the_pinned_versions(self):
        extras = project()["optional-dependencies"]
        names = {extra: {re.match(r"[A-Za-z0-9_.-]+", r).group().lower() for r in requirements}
                 for extra, requirements in extras.items()}
        # hf_generate.py --gguf: transformers' GGUF loader needs gguf and accelerate.
        self.assertLessEqual(set(extras["transformers"]), set(extras["gguf"]))
        self.assertEqual(names["gguf"], names["transformers"] | {"gguf", "accelerate"})
        pins = constraints()
        for extra, requirements in extras.items():
            for requirement in requirements:
                name, specifiers = re.fullmatch(r"([A-Za-z0-9_.-]+)(.*)", requirement).groups()
                self.assertIn(name.lower(), pins, f"[{extra}] {requirement}: constraints.txt pins no version")
                self.assertTrue(allows(specifiers, pins[name.lower()]),
                                f"[{extra}] {requirement}: constraints.txt pins {pins[name.lower()]}")


if __name__ == "__main__":
    unittest.main()
