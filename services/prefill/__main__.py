"""python -m services.prefill: the prefill worker (prompt forward pass, first token, KV export);
with prefill.tensor_parallel > 1, its rank 0, which starts the other ranks (services/prefill/follower.py)."""

from services.prefill import follower
from services.prefill.worker import PrefillWorker
from shared.control.messages import Role
from shared.worker.loop import serve
from shared.worker.main import exit_on_error

if __name__ == "__main__":
    exit_on_error(lambda: serve(Role.PREFILL, PrefillWorker, follower.follow))
