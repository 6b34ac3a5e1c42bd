"""python -m services.decode: the decode worker (KV pull, continuous batching, sampling); with
decode.tensor_parallel > 1, its rank 0, which starts the other ranks (services/decode/follower.py)."""

from services.decode import follower
from services.decode.worker import DecodeWorker
from shared.control.messages import Role
from shared.runtime import metrics
from shared.worker.main import exit_on_error, start_worker


def main() -> None:
    worker = start_worker(Role.DECODE)
    if not worker.ranks.leads:
        follower.follow(worker)
        return
    decode = DecodeWorker(worker)
    metrics.watch_workers([decode.load])
    decode.run()


if __name__ == "__main__":
    exit_on_error(main)
