"""python -m services.router: the gRPC front and ZeroMQ token router."""

import sys

import uvloop

from services.router.server import serve
from shared.runtime.log import configure_logging
from shared.runtime.process import die_with_parent
from shared.runtime.service_config import parse_service_config


def main() -> None:
    die_with_parent()
    config = parse_service_config("router")
    configure_logging("router", "router", config.log.format, config.log.level)
    sys.exit(uvloop.run(serve(config)))


if __name__ == "__main__":
    main()
