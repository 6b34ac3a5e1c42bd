"""python -m services.router: the gRPC front and ZeroMQ token router."""

import argparse

import uvloop

from services.router.server import serve
from shared.config import add_config_arguments, load_config
from shared.log import configure_logging


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.router")
    add_config_arguments(parser)
    config = load_config(parser.parse_args())
    configure_logging("router", "router", config.log.format, config.log.level)
    uvloop.run(serve(config))


if __name__ == "__main__":
    main()
