# The step-time and dollar model (parallelism/cost_model.py) and the planner's time columns:
# the α–β fit recovers known constants, the FLOP count equals a count of model.py's own
# weights, the bubble formula equals the idle slots of parallelism/pipeline.py's step
# tables, the published-run predictions are computed (a hand recomputation agrees) and land
# in the stated band, the serving dollars equal the hand formula. Arithmetic: no process group.
import argparse
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from core.errors import UserError
from core.meters import GPU_PEAK_BF16_FLOPS
from harness import ROOT
from model import GPT, get_config
from parallelism.cost_model import (GPUS, SERVE_SHAPES, Link, StepWork, bubble_fraction,
                                    collective_seconds, comm_seconds, dense_params, fit_link,
                                    gpu, kv_bytes_per_token, predict_step, repo_overlap,
                                    ring_factors, serving_cost, shape_from_config,
                                    train_flops_per_token)
from parallelism.pipeline import build_schedule
from parallelism.planner import (PUBLISHED, add_plan_arguments, layout_collectives, plan,
                                 plan_layouts, published_runs)

# the ratio band the published runs must land in (docs/cost.md states it)
BAND = (0.5, 2.0)


def synthetic_timings(link, rng, noise):
    """Timings of every collective over 2-8 ranks, 1 KB to 256 MB, from `link`, each times
    (1 + noise·N(0, 1)): what scripts/cost_check.py measures on a real machine."""
    samples = []
    for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send"):
        for p in (2, 4, 8):
            for nbytes in 2 ** np.arange(10, 29, 2):
                t = collective_seconds(op, float(nbytes), p, link)
                samples.append((op, int(nbytes), p, t * (1 + noise * rng.standard_normal())))
    return samples


@pytest.mark.parametrize("alpha, beta", [(5e-6, 20e9), (60e-6, 1.2e9)])   # NVLink-ish, gloo-ish
def test_fit_recovers_alpha_and_beta_from_noisy_timings(alpha, beta):
    rng = np.random.default_rng(0)
    link, residuals = fit_link(synthetic_timings(Link(alpha, beta), rng, noise=0.02))
    assert link.alpha == pytest.approx(alpha, rel=0.02)
    assert link.beta == pytest.approx(beta, rel=0.02)
    assert np.abs(residuals).max() < 0.1          # 2% noise: every sample within a few σ
    exact, residuals = fit_link(synthetic_timings(Link(alpha, beta), rng, noise=0.0))
    assert exact.alpha == pytest.approx(alpha, rel=1e-9) and np.abs(residuals).max() < 1e-9


def test_fit_refuses_what_cannot_be_fitted():
    one_size = [("all_reduce", 1 << 20, 4, 1e-3), ("all_reduce", 1 << 20, 4, 1.1e-3)]
    with pytest.raises(UserError, match="cannot separate"):
        fit_link(one_size)
    shrinking = [("send", 1 << 10, 2, 1e-3), ("send", 1 << 20, 2, 1e-4),
                 ("send", 1 << 24, 2, 1e-5)]
    with pytest.raises(UserError, match="β ≤ 0"):
        fit_link(shrinking)
    with pytest.raises(UserError, match="positive seconds"):
        fit_link([("send", 1 << 10, 2, 0.0), ("send", 1 << 20, 2, 1e-3)])


def test_ring_factors_are_the_textbook_ones_on_commmeter_payloads():
    link, n, p = Link(1e-5, 1e10), 8e6, 8
    # all-reduce: 2(p−1)α + 2(p−1)/p · n/β
    assert collective_seconds("all_reduce", n, p, link) == pytest.approx(
        14e-5 + 2 * 7 / 8 * n / 1e10)
    # all-gather: CommMeter records the input shard n/p; the textbook's n is the output
    assert collective_seconds("all_gather", n / p, p, link) == pytest.approx(
        7e-5 + 7 / 8 * n / 1e10)
    assert collective_seconds("reduce_scatter", n, p, link) == pytest.approx(7e-5 + 7 / 8 * n / 1e10)
    assert collective_seconds("all_to_all", n, p, link) == pytest.approx(7e-5 + 7 / 8 * n / 1e10)
    assert collective_seconds("send", n, 2, link) == pytest.approx(1e-5 + n / 1e10)
    assert ring_factors("recv", 2) == (0, 0.0) and ring_factors("all_reduce", 1) == (0, 0.0)


def test_comm_seconds_prices_a_commmeter_table():
    # core/meters.py's CommMeter.table(): (op, group, calls, payload, wire)
    rows = [("all_reduce", "dp", 10, 4e8, 6e8), ("send", "pp", 4, 1e6, 1e6),
            ("recv", "pp", 4, 1e6, 0)]
    links = {"dp": Link(1e-5, 1e10), "pp": Link(2e-5, 5e9)}
    got = comm_seconds(rows, links, {"dp": 4, "pp": 2})
    assert got[("all_reduce", "dp")] == pytest.approx(10 * 6 * 1e-5 + 1.5 * 4e8 / 1e10)
    assert got[("send", "pp")] == pytest.approx(4 * 2e-5 + 1e6 / 5e9)
    assert got[("recv", "pp")] == 0            # the send prices the pair
    with pytest.raises(UserError, match="no link or size given for group 'tp'"):
        comm_seconds([("all_gather", "tp", 1, 1e6, 1e6)], links, {"dp": 4})


@pytest.mark.parametrize("preset", ["tiny", "small", "draft"])
def test_flops_per_token_equal_a_count_of_the_models_own_weights(preset):
    cfg = get_config(preset)
    model = GPT(cfg, seed=None)
    # the weights that multiply activations: every 2-D parameter but the embedding table
    matmul = sum(p.numel() for name, p in model.named_parameters()
                 if p.dim() == 2 and not name.startswith("tok_embeddings"))
    counts = dense_params(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.ffn_dim,
                          cfg.vocab_size)
    assert counts["matmul"] == matmul
    assert sum(counts.values()) == model.num_params()
    L, h, s = cfg.n_layer, cfg.n_embd, cfg.block_size
    assert train_flops_per_token(matmul, L, h, s) == 6 * matmul + 12 * L * h * s
    # full recomputation runs one more forward: 8Ψ instead of 6Ψ (and 16·L·h·s)
    assert train_flops_per_token(matmul, L, h, s, "full") == 8 * matmul + 16 * L * h * s
    assert train_flops_per_token(matmul, L, h, s, "selective") == 6 * matmul + 16 * L * h * s
    # model.py's own MFU count differs by its norms only (it counts every non-embedding weight)
    assert model.flops_per_token(s) - train_flops_per_token(matmul, L, h, s) == \
        6 * counts["norms"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 4), (4, 8), (8, 3), (3, 7)])
def test_bubble_formula_equals_the_idle_slots_of_the_step_table(schedule, p, m):
    # pipeline.py places every action on a grid where an F or a B takes one slot and
    # starts as soon as its inputs exist: a rank's idle fraction is its empty slots
    actions = build_schedule(schedule, p, m)
    slots = 1 + max(a.slot for row in actions for a in row)
    for row in actions:
        assert 1 - len(row) / slots == pytest.approx(bubble_fraction(p, m), abs=1e-12)
    assert bubble_fraction(p, m, virtual=2) < bubble_fraction(p, m) or p == 1


def test_predict_step_by_hand():
    g = gpu("H100")
    work = StepWork(flops=0.8e15, hw_flops=0.989e15, bubble=0.5,
                    comm={"TP": 1.0, "DP": 1.0}, hidden={"DP": 0.25})
    p = predict_step(work, g, efficiency=0.5)
    assert p.compute == pytest.approx(2.0)
    assert p.exposed == pytest.approx({"TP": 1.0, "DP": 0.5})     # DP hidden under 0.25·2 s
    assert p.step == pytest.approx((2.0 + 1.0) / 0.5 + 0.5)       # DP after the drain
    assert p.mfu == pytest.approx(0.8e15 / (6.5 * 989e12))
    # this repo: DDP's buckets hide under the last micro-step's backward; ZeRO blocks
    assert repo_overlap("ddp", 4, 0.1)["DP"] == pytest.approx(1 / 6)
    assert repo_overlap("zero3", 4, 0.1)["DP"] == 0 and repo_overlap("zero1", 4, 0.1)["TP"] == 0


def plan_args(*argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args([str(a) for a in argv])


def test_planner_collectives_are_its_bytes_and_its_time_columns():
    llama = PUBLISHED[0].argv.split()
    args = plan_args(*llama)
    psi, _, rows, best = plan_layouts(args)
    sent = {}
    for c in layout_collectives(args, psi, 8, 1, 16, 128, 16):
        sent[c.dim] = sent.get(c.dim, 0) + c.wire
    assert sent["TP"] == pytest.approx(best.sent["TP"]) and sent["DP"] == pytest.approx(
        best.sent["DP"])
    assert "step s" not in plan(plan_args(*llama[:-2]))          # no GPU: memory only
    timed = plan(plan_args(*llama, "--rank-by", "time")).splitlines()
    steps = [float(line.split("|")[3].split()[0]) for line in timed
             if line.endswith(" fits") and line.count("|") == 3]
    assert steps == sorted(steps) and len(steps) > 1             # fastest first
    assert "fastest that fits" in "\n".join(timed)


def test_published_runs_are_computed_and_land_in_the_band():
    rows = published_runs()
    for row in rows:
        if row.how != "as published":
            continue
        if row.run.mfu is not None:
            assert BAND[0] <= row.predicted.mfu / row.run.mfu <= BAND[1]
        assert BAND[0] <= row.cost.gpu_hours / row.run.gpu_hours <= BAND[1]
    # Llama 3 405B as published, by hand: 6Ψ + 12·L·h·s per token (selective recompute runs
    # attention's forward once more), TP's 512 all-gathers and reduce-scatters per step on
    # NVLink (450 GB/s, 2 µs), DP and PP hidden, the 1F1B bubble 15/31
    llama = rows[0]
    V, h, L, s = 128256, 16384, 126, 8192
    active = 405e9 - V * h                                       # --params 405B, less the table
    model = 6 * active + 12 * L * h * s
    hw = model + 4 * L * h * s
    tokens = 16 * 2**20
    compute = tokens * hw / 16384 / (989e12 * 0.75)
    act = s * h * 2
    tp = 512 * (7 * 2e-6 + 7 * (act / 8) / 450e9) + 512 * (7 * 2e-6 + 7 / 8 * act / 450e9)
    step = (compute + tp) / (1 - 15 / 31)
    assert llama.flops_per_token == pytest.approx(model)
    assert llama.predicted.step == pytest.approx(step)
    assert llama.predicted.mfu == pytest.approx(tokens * model / 16384 / (step * 989e12))
    assert llama.cost.gpu_hours == pytest.approx(step * 15.6e12 / tokens * 16384 / 3600)
    # DeepSeek-V3: $ at $2 per GPU-hour, as its report prices them
    v3 = rows[2]
    assert v3.cost.dollars == pytest.approx(2 * v3.cost.gpu_hours)
    assert v3.run.dollars == pytest.approx(2 * v3.run.gpu_hours)


def test_serving_dollars_equal_the_hand_formula():
    s, g = SERVE_SHAPES["70B"], gpu("H100", price=2.0)
    weights = 80 * (2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672) + 128256 * 8192 \
        + (2 * 80 + 1) * 8192                                    # matmuls + norms, no table
    kv = 2 * 80 * 8 * 128 * 2                                    # K, V · layers · kv heads · d
    assert kv_bytes_per_token(s) == kv
    read = 2 * weights + 64 * 2048 * kv
    row = serving_cost(s, g, batch=64, context=2048)
    assert row.tp == 4 and row.bytes == pytest.approx(read)     # 182 GB: 4 × 80 GB at 90%
    step = read / (4 * 3.35e12)                                  # memory-bound
    assert row.bound == "memory" and row.step == pytest.approx(step)
    assert row.tok_s_per_gpu == pytest.approx(64 / step / 4)
    assert row.usd_per_mtok == pytest.approx(2.0 / 3600 / (64 / step / 4) * 1e6)
    # the demo shape is model.py's small preset
    demo = shape_from_config(get_config("small"), SERVE_SHAPES["demo"].name)
    assert replace(demo, weight_bytes=4, kv_bytes=4) == SERVE_SHAPES["demo"]   # served fp32


def test_gpu_table_agrees_with_the_meters():
    for name, g in GPUS.items():
        if name in GPU_PEAK_BF16_FLOPS:
            assert g.peak_flops == GPU_PEAK_BF16_FLOPS[name]


@pytest.mark.parametrize("call, message", [
    (lambda: gpu("B300"), "unknown GPU 'B300': choose one of H100"),
    (lambda: gpu("H100", price=-2), "price must be positive"),
    (lambda: ring_factors("gather", 4), "unknown collective"),
    (lambda: train_flops_per_token(1, 1, 1, 1, "half"), "unknown recompute"),
    (lambda: bubble_fraction(0, 4), "p, m, v ≥ 1"),
    (lambda: plan(plan_args("--gpu", "B300")), "unknown GPU"),
    (lambda: plan(plan_args("--price", "-1")), "price must be positive"),
    (lambda: plan(plan_args("--hide", "XP")), "--hide takes"),
])
def test_bad_input_is_one_clear_error(call, message):
    with pytest.raises(UserError, match=message):
        call()


def test_command_line_error_is_one_line():
    done = subprocess.run([sys.executable, "-m", "parallelism.cost_model", "--price", "-1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: a price must be positive $ per GPU-hour, got -1.0"]
