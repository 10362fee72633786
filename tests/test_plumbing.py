import pytest
import torch
import torch.nn as nn

from harness import torchrun
from core.cli import fmt_bytes
from core.errors import UserError
from core.meters import ActivationMeter, model_state_bytes
from core.runtime import pick_device


@pytest.mark.slow
def test_comm_meter_under_torchrun():
    """Real processes, real gloo collectives: data moved right and bytes counted right."""
    result = torchrun("tests/dist_plumbing_check.py", nproc=3)
    assert result.returncode == 0, result.output
    assert "plumbing check ok on 3 ranks" in result.output


def test_model_state_bytes_counts_adam_exactly():
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 5))
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    s = model_state_bytes(model, opt)
    assert s["params"] == 4 * n and s["grads"] == 4 * n and s["optimizer"] == 8 * n
    assert s["opt_scalars"] == 4 * 4            # one fp32 step counter per parameter tensor
    assert s["total"] == 16 * n + 16


def test_activation_meter_counts_saved_tensors_not_weights():
    lin = nn.Linear(100, 100, bias=False)
    x = torch.randn(8, 100, requires_grad=True)
    with ActivationMeter(lin) as meter:
        out = torch.relu(lin(x))     # matmul saves x (and the weight: excluded); relu saves out
    assert out.requires_grad and meter.bytes == 2 * 8 * 100 * 4
    with ActivationMeter(lin) as meter:
        with torch.no_grad():
            lin(x)
    assert meter.bytes == 0


def test_helpers():
    assert fmt_bytes(112e9) == "112.0 GB" and fmt_bytes(12) == "12 B"
    assert pick_device("cpu").type == "cpu"
    with pytest.raises(UserError):
        pick_device("tpu")


def test_a_mistyped_flag_is_named_even_before_a_positional_mode():
    """argparse alone reads `--stpes 10` as an unknown flag plus a mode "10" and names the
    mode; cli.ArgumentParser names the flag and the nearest real one."""
    import pytest
    from core.cli import ArgumentParser
    from core.errors import UserError
    p = ArgumentParser(prog="demo")
    p.add_argument("mode", nargs="?", default="train", choices=["train", "bench"])
    p.add_argument("--steps", type=int, default=3)
    sub_free = p.parse_args(["--step", "7"])             # an unambiguous prefix still works
    assert sub_free.steps == 7 and sub_free.mode == "train"
    with pytest.raises(UserError, match=r"unknown flag --stpes \(did you mean --steps\?\)"):
        p.parse_args(["--stpes", "10"])
    with pytest.raises(UserError, match="unknown flag --zzz"):
        p.parse_args(["bench", "--zzz=1"])


def test_progress_prints_percent_elapsed_and_eta_at_most_every_interval(capsys):
    from core.runtime import Progress
    now = [0.0]
    progress = Progress("build", total=10, every=5.0, clock=lambda: now[0])
    for done in range(10):
        now[0] = 2.0 * done          # 2 s per item
        progress.update(done)
    now[0] = 20.0
    progress.update(10)
    lines = capsys.readouterr().out.splitlines()
    # printed at t = 6 (3 done), 12 (6 done), 18 (9 done), and the end
    assert lines[0] == "build: 30% (3/10) | 6 s | eta 14 s"
    assert len(lines) == 4 and lines[-1] == "build: 100% (10/10) | 20 s | eta 0 s"


def test_progress_names_the_configuration_it_starts_and_guesses_no_eta_before_one(capsys):
    from core.runtime import Progress
    now = [0.0]
    progress = Progress("bench", total=3, every=0, clock=lambda: now[0])
    for done, label in enumerate(["fp32", "bf16", "fp16"]):
        now[0] = 4.0 * done
        progress.update(done, now_on=label)
    assert capsys.readouterr().out.splitlines() == [
        "bench: 0% (0/3) | 0 s | eta ? | now: fp32",
        "bench: 33% (1/3) | 4 s | eta 8 s | now: bf16",
        "bench: 66% (2/3) | 8 s | eta 4 s | now: fp16"]


def test_progress_counts_in_its_unit(capsys):
    """A run of one method counts its steps: `lora: 40% (80/200 steps)`, not 0 of 1 methods."""
    from core.runtime import Progress
    now = [0.0]
    progress = Progress("lora", total=200, every=10.0, clock=lambda: now[0], unit="steps")
    now[0] = 12.0
    progress.update(80)
    assert capsys.readouterr().out.splitlines() == ["lora: 40% (80/200 steps) | 12 s | eta 18 s"]


def test_timing_conditions_warn_on_a_loaded_machine_or_a_wide_spread():
    """One judge for every command that prints a time: a load average over the cores, read
    as the timed part starts or ends, or repeats whose median is far off their best, give
    ONE warning line naming why; a quiet machine with steady repeats gives none."""
    from core.runtime import spread, TimingConditions
    narrow, wide = {"a": [1.0, 1.05, 1.1]}, {"a": [1.0, 1.05], "b": [1.0, 1.6, 1.7]}
    assert spread([1.0, 1.6, 1.7]) == pytest.approx(1.6)
    loads = iter([0.5, 4.5])                 # quiet as it starts, loaded as it ends
    with TimingConditions(reader=lambda: next(loads), cores=2) as busy:
        pass
    line = busy.verdict(narrow)
    assert line.startswith("warning: ") and "load average 0.5 -> 4.5 on 2 cores" in line
    assert "\n" not in line and "spread" not in line
    printed = []                             # report: the same line, printed once
    assert busy.report(narrow, out=printed.append) == line and printed == [line]
    with TimingConditions(reader=lambda: 1.5, cores=2) as quiet:
        pass
    assert quiet.verdict(narrow) is None and quiet.verdict({"one run": [9.0]}) is None
    assert quiet.report(narrow, out=printed.append) is None and len(printed) == 1
    line = quiet.verdict(wide)               # the worst row is named, with its spread
    assert "repeats of 'b' spread 1.60x" in line and "load" not in line
    both = TimingConditions(reader=lambda: 3.0, cores=2)
    with both:
        pass
    assert "load average" in both.verdict(wide) and "spread" in both.verdict(wide)
    # no load average on this OS (Windows): judged on the spread alone
    with TimingConditions(reader=lambda: None, cores=2) as blind:
        pass
    assert blind.verdict(narrow) is None and blind.verdict(wide) is not None
