"""The decode loop's wait for messages between steps (services/decode/worker.py)."""

from services.decode.worker import IDLE_WAIT_S, receive_timeout_s


def test_a_decode_with_work_never_waits_for_messages():
    assert receive_timeout_s(busy=True, idle_for_s=0.0, idle_spin_s=0.0) == 0.0
    assert receive_timeout_s(busy=True, idle_for_s=0.0, idle_spin_s=1.0) == 0.0


def test_an_idle_decode_spins_for_idle_spin_s_then_waits():
    assert receive_timeout_s(busy=False, idle_for_s=0.5, idle_spin_s=1.0) == 0.0
    assert receive_timeout_s(busy=False, idle_for_s=1.5, idle_spin_s=1.0) == IDLE_WAIT_S
    assert receive_timeout_s(busy=False, idle_for_s=float("inf"), idle_spin_s=0.0) == IDLE_WAIT_S
