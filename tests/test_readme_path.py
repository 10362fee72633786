"""
The newcomer's path: the README's "how to run" commands, in the README's order, at tiny
sizes, in a fresh folder -- and the demo model they all read (out/ckpt.pt) is unchanged at
the end: no command writes over another's model. Each command has a tiny equivalent named
here (the same script, mode and output paths; smaller flags), or is one of reproduce.py's
runs (checked the same way by tests/test_reproduce.py), or says why it is not run; a
README row without one fails the first test, so a new command cannot skip the check.
"""
import hashlib
import os
import re

import pytest

from harness import ROOT, run_python, torchrun
from reproduction.tradeoffs import RUNS

# A README command that `python reproduce.py` runs too is run there at --quick sizes
# (tests/test_reproduce.py), in one folder, with the demo model hashed after every run:
# the same promise, checked once instead of twice (the suite's 10 minutes are shared).
BY_REPRODUCE = ("run by reproduce.py --quick in one folder, which checks after every run "
                "that out/ckpt.pt is unchanged (tests/test_reproduce.py)")

TINY_MODEL = ["--preset", "tiny", "--eval-iters", "1", "--sample-tokens", "0"]

# README command -> (how the test runs it: "python" or "torchrun", argv) or the reason
# it is not run here. Keys are the commands exactly as the README's table writes them.
TINY = {
    "python train.py": ("python", ["train.py", *TINY_MODEL, "--steps", "4"]),
    "python sample.py": ("python", ["sample.py", "--prompt", "def ", "--max-new-tokens", "8"]),
    "python -m scripts.train_bench --estimate --params 7B --gpus 64":
        ("python", ["-m scripts.train_bench", "--estimate", "--params", "7B", "--gpus", "64"]),
    "python -m scripts.train_bench": BY_REPRODUCE,
    "torchrun --standalone --nproc_per_node=2 train.py --dp zero2 --ckpt out/dp/ckpt.pt "
    "--steps 50":
        ("torchrun", ["train.py", "--dp", "zero2", "--ckpt", "out/dp/ckpt.pt", *TINY_MODEL,
                      "--steps", "2"]),
    "torchrun --standalone --nproc_per_node=2 parallel.py --tp 2 --check": BY_REPRODUCE,
    "python parallel.py plan": ("python", ["parallel.py", "plan"]),
    "python optim.py compare": BY_REPRODUCE,
    "python lora.py compare": BY_REPRODUCE,
    "python -m scripts.mla_bench": BY_REPRODUCE,
    "python -m scripts.serve_bench --workload agent --kv-tier host --num-blocks 96":
        "reads the checkpoint and writes nothing (tests/test_serve.py runs the agent "
        "workload with and without the tier in process)",
    "torchrun --standalone --nproc_per_node=2 disagg.py run":
        "a random-init model (or --checkpoint, read only) on two ranks; tests/test_disagg.py "
        "runs it under torchrun",
    "python kv_router.py bench":
        "random-init replicas in one process, writes nothing (tests/test_kv_router.py)",
    "python streaming.py measure --bos": BY_REPRODUCE,
    "python serve.py --port 8000":
        "serves until Ctrl-C and only reads the checkpoint (tests/test_api_server.py serves "
        "one over HTTP)",
    "python train.py --preset draft --ckpt out/draft.pt --sample-tokens 0": BY_REPRODUCE,
    "python spec_decode.py bench": BY_REPRODUCE,
    "python rl.py compare": BY_REPRODUCE,
    "python quantize.py compare": BY_REPRODUCE,
    "python -m scripts.calibration": BY_REPRODUCE,
    "python curate.py stats": BY_REPRODUCE,
    "python -m scripts.curate_sweep":
        "trains several models on mixtures it writes under out/curate/ (tests/test_curate.py "
        "runs its sweep at tiny sizes); it reads no checkpoint",
}


def readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


TABLE_HEAD = "| command | what it shows | `out/ckpt.pt` | time |"
# What the `out/ckpt.pt` column may say (the demo model's file; each cell starts with one):
CHECKPOINT_NEEDS = ("writes it", "needs it", "used if present", "not used")


def readme_rows():
    """{command: its cells after the command} of the README's "how to run" table, in order."""
    table = readme().split(TABLE_HEAD, 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (.*) \|$", table, flags=re.M)
    return {command: [cell.strip() for cell in rest.split(" | ")] for command, rest in rows}


def readme_commands():
    """The commands of the README's "how to run" table, in order."""
    return list(readme_rows())


def test_every_readme_row_says_what_it_needs_of_the_demo_model():
    """Each row's `out/ckpt.pt` cell says whether the command reads the demo model and, where
    it needs or prefers one, what it does without (the demo row also names the previous
    generation it keeps, out/ckpt.pt.1, and its size)."""
    rows = readme_rows()
    assert all(len(cells) == 3 for cells in rows.values()), rows
    for command, (_, need, _) in rows.items():
        assert need.startswith(CHECKPOINT_NEEDS), (command, need)
        if need.startswith(("needs it", "used if present")):
            assert "without" in need, (command, need)
    shows, need, _ = rows["python train.py"]
    assert need == "writes it" and "`out/ckpt.pt.1`" in shows and "MB" in shows, shows


def test_every_readme_command_has_a_tiny_equivalent():
    commands = readme_commands()
    assert len(commands) >= 10
    assert [c for c in commands if c not in TINY] == []
    assert [c for c in TINY if c not in commands] == []


def test_the_commands_left_to_reproduce_are_its_runs():
    """A row marked BY_REPRODUCE is run there only if reproduce.py has that exact command."""
    theirs = {run.command for run in RUNS}
    assert [c for c, how in TINY.items() if how == BY_REPRODUCE and c not in theirs] == []


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.slow
def test_readme_commands_in_order_leave_the_demo_model_unchanged(tmp_path):
    demo = tmp_path / "out" / "ckpt.pt"
    before = None
    for command in readme_commands():
        how = TINY[command]
        if isinstance(how, str):
            continue                                  # not run here; the reason is above
        launcher, (script, *args) = how
        if launcher == "torchrun":
            result = torchrun(script, args, nproc=2, timeout=600, cwd=str(tmp_path))
        else:
            result = run_python(script, args, timeout=600, cwd=str(tmp_path))
        assert result.returncode == 0, f"{command}:\n{result.output[-3000:]}"
        if before is None:
            assert demo.exists(), f"{command} wrote no out/ckpt.pt:\n{result.output[-2000:]}"
            before = sha256(demo)                     # the demo model everyone reads
        assert sha256(demo) == before, f"{command} wrote over the demo model out/ckpt.pt"
