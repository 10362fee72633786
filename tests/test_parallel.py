"""parallel.py: tensor, sequence, context, expert and data parallelism (and their
compositions with the pipeline) against one process, in real torchrun processes on the CPU.
The per-step comparisons (loss, every gradient, every weight) and the traffic-vs-formula
checks run inside parallel.py --check; dist_parallel_check.py runs every layout of one
world size in one launch, and here we read the verdicts."""
import pytest

import parallel
from dist_parallel_check import BAD, LAYOUTS
from harness import python_cmd, run_together, torchrun
from model import get_config
from core.errors import UserError

CHECK = "tests/dist_parallel_check.py"


def launch(world, text_file):
    result = torchrun(CHECK, [world, text_file], nproc=world, timeout=400)
    assert result.returncode == 0, result.output[-4000:]
    for flags in LAYOUTS[world]:
        assert "LAYOUT OK " + " ".join(flags) in result.output, result.output[-4000:]
    assert result.output.count("CHECK traffic") == len(LAYOUTS[world])
    return result.output


def memory(out, flags):
    line = next(l for l in out.splitlines() if l.startswith("MEMORY " + flags + " |"))
    return [int(part.split()[-1]) for part in line.split("|")[1:]]   # activations, state


@pytest.mark.slow
def test_two_ranks_every_dimension_alone_and_dtensor_tp(text_file):
    out = launch(2, text_file)
    assert "CHECK step 1: every layer's expert loads and loss-free bias equal" in out
    for flags in BAD[2]:
        assert "REFUSED " + " ".join(flags) in out
    assert "CHECK hand TP = DTensor TP (tp=2)" in out
    # what each split saves on a rank, same global batch of 4 sequences:
    dp_act, dp_state = memory(out, "--dp 2")
    tp_act, tp_state = memory(out, "--tp 2")
    sp_act, sp_state = memory(out, "--tp 2 --sp")
    cp_act, cp_state = memory(out, "--cp 2")
    assert tp_state < 0.55 * dp_state and sp_state == tp_state       # weights, grads, Adam ÷2
    assert cp_state == dp_state                                       # cp replicates them
    assert sp_act < tp_act          # sp keeps the norm and residual activations as shards
    assert cp_act < tp_act and abs(cp_act - dp_act) < 0.1 * dp_act     # half the tokens,
    # like dp's half of the batch (tp leaves the norms' and the residual's replicated)


@pytest.mark.slow
def test_four_ranks_tp4_cp4_tp_x_cp_and_experts(text_file):
    out = launch(4, text_file)
    assert "experts got no token" in out       # the batch where an expert sat idle
    # DeepSeek-V3's MoE under dp × ep and pp × ep: loads and bias equal one process's
    assert out.count("loss-free bias equal one process's") == 2 * 2


@pytest.mark.slow
def test_eight_ranks_dp_x_pp_x_tp_and_pp_x_cp_x_tp(text_file):
    out = launch(8, text_file)
    assert "CHECK step 2 dp=2 × pp=2 × tp=2" in out     # 3 optimizer steps


def check(cfg_overrides=None, world=2, batch=4, seq=32, **layout):
    cfg = get_config("tiny", **(cfg_overrides or {}))
    parallel.check_layout(parallel.Layout(**layout), cfg, world, batch, seq)


@pytest.mark.parametrize("kwargs,message", [
    (dict(world=2, tp=4), "needs 4 processes, but 2 were launched"),
    (dict(world=3, tp=3), "does not divide n_head=4"),
    (dict(world=4, tp=4), "does not divide n_kv_head=2"),  # tiny: 4 heads, 2 KV heads
    (dict(world=2, tp=2, cfg_overrides=dict(n_kv_head=1)), "does not divide n_kv_head=1"),
    (dict(world=2, cp=2, seq=30), "not divisible into 4 equal chunks"),
    (dict(world=2, cp=2, seq=31, zigzag=False), "not divisible into 2 equal chunks"),
    (dict(world=4, cp=2, tp=2, sp=True, seq=6, zigzag=False), "do not split evenly over tp=2"),
    (dict(world=2, ep=2, cfg_overrides=dict(n_expert=3)), "does not divide the 3 experts"),
    (dict(world=2, ep=2), "needs a mixture-of-experts model"),
    (dict(world=2, tp=2, cfg_overrides=dict(n_expert=4)), "spread a mixture of experts with --ep"),
    (dict(world=2, dp=2, batch=3), "not divisible into 2 data replicas"),
    (dict(world=2, pp=2, cfg_overrides=dict(n_layer=3), microbatches=4), "not divisible"),
    (dict(world=2, dp=0), "must be at least 1"),
    (dict(world=2, tp=2, cfg_overrides=dict(n_extra_heads=1)), "without --tp and --cp"),
])
def test_bad_layouts_get_one_clear_message(kwargs, message):
    with pytest.raises(UserError, match=message):
        check(**kwargs)


def test_good_layouts_pass():
    check(world=8, dp=2, pp=2, tp=2, microbatches=2, cfg_overrides=dict(n_layer=4))
    check(world=4, cp=2, tp=2, sp=True)
    check(world=4, ep=4, cfg_overrides=dict(n_expert=8))


def test_command_line(text_file, tmp_path):
    helped, alone = run_together([python_cmd("parallel.py", "--help"),
                                  python_cmd("parallel.py", "--tp", "2", "--data", text_file)],
                                 timeout=60)
    assert helped.returncode == 0 and "--cp-layout" in helped.output and "plan" in helped.output
    assert alone.returncode == 2 and "trains under torchrun" in alone.output
    assert "Traceback" not in alone.output


@pytest.mark.slow
def test_bad_layout_under_torchrun_one_message_no_hang(text_file):
    result = torchrun("parallel.py", ["--preset", "tiny", "--data", text_file, "--tp", "2",
                                      "--n-kv-head", "1"], nproc=2, timeout=120)
    assert result.returncode != 0
    assert result.output.count("error: --tp 2 does not divide n_kv_head=1") == 1, result.output
