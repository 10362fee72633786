"""
Every script's command line, as a newcomer meets it: `--help` shows exactly one default
per flag (or says what "not given" means), a mistyped flag is one `error:` line that
names it with exit status 2, and a library module asked for --help says what it is and
where it runs. One subprocess probes them all (tests/cli_probe.py).
"""
import json

import pytest

from harness import run_python

# Every command line with flags of its own: a script, or a script and its subcommand, or an
# entry point under a folder run as a module from the repo root (`python -m scripts.X`).
COMMANDS = [
    "train.py", "-m core.data", "sample.py", "optim.py",
    "parallel.py", "parallel.py plan", "-m parallelism.pipeline",
    "lora.py", "rl.py", "spec_decode.py",
    "kvcache.py", "serve.py", "-m scripts.serve_bench",
    "quantize.py rtn", "quantize.py gptq", "quantize.py awq", "quantize.py smoothquant",
    "quantize.py qat", "quantize.py prune", "quantize.py compare",
    "evaluate.py ppl", "evaluate.py task", "-m scripts.calibration",
    "-m scripts.uncertainty", "-m scripts.contamination",
    "curate.py stats", "curate.py dedup", "curate.py filter", "-m scripts.curate_mix",
    "-m scripts.curate_sweep",
    "-m scripts.gpu_bench", "-m core.checkpoint export", "-m core.checkpoint convert",
    "-m scripts.mla_bench", "streaming.py measure", "streaming.py generate",
    "disagg.py run", "disagg.py bench", "kv_router.py bench",
    "-m scripts.train_bench", "-m scripts.lora_estimate", "-m training.fp8",
    "-m serving.multi_lora", "-m serving.structured", "-m parallelism.cost_model",
    "-m scripts.cost_check calibrate", "-m scripts.cost_check table",
    "labs.py list", "labs.py run", "labs.py check",
]
# Modules that are read, not run: --help says so and names the command that runs them.
LIBRARIES = [
    "-m core.runtime", "-m training.resume", "-m core.moe", "-m core.plots",
    "-m compression.nf4", "-m serving.openai_api", "-m parallelism.planner",
    "-m parallelism.tensor_parallel", "-m parallelism.ring_attention",
    "-m parallelism.parallel_check", "-m compression.calibrated", "-m compression.qat",
    "-m compression.prune",
]


@pytest.fixture(scope="module")
def probed():
    result = run_python("tests/cli_probe.py", COMMANDS + LIBRARIES, timeout=600)
    assert result.returncode == 0, result.output[-3000:]
    rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    return {row["spec"]: row for row in rows}


def states_one_default(entry):
    """'(default: X)' exactly once, or no value and the help says what 'not given' does."""
    shown = entry.count("(default")
    return shown == 1 or (shown == 0 and "not given" in entry)


@pytest.mark.parametrize("spec", COMMANDS)
def test_help_shows_one_default_per_flag(probed, spec):
    row = probed[spec]
    assert row["help_status"] == 0, row["help"]
    bad = [entry for entry in row["flags"] if not states_one_default(entry)]
    assert not bad, f"{spec} --help: flags without exactly one default:\n" + "\n".join(bad)


@pytest.mark.parametrize("spec", COMMANDS)
def test_mistyped_flag_is_one_line_naming_it(probed, spec):
    row = probed[spec]
    lines = [line for line in row["typo"].splitlines() if line.strip()]
    assert row["typo_status"] == 2, row["typo"]
    assert len(lines) == 1 and "error" in lines[0] and "--stpes" in lines[0], row["typo"]


@pytest.mark.parametrize("spec", LIBRARIES)
def test_library_says_where_it_runs(probed, spec):
    row = probed[spec]
    assert row["help_status"] == 0, row["help"]
    assert "library" in row["help"] or "runs as" in row["help"], row["help"]
