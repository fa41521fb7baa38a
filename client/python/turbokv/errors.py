"""The exceptions of turbokv: one class per kind of failure, all TurbokvError.

A failed call raises the class of its gRPC status code; so does each failed
item of a batch (DecodeResult.errors, Client.prefetch). Arguments the client
refuses before sending anything raise plain ValueError or TypeError.
"""

from __future__ import annotations

from typing import Dict, Type

import grpc

__all__ = [
    "TurbokvError", "SessionNotFound", "BudgetExceeded", "InvalidArgument", "FailedPrecondition", "Unavailable",
    "DeadlineExceeded", "PermissionDenied", "Unauthenticated", "ServiceError", "error_for",
]


class TurbokvError(Exception):
    """A call (or a batch item) the daemon failed.

    code: the grpc.StatusCode; details: the daemon's message naming the
    problem (also as .message); attempts: how many times the client tried
    (more than 1 only for idempotent calls retried on UNAVAILABLE)."""

    def __init__(self, code: grpc.StatusCode, details: str, attempts: int = 1):
        super().__init__(f"{code.name}: {details}" + (f" (after {attempts} attempts)" if attempts > 1 else ""))
        self.code = code
        self.details = details
        self.attempts = attempts

    @property
    def message(self) -> str:
        """The daemon's message: the same as .details."""
        return self.details


class SessionNotFound(TurbokvError, LookupError):
    """NOT_FOUND: an unknown session id, or one evicted or expired (the message says which)."""


class BudgetExceeded(TurbokvError):
    """RESOURCE_EXHAUSTED: no room in the memory budget, past a session's
    max_tokens, or a message over the size limit (the message has the numbers)."""


class InvalidArgument(TurbokvError, ValueError):
    """INVALID_ARGUMENT: the daemon refused a field, naming it."""


class FailedPrecondition(TurbokvError):
    """FAILED_PRECONDITION: positions out of order (a gap, a query past the
    stored tokens), a range past a layer's end, Snapshot without --snapshot-dir."""


class Unavailable(TurbokvError, ConnectionError):
    """UNAVAILABLE: turbokvd is not reachable, or shutting down."""


class DeadlineExceeded(TurbokvError, TimeoutError):
    """DEADLINE_EXCEEDED: the call's deadline (Client's timeout) passed."""


class PermissionDenied(TurbokvError, PermissionError):
    """PERMISSION_DENIED: the caller may not make this call."""


class Unauthenticated(TurbokvError, PermissionError):
    """UNAUTHENTICATED: a missing or unknown bearer token (turbokvd --auth-tokens-file)."""


class ServiceError(TurbokvError):
    """Any other status: INTERNAL, UNKNOWN, ABORTED, DATA_LOSS, CANCELLED, ..."""


_CLASSES: Dict[grpc.StatusCode, Type[TurbokvError]] = {
    grpc.StatusCode.NOT_FOUND: SessionNotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: BudgetExceeded,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def error_for(code, details: str, attempts: int = 1) -> TurbokvError:
    """The exception of a status: code is a grpc.StatusCode or its number (as ItemStatus carries it)."""
    if not isinstance(code, grpc.StatusCode):
        code = _STATUS_CODES.get(code, grpc.StatusCode.UNKNOWN)
    return _CLASSES.get(code, ServiceError)(code, details, attempts)
