"""Runs a test stack's worker as on a host whose clock disagrees with the router's: on a process's
PYTHONPATH, Python imports this module at start, and it moves time.time by CLOCK_SKEW_S seconds
(tests/conftest.py's stack). A stage timed by one process's reading against another's would show
the skew; pdserve subtracts only readings of one clock (services/router/control/request.py)."""

import os
import time

_skew_s = float(os.environ.get("CLOCK_SKEW_S", "0"))
if _skew_s:
    _host_time = time.time
    time.time = lambda: _host_time() + _skew_s
