"""Starts the real turbokvd binary ($TURBOKVD) on a private unix socket for a test."""

import os
import signal
import subprocess
import tempfile
import unittest


def socket_target() -> "tuple[tempfile.TemporaryDirectory, str]":
    """A private folder and a unix:// target in it where nothing listens yet."""
    folder = tempfile.TemporaryDirectory(prefix="turbokv-py-")
    return folder, f"unix://{folder.name}/turbokv.sock"


class Daemon:
    """turbokvd on a unix socket; at = (folder, target) of socket_target() to
    listen on a target chosen before the daemon starts."""

    def __init__(self, *flags: str, at: "tuple[tempfile.TemporaryDirectory, str] | None" = None):
        self._dir, self.target = at or socket_target()
        self.log_path = os.path.join(self._dir.name, "turbokvd.log")
        self._log = open(self.log_path, "w")
        self._process = subprocess.Popen(
            [os.environ["TURBOKVD"], f"--listen={self.target}", "--device=cpu", "--threads=2",
             "--metrics-listen=127.0.0.1:0", *flags],
            stderr=self._log)

    def stop(self) -> int:
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
        code = self._process.wait(timeout=30)
        self._log.close()
        return code

    def pause(self) -> None:
        """SIGSTOP: the daemon hangs, its connections open."""
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._process.send_signal(signal.SIGCONT)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._log.close()
        self._dir.cleanup()


class DaemonTestCase(unittest.TestCase):
    """A test class sharing one daemon (--memory-budget=256MiB) and one
    client, started once for the class and stopped cleanly after it."""

    @classmethod
    def setUpClass(cls):
        import turbokv  # here: install_test.py runs Daemon without the package on its path
        cls.daemon = Daemon("--memory-budget=256MiB")
        cls.client = turbokv.Client(cls.daemon.target)
        cls.client.wait_until_ready(20)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        assert cls.daemon.stop() == 0
        cls.daemon.close()
