"""python -m services.decode: the decode worker (KV pull, continuous batching, sampling)."""

from services.decode.worker import DecodeWorker
from shared.control.messages import Role
from shared.runtime import metrics
from shared.worker.main import exit_on_error, start_worker


def main() -> None:
    worker = DecodeWorker(start_worker(Role.DECODE))
    metrics.watch_workers([worker.load])
    worker.run()


if __name__ == "__main__":
    exit_on_error(main)
