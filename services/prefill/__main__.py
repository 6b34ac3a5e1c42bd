"""python -m services.prefill: the prefill worker (prompt forward pass, first token, KV export)."""

from services.prefill.worker import PrefillWorker
from shared.control.messages import Role
from shared.runtime import metrics
from shared.worker.main import exit_on_error, start_worker


def main() -> None:
    worker = PrefillWorker(start_worker(Role.PREFILL))
    metrics.watch_workers([worker.load])
    worker.run()


if __name__ == "__main__":
    exit_on_error(main)
