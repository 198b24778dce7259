import json
import math
from pathlib import Path

import pytest

from dflash.tools.plan import cli as plan
from dflash.tools.plan.cli import PlanConfig, best_split, plan_splits
from dflash.tools.plan.rates import ddp_efficiency, measure_rates, steady_rate


def _best(**kw):
    b = best_split(plan_splits(PlanConfig(**kw)))
    return b.producers, b.consumers, b.end_to_end_tok_s, b.bottleneck


def test_ddp_efficiency_model():
    assert ddp_efficiency(1, 0.95) == 1.0
    assert ddp_efficiency(2, 0.95) == pytest.approx(0.95)
    assert ddp_efficiency(8, 0.95) == pytest.approx(0.95**3)
    assert ddp_efficiency(6, 0.9) == pytest.approx(0.9 ** math.log2(6))


@pytest.mark.parametrize(
    "kw,want",
    [
        # 6+2 would give 41.8K (consumers short); 5+3 gives 45K, producers short
        (dict(num_gpus=8, producer_tok_s=9000, consumer_tok_s=22000), (5, 3, 45_000, "producers")),
        # exact balance when DDP is free
        (
            dict(num_gpus=8, producer_tok_s=10_000, consumer_tok_s=30_000, ddp_efficiency=1.0),
            (6, 2, 60_000, "balanced"),
        ),
        # fast producers: most GPUs train, the DDP loss decides between 2+6 and 1+7
        (
            dict(num_gpus=8, producer_tok_s=50_000, consumer_tok_s=10_000),
            (2, 6, 60_000 * 0.95 ** math.log2(6), "consumers"),
        ),
        # two nodes: the DDP group spans 2*c consumers
        (dict(num_gpus=8, producer_tok_s=9000, consumer_tok_s=22000, nodes=2), (5, 3, 90_000, "producers")),
        # a tie (1+2 and 2+1 both give 1 tok/s, same headroom): fewer consumers
        (dict(num_gpus=3, producer_tok_s=1, consumer_tok_s=1, ddp_efficiency=1.0), (2, 1, 1, "consumers")),
    ],
)
def test_best_split(kw, want):
    p, c, e2e, neck = _best(**kw)
    assert (p, c, neck) == (want[0], want[1], want[3])
    assert e2e == pytest.approx(want[2])


def test_all_alternatives_listed():
    splits = plan_splits(PlanConfig(num_gpus=4, producer_tok_s=100, consumer_tok_s=100, ddp_efficiency=1.0))
    assert [(s.producers, s.consumers, s.end_to_end_tok_s) for s in splits] == [
        (1, 3, 100),
        (2, 2, 200),
        (3, 1, 100),
    ]


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_gpus=1, producer_tok_s=1, consumer_tok_s=1), "num_gpus=1"),
        (dict(num_gpus=8, producer_tok_s=0, consumer_tok_s=1), "producer_tok_s=0"),
        (dict(num_gpus=8, producer_tok_s=1, consumer_tok_s=float("nan")), "consumer_tok_s=nan"),
        (dict(num_gpus=8, producer_tok_s=1, consumer_tok_s=1, ddp_efficiency=1.5), "ddp_efficiency=1.5"),
        (dict(num_gpus=8, producer_tok_s=1, consumer_tok_s=1, nodes=0), "nodes=0"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        PlanConfig(**kw)


def test_steady_rate_skips_warmup_and_events():
    recs = [
        {"tok_s": 10},
        {"event": "checkpoint", "tok_s": 1},
        {"tok_s": 9000},
        {"tok_s": 9100},
        {"tok_s": 8900},
    ]
    assert steady_rate(recs) == 9000  # first of 4 rate records dropped
    assert steady_rate([{"tok_s": 5}]) == 5  # never drop everything
    assert steady_rate([{"step": 1}]) is None


def _run(tmp_path, prod_rates, cons_rates):
    m = tmp_path / "metrics"
    m.mkdir(parents=True)
    for role, rates in (("producer", prod_rates), ("consumer", cons_rates)):
        for i, rs in enumerate(rates):
            (m / f"{role}-{i}.jsonl").write_text(
                "".join(json.dumps({"time": t, "tok_s": r}) + "\n" for t, r in enumerate(rs))
            )
    return tmp_path


def test_measure_rates(tmp_path):
    run = _run(
        tmp_path,
        [[100, 9000, 9100, 8900], [50, 10_000, 10_000, 10_000]],
        [[1, 20_000, 21_000, 19_000], [1, 18_000, 18_000, 18_000]],
    )
    m = measure_rates(run)
    assert (m.num_producers, m.num_consumers) == (2, 2)
    assert m.producer_tok_s == pytest.approx(9500)
    assert m.producer_total_tok_s == pytest.approx(19_000)
    assert m.consumer_total_tok_s == pytest.approx(38_000)
    assert m.consumer_tok_s == pytest.approx(19_000 / 0.95)  # normalized to a 1-GPU group


def test_cli_from_run_dir_json(tmp_path, capsys):
    run = _run(
        tmp_path, [[100, 9000, 9000, 9000]], [[1, 20_900, 20_900, 20_900], [1, 20_900, 20_900, 20_900]]
    )
    plan.main(["--gpus", "8", str(run), "--json"])
    out = json.loads(capsys.readouterr().out)
    # measured C = 20900/0.95 = 22000 per GPU alone: same as the flag case below
    assert out["config"]["consumer_tok_s"] == pytest.approx(22_000)
    assert (out["best"]["producers"], out["best"]["consumers"]) == (5, 3)
    assert len(out["splits"]) == 7 and out["measured"]["num_consumers"] == 2


def test_cli_flags_text(capsys):
    plan.main(["--gpus", "8", "--producer-tok-s", "9000", "--consumer-tok-s", "22000"])
    out = capsys.readouterr().out
    assert "best: 5 producers + 3 consumers per node -> 45.0K tok/s end-to-end (bottleneck: producers)" in out
    star = [ln for ln in out.splitlines() if ln.startswith("*")]
    assert len(star) == 1 and star[0].split()[1:3] == ["5", "3"]


def test_cli_flag_overrides_run_dir_and_throttle_note(tmp_path, capsys):
    run = _run(tmp_path, [[9000, 9000]], [[9500, 9500]])
    plan.main(["--gpus", "4", str(run), "--consumer-tok-s", "1000", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["consumer_tok_s"] == 1000 and out["config"]["producer_tok_s"] == 9000
    plan.main(["--gpus", "4", str(run)])
    assert (
        "note: the measured totals are close: the consumer side was probably throttled"
        in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--gpus", "8"], "give --producer-tok-s and --consumer-tok-s"),
        (["--gpus", "1", "--producer-tok-s", "1", "--consumer-tok-s", "1"], "num_gpus=1"),
        (["--gpus", "8", "/nonexistent/run"], "run dir /nonexistent/run does not exist"),
        (["--gpus", "8", "--producer-tok-s", "5", "RUN"], "no such rates in"),
    ],
)
def test_cli_errors_one_line_exit_2(tmp_path, capsys, argv, match):
    argv = [str(tmp_path) if a == "RUN" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        plan.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-plan: error: ") and match in err and "\n" not in err


def test_measure_rates_group_rate_file(tmp_path):
    """Rank 0 logging the all-reduced rate of a 2-rank group (world_size=2) counts as 2 consumers."""
    m = tmp_path / "metrics"
    m.mkdir()
    recs = [{"time": t, "tok_s": r, "world_size": 2} for t, r in enumerate([5, 40_000, 40_000])]
    (m / "consumer-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = measure_rates(tmp_path)
    assert (got.num_consumers, got.consumer_total_tok_s) == (2, 40_000)
    assert got.consumer_tok_s == pytest.approx(20_000 / 0.95)
    assert got.producer_tok_s is None


def _pipeline_json(path, shape, producer, consumer, scale=1.0):
    """pipeline_bench's JSON: its ``figures`` (one per shape) beside its phases."""
    fig = {"shape": shape, "producer_tok_s": producer, "consumer_tok_s": consumer, "depth_scale": scale}
    if scale != 1.0:
        fig["producer_tok_s_full_depth"] = producer * scale
    path.write_text(json.dumps({"figures": [fig], "phases": {}}))
    return str(path)


def test_bench_figures_plan_each_shape(tmp_path, capsys):
    """pipeline_bench figures for three shapes (the hybrid a slice, scaled to full depth) and a
    producer_bench result overriding the 8B producer rate: a split and a node rate per shape."""
    files = [
        _pipeline_json(tmp_path / "p8.json", "8b", 30_000, 26_000),
        _pipeline_json(tmp_path / "p32.json", "32b", 9_000, 22_000),
        _pipeline_json(tmp_path / "ph.json", "hybrid27b", 80_000, 22_000, scale=6 / 62),
    ]
    pb = tmp_path / "prod8.json"
    pb.write_text(
        json.dumps({"preset": "8b", "depth_scale": 1.0, "results": {"producer_full": {"tok_s": 40_000}}})
    )
    shapes = plan.read_bench_figures([*files, str(pb)])
    assert shapes["8b"] == {"producer_tok_s": 40_000, "consumer_tok_s": 26_000}
    assert shapes["hybrid27b"]["producer_tok_s"] == pytest.approx(80_000 * 6 / 62)
    base = PlanConfig(num_gpus=8, producer_tok_s=1, consumer_tok_s=1)
    plans, missing = plan.plan_shapes(shapes, base)
    by = {p["shape"]: p for p in plans}
    assert missing == []
    for shape, rates in shapes.items():  # each the best of the node's splits, as plan_splits computes them
        want = best_split(plan_splits(PlanConfig(num_gpus=8, **rates)))
        assert by[shape]["best"]["producers"] == want.producers and by[shape]["node_tok_s"] == pytest.approx(
            want.end_to_end_tok_s
        )
    assert (by["32b"]["best"]["producers"], by["32b"]["best"]["consumers"]) == (5, 3)  # 45K: producers short
    plan.main(["--gpus", "8", "--bench", ",".join([*files, str(pb)])])
    text = capsys.readouterr().out
    assert "hybrid27b" in text and "5 + 3" in text
    plan.main(["--gpus", "8", "--bench", ",".join(files), "--json"])
    assert {p["shape"] for p in json.loads(capsys.readouterr().out)["plans"]} == {"8b", "32b", "hybrid27b"}


def test_bench_without_a_rate_is_a_short_error_line_then_one_line_per_shape_exit_2(tmp_path, capsys):
    """No shape planned: a short error line, then each shape's lack and each ignored file on its own line
    (it was one 400-character line, and the files' notes were lost)."""
    pb = tmp_path / "prod.json"
    pb.write_text(json.dumps({"preset": "32b", "results": {"producer_full": {"tok_s": 9000}}}))
    ph = tmp_path / "prodh.json"
    ph.write_text(json.dumps({"preset": "hybrid27b", "results": {"producer_full": {"tok_s": 8000}}}))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        plan.main(["--gpus", "8", "--bench", f"{pb},{ph},{tmp_path / 'junk.json'}"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "dflash-plan: error: no shape could be planned from 3 --bench files:"
    assert [ln.split(":")[0].strip() for ln in lines[1:3]] == ["shape 32b", "shape hybrid27b"]
    assert "no consumer rate (measured by ops/bench/consumer_bench.py --mode trainer" in lines[1]
    assert lines[3].startswith(f"  --bench {tmp_path / 'junk.json'}: no producer or consumer rate in it")
    assert len(lines) == 4
    with pytest.raises(SystemExit):
        plan.main(["--gpus", "8", "--bench", str(tmp_path / "junk.json")])
    err = capsys.readouterr().err
    assert "no shape could be planned from 1 --bench file: no rate in it" in err


def test_notes_on_ignored_files_survive_an_error_exit(tmp_path, capsys):
    """A file that holds no rate, then one that cannot be read: the error, and the note on the first."""
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        plan.main(["--gpus", "8", "--bench", f"{tmp_path / 'junk.json'},{tmp_path / 'missing.json'}"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith(f"dflash-plan: error: --bench {tmp_path / 'missing.json'}: cannot read")
    assert lines[1:] == [
        f"  --bench {tmp_path / 'junk.json'}: no producer or consumer rate in it (not a pipeline_bench, "
        "producer_bench, consumer_bench or consumer_ab result), ignored"
    ]


# The benches' files as they write them (fields the plan reads, and others beside them), fabricated small.
PRODUCER_BENCH_32B = {  # ops/bench/producer_bench.py: producer_bench_<preset>.json
    "preset": "32b",
    "layers": 64,
    "full_depth": 64,
    "depth_scale": 1.0,
    "complete": True,
    "results": {
        "producer_full": {"tok_s": 9_000.0, "first_shard_s": 41.2, "own_forward": {"tok_s": 9_900.0}}
    },
}
PRODUCER_BENCH_HYBRID = {
    **PRODUCER_BENCH_32B,
    "preset": "hybrid27b",
    "results": {"producer_full": {"tok_s": 8_000.0}},
}
CONSUMER_BENCH = [  # ops/bench/consumer_bench.py --json: reference, then one record per preset x precision x seed
    {"mode": "reference", "ms_per_step": 170.3, "context_tok_s": 24_052},
    {
        "mode": "trainer (real Trainer over a real spool)",
        "preset": "32b",
        "precision": "amp",
        "seed": 0,
        "device": "NVIDIA H200",
        "context_tokens": 4096,
        "ms_per_step_median": 180.0,
        "context_tok_s": 22_756,
        "real_tok_s": 21_600,
        "fill": 0.949,
    },
    {
        "mode": "trainer (real Trainer over a real spool)",
        "preset": "32b",
        "precision": "bf16",  # a sweep's other precision: not the consumer's default rate
        "seed": 0,
        "device": "NVIDIA H200",
        "context_tokens": 4096,
        "ms_per_step_median": 150.0,
        "real_tok_s": 25_900,
        "fill": 0.949,
    },
    {
        "mode": "feed (data path only: claim, decode, pack, anchors, pinned copy; no step)",
        "context_tok_s": 90_000,
    },
]
AB_JSONL = [  # ops/bench/consumer_ab.py: OUT/ab/ab.jsonl, a record per line as each finishes
    {"variant": "reference", "ms_per_step": 170.3},
    {"variant": "prefill", "prefill_s": 35.1, "prefill_tokens": 400_000},
    {
        "variant": "default",
        "flags": "--profile-steps 1:5",
        "ms_per_step_median": 176.0,
        "fill": 0.95,
        "precision": "amp",
        "rc": 0,
        "preset": "8b",
        "context_tokens": 4096,
        "real_tok_s": 22_109,
    },
    {
        "variant": "liger",
        "flags": "--loss-impl liger",
        "ms_per_step_median": 160.0,
        "fill": 0.95,
        "preset": "8b",
        "context_tokens": 4096,
        "real_tok_s": 24_320,
    },
]


def test_bench_plans_every_shape_with_both_measured_rates_and_names_what_the_others_lack(tmp_path, capsys):
    """The device suite's own files: producer_bench (32b, hybrid27b), consumer_bench (32b: its default
    precision's run, not the bf16 sweep's), consumer_ab (8b: the default flags' variant) and pipeline_bench
    (8b's producer). 32b and 8b are planned; hybrid27b, with no consumer rate measured, is one line."""
    files = {
        "producer_bench_32b.json": json.dumps(PRODUCER_BENCH_32B),
        "producer_bench_hybrid27b.json": json.dumps(PRODUCER_BENCH_HYBRID),
        "trainer32.json": json.dumps(CONSUMER_BENCH, indent=2),
        "ab.jsonl": "".join(json.dumps(r) + "\n" for r in AB_JSONL),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    paths = [str(tmp_path / n) for n in files]
    paths.append(_pipeline_json(tmp_path / "pipeline_bench_8b.json", "8b", 30_000, None))
    shapes = plan.read_bench_figures(paths)
    assert shapes == {
        "32b": {"producer_tok_s": 9_000.0, "consumer_tok_s": 21_600},
        "hybrid27b": {"producer_tok_s": 8_000.0},
        "8b": {"consumer_tok_s": 22_109, "producer_tok_s": 30_000.0},
    }
    plan.main(["--gpus", "8", "--bench", ",".join(paths)])
    out = capsys.readouterr().out
    assert "32b" in out and "  8b " in out
    lines = [line.strip() for line in out.splitlines() if "shape hybrid27b" in line]
    assert lines == [
        "shape hybrid27b: no consumer rate (measured by ops/bench/consumer_bench.py --mode trainer, "
        "consumer_ab.py or pipeline_bench.py), not planned"
    ]
    plan.main(["--gpus", "8", "--bench", ",".join(paths), "--json"])
    got = json.loads(capsys.readouterr().out)
    assert [p["shape"] for p in got["plans"]] == ["32b", "8b"] and len(got["not_planned"]) == 1


def test_the_device_suite_plans_from_its_own_files_and_assumes_no_rate():
    """ops/bench/device_suite.sh's plan part feeds dflash-plan the suite's bench outputs, and writes no rate
    of its own (an assumed consumer rate once stood in for a measured one)."""
    suite = (Path(__file__).resolve().parents[1] / "ops" / "bench" / "device_suite.sh").read_text()
    part = suite[suite.index("if want plan; then") :]
    assert "assumed" not in part and "consumer_tok_s" not in part and "echo '{" not in part
    for made in ("producer_bench_*.json", "pipeline_bench_*.json", "trainer*.json", "ab*/ab.jsonl"):
        assert made in part, made


def test_a_producer_throttled_by_the_spool_budget_is_planned_at_its_unthrottled_rate(tmp_path, capsys):
    """A producer that waited on the spool budget 75 % of the time: 400 tok/s measured, 1600 tok/s while
    not waiting. The plan uses the latter and says the measured one was throttled."""
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    recs, tokens, budget, main_wait = [], 0, 0.0, 0.0
    for k in range(21):  # one record every 10 s: 4000 tokens, 7.5 s of it waiting on the budget
        recs.append(
            {
                "time": 1000.0 + 10 * k,
                "elapsed_s": 10.0 * k,
                "tokens": tokens,
                "tok_s": 400.0,
                "budget_wait_s": budget,
                "main_wait_s": main_wait,
            }
        )
        tokens, budget, main_wait = tokens + 4000, budget + 15.0, main_wait + 7.5  # 2 writer threads waited
    (run / "metrics" / "producer-n0p0.1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "metrics" / "consumer-0.jsonl").write_text(json.dumps({"time": 1.0, "tok_s": 3000.0}) + "\n")
    m = measure_rates(run, warmup_frac=0.0)
    assert m.producer_tok_s == pytest.approx(1600) and m.producer_total_tok_s == pytest.approx(400)
    assert m.producer_throttled == pytest.approx(0.75)
    plan.main(["--gpus", "8", str(run), "--warmup-frac", "0"])
    out = capsys.readouterr().out
    assert "the producers waited on the spool budget 75% of the time (throttled: 400 tok/s measured)" in out
    assert "producer 1.6K tok/s" in out
    # unthrottled, 1600 vs 3000 tok/s per GPU: 5 producers + 3 consumers, not the 7 + 1 the throttled rate gives
    assert "best: 5 producers + 3 consumers" in out, out


def test_an_ab_file_without_the_default_variant_is_named_as_such(tmp_path, capsys):
    """consumer_ab's ab.jsonl with only a non-default variant: ignored, and said to be a consumer_ab result
    that lacks the default flags' variant (it was called "not a consumer_ab result")."""
    ab = tmp_path / "ab.jsonl"
    ab.write_text("".join(json.dumps(r) + "\n" for r in AB_JSONL if r["variant"] != "default"))
    notes: list[str] = []
    assert plan.read_bench_figures([str(ab)], notes) == {}
    assert notes == [
        f"--bench {ab}: a consumer_ab result without the default flags' variant (it has liger; the "
        "consumer rate is the variant named default or with empty flags, e.g. --variant default=), ignored"
    ]
    failed = [
        {**r, "error": "CUDA out of memory", "real_tok_s": None}
        for r in AB_JSONL
        if r["variant"] == "default"
    ]
    ab.write_text("".join(json.dumps(r) + "\n" for r in failed))
    notes.clear()
    plan.read_bench_figures([str(ab)], notes)
    assert "default-flags variant 'default' measured no rate (CUDA out of memory)" in notes[0]
    # an ab.jsonl of the default variant alone (one line: it parses as one JSON object) gives its rate
    ab.write_text(json.dumps(AB_JSONL[2]) + "\n")
    assert plan.read_bench_figures([str(ab)]) == {"8b": {"consumer_tok_s": 22_109}}


def test_the_plan_says_which_files_gave_which_rates_and_which_shapes_a_flag_overrode(tmp_path, capsys):
    """--bench with --consumer-tok-s: the flag's rate is used for every shape, and the plan says so per
    shape (the measured rate it replaces, or that the shape had none); every file is named with what it
    gave; a later file's figure over an earlier one's is said with both values."""
    files = {
        "p32.json": json.dumps(PRODUCER_BENCH_32B),
        "ph.json": json.dumps(PRODUCER_BENCH_HYBRID),
        "c32.json": json.dumps(CONSUMER_BENCH),
        "p32_again.json": json.dumps({**PRODUCER_BENCH_32B, "results": {"producer_full": {"tok_s": 9_500}}}),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    paths = [str(tmp_path / n) for n in files]
    plan.main(["--gpus", "8", "--bench", ",".join(paths), "--consumer-tok-s", "20000"])
    out = capsys.readouterr().out
    assert f"  {paths[0]}: 32b producer\n" in out and f"  {paths[2]}: 32b consumer\n" in out
    assert (
        "--consumer-tok-s 20.0K tok/s used for every shape: replaces the measured consumer rate of 32b "
        "(21.6K); gives hybrid27b one (none measured)" in out
    )
    assert (
        f"--bench {paths[3]}: shape 32b producer rate 9.5K tok/s replaces 9.0K tok/s from {paths[0]}" in out
    )
    plan.main(["--gpus", "8", "--bench", ",".join(paths), "--consumer-tok-s", "20000", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert [p["consumer_tok_s"] for p in got["plans"]] == [20_000, 20_000]
    assert len(got["rates_from"]) == 4 and got["given"][0].startswith("--consumer-tok-s 20.0K")


def test_a_flag_over_a_measured_rate_is_said_with_both_values(tmp_path, capsys):
    run = _run(tmp_path, [[9000, 9000]], [[9500, 9500]])
    plan.main(["--gpus", "4", str(run), "--consumer-tok-s", "1000"])
    assert (
        "consumer rate 1.0K tok/s from --consumer-tok-s, not the 9.5K tok/s measured"
        in capsys.readouterr().out
    )


AB_JSONL_HYBRID = [  # ops/bench/consumer_ab.py --preset hybrid27b: OUT/ab-hybrid27b/ab.jsonl
    {"variant": "reference", "shape": "hybrid27b", "ms_per_step": 190.0, "context_tok_s": 21_558},
    {"variant": "prefill", "prefill_s": 33.0, "prefill_tokens": 300_000},
    {
        "variant": "default",
        "flags": "",
        "ms_per_step_median": 120.0,
        "vs_reference": 1.583,
        "fill": 0.99,
        "precision": "amp",
        "rc": 0,
        "preset": "hybrid27b",
        "context_tokens": 4096,
        "real_tok_s": 33_792,
    },
]


def test_a_hybrid_ab_of_the_default_flags_gives_the_hybrid_its_consumer_rate_and_a_plan(tmp_path, capsys):
    """The hybrid's producer rate (producer_bench) and its consumer rate (consumer_ab --preset hybrid27b,
    the default flags' variant, in ab-hybrid27b/ab.jsonl): the hybrid node is planned. An A/B that measured
    only other flags gives no rate, and the plan says which variants it had."""
    (tmp_path / "ab-hybrid27b").mkdir()
    ab = tmp_path / "ab-hybrid27b" / "ab.jsonl"
    ab.write_text("".join(json.dumps(r) + "\n" for r in AB_JSONL_HYBRID))
    prod = tmp_path / "producer_bench_hybrid27b.json"
    prod.write_text(json.dumps(PRODUCER_BENCH_HYBRID))
    shapes = plan.read_bench_figures([str(prod), str(ab)])
    assert shapes == {"hybrid27b": {"producer_tok_s": 8_000.0, "consumer_tok_s": 33_792}}
    plan.main(["--gpus", "8", "--bench", f"{prod},{ab}", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert [p["shape"] for p in got["plans"]] == ["hybrid27b"] and not got["not_planned"]

    mixed_only = [
        dict(r, variant="mixed", flags="--precision mixed") if r.get("preset") else r for r in AB_JSONL_HYBRID
    ]
    ab.write_text("".join(json.dumps(r) + "\n" for r in mixed_only))
    notes: list[str] = []
    assert plan.read_bench_figures([str(prod), str(ab)], notes) == {"hybrid27b": {"producer_tok_s": 8_000.0}}
    assert any("a consumer_ab result without the default flags' variant (it has mixed;" in n for n in notes)
