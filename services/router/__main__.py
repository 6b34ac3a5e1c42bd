"""python -m services.router: the gRPC front and ZeroMQ token router."""

import sys

import structlog
import uvloop

from services.router.server import serve
from shared.control.dispatch import FatalError
from shared.runtime.log import configure_logging
from shared.runtime.process import die_with_parent
from shared.runtime.service_config import parse_service_config


def main() -> None:
    die_with_parent()
    config = parse_service_config("router")
    configure_logging("router", "router", config.log.format, config.log.level)
    try:
        code = uvloop.run(serve(config))
    except FatalError as exc:  # it cannot start: exits with the reason, whatever a restart would meet again
        structlog.get_logger().error("router cannot start", reason=str(exc), exit_code=exc.exit_code)
        code = exc.exit_code
    sys.exit(code)


if __name__ == "__main__":
    main()
