import threading
import time

import pytest

from policyworker.errors import ConfigError, RefitTimeout
from policyworker.runtime.watchdog import RefitWatchdog


def test_fire_marks_fired_and_runs_abort_callbacks():
    wd = RefitWatchdog()
    aborted = threading.Event()
    d = wd.arm(0.05, [aborted.set], label="r1")
    assert d.armed and wd.armed_count() == 1
    assert aborted.wait(2.0), "abort callback never ran"
    assert d.fired and not d.armed
    assert wd.armed_count() == 0
    with pytest.raises(RefitTimeout):
        d.check()


def test_disarm_before_deadline_never_fires():
    wd = RefitWatchdog()
    aborted = threading.Event()
    d = wd.arm(0.1, [aborted.set])
    assert wd.disarm(d) is True
    assert wd.disarm(d) is False
    assert not aborted.wait(0.3)
    assert not d.fired
    d.check()  # no raise


def test_stand_down_disarms_all_and_counts():
    wd = RefitWatchdog()
    fired = []
    ds = [wd.arm(0.2, [lambda i=i: fired.append(i)]) for i in range(3)]
    assert wd.stand_down() == 3
    assert wd.stand_down() == 0
    time.sleep(0.4)
    assert fired == []
    assert all(d.stood_down and not d.fired for d in ds)


def test_earlier_deadline_armed_later_fires_first():
    wd = RefitWatchdog()
    order = []
    done = threading.Event()
    wd.arm(0.4, [lambda: (order.append("late"), done.set())])
    wd.arm(0.05, [lambda: order.append("early")])
    assert done.wait(2.0)
    assert order == ["early", "late"]


def test_a_failing_callback_does_not_stop_the_others():
    wd = RefitWatchdog()
    ok = threading.Event()

    def boom():
        raise RuntimeError("abort failed")

    wd.arm(0.02, [boom, ok.set])
    assert ok.wait(2.0)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "5", True, None])
def test_bad_timeouts_are_config_errors(bad):
    wd = RefitWatchdog()
    with pytest.raises(ConfigError):
        wd.arm(bad)
    assert wd.armed_count() == 0


def test_stand_down_is_instant_while_another_thread_blocks():
    """The controller's stand-down must not wait for a refit stuck on another thread."""
    wd = RefitWatchdog()
    release = threading.Event()
    d = wd.arm(30.0, [release.set])
    stuck = threading.Thread(target=release.wait, args=(10.0,), daemon=True)
    stuck.start()
    t0 = time.perf_counter()
    count = wd.stand_down()
    elapsed = time.perf_counter() - t0
    release.set()
    stuck.join(2.0)
    assert count == 1 and d.stood_down
    assert elapsed < 1e-3, f"stand_down took {elapsed * 1e3:.3f} ms"
