"""Python client of turbokvd, the KV-cache compression service.

    import numpy as np, turbokv
    client = turbokv.Client("unix:///tmp/turbokv.sock")
    session = client.create_session(layers=32, kv_heads=8, q_heads=32, head_dim=128)
    session.append(layer=0, start=0, keys=k, values=v)        # [tokens, kv_heads, head_dim]
    result = session.attend(layer=0, queries=q)                # [n, q_heads, head_dim]
    result.output, result.lse

    with client.decode_stream() as stream:  # one layer's step for a batch of sessions
        batch = stream.step(0, [session, other], k, v, q, positions)  # k, v, q: [B, heads, head_dim]
        batch.raise_for_status().output                            # [B, 1, q_heads, head_dim]

Tensors are numpy arrays or, when the program uses torch, torch tensors
(float32, float16, bfloat16; CUDA tensors are copied to the host and results
come back on the input's device). Arguments are checked before anything is
sent (ValueError / TypeError naming the argument); failures of the daemon
raise the subclass of turbokv.TurbokvError for their gRPC code
(SessionNotFound, BudgetExceeded, InvalidArgument, ...). Calls have a default
deadline (Client(timeout=60.0)) and idempotent reads are retried on
UNAVAILABLE (Client(retry=turbokv.RetryPolicy(...))). turbokv.aio is the
same API on asyncio.

With turbokvd's --spill-dir, session.info().residency is RESIDENCY_MEMORY,
RESIDENCY_DISK (demoted: the next call brings it back) or
RESIDENCY_MEMORY_AND_DISK; client.prefetch(sessions) brings them back ahead
of use, and create_session(..., pinned=True) keeps one in memory.
"""

__version__ = "0.1.0"

from turbokv._common import (  # noqa: E402
    KEY_TRANSFORMS, PRESETS, AttentionResult, DecodeResult, RetryPolicy, block_hashes, merge_attention,
)
from turbokv.client import Client, DecodeStream, Session  # noqa: E402
from turbokv.errors import (  # noqa: E402
    BudgetExceeded, DeadlineExceeded, FailedPrecondition, InvalidArgument, PermissionDenied, ServiceError,
    SessionNotFound, TurbokvError, Unauthenticated, Unavailable,
)
from turbokv.v1.turbokv_pb2 import RESIDENCY_DISK, RESIDENCY_MEMORY, RESIDENCY_MEMORY_AND_DISK  # noqa: E402

__all__ = [
    "__version__", "Client", "Session", "DecodeStream", "AttentionResult", "DecodeResult", "RetryPolicy",
    "merge_attention", "block_hashes", "TurbokvError", "SessionNotFound", "BudgetExceeded", "InvalidArgument", "FailedPrecondition",
    "Unavailable", "DeadlineExceeded", "PermissionDenied", "Unauthenticated", "ServiceError",
    "RESIDENCY_MEMORY", "RESIDENCY_DISK", "RESIDENCY_MEMORY_AND_DISK", "PRESETS", "KEY_TRANSFORMS",
]
