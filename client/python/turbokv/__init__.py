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

Failures raise turbokv.TurbokvError carrying the gRPC status code and message.
With turbokvd's --spill-dir, session.info().residency is RESIDENCY_MEMORY,
RESIDENCY_DISK (demoted: the next call brings it back) or
RESIDENCY_MEMORY_AND_DISK; client.prefetch(sessions) brings them back ahead
of use, and create_session(..., pinned=True) keeps one in memory.
"""

from turbokv.client import (  # noqa: F401
    AttentionResult,
    Client,
    DecodeResult,
    DecodeStream,
    Session,
    TurbokvError,
    merge_attention,
)
from turbokv.v1.turbokv_pb2 import RESIDENCY_DISK, RESIDENCY_MEMORY, RESIDENCY_MEMORY_AND_DISK  # noqa: F401,E402
