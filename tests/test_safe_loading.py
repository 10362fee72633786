"""Opening a file must never run code: a malicious pickle (one that creates a marker file
when unpickled) fed to every entry point that opens a file the user names gives one
`error:` line and exit status 2, and the marker never appears. Everything the repo writes
loads with torch.load(weights_only=True); bad files are one clear error each; an old
checkpoint is refused with the conversion command, which then works."""
import argparse
import os
import pickle
import random
import shutil
from dataclasses import asdict

import numpy as np
import pytest
import torch

from core import data
from training import data_parallel
from core import checkpoint as checkpoint_py
import spec_decode
from training import resume as saved
import train
from harness import ROOT, run_python
from core.checkpoint import load_model
from core.files import load_checkpoint
from model import GPT, get_config
from core.errors import UserError
from core.runtime import rng_state, run_cli


class Evil:
    """Unpickling this calls exec(code): what a planted checkpoint can do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.fixture
def evil(tmp_path):
    """(checkpoint-shaped torch file with a payload, a raw pickle, the marker path)."""
    marker = tmp_path / "PWNED"
    cfg = get_config("tiny")
    path = tmp_path / "evil.pt"
    torch.save({"config": asdict(cfg), "model": {}, "tokenizer": Evil(marker),
                "optimizer": Evil(marker)}, path)
    raw = tmp_path / "evil.pkl"
    raw.write_bytes(pickle.dumps({"config": Evil(marker)}))
    return path, raw, marker


def test_the_payload_really_runs_when_unpickled(evil, tmp_path):
    """The test's own check: an unsafe load DOES create the marker (so its absence below
    means something)."""
    path, raw, marker = evil
    torch.load(path, weights_only=False)
    assert marker.exists()
    marker.unlink()
    pickle.loads(raw.read_bytes())
    assert marker.exists()


def one_error_line(capsys, fn, *args):
    """Run an entry point through runtime.run_cli: -> its single `error:` line."""
    with pytest.raises(SystemExit) as e:
        run_cli(fn, list(map(str, args)))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert e.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def cli_entry_points(tmp_path, ckpt):
    import kvcache
    import lora
    import rl
    from scripts import serve_bench
    return {
        "train.py --resume": (train.main, ["--resume", "--ckpt", ckpt, "--preset", "tiny"]),
        "serve.py --checkpoint": (serve_bench.main, ["--checkpoint", ckpt, "--threads", "0"]),
        "lora.py --ckpt": (lora.main, ["--ckpt", ckpt, "--device", "cpu"]),
        "lora.py --load": (lora.main, ["--ckpt", "none", "--preset", "tiny", "--load", ckpt,
                                       "--device", "cpu"]),
        "rl.py --ckpt": (rl.main, ["--ckpt", ckpt, "--device", "cpu"]),
        "-m core.checkpoint export": (checkpoint_py.main, ["export", "--checkpoint", ckpt, "--to",
                                            tmp_path / "hf"]),
        "spec_decode.py --ckpt": (spec_decode.main, ["--ckpt", ckpt, "--threads",
                                                     torch.get_num_threads()]),
        "kvcache.py --checkpoint": (kvcache.main, ["--checkpoint", ckpt]),
    }


@pytest.mark.parametrize("entry", ["train.py --resume", "serve.py --checkpoint",
                                   "lora.py --ckpt", "lora.py --load", "rl.py --ckpt",
                                   "-m core.checkpoint export", "spec_decode.py --ckpt",
                                   "kvcache.py --checkpoint"])
@pytest.mark.parametrize("which", [0, 1])
def test_every_command_line_entry_point_refuses_a_malicious_pickle(evil, tmp_path, capsys,
                                                                  entry, which):
    path, marker = evil[which], evil[2]
    fn, argv = cli_entry_points(tmp_path, path)[entry]
    line = one_error_line(capsys, fn, *argv)
    assert not marker.exists(), f"{entry} ran the payload"
    assert os.path.basename(path) in line


@pytest.mark.slow
def test_train_resume_from_the_real_command_line(evil):
    path, _, marker = evil
    r = run_python("train.py", ["--resume", "--ckpt", path, "--preset", "tiny"], timeout=180)
    assert r.returncode == 2, r.output
    assert not marker.exists()
    errors = [line for line in r.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    assert "python -m core.checkpoint convert" in errors[0]


def test_load_model_and_load_checkpoint_refuse_it(evil):
    path, raw, marker = evil
    with pytest.raises(UserError, match="asks to run exec when opened"):
        load_model(str(path))
    for p in (path, raw):    # a protocol-4 pickle stops torch at its first opcode (FRAME):
        # the payload is then found by reading the opcodes, and named the same way
        with pytest.raises(UserError, match="asks to run exec when opened, which safe "
                                            "loading refuses \\(weights_only=True\\)"):
            load_checkpoint(str(p))
    assert not marker.exists()


def test_sharded_checkpoint_loading_refuses_it(evil, tmp_path):
    path, _, marker = evil
    shards = tmp_path / "step_4"
    shards.mkdir()
    (shards / "meta.pt").write_bytes(path.read_bytes())
    with pytest.raises(UserError, match="meta.pt asks to run exec"):
        data_parallel.load_shards(str(shards), None, None, 0)
    torch.save({"world_size": 1}, shards / "meta.pt")           # a good meta, a bad shard
    (shards / "shard-0.pt").write_bytes(path.read_bytes())
    with pytest.raises(UserError, match="shard-0.pt asks to run exec"):
        data_parallel.load_shards(str(shards), None, None, 0)
    assert not marker.exists()


def test_drafter_cache_refuses_it(evil, tmp_path):
    path, _, marker = evil
    target = GPT(get_config("tiny"), seed=0).eval().requires_grad_(False)
    (tmp_path / "spec_medusa.pt").write_bytes(path.read_bytes())
    args = argparse.Namespace(train_steps=1, heads=2, dflash_block=3, drafter_layers=1,
                              out_dir=str(tmp_path), draft_ckpt=str(tmp_path / "none.pt"))
    with pytest.raises(UserError, match="spec_medusa.pt asks to run exec.*Delete it to retrain"):
        spec_decode.build_drafters(["medusa"], target, args, {})
    assert not marker.exists()


# ------------------------------------------------------------------ bad files, one line each
def test_bad_files_are_one_clear_error(tmp_path):
    model = GPT(get_config("tiny"), seed=0)
    cases = {}
    (tmp_path / "empty.pt").write_bytes(b"")
    cases["empty.pt"] = "is empty or truncated"
    # Not a checkpoint at all: what the file is comes first, and safe loading is not named
    # (nothing was refused; the old line, "not a PyTorch checkpoint of plain data (safe
    # loading, weights_only=True, cannot read it)", read like a security alarm for README.md)
    text = "is not a PyTorch checkpoint \\(it holds text or another format, not what torch.save"
    (tmp_path / "notes.txt").write_text("hello, I am text\n")
    cases["notes.txt"] = text
    (tmp_path / "cfg.json").write_text('{"a": 1}')
    cases["cfg.json"] = text
    shutil.copy(os.path.join(ROOT, "README.md"), tmp_path / "README.md")
    cases["README.md"] = text
    (tmp_path / "plain.pkl").write_bytes(pickle.dumps({"a": [1, 2]}))
    cases["plain.pkl"] = "is not a PyTorch checkpoint \\(a plain Python pickle"
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    cases["tensor.pt"] = "holds Tensor, not a checkpoint of this repo"
    torch.save([1, 2], tmp_path / "list.pt")
    cases["list.pt"] = "holds list, not a checkpoint"
    torch.save({"weights": {}}, tmp_path / "dict.pt")
    cases["dict.pt"] = "holds a dict without 'config' and 'model'"
    good = {"config": asdict(model.config), "model": model.state_dict()}
    torch.save(good, tmp_path / "good.pt")
    blob = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(blob[:len(blob) // 2])
    cases["truncated.pt"] = "is not a readable PyTorch checkpoint \\(truncated"
    torch.save({**good, "config": {**good["config"], "n_layer": 3}}, tmp_path / "mismatch.pt")
    cases["mismatch.pt"] = "the weights do not match its config"
    torch.save({**good, "config": {**good["config"], "wings": 2}}, tmp_path / "future.pt")
    cases["future.pt"] = "its config does not fit this GPTConfig"
    (tmp_path / "folder").mkdir()
    cases["folder"] = "a folder without config.json"
    cases["missing.pt"] = "not found"
    for name, message in cases.items():
        with pytest.raises(UserError, match=message) as e:
            load_model(str(tmp_path / name))
        assert name in str(e.value) and "\n" not in str(e.value)
        assert "safe loading" not in str(e.value) and "weights_only" not in str(e.value)
    load_model(str(tmp_path / "good.pt"))


# ------------------------------------------------------------------ what the repo writes
def test_rng_state_travels_as_plain_data(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    torch.save({"rng": saved.plain_rng_state()}, tmp_path / "r.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    saved.restore_rng_state(torch.load(tmp_path / "r.pt", weights_only=True)["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


@pytest.mark.slow
def test_train_checkpoint_loads_with_weights_only(text_file, tmp_path):
    ckpt = tmp_path / "c.pt"
    train.main(["--preset", "tiny", "--data", text_file, "--steps", "2", "--batch-size", "2",
                "--seq-len", "16", "--eval-interval", "2", "--eval-iters", "1",
                "--sample-tokens", "0", "--warmup-steps", "1", "--ckpt", str(ckpt)])
    saved = torch.load(ckpt, weights_only=True)
    assert {"config", "model", "optimizer", "scaler", "rng", "tokenizer", "args"} <= set(saved)
    assert isinstance(saved["config"], dict)


def test_old_checkpoint_is_refused_with_the_conversion_command_which_works(tmp_path, capsys):
    """An older version pickled numpy's RNG state (an ndarray) and the config dataclass."""
    model = GPT(get_config("tiny"), seed=0)
    old = tmp_path / "old.pt"
    torch.save({"config": model.config, "model": model.state_dict(), "rng": rng_state(),
                "args": argparse.Namespace(lr=1e-3), "tokenizer": data.encoding_to_state(
                    data.make_encoding({bytes([i]): i for i in range(256)}))}, old)
    with pytest.raises(UserError, match=f"convert it once: python -m core.checkpoint convert {old} NEW"):
        load_model(str(old))
    new = tmp_path / "new.pt"
    checkpoint_py.main(["convert", str(old), str(new)])
    assert "weights_only=False" in capsys.readouterr().out     # it says what it does
    back, ckpt = load_model(str(new))
    assert ckpt["config"] == asdict(model.config) and ckpt["args"] == {"lr": 1e-3}
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    state = rng_state()
    saved.restore_rng_state(ckpt["rng"])                       # still restorable
    saved.restore_rng_state({**state, "numpy": list(state["numpy"])})


def test_every_entry_point_gives_one_line_for_every_broken_file(tmp_path, capsys):
    """Truncated, empty, text, a bare tensor, a folder that is not a model: each is one
    `error:` line naming the file, exit 2, from every command that opens a checkpoint."""
    import evaluate
    import quantize
    import sample
    model = GPT(get_config("tiny"), seed=0)
    torch.save({"config": asdict(model.config), "model": model.state_dict()},
               tmp_path / "good.pt")
    blob = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(blob[:len(blob) // 2])
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("hello, I am text\n")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    (tmp_path / "folder").mkdir()
    broken = ["truncated.pt", "empty.pt", "notes.txt", "tensor.pt", "folder"]
    for name in broken:
        path = str(tmp_path / name)
        entries = dict(cli_entry_points(tmp_path, path))
        entries["quantize.py --ckpt"] = (quantize.main, ["rtn", "--ckpt", path])
        entries["evaluate.py --checkpoint"] = (evaluate.main, ["ppl", "--checkpoint", path])
        entries["sample.py --checkpoint"] = (sample.main, ["--checkpoint", path,
                                                            "--prompt", "a"])
        for entry, (fn, argv) in entries.items():
            line = one_error_line(capsys, fn, *argv)
            assert name in line, (entry, name, line)
