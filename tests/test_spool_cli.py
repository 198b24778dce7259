"""dflash-spool stats / inspect: real spools and real shards; every user error is one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.common.contract.codecs import CodecConfig
from dflash.common.contract.names import shard_name
from dflash.common.contract.shard import Shard, ShardMeta
from dflash.common.contract.shard_reader import shard_nbytes
from dflash.common.contract.shard_writer import write_shard
from dflash.common.contract.spool import Spool
from dflash.tools.spool.cli import main

CLI = Path(sys.executable).with_name("dflash-spool")


def make_shard(bucket: int, first_index: int, seqlens=(40, 25, 60), hidden_size: int = 32) -> Shard:
    g = torch.Generator().manual_seed(first_index)
    t = sum(seqlens)
    # smooth-ish activations (like real hidden states) so zstd has something to find
    hidden = (torch.randn(t, 1, generator=g) + 0.01 * torch.randn(t, 3 * hidden_size, generator=g)).to(
        torch.bfloat16
    )
    return Shard(
        input_ids=torch.randint(0, 1000, (t,), dtype=torch.int32, generator=g),
        loss_mask=torch.rand(t, generator=g) > 0.3,
        cu_seqlens=torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int64),
        sample_index=torch.arange(first_index, first_index + len(seqlens), dtype=torch.int64),
        hidden=hidden,
        meta=ShardMeta(
            target_model="tiny-qwen3",
            layer_ids=[1, 3, 5],
            hidden_size=hidden_size,
            producer_id="p0",
            bucket=bucket,
        ),
    )


def publish_real(sp: Spool, bucket: int, seq: int, codec: CodecConfig | None = None) -> Path:
    tmp = sp.new_tmp_path(shard_name(bucket, "p0", seq))
    return sp.publish(tmp, nbytes=write_shard(tmp, make_shard(bucket, 10 * seq), codec))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def spool(tmp_path: Path) -> Spool:
    sp = Spool(tmp_path / "spool")
    for seq, bucket in enumerate((128, 128, 512)):
        publish_real(sp, bucket, seq)
    sp.claim("c0", bucket=512)
    sp.register_producers(["p0", "p1"])
    sp.mark_done("p0")
    sp.heartbeat("producer", "p0", {"samples": 9, "tokens": 375})
    return sp


def test_stats_json_matches_the_spool(spool: Spool, capsys):
    rc, out, err = run(capsys, "stats", str(spool.root), "--json")
    assert rc == 0 and err == ""
    st = json.loads(out)
    sizes = {n: shard_nbytes(spool.ready_dir / n) for n in os.listdir(spool.ready_dir)}
    assert st["states"]["ready"]["shards"] == 2 and st["states"]["ready"]["bytes"] == sum(sizes.values())
    assert st["states"]["ready"]["buckets"] == {"128": {"shards": 2, "bytes": sum(sizes.values())}}
    assert st["states"]["claimed"]["buckets"]["512"]["shards"] == 1
    assert st["claimed_by"]["c0"]["shards"] == 1
    assert st["total_bytes"] == spool.total_bytes()
    assert (
        st["producers"] == {"registered": ["p0", "p1"], "done": ["p0"], "dead": {}}
        and st["producers_done"] is False
    )
    procs = {(p["role"], p["id"]): p for p in st["processes"]}
    assert procs[("producer", "p0")]["alive"] is True and procs[("producer", "p0")]["pid"] == os.getpid()
    assert procs[("producer", "p0")]["counters"] == {"samples": 9, "tokens": 375}
    assert set(procs[("producer", "p0")]["rates"]) == {"samples", "tokens"}


def test_stats_human_table(spool: Spool, capsys):
    rc, out, err = run(capsys, "stats", str(spool.root))
    assert rc == 0 and err == ""
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("state"))
    assert header.split()[:5] == ["state", "shards", "bytes", "b128", "b512"]
    ready = next(line for line in lines if line.startswith("ready")).split()
    assert ready[1] == "2" and ready[4:6] == ["2", "/"] and ready[-1] == "-"  # cells: shards / bytes
    claimed = next(line for line in lines if line.startswith("claimed ")).split()
    assert claimed[1] == "1" and claimed[4] == "-" and claimed[5:7] == ["1", "/"]
    row = next(line for line in lines if line.startswith("producer"))
    assert (
        f" {os.getpid()} " in row
        and " yes " in row
        and "samples=9 (" in row
        and "/s)" in row
        and "ago" in row
    )
    assert "claimed by  c0: 1 (" in out
    assert "producers registered: p0 p1; not done: p1" in out


def test_inspect_reports_counts_codec_and_compression(tmp_path: Path, capsys):
    sp = Spool(tmp_path / "spool")
    path = publish_real(sp, 256, 0, CodecConfig.parse("zstd:3:shuffle"))
    rc, out, err = run(capsys, "inspect", str(path), "--json")
    assert rc == 0 and err == ""
    info = json.loads(out)
    t, n, d = 125, 3, 3 * 32
    raw = t * 4 + t * 1 + (n + 1) * 8 + n * 8 + t * d * 2
    assert info["num_samples"] == n and info["num_tokens"] == t
    assert info["codec"] == "zstd:3:shuffle"
    assert info["meta"]["bucket"] == 256 and info["meta"]["layer_ids"] == [1, 3, 5]
    assert info["raw_bytes"] == raw and info["disk_bytes"] == shard_nbytes(path)
    assert info["compression_ratio"] == pytest.approx(raw / shard_nbytes(path))
    assert info["arrays"]["hidden"]["raw_bytes"] == t * d * 2
    assert info["arrays"]["hidden"]["raw_bytes"] / info["arrays"]["hidden"]["disk_bytes"] > 1.5

    rc, out, _ = run(capsys, "inspect", str(path))
    assert rc == 0
    assert "samples 3, tokens 125, codec zstd:3:shuffle" in out
    assert f"compression ratio {raw / shard_nbytes(path):.2f}x" in out
    assert next(line for line in out.splitlines() if line.startswith("hidden")).split()[1:3] == [
        "125x96",
        "uint16",
    ]


def test_inspect_gives_an_fp8_shards_ratio_against_bf16_first_and_as_stored_second(tmp_path: Path, capsys):
    """An FP8 shard: the headline ratio is against the bf16 hidden states a bf16 shard would hold raw (what a
    user compares across codecs), the one against its stored FP8 bytes + scales is said beside it (it was
    the only ratio: 1.31x where bf16 gives 2.58x)."""
    sp = Spool(tmp_path / "spool")
    path = publish_real(sp, 256, 0, CodecConfig.parse("fp8"))
    rc, out, err = run(capsys, "inspect", str(path), "--json")
    assert rc == 0 and err == ""
    info = json.loads(out)
    t, n, d, k = 125, 3, 3 * 32, 3
    rest = t * 4 + t * 1 + (n + 1) * 8 + n * 8
    disk = shard_nbytes(path)
    assert info["raw_bytes"] == rest + t * d + t * k * 2  # as stored: e4m3 bytes + one bf16 scale per layer
    assert info["compression_ratio"] == pytest.approx((rest + t * d * 2) / disk)
    assert info["bf16_bytes"] == rest + t * d * 2 and info["fp8"] is True
    assert info["stored_ratio"] == pytest.approx(info["raw_bytes"] / disk)
    rc, out, _ = run(capsys, "inspect", str(path))
    assert f"compression ratio {(rest + t * d * 2) / disk:.2f}x against bf16\n" in out
    assert "against the stored arrays (FP8 hidden states + scales, " in out
    assert f": {info['raw_bytes'] / disk:.2f}x, as the table below counts" in out


def _not_a_dflash_shard(tmp_path: Path) -> str:
    sp = Spool(tmp_path / "s")
    path = publish_real(sp, 128, 0)
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"]["format"] = "something-else"
    (path / "zarr.json").write_text(json.dumps(meta))
    return str(path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (lambda p: ["stats", str(p / "missing")], "no spool directory at"),
        (lambda p: ["stats", str(p)], "is not a spool"),
        (lambda p: ["inspect", str(p / "missing.zarr")], "no such shard"),
        (lambda p: ["inspect", str(Path(__file__))], "not a shard"),
        (lambda p: ["inspect", str(p)], "not a readable zarr v3 group"),
        (lambda p: ["inspect", _not_a_dflash_shard(p)], "not a dflash shard"),
        (lambda p: ["stats"], "required: dir"),
        (lambda p: ["stats", str(p), "--jsonn"], "unrecognized arguments: --jsonn"),
        (lambda p: ["frobnicate"], "invalid choice"),
        (lambda p: [], "required: cmd"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(tmp_path: Path, capsys, argv, message):
    rc, out, err = run(capsys, *argv(tmp_path))
    assert rc == 2 and out == ""
    assert (
        err.count("\n") == 1 and err.startswith("dflash-spool") and ": error: " in err and message in err
    ), err


@pytest.mark.pipeline
def test_installed_entry_point(spool: Spool, tmp_path: Path):
    ok = subprocess.run([CLI, "stats", str(spool.root)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith(f"spool {spool.root}")
    bad = subprocess.run(
        [CLI, "inspect", str(tmp_path / "nope.zarr")], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
    assert bad.stderr == f"dflash-spool: error: {tmp_path / 'nope.zarr'}: no such shard\n"


def _age_tree(root: Path, seconds: float) -> None:
    """Make everything under ``root`` look untouched for ``seconds``."""
    import time

    t = time.time() - seconds
    for p in [root, *root.rglob("*")]:
        os.utime(p, (t, t), follow_symlinks=False)


def test_gc_removes_only_abandoned_spools(tmp_path, capsys):
    """gc removes a spool with no live process and no recent activity; it keeps a spool whose lock a live
    process holds, one active a moment ago, and any folder that is not a spool; --dry-run removes nothing."""
    root = tmp_path / "shm"
    abandoned, locked, recent = (root / n for n in ("crashed", "running", "starting"))
    for d in (abandoned, locked, recent):
        sp = Spool(d)
        sp.bind_run({"run": d.name})
        publish_real(sp, 128, 0)
    held = Spool(locked).acquire_lock("producer-p0", "test process")  # noqa: F841 (held for the test)
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("not a spool\n")
    for d in (abandoned, locked, root / "mine"):
        _age_tree(d, 2 * 3600)

    rc, out, _ = run(capsys, "gc", str(root), "--dry-run")
    assert rc == 0
    assert f"would remove  {abandoned}" in out and "run 'crashed', no live process, idle 2.0h" in out
    assert abandoned.exists()

    rc, out, _ = run(capsys, "gc", str(root))
    assert rc == 0, out
    assert not abandoned.exists()
    assert locked.exists() and recent.exists() and (root / "mine" / "notes.txt").exists()
    assert f"kept          {locked}" in out and f"kept          {recent}" in out
    assert "1 abandoned spool(s), freed" in out

    rc, out, _ = run(capsys, "gc", str(tmp_path / "nowhere"))
    assert rc == 0 and "does not exist" in out


def test_free_discards_the_shards_keeps_the_records_and_refuses_a_live_spool(tmp_path, capsys):
    """What ops/run_all.sh does to the spool of a stopped or failed run it did not create: the shards (the
    RAM) go, the run record and the quarantine reasons stay; never while a producer or consumer is live."""
    sp = Spool(tmp_path / "sp")
    sp.bind_run({"run": "r"})
    for seq in range(3):
        publish_real(sp, 128, seq)
    sp.quarantine(sp.claim("c0"), "bad bytes")
    rc, out, _ = run(capsys, "free", str(sp.root))
    assert rc == 0, out
    assert "freed 2 shard(s) (6 samples" in out  # the quarantined one goes too (its samples are re-produced)
    assert not list(sp.ready_dir.iterdir()) and sp.leftover_shards() == []
    assert sp.read_run()["run"] == "r" and [p.suffix for p in sp.quarantine_dir.iterdir()] == [".why"]

    held = sp.acquire_lock("consumer-r0", "a live consumer")  # noqa: F841 (held for the test)
    publish_real(sp, 128, 9)
    rc, _, err = run(capsys, "free", str(sp.root))
    assert (
        rc == 2
        and "in use by a live process: a live consumer (pid" in err
        and "holds lock-consumer-r0" in err
    )
    assert len(list(sp.ready_dir.iterdir())) == 1
