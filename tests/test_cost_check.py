# scripts/cost_check.py: the calibration's fit reproduces the timings it was fitted on, and
# the table's parser reads what real train.py and parallel.py runs print (their step times
# and their ledgers) into the numbers the prediction is built from. One batch of real
# processes, started together (a 2-rank calibration on a short sweep, a 2-rank ddp run, a
# 2-rank tp run, a bad command line); no assertion on how long anything took.
import json
import math
import statistics

import pytest

from harness import python_cmd, run_together, torchrun_cmd
from core.cli import fmt_bytes
from core.errors import UserError
from core.runtime import run_cli
from model import get_config
from parallelism import cost_model
from scripts import cost_check as cc

STEPS = 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Everything this file reads, started at once: -> dict of Results and the JSON path.
    The runs are the table's own command lines (run_argv) on the tiny model, STEPS steps;
    the calibration a short sweep (3 sizes, 3 repeats) at 2 ranks."""
    folder = tmp_path_factory.mktemp("cost")
    cal_path = folder / "calibration.json"
    calibrate = python_cmd("-m scripts.cost_check", "calibrate", "--size", "tiny",
                           "--ranks", "2", "--sizes", "65536,1048576,4194304",
                           "--repeats", "3", "--out", cal_path)
    ddp = torchrun_cmd(2, *cc.run_argv("ddp", 2, "tiny", STEPS))
    tp = torchrun_cmd(2, *cc.run_argv("tp", 2, "tiny", STEPS))
    # Together, not one after the other: the test reads what they print, never how long
    # they took, and a 2-core machine finishes the three sooner side by side.
    results = run_together([calibrate, ddp, tp], timeout=240)
    for r in results:
        assert r.returncode == 0, r.output
    return dict(zip(("calibrate", "ddp", "tp"), results), cal=str(cal_path))


def test_the_fitted_links_reproduce_the_timings_they_were_fitted_on(runs):
    """Hockney's α + factor·n/β, fitted (cost_model.fit_link) on every collective the repo
    calls at 2 ranks, gives back the timings it was fitted on: the stored residuals are
    what the links say, the typical sample is within half, the constants are sane."""
    cal = json.load(open(runs["cal"]))
    samples = [s for s in cal["samples"] if s[2] == 2]
    assert {s[0] for s in samples} == set(cc.OPS) and len(samples) == 3 * len(cc.OPS)
    # the all-gather's payload is its input shard (CommMeter's), the others' the buffer
    sizes = {op: sorted(n for o, n, _, _ in samples if o == op) for op in cc.OPS}
    assert sizes["all_gather"][0] == 65536 // 2 and sizes["all_reduce"][0] == 65536
    ratios = []
    # each sample priced by the link the table would use for it (per collective when the
    # residuals support that, else per world size)
    for op, nbytes, p, seconds in samples:
        link = cc.link_for(cal, op, p)
        assert link.alpha >= 0 and link.beta > 0
        ratios.append(cost_model.collective_seconds(op, nbytes, p, link) / seconds)
    # what the fit stored as its residuals is what the links say, sample by sample
    fit = cal["fits"]["per_p"]["2"]
    again = [cost_model.collective_seconds(op, n, p, cost_model.Link(fit["alpha"], fit["beta"]))
             / t - 1 for op, n, p, t in samples]
    assert again == pytest.approx(fit["residuals"], rel=1e-6, abs=1e-9)
    # the pricing fit reproduces the samples: the typical one within half (a lone sample
    # may be far off on a busy machine: a 3-4 ms scheduler wake-up in a 0.3 ms call)
    assert statistics.median(abs(r - 1) for r in ratios) < 0.5, ratios
    # and the constants are a loopback link's, not a unit slip (bytes vs elements, ms vs
    # s): start-up under 50 ms, bandwidth between 10 MB/s and 100 GB/s
    for p, ops in cal["fits"]["per_op"].items():
        for f in [*ops.values(), cal["fits"]["per_p"][p]]:
            assert 0 <= f["alpha"] < 0.05 and 1e7 < f["beta"] < 1e11, f


def test_the_calibration_measures_compute_at_every_process_count(runs):
    """The compute side: a matmul rate per process count (1 alone, 2 sharing the cores),
    η per model and token count, the AdamW seconds per parameter, and η read between
    the calibrated token counts as the table reads it."""
    cal = json.load(open(runs["cal"]))
    assert set(cal["rates"]) == {"1", "2"} and cal["size"] == "tiny"
    for rates in cal["rates"].values():
        assert rates["model"]["dense"]["matmul"] > 1e8 and rates["adamw"] > 0
    # one core's rates, undone from each job's sharing (its ranks and the other processes
    # measured beside it: cores, never negative)
    assert set(cal["others"]) == {"1", "2"} and min(cal["others"].values()) >= 0
    assert cal["single"]["dense"] >= min(r["model"]["dense"]["matmul"]
                                         for r in cal["rates"].values())
    assert cc.share({"cores": 2}, 4, 0) == 0.5 and cc.share({"cores": 2}, 1, 0.5) == 1.0
    # η: the whole step's FLOP/s below its matmuls' (norms, softmax, the loss: 0 FLOPs in
    # 6Ψ), at each of the batch sizes the table's runs need
    for model in ("dense", "moe"):
        assert set(cal["eta"][model]) == {str(b * cc.SEQ) for b in cc.BATCHES}
        assert all(0 < e < 1.5 for e in cal["eta"][model].values())
    # between two batch sizes, linear in log(tokens); held at the ends
    e64, e128 = cal["eta"]["dense"]["64"], cal["eta"]["dense"]["128"]
    assert cc.eta_at(cal, "dense", 96) == pytest.approx(e64 + math.log2(1.5) * (e128 - e64))
    assert cc.eta_at(cal, "dense", 8) == e64
    assert "α–β fits" in runs["calibrate"].output and "saved" in runs["calibrate"].output


def test_the_parser_reads_a_real_ddp_run_and_its_bytes_match_the_structure(runs):
    """train.py prints its step times and, per rank, what it sent: the parser reads both,
    and the rows the table prices (built from training/data_parallel.py's DDP buckets)
    send exactly what the run's meter counted."""
    got = cc.parse_run("train.py", runs["ddp"].output)
    # one time per step (--log-interval 1), warm-up included: the table drops WARMUP
    assert len(got.seconds) == STEPS and all(s > 0 for s in got.seconds)
    # the ledger train.py prints under --dp: one row per rank, its bytes sent per step
    assert len(got.sent) == 2
    rows = cc.dp_ledger("ddp", get_config(**cc.MODELS["tiny"]["dense"]), 2)
    op, group, calls, payload, wire = rows[0]
    assert (op, group) == ("all_reduce", "world") and calls >= 1
    # the bucketed gradient of every parameter, all-reduced: 2(N-1)/N of 4Ψ on the wire
    n_params = cc.param_counts(get_config(preset="tiny"))["total"]
    assert payload == 4 * n_params and wire == payload
    # what the run's meter counted (printed to 0.1 of its unit) is what the structure says
    # (+ the 24-byte loss all-reduce every step makes outside the step)
    assert fmt_bytes(got.sent[0]) == fmt_bytes(wire + 24)


def test_the_parser_reads_a_real_tp_run_and_prices_its_ledger(runs):
    """parallel.py prints its ledger by (group, collective): the parser reads the rows,
    each is priced by the fitted link for its collective (comm_seconds), and the whole
    prediction comes out: compute, communication, a step longer than its compute."""
    got = cc.parse_run("parallel.py", runs["tp"].output)
    assert len(got.seconds) == STEPS
    # rank 0's rows per step: (collective, group) -> calls and payload bytes, as printed
    ledger = {(op, group): (calls, payload) for op, group, calls, payload, _ in got.ledger}
    calls, payload = ledger[("all_reduce", "tp")]
    # Megatron: an all-reduce after each block's attention and MLP, forward and backward
    cfg = get_config(preset="tiny")
    assert calls >= 4 * cfg.n_layer and payload > 0
    # priced with this file's own calibration, by dimension: the tp group's rows are "TP",
    # the world's (the gradient norm's one scalar all-reduce) "DP"
    cal = cc.load_calibration(runs["cal"])
    dims = cc.price_ledger(got.ledger, "tp", 2, cal)
    link = cc.link_for(cal, "all_reduce", 2)
    # a ring all-reduce over 2 ranks: 2(p-1) = 2 steps of α per call, 2(p-1)/p = 1 pass
    # of the payload over β -- what the tp rows must cost, and nothing else is "TP"
    assert dims["TP"] == pytest.approx(2 * calls * link.alpha + payload / link.beta, rel=0.02)
    # the whole row, as the table builds it (timed steps only: the warm-up is dropped)
    row = cc.predict("tp", 2, got, got.ledger, cal)
    assert math.isfinite(row.step) and row.step > row.compute > 0 and row.comm > 0
    assert row.measured == got.seconds[cc.WARMUP:]


def test_bad_input_is_one_line(runs, tmp_path, capsys):
    """A missing or foreign calibration, an unknown mode, an uncalibrated world size, a
    malformed flag: each one `error:` line (core.errors.UserError), no traceback."""
    # through run_cli, as `python -m scripts.cost_check` runs: one `error:` line, status 2
    with pytest.raises(SystemExit) as exit_:
        run_cli(cc.main, ["table", "--calibration", str(tmp_path / "nothing.json")])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2
    assert len(lines) == 1 and lines[0].startswith("error: no calibration at"), lines
    with pytest.raises(UserError, match="unknown mode warp"):
        cc.main(["table", "--modes", "ddp,warp", "--calibration", runs["cal"]])
    with pytest.raises(UserError, match="no fit at 8 ranks"):
        cc.main(["table", "--ranks", "8", "--calibration", runs["cal"]])
    with pytest.raises(UserError, match="--sizes takes integers"):
        cc.main(["calibrate", "--sizes", "4KB"])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="not a calibration"):
        cc.main(["table", "--calibration", str(tmp_path / "bad.json")])
