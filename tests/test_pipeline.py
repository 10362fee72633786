"""pipeline.py: the schedules as data (complete, dependency-respecting, the bubble and memory
the papers promise, checked by an event simulation written here), the zero-bubble weight-
gradient split, every schedule on one process against gradient accumulation, and real
torchrun runs at P=2 and P=4 (tests/dist_pipeline_check.py, which also checks the bench
against torch.distributed.pipelining)."""
from collections import Counter

import pytest
import torch
import torch.nn as nn

from parallelism import pipeline
from harness import run_python, torchrun
from model import GPT, get_config
from core.errors import UserError

CHECK = "tests/dist_pipeline_check.py"


def valid_cases(max_p=4):
    for schedule in pipeline.SCHEDULES:
        for P in range(1, max_p + 1):
            low = 2 * P if schedule == "dualpipev" else 1
            for M in range(low, max(low, 2 * P + 2) + 1):
                yield schedule, P, M


def test_split_layers_and_stage_ranks():
    assert pipeline.split_layers(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    for n_layer, n_stages in [(5, 2), (4, 0), (2, 4)]:
        with pytest.raises(UserError, match="not divisible into stages"):
            pipeline.split_layers(n_layer, n_stages)
    assert pipeline.stage_ranks("1f1b", 3) == {0: 0, 1: 1, 2: 2}
    assert pipeline.stage_ranks("dualpipev", 4) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 3, 5: 2, 6: 1,
                                                     7: 0}


def test_bad_schedule_arguments_raise_user_errors():
    with pytest.raises(UserError, match="unknown schedule"):
        pipeline.build_schedule("interleaved", 2, 4)
    with pytest.raises(UserError, match="at least 1"):
        pipeline.build_schedule("1f1b", 2, 0)
    with pytest.raises(UserError, match="needs at least 2·P = 8 microbatches for P=4"):
        pipeline.build_schedule("dualpipev", 4, 7)


def test_every_schedule_is_complete_and_respects_dependencies():
    """Independently of the builder's own grid: each (stage, mb) has one F, one backward
    (B, or I plus one later W on the same rank), every action starts after what it needs,
    and send_at is the slot of the consumer on the other rank."""
    for schedule, P, M in valid_cases():
        per_rank = pipeline.build_schedule(schedule, P, M)
        n_stages = 2 * P if schedule == "dualpipev" else P
        owner = pipeline.stage_ranks(schedule, P)
        where, label = {}, (schedule, P, M)
        for r, row in enumerate(per_rank):
            assert [a.slot for a in row] == sorted({a.slot for a in row}), label
            for a in row:
                assert owner[a.stage] == r, label
                key = ("back" if a.kind in "BI" else a.kind, a.stage, a.mb)
                assert key not in where, (label, a)
                where[key] = a
                if a.kind == "B":
                    assert ("W", a.stage, a.mb) not in where, label
        for s in range(n_stages):
            for m in range(M):
                f, back = where[("F", s, m)], where[("back", s, m)]
                assert f.slot < back.slot, label
                if s > 0:
                    assert where[("F", s - 1, m)].slot < f.slot, label
                if s < n_stages - 1:
                    assert where[("back", s + 1, m)].slot < back.slot, label
                w = where.get(("W", s, m))
                assert (w is not None) == (back.kind == "I"), label
                if w is not None:
                    assert back.slot < w.slot, label
                for a, to in ((f, ("F", s + 1, m)), (back, ("back", s - 1, m))):
                    consumer = where.get(to)
                    crosses = consumer is not None and owner[to[1]] != owner[s]
                    assert a.send_at == (consumer.slot if crosses else -1), (label, a)
        kinds = Counter(a.kind for row in per_rank for a in row)
        assert kinds["F"] == n_stages * M and kinds["B"] + kinds["I"] == n_stages * M, label
        assert kinds["W"] == kinds["I"], label
        assert (kinds["I"] > 0) == (schedule in ("zb", "dualpipev")), label


def simulate(per_rank, n_stages, times):
    """Event simulation: each rank runs its list in order, an action starts when the rank
    is free and its inputs exist (communication free). -> idle time per rank."""
    done, clock, busy = {}, [0.0] * len(per_rank), [0.0] * len(per_rank)
    todo = [list(row) for row in per_rank]
    while any(todo):
        progressed = False
        for r, row in enumerate(todo):
            while row:
                a = row[0]
                deps = pipeline.needs(a.kind, a.stage, a.mb, n_stages)
                if not all(d in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = start + times[a.kind]
                busy[r] += times[a.kind]
                for what in pipeline.PROVIDES[a.kind]:
                    done[(what, a.stage, a.mb)] = clock[r]
                row.pop(0)
                progressed = True
        assert progressed, "deadlock"
    return [max(clock) - b for b in busy]


@pytest.mark.parametrize("P,M", [(2, 8), (4, 8), (4, 16)])
def test_bubbles_and_memory_as_the_papers_say(P, M):
    """F = I = W = 1 (a full backward B = 2): 1F1B idles (P-1)(F+B) per rank, ZB-H1
    (P-1)(F+B-2W) -- a third -- and DualPipeV at most (P-1)(F&B+B-3W). 1F1B and ZB-H1 hold
    at most P-r microbatches on rank r, GPipe all M."""
    times = {"F": 1, "I": 1, "W": 1, "B": 2}
    idle = {s: simulate(pipeline.build_schedule(s, P, M), 2 * P if s == "dualpipev" else P,
                        times) for s in pipeline.SCHEDULES}
    assert idle["gpipe"] == idle["1f1b"] == [(P - 1) * 3] * P
    assert idle["zb"] == [(P - 1) * 1] * P
    assert all(x <= (P - 1) * (3 + 2 - 3) for x in idle["dualpipev"])
    for s, want in [("gpipe", lambda r: M), ("1f1b", lambda r: P - r), ("zb", lambda r: P - r)]:
        peaks = [pipeline.peak_in_flight(row)[0] for row in pipeline.build_schedule(s, P, M)]
        assert peaks == [want(r) for r in range(P)], (s, peaks)
    assert pipeline.theory_bubble("1f1b", P, M, 1, 2, 1) == (P - 1) / (M + P - 1)


def test_format_schedule_prints_the_step_table():
    text = pipeline.format_schedule(pipeline.build_schedule("1f1b", 2, 3))
    assert text.splitlines()[:2] == ["rank 0 | F0 F1 .  B0 F2 B1 .  B2",
                                     "rank 1 | .  F0 B0 F1 B1 F2 B2 ."]
    v = pipeline.format_schedule(pipeline.build_schedule("dualpipev", 2, 4)).splitlines()
    assert v[0].startswith("rank 0 | F0 F1 F2 f0 i0 w0 f1") and "lower case" in v[-1]


def test_deferred_weight_gradient_is_only_dW_and_keeps_hooks():
    torch.manual_seed(0)
    lin = nn.Linear(6, 5)
    lin.register_forward_hook(lambda mod, inp, out: out * 2)   # like a TP hook: must survive
    ref = nn.Linear(6, 5)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(3, 4, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    (2 * ref(x_ref)).pow(2).sum().backward()
    store = pipeline.WeightGradStore()
    with pipeline.DeferWeightGrads(store):
        out = lin(x)
    assert "forward" not in vars(lin)                       # the module itself is untouched
    store.deferring = True
    out.pow(2).sum().backward()
    store.deferring = False
    store.file("key")
    assert lin.weight.grad is None                          # I: no weight gradient yet ...
    torch.testing.assert_close(x.grad, x_ref.grad)          # ... but the input's is right
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)
    assert store.deferred_jobs == 1
    store.run("key")                                        # W
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_one_process_runs_each_schedule_like_gradient_accumulation(schedule):
    """P=1: every stage on this process (DualPipeV: both of the V's stages, handed over
    locally), run_schedule vs a plain loop over microbatches."""
    M, T, n_layer = 4, 16, 2
    cfg = get_config("tiny", n_layer=n_layer)
    data = torch.randint(0, cfg.vocab_size, (M, 2, T + 1),
                         generator=torch.Generator().manual_seed(0))
    xs, ys = [d[:, :-1] for d in data], [d[:, 1:] for d in data]
    ref = GPT(cfg, seed=0)
    ref_loss = 0.0
    for x, y in zip(xs, ys):
        _, loss = ref(x, y)
        (loss / M).backward()
        ref_loss += loss.item() / M
    model = GPT(cfg, seed=0)
    cos, sin = model.rope(torch.arange(T))
    stages = pipeline.build_stages(model, schedule, 1, 0, pipeline.cross_entropy_loss, cos, sin)
    actions = pipeline.build_schedule(schedule, 1, M)[0]
    loss = pipeline.run_schedule(stages, actions, xs, ys, None, (2, T, cfg.n_embd),
                                 torch.float32, "cpu")
    assert abs(loss - ref_loss) < 1e-6
    ref_params = dict(ref.named_parameters())
    held = {n: p for st in stages.values() for n, p in st.named_parameters()}
    assert set(held) == set(ref_params)
    for name, p in held.items():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-7)
    assert not any("forward" in vars(m) for m in model.modules())   # patches removed


def test_cli_show_and_one_line_error():
    actions = pipeline.main(["show", "--schedule", "zb", "--pp", "2", "--microbatches", "4"])
    assert len(actions) == 2
    result = run_python("-m parallelism.pipeline", ["show", "--schedule", "dualpipev", "--pp", "2",
                                        "--microbatches", "3"])
    assert result.returncode == 2, result.output
    assert "error: dualpipev needs at least 2·P = 4 microbatches" in result.output
    assert "Traceback" not in result.output


def _check_run(nproc, args=(), timeout=180):
    result = torchrun(CHECK, list(args), nproc=nproc, timeout=timeout)
    assert result.returncode == 0, result.output
    checks = [line for line in result.output.splitlines() if line.startswith("CHECK")]
    for schedule in pipeline.SCHEDULES:
        assert any(line.startswith(f"CHECK {schedule} P={nproc} ") for line in checks), \
            result.output
    assert any("bad layers" in line for line in checks)
    assert any("bad microbatches" in line for line in checks)
    return checks


@pytest.mark.slow
def test_two_ranks_every_schedule_equals_one_process_and_torch():
    checks = _check_run(2, ["--bench"])
    for schedule in pipeline.SCHEDULES:            # the bench's torch rows ran and matched
        assert any(line.startswith(f"CHECK bench {schedule} P=2: hand loss") and "torch 6." in line
                   for line in checks), checks


@pytest.mark.slow
def test_four_ranks_every_schedule_equals_one_process():
    _check_run(4)
