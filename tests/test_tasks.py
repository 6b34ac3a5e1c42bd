"""Background tasks (shared/runtime/tasks.py): one that raises is logged and stops its service as
failed; one cancelled at shutdown, or one that ends well, stops nothing; a loop outlives a failed
iteration and gives up only when it keeps failing."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from shared.runtime.tasks import MAX_FAILURES_IN_A_ROW, LoopBroken, LoopGuard, ServiceStop, spawn


async def _raise() -> None:
    raise RuntimeError("the loop died")


async def _settle(task: asyncio.Task) -> None:
    """Until the task has ended and its done-callbacks have run."""
    await asyncio.wait([task])
    await asyncio.sleep(0)


def test_a_task_that_raises_is_logged_and_stops_the_service_as_failed():
    async def main() -> ServiceStop:
        stop = ServiceStop()
        await _settle(spawn(_raise(), "worker socket", stop.fail))
        return stop

    with capture_logs() as logs:
        stop = asyncio.run(main())
    assert stop.requested.is_set() and stop.exit_code == 1
    assert isinstance(stop.failure, RuntimeError)
    [entry] = logs
    assert entry["log_level"] == "error" and entry["task"] == "worker socket"
    assert str(entry["exc_info"]) == "the loop died"


def test_a_cancelled_task_is_no_failure():
    async def main() -> ServiceStop:
        stop = ServiceStop()
        task = spawn(asyncio.sleep(60), "timeouts", stop.fail)
        await asyncio.sleep(0)
        task.cancel()
        await _settle(task)
        return stop

    with capture_logs() as logs:
        stop = asyncio.run(main())
    assert not stop.requested.is_set() and stop.exit_code == 0
    assert logs == []


def test_a_task_that_ends_well_stops_nothing():
    async def main() -> ServiceStop:
        stop = ServiceStop()
        await _settle(spawn(asyncio.sleep(0), "health", stop.fail))
        return stop

    assert asyncio.run(main()).exit_code == 0


def test_a_stop_signal_exits_0_and_the_first_failure_is_kept():
    stop = ServiceStop()
    stop.request()
    assert stop.requested.is_set() and stop.exit_code == 0
    first = RuntimeError("first")
    stop.fail(first)
    stop.fail(RuntimeError("second"))
    assert stop.failure is first and stop.exit_code == 1


def test_a_loop_outlives_failed_iterations_and_gives_up_only_when_it_keeps_failing():
    """LoopGuard: each failure logged with its traceback, a success starts the count over; a run of
    MAX_FAILURES_IN_A_ROW failures ends the loop, and its task stops the service as failed."""
    outcomes = iter([False] * (MAX_FAILURES_IN_A_ROW - 1) + [True] + [False] * MAX_FAILURES_IN_A_ROW)
    done = []

    async def loop() -> None:
        guard = LoopGuard("timeouts")
        for succeeds in outcomes:
            with guard.iteration():
                if not succeeds:
                    raise RuntimeError("one bad iteration")
            done.append(succeeds)

    async def main() -> ServiceStop:
        stop = ServiceStop()
        await _settle(spawn(loop(), "timeouts", stop.fail))
        return stop

    with capture_logs() as logs:
        stop = asyncio.run(main())
    assert len(done) == 2 * MAX_FAILURES_IN_A_ROW - 1, "every failure but the last let the loop go on"
    assert isinstance(stop.failure, LoopBroken) and stop.exit_code == 1
    failed = [e for e in logs if e["event"].startswith("loop iteration failed")]
    assert len(failed) == 2 * MAX_FAILURES_IN_A_ROW - 1 and all(e["exc_info"] is True for e in failed)
    assert [e["failures_in_a_row"] for e in failed][MAX_FAILURES_IN_A_ROW - 2:MAX_FAILURES_IN_A_ROW] == [
        MAX_FAILURES_IN_A_ROW - 1, 1]
