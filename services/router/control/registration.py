"""Which workers may join the stack: the checks behind Registered or Refused, each with its reason.

A worker joins only if it speaks this router's protocol version, uses its KV page size, exports a
pool exactly when it is a prefill, registers as an id and role its CURVE key permits (tcp://), and
runs the router's own model with the dtype and KV layout of the workers already serving: a
prefill and a decode of different models must never pair.
"""

from __future__ import annotations

from services.router.control.worker_records import WorkerRegistry
from shared.control.messages import PROTOCOL_VERSION, ModelFingerprint, Register, Role
from shared.model import fingerprint


class RegistrationPolicy:
    def __init__(self, page_size: int, checkpoint: tuple[str, str, str], security):
        """checkpoint: the (config, weights, tokenizer) hashes of the router's own copy of the model;
        security: the CURVE server (shared/control/curve.py), or None on ipc://."""
        self.page_size = page_size
        self.checkpoint = checkpoint
        self.security = security

    def refusal(self, message: Register, user_id: str | None, registry: WorkerRegistry) -> str:
        """Why this worker may not join, or "" if it may."""
        if message.protocol_version != PROTOCOL_VERSION:
            return version_refusal(message.protocol_version)
        if message.page_size != self.page_size:
            return f"KV page size {message.page_size}, but this router's kv.page_size is {self.page_size}"
        if (message.role == Role.PREFILL) != bool(message.pool_handles):
            return "only a prefill exports a KV pool, and every prefill does"
        if message.role == Role.DECODE and message.max_batch_size < 1:
            return f"max_batch_size {message.max_batch_size}: a decode must run at least one request"
        if self.security is not None and not self.security.permits(user_id, message.worker_id, message.role):
            return f"its key does not permit worker id {message.worker_id!r} as a {message.role}"
        return self._mismatch(message, registry)

    def _mismatch(self, message: Register, registry: WorkerRegistry) -> str:
        theirs = message.fingerprint
        others = [w.fingerprint for w in registry.workers.values() if w.worker_id != message.worker_id]
        serving = others[0] if others else theirs
        expected = ModelFingerprint(*self.checkpoint, serving.dtype, serving.kv_layout)
        wrong = fingerprint.differences(expected, theirs)
        return f"another model than this stack's: {'; '.join(wrong)}" if wrong else ""


def version_refusal(version: int) -> str:
    return f"protocol version {version}, but this router speaks {PROTOCOL_VERSION}: run one pdserve release everywhere"
