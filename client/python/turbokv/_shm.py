"""The client's side of shared memory (docs/API.md, "Shared memory").

Connected over a unix socket, a client creates one memfd region, seals it
against resizing, and hands it to turbokvd over the socket beside the
daemon's (its path with ".shm" appended) on first use. A call then copies
its tensors, and leaves room for its results, in a block of that region,
and its messages carry only the slices. Where anything of this fails (the
daemon is not on this machine, serves no shared memory, restarted, or the
region is full), calls send their tensors in the messages as before."""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from turbokv.errors import SessionNotFound
from turbokv.v1 import turbokv_pb2 as pb

ALIGNMENT = 64
HELLO = b"turbokv-shm 1\n"  # a registration message's start; the bearer token follows
_RETRY_SECONDS = 5.0


def aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class _Region:
    """One registered memfd: its mapping, the connection that keeps it
    registered (closing it releases the region in the daemon), and its free
    runs."""

    def __init__(self, socket_path: str, size: int, token: str):
        fd = os.memfd_create("turbokv-client", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.memory = mmap.mmap(fd, size)
            self.connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self.connection.settimeout(5.0)
                self.connection.connect(socket_path)
                socket.send_fds(self.connection, [HELLO + token.encode()], [fd])
                words = self.connection.recv(256).decode(errors="replace").split(" ")
            except OSError:
                self.close()
                raise
        finally:
            os.close(fd)  # the daemon holds its own copy now
        if len(words) != 3 or words[0] != "OK":
            self.close()
            raise OSError("the daemon refused the region: " + " ".join(words))
        self.id = words[1]
        self._lock = threading.Lock()
        self._free: List[List[int]] = [[0, size]]  # [offset, bytes], by offset

    def close(self) -> None:
        self.connection.close()

    def take(self, size: int) -> Optional[int]:
        with self._lock:
            for run in self._free:
                if run[1] >= size:
                    offset = run[0]
                    run[0] += size
                    run[1] -= size
                    if run[1] == 0:
                        self._free.remove(run)
                    return offset
        return None

    def give(self, offset: int, size: int) -> None:
        with self._lock:
            self._free.append([offset, size])
            self._free.sort()
            merged: List[List[int]] = []
            for run in self._free:
                if merged and merged[-1][0] + merged[-1][1] == run[0]:
                    merged[-1][1] += run[1]
                else:
                    merged.append(run)
            self._free = merged


class Block:
    """A call's part of the region: its tensors, then room for its results.
    release() gives it back (once the daemon has answered)."""

    def __init__(self, region: _Region, offset: int, size: int):
        self.region, self.offset, self.size = region, offset, size
        self._used = 0

    def put(self, tensor: pb.Tensor, values: Optional[np.ndarray] = None) -> None:
        """Moves tensor's data (or, for a tensor built without it, `values`,
        contiguous) into the block: the message carries its slice."""
        raw = np.frombuffer(tensor.data, dtype=np.uint8) if values is None else values.reshape(-1).view(np.uint8)
        start = self.offset + self._used
        np.frombuffer(self.region.memory, dtype=np.uint8, count=raw.size, offset=start)[:] = raw
        tensor.ClearField("data")
        tensor.shared.region, tensor.shared.offset, tensor.shared.length = self.region.id, start, raw.size
        self._used += aligned(raw.size)

    def results(self, slice_: pb.SharedSlice) -> None:
        slice_.region, slice_.offset, slice_.length = self.region.id, self.offset + self._used, self.size - self._used

    def read(self, slice_: pb.SharedSlice) -> memoryview:
        """The bytes of a result the daemon put in this block, not copied:
        read them before release()."""
        start = slice_.offset - self.offset
        if slice_.region != self.region.id or start < 0 or slice_.length > self.size - start:
            raise RuntimeError("the daemon answered with a result outside the shared memory the call gave it")
        return memoryview(self.region.memory)[slice_.offset:slice_.offset + slice_.length]

    def release(self) -> None:
        if self.region is not None:
            self.region.give(self.offset, self.size)
            self.region = None  # type: ignore[assignment]


class SharedMemory:
    """One client's region, registered on first use; None from for_target
    when the target is not a unix socket or shared memory is off."""

    def __init__(self, socket_path: str, size: int, token: str):
        self._socket_path, self._size, self._token = socket_path, aligned(size), token
        self._lock = threading.Lock()
        self._region: Optional[_Region] = None
        self._retry_after = 0.0

    @staticmethod
    def for_target(target: str, size: int, token: Optional[str]) -> Optional["SharedMemory"]:
        if size <= 0 or not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
            return None
        for prefix in ("unix://", "unix:"):
            if target.startswith(prefix):
                return SharedMemory(target[len(prefix):] + ".shm", size, token or "")
        return None

    def block(self, sizes: Sequence[int], result_values: int = 0, result_tensors: int = 0) -> Optional[Block]:
        """A block for tensors of `sizes` bytes and result_values f32 results
        in result_tensors tensors, or None (send bytes)."""
        size = sum(aligned(n) for n in sizes) + aligned(4 * result_values) + ALIGNMENT * result_tensors
        with self._lock:
            if self._region is None and time.monotonic() >= self._retry_after:
                try:
                    self._region = _Region(self._socket_path, self._size, self._token)
                except OSError:
                    # Not co-located, or no shared memory there: try again
                    # now and then (the daemon may start later).
                    self._retry_after = time.monotonic() + _RETRY_SECONDS
            region = self._region
        if region is None or size == 0:
            return None
        offset = region.take(aligned(size))
        return None if offset is None else Block(region, offset, aligned(size))

    def forget(self) -> None:
        """The daemon no longer knows the region (it restarted, say): the next block registers a new one."""
        with self._lock:
            if self._region is not None:
                self._region.close()
            self._region = None
            self._retry_after = 0.0

    def close(self) -> None:
        self.forget()


def place(shared: Optional[SharedMemory], request: Any, fields: Sequence[str], result_values: int = 0,
          result_tensors: int = 0, values: Optional[Dict[str, np.ndarray]] = None) -> Optional[Block]:
    """Moves the request's tensors named by `fields` (those set) into a block
    of shared memory, with room for its results (output_to); None when there
    is none to be had (the tensors stay in the message). A field named in
    `values` is a tensor built without its bytes (_tensors.encode_values):
    its values go into the block, or into the message when there is none."""
    values = values or {}
    tensors = [(getattr(request, f), values.get(f)) for f in fields if request.HasField(f)]
    sizes = [len(t.data) if v is None else v.nbytes for t, v in tensors]
    block = shared.block(sizes, result_values, result_tensors) if shared is not None else None
    if block is None:
        for t, v in tensors:
            if v is not None:
                t.data = v.tobytes()
        return None
    for t, v in tensors:
        block.put(t, v)
    if result_tensors:
        block.results(request.output_to)
    return block


def release(block: Optional[Block]) -> None:
    """Gives a call's block back (None: it had none)."""
    if block is not None:
        block.release()


def region_lost(error: BaseException, block: Optional[Block]) -> bool:
    """Whether a call failed only because the daemon no longer holds its
    block's region (nothing was applied: retry it with bytes)."""
    return block is not None and isinstance(error, SessionNotFound) and "shared-memory region" in str(error)


def result_bytes(tensor: pb.Tensor, block: Optional[Block]) -> Union[bytes, memoryview]:
    """A result tensor's bytes, from the message or a view of the call's block."""
    if tensor.HasField("shared"):
        if block is None:
            raise RuntimeError("the daemon answered with a result in shared memory the call did not give it")
        return block.read(tensor.shared)
    return tensor.data
