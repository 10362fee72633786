"""gpu_bench.py: the one-command GPU table, run at toy size (--tiny) as a user would type
it. On the CPU it checks the table's header and every row (the figures themselves are
meaningful only on a GPU: docs/gpu.md); with CUDA the same toy run also prints MFU."""
import os

import pytest

from harness import run_python

TINY = ["--tiny", "--threads", "1", "--spec-methods", "draft,medusa"]
ROWS = ["train fp32", "train fp8 tensorwise", "train autocast-bf16", "decode B=1 bf16", "serve sequential generate()",
        "serve static batching B=4", "serve engine (fcfs)", "serve engine (slo)",
        "spec draft γ=4 w=1", "spec medusa γ=4 w=3"]


def table_of(output):
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("gpu_bench: "))
    return lines[start:]


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])
def test_tiny_run_prints_the_table(device, text_file, tmp_path):
    r = run_python("-m scripts.gpu_bench", TINY + ["--device", device, "--data", text_file,
                                           "--out-dir", tmp_path], timeout=300)
    assert r.returncode == 0, r.output[-3000:]
    table = table_of(r.output)
    assert table[1].split() == ["row", "measured", "against", "detail"], table[:2]
    for name in ROWS:
        row = next((line for line in table if line.startswith(name)), None)
        assert row is not None, (name, table)
        if name.startswith("train"):         # the ledger: state == 16 B/param, every precision
            assert "= 16.0 B/param" in row and "act " in row, row
            assert ("MFU" in row) == (device == "cuda" and "no peak" not in row), row
        if name.startswith("serve"):
            assert "greedy == sequential 4/4" in row, row
        if name.startswith("spec"):
            assert "== greedy yes" in row, row
    assert open(os.path.join(tmp_path, "table.txt"), encoding="utf-8").read().splitlines() == \
        table
    assert os.path.exists(os.path.join(tmp_path, "bench.log"))


def test_bad_flags_are_one_line_errors(tmp_path):
    r = run_python("-m scripts.gpu_bench", ["--spec-methods", "nope", "--out-dir", tmp_path], timeout=60)
    assert r.returncode == 2 and "error: unknown spec method 'nope'" in r.output, r.output
    assert "Traceback" not in r.output
