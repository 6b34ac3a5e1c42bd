"""python -m services.prefill: the prefill worker (prompt forward pass, first token, KV export)."""

from services.prefill.worker import PrefillWorker
from shared.worker_main import exit_on_error, start_worker


def main() -> None:
    config, model, finish, stopping = start_worker(
        "prefill", lambda c: c.prefill.worker_id, lambda c: c.prefill.cpu_cores, half="lower")
    PrefillWorker(config, model, finish, stopping).run()


if __name__ == "__main__":
    exit_on_error(main)
