"""python -m services.decode: the decode worker (KV pull, continuous batching, sampling)."""

from services.decode.worker import DecodeWorker
from shared import metrics
from shared.messages import Role
from shared.worker_main import exit_on_error, start_worker


def main() -> None:
    worker = DecodeWorker(start_worker(Role.DECODE))
    metrics.watch_workers([worker.load])
    worker.run()


if __name__ == "__main__":
    exit_on_error(main)
