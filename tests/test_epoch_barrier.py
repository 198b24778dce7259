"""The producers' epoch barrier (producer/epoch_barrier.py) waits for the producers that can still finish the
epoch, and only for them: one killed before its first heartbeat is given up after GONE_AFTER_S."""

from __future__ import annotations

import threading
import time

from dflash.common.contract.spool import Spool
from dflash.producer import epoch_barrier
from dflash.producer.epoch_barrier import EpochBarrier


def test_a_producer_that_never_beat_is_given_up_and_a_live_one_is_waited_for(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(epoch_barrier, "GONE_AFTER_S", 0.5)
    spool = Spool(tmp_path / "spool")
    spool.register_producers(["p0", "p1"])
    spool.heartbeat("producer", "p0", {"phase": "producing"})
    stop = threading.Event()
    barrier = EpochBarrier(spool, "p0", stop=stop, on_wait=lambda: None)

    # p1 was killed before it wrote any heartbeat: not waited for past GONE_AFTER_S
    guard = threading.Timer(60.0, stop.set)  # a hang guard: waiting for p1 forever ends False
    guard.start()
    t0 = time.monotonic()
    assert barrier.reached(0)
    assert time.monotonic() - t0 >= 0.5
    guard.cancel()
    assert "producer p1 is gone" in caplog.text

    # p1 alive (beating) and not done with epoch 1: waited for until the stop
    def beat():
        while not stop.wait(0.05):
            spool.heartbeat("producer", "p1", {"phase": "producing"})

    spool.heartbeat("producer", "p1", {"phase": "producing"})
    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    threading.Timer(1.0, stop.set).start()
    t0 = time.monotonic()
    assert not barrier.reached(1)  # ended by the stop, not by giving p1 up
    assert time.monotonic() - t0 >= 1.0
    beating.join(timeout=10)
