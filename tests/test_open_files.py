"""shared/runtime/process.py raise_open_files_limit: the router starts with its soft limit of open
files raised to the hard one, so that a shell's 1,024 does not cap its connections."""

from __future__ import annotations

import resource

from shared.runtime.process import raise_open_files_limit


def test_the_soft_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, hard, 256)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        assert raise_open_files_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
