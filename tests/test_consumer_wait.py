"""A consumer started before its producers waits for the spool (and, without --run, for the run record the
producers write) and says so; a bound ends the wait with one line and exit 2. The clock and the sleep are
injected: the verdicts never depend on how fast the machine is."""

from __future__ import annotations

import logging

import pytest

from dflash.consumer.launch import await_spool


class FakeTime:
    """A clock that advances only when slept on; ``on_sleep(n)`` runs at the n-th sleep."""

    def __init__(self, on_sleep=None):
        self.now, self.sleeps, self.on_sleep = 0.0, 0, on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1
        if self.on_sleep is not None:
            self.on_sleep(self.sleeps)


def test_waits_for_the_spool_and_its_run_record_then_returns(tmp_path, caplog):
    spool = tmp_path / "spool"

    def producers_start(n: int) -> None:
        if n == 5:
            (spool / "state").mkdir(parents=True)  # the directory first: not enough without --run
        if n == 40:
            (spool / "state" / "run.json").write_text('{"run": "r"}')

    t = FakeTime(producers_start)
    with caplog.at_level(logging.INFO, logger="dflash-consume"):
        await_spool(str(spool), need_run=True, wait_s=600, sleep=t.sleep, clock=t.clock, every_s=30)
    assert t.sleeps == 40
    said = [r.getMessage() for r in caplog.records]
    assert (
        said[0].startswith("waiting for the spool and its run record at") and "--spool-wait-s 600" in said[0]
    )
    assert any(m.startswith("still waiting") for m in said)  # the wait is never silent


def test_with_a_run_given_the_directory_is_enough(tmp_path):
    spool = tmp_path / "spool"
    t = FakeTime(lambda n: spool.mkdir() if n == 3 else None)
    await_spool(str(spool), need_run=False, wait_s=600, sleep=t.sleep, clock=t.clock)
    assert t.sleeps == 3


def test_an_existing_spool_is_taken_as_it_is(tmp_path):
    t = FakeTime()
    await_spool(str(tmp_path), need_run=True, wait_s=600, sleep=t.sleep, clock=t.clock)
    assert t.sleeps == 0


@pytest.mark.parametrize(
    "make_dir, message",
    [(False, "no such directory after waiting 10 s"), (True, "no run recorded after waiting 10 s")],
)
def test_the_bound_ends_the_wait_with_one_line_and_exit_2(tmp_path, capsys, make_dir, message):
    spool = tmp_path / "spool"
    t = FakeTime((lambda n: spool.mkdir() if n == 2 else None) if make_dir else None)
    with pytest.raises(SystemExit) as exit_info:
        await_spool(str(spool), need_run=True, wait_s=10, sleep=t.sleep, clock=t.clock)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash-consume: error:") and message in err[0]
