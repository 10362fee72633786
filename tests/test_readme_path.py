"""
The newcomer's path: the README's "how to run" commands, in the README's order, at tiny
sizes, in a fresh folder -- and the demo model they all read (out/ckpt.pt) is unchanged at
the end: no command writes over another's model. Each command has a tiny equivalent named
here (the same script, mode and output paths; smaller flags); a README row without one
fails the first test, so a new command cannot skip the check.
"""
import hashlib
import os
import re

import pytest

from harness import ROOT, run_python, torchrun

TINY_MODEL = ["--preset", "tiny", "--eval-iters", "1", "--sample-tokens", "0"]

# README command -> (how the test runs it: "python" or "torchrun", argv) or the reason
# it is not run here. Keys are the commands exactly as the README's table writes them.
TINY = {
    "python train.py": ("python", ["train.py", *TINY_MODEL, "--steps", "4"]),
    "python sample.py": ("python", ["sample.py", "--prompt", "def ", "--max-new-tokens", "8"]),
    "python -m scripts.train_bench --estimate --params 7B --gpus 64":
        ("python", ["-m scripts.train_bench", "--estimate", "--params", "7B", "--gpus", "64"]),
    "python -m scripts.train_bench":
        ("python", ["-m scripts.train_bench", "--preset", "tiny", "--bench-steps", "1",
                    "--batch-size", "4"]),
    "torchrun --standalone --nproc_per_node=2 train.py --dp zero2 --ckpt out/dp/ckpt.pt "
    "--steps 50":
        ("torchrun", ["train.py", "--dp", "zero2", "--ckpt", "out/dp/ckpt.pt", *TINY_MODEL,
                      "--steps", "2"]),
    "torchrun --standalone --nproc_per_node=2 parallel.py --tp 2 --check":
        ("torchrun", ["parallel.py", "--tp", "2", "--check", "--preset", "tiny",
                      "--steps", "2"]),
    "python parallel.py plan": ("python", ["parallel.py", "plan"]),
    "python optim.py compare":
        ("python", ["optim.py", "compare", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                    "--n-kv-head", "1", "--steps", "2", "--eval-interval", "2",
                    "--eval-iters", "1", "--batch-size", "2"]),
    "python lora.py compare":
        ("python", ["lora.py", "compare", "--steps", "2", "--n-train", "50",
                    "--eval-problems", "4", "--batch-size", "4"]),
    "python -m scripts.mla_bench":
        ("python", ["-m scripts.mla_bench", "--preset", "tiny", "--context", "16", "--new-tokens", "2",
                    "--repeats", "1"]),
    "python -m scripts.serve_bench --workload agent --kv-tier host --num-blocks 96":
        "reads the checkpoint and writes nothing (tests/test_serve.py runs the agent "
        "workload with and without the tier in process)",
    "torchrun --standalone --nproc_per_node=2 disagg.py run":
        "a random-init model (or --checkpoint, read only) on two ranks; tests/test_disagg.py "
        "runs it under torchrun",
    "python kv_router.py bench":
        "random-init replicas in one process, writes nothing (tests/test_kv_router.py)",
    "python streaming.py measure --bos":
        ("python", ["streaming.py", "measure", "--bos", "--tokens", "128", "--train-steps",
                    "20"]),
    "python serve.py --port 8000":
        "serves until Ctrl-C and only reads the checkpoint (tests/test_api_server.py serves "
        "one over HTTP)",
    "python train.py --preset draft --ckpt out/draft.pt --sample-tokens 0":
        ("python", ["train.py", *TINY_MODEL, "--n-layer", "1", "--ckpt", "out/draft.pt",
                    "--steps", "2"]),
    "python spec_decode.py bench":
        ("python", ["spec_decode.py", "bench", "--max-new-tokens", "8", "--train-steps", "2",
                    "--batch-size", "1"]),
    "python rl.py compare":
        ("python", ["rl.py", "compare", "--steps", "1", "--prompts", "2", "--n-train", "50",
                    "--eval-problems", "4", "--eval-samples", "1", "--sft-steps", "2",
                    "--teacher-sft-steps", "2", "--teacher-preset", "tiny"]),
    "python quantize.py compare":
        ("python", ["quantize.py", "compare", "--bits-list", "4", "--qat-steps", "1",
                    "--eval-batches", "1", "--calib-batches", "1", "--prompts", "2",
                    "--repeats", "1"]),
    "python -m scripts.calibration":
        ("python", ["-m scripts.calibration", "--sft-steps", "2", "--n-train", "50",
                    "--eval-problems", "4"]),
    "python curate.py stats": ("python", ["curate.py", "stats", "--max-bytes-per-domain", "20000"]),
    "python -m scripts.curate_sweep":
        "trains several models on mixtures it writes under out/curate/ (tests/test_curate.py "
        "runs its sweep at tiny sizes); it reads no checkpoint",
}


def readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def readme_commands():
    """The commands of the README's "how to run" table, in order."""
    table = readme().split("| command | what it shows | time |", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)


def test_every_readme_command_has_a_tiny_equivalent():
    commands = readme_commands()
    assert len(commands) >= 10
    assert [c for c in commands if c not in TINY] == []
    assert [c for c in TINY if c not in commands] == []


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
