"""TurbokvConnector with a fault injected, for vllm_connector_test.py (vLLM
loads a connector by module path, in its own processes)."""
import os
import signal
import threading
import time

import torch

from turbokv.vllm import LayoutUnknown, TurbokvConnector, _Layout, logger


class ScrambledLoadConnector(TurbokvConnector):
    """Saves through vLLM's layout as learned but loads with every block's
    tokens shifted by one: the negative control (a wrong layout must change
    the output)."""

    def start_load_kv(self, forward_context, **kwargs):
        layout = self._layout
        rows = layout.to_row
        tokens = layout.block_size * layout.head_dim
        shifted = torch.where(rows < tokens, (rows + layout.head_dim) % tokens,
                              tokens + (rows - tokens + layout.head_dim) % tokens)
        self._layout = _Layout(layout.block_size, layout.kv_heads, layout.head_dim, shifted, torch.argsort(shifted))
        try:
            super().start_load_kv(forward_context, **kwargs)
        finally:
            self._layout = layout


class KillDaemonBeforeLoadConnector(TurbokvConnector):
    """SIGKILLs turbokvd ($TURBOKV_TEST_DAEMON_PID) after the scheduler found
    a prefix and before the worker loads it."""

    def start_load_kv(self, forward_context, **kwargs):
        if self._get_connector_metadata().loads:
            os.kill(int(os.environ["TURBOKV_TEST_DAEMON_PID"]), signal.SIGKILL)
        super().start_load_kv(forward_context, **kwargs)


class DeleteBeforeLoadConnector(TurbokvConnector):
    """Deletes the session between the lookup and the load (as an eviction would)."""

    def start_load_kv(self, forward_context, **kwargs):
        for load in self._get_connector_metadata().loads:
            self._connect().delete_session(load.session)
        super().start_load_kv(forward_context, **kwargs)


class UnknownLayoutConnector(TurbokvConnector):
    """A buffer whose layout cannot be learned: the connector must turn off."""

    def _learn(self, kv_layer):
        raise LayoutUnknown("this test's buffer")


class SteppingWhileLoadingConnector(TurbokvConnector):
    """Loads only once vLLM has asked for the transfer results three times
    since the load began: a load that held up the engine's steps would see
    none of them, and fail after 30 s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._steps = 0
        self._stepped = threading.Condition()

    def get_transfer_results(self, finished_req_ids):
        with self._stepped:
            self._steps += 1
            self._stepped.notify_all()
        return super().get_transfer_results(finished_req_ids)

    def _load(self, load, layout):
        with self._stepped:
            begun = self._steps
            if not self._stepped.wait_for(lambda: self._steps >= begun + 3, timeout=30):
                self._count("load_errors")
                logger.warning("turbokv.vllm test: the engine did not step while loading")
                return False
        return super()._load(load, layout)


class HeldLoadConnector(TurbokvConnector):
    """Each load touches $TURBOKV_TEST_HOLD/started and waits (up to 60 s)
    for $TURBOKV_TEST_HOLD/release before it reads anything."""

    def _load(self, load, layout):
        folder = os.environ["TURBOKV_TEST_HOLD"]
        open(os.path.join(folder, "started"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(folder, "release")) and time.monotonic() < deadline:
            time.sleep(0.01)
        return super()._load(load, layout)
