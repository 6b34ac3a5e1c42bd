"""python -m services.decode: the decode worker (KV pull, continuous batching, sampling); with
decode.tensor_parallel > 1, its rank 0, which starts the other ranks (services/decode/follower.py)."""

from services.decode import follower
from services.decode.worker import DecodeWorker
from shared.control.messages import Role
from shared.worker.loop import serve
from shared.worker.main import exit_on_error

if __name__ == "__main__":
    exit_on_error(lambda: serve(Role.DECODE, DecodeWorker, follower.follow))
