"""python -m services.decode: the decode worker (KV pull, continuous batching, sampling)."""

from services.decode.worker import DecodeWorker
from shared.worker_main import exit_on_error, start_worker


def main() -> None:
    config, model, finish, stopping = start_worker(
        "decode", lambda c: c.decode.worker_id, lambda c: c.decode.cpu_cores, half="upper")
    DecodeWorker(config, model, finish, stopping).run()


if __name__ == "__main__":
    exit_on_error(main)
