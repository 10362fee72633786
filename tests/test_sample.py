"""sample.py: its completions equal model.generate with the same knobs and seed; prompts
from a pipe; every bad input is one error line (exit 2)."""
import io
import sys
from dataclasses import asdict

import pytest
import torch

from core import data
import sample
from harness import run_python
from model import GPT, get_config
from core.runtime import run_cli

BYTES = data.make_encoding({bytes([i]): i for i in range(256)})   # + <|endoftext|> = 257


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = GPT(get_config("tiny", vocab_size=BYTES.n_vocab), seed=5)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pt"
    torch.save(dict(config=asdict(model.config), model=model.state_dict(),
                    tokenizer=data.encoding_to_state(BYTES)), path)
    return str(path), model.eval()


def expected(model, prompt, n, seed, **knobs):
    new = model.generate(BYTES.encode_ordinary(prompt), n, seed=seed, **knobs)
    return BYTES.decode(new)


def test_one_prompt_equals_generate_with_the_same_knobs(checkpoint, capsys):
    path, model = checkpoint
    sample.main(["--checkpoint", path, "--prompt", "def f", "--max-new-tokens", "12",
                 "--seed", "3", "--temperature", "0.9", "--top-k", "20", "--no-stop"])
    got = capsys.readouterr().out
    # the prompt is echoed by default: the completion continues the line it starts
    assert got == "def f" + expected(model, "def f", 12, 3, temperature=0.9, top_k=20) + "\n"


def test_samples_use_consecutive_seeds_and_greedy_ignores_them(checkpoint, capsys):
    path, model = checkpoint
    sample.main(["--checkpoint", path, "--prompt", "ab", "--max-new-tokens", "6",
                 "--num-samples", "2", "--seed", "7", "--top-p", "0.9", "--no-stop",
                 "--no-echo"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "---- sample 1/2 ----" and out[2] == "---- sample 2/2 ----"
    assert out[1] == expected(model, "ab", 6, 7, temperature=0.8, top_k=50, top_p=0.9)
    assert out[3] == expected(model, "ab", 6, 8, temperature=0.8, top_k=50, top_p=0.9)
    for seed in ("1", "2"):
        sample.main(["--checkpoint", path, "--prompt", "ab", "--max-new-tokens", "6",
                     "--temperature", "0", "--seed", seed, "--no-stop"])   # echo: the default
    greedy = capsys.readouterr().out.splitlines()
    assert greedy[0] == greedy[1] == "ab" + expected(model, "ab", 6, 0, temperature=0)


def test_prompts_from_a_pipe_one_per_line_with_typed_newlines(checkpoint, capsys, monkeypatch):
    path, model = checkpoint
    monkeypatch.setattr(sys, "stdin", io.StringIO("x = 1\\ny\n\nimport os\n"))
    sample.main(["--checkpoint", path, "--max-new-tokens", "5", "--temperature", "0",
                 "--no-stop", "--no-echo"])
    out = capsys.readouterr().out
    want = [expected(model, "x = 1\ny", 5, 0, temperature=0),
            expected(model, "import os", 5, 0, temperature=0)]
    assert out == "".join(w + "\n" for w in want)       # the empty line is skipped


@pytest.mark.parametrize("flags, message", [
    (["--checkpoint", "missing.pt"], "not found"),
    (["--top-p", "1.5"], "--top-p"),
    (["--num-samples", "0"], "--num-samples"),
    (["--prompt", "x" * 80], "context"),
])
def test_bad_input_is_one_error_line(checkpoint, capsys, flags, message):
    path, _ = checkpoint
    argv = ["--checkpoint", path, "--prompt", "a"] + flags
    with pytest.raises(SystemExit) as info:
        run_cli(sample.main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1
    assert err[0].startswith("error:") and message in err[0]


def test_command_line(checkpoint):
    path, model = checkpoint
    result = run_python("sample.py", ["--checkpoint", path, "--prompt", "q", "--seed", "1",
                                      "--max-new-tokens", "4", "--no-stop"], timeout=120)
    assert result.returncode == 0, result.output
    assert result.output == "q" + expected(model, "q", 4, 1, temperature=0.8, top_k=50) + "\n"
