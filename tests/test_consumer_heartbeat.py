"""The consumer's heartbeat thread (consumer/heartbeat.py) outlives what it reads: the spool's records."""

from __future__ import annotations

import time

from dflash.common.contract.spool import Spool
from dflash.consumer.heartbeat import ConsumerHeartbeat


def test_an_unreadable_producer_record_never_stops_the_consumers_beats(tmp_path, caplog):
    """Another process's heartbeat with a counter that is not a number makes the spool scan fail: the
    failure is one warning, the consumer keeps beating (the others must not take its claims back)."""
    spool = Spool(tmp_path / "spool")
    spool.heartbeat("producer", "p0", {"phase": "producing", "tok_s": "fast"})
    hb = ConsumerHeartbeat(spool, "c0", timeout_s=2.0)  # beats every 0.5 s
    try:
        first = next(r["time"] for r in spool.heartbeats() if r["role"] == "consumer")
        deadline = time.monotonic() + 60  # guards a hang only
        while time.monotonic() < deadline:
            beats = [r["time"] for r in spool.heartbeats() if r["role"] == "consumer"]
            if beats and beats[0] > first:
                break
            time.sleep(0.1)
        assert beats and beats[0] > first, "the consumer stopped beating"
        assert hb._thread.is_alive()
    finally:
        hb.close()
    failed = [r for r in caplog.records if "spool scan failed" in r.getMessage()]
    assert len(failed) == 1 and "ValueError" in failed[0].getMessage()
