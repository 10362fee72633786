"""
Any file, one line. A few hundred generated files -- text, random bytes, real checkpoints
truncated at many lengths, pickles of every protocol (plain objects and ones that try to
run code), torch.save'd things that are not this repo's checkpoints, JSON, empty and junk
folders -- go through every loader a command line reaches with a path the user named.
Each either reads the file or raises one UserError whose message is one line (what
`run_cli` prints as `error: ...`, exit 2); no other exception, no traceback, and nothing
in any file ever runs.

    loader                               reached by
    core.files.load_checkpoint          every .pt a user names (below all the others)
    core.checkpoint.load_model           --checkpoint / --ckpt of sample, serve, kvcache,
                                         spec_decode, lora, quantize, evaluate, export
    training.resume.load_resume          train.py --resume (one process)
    training.data_parallel.read_generation  train.py --dp ... --resume (a save folder)
    core.llama_format.load_folder        a Hugging Face folder given as --checkpoint
    lora.read_adapter                    lora.py --load
    training.rl_models.checkpoint_tokenizer  rl.py --ckpt / --teacher-ckpt (the tokenizer)
    core.data.read_documents             --data of train.py, curate.py, evaluate.py
"""
import io
import json
import os
import pickle
import random
import zipfile

import numpy as np
import pytest
import torch

import lora
from core import checkpoint, data, llama_format
from core.errors import UserError
from core.files import load_checkpoint
from model import GPT, get_config
from training import data_parallel
from training import resume
from training import rl_models

MARKER = "ran-code.txt"          # an evil pickle creates this file (in the test's folder)


class Evil:
    """Unpickling calls exec: what a planted file can do. It must never run."""

    def __reduce__(self):
        return (exec, (f"open({MARKER!r}, 'w').write('pwned')",))


class EvilSystem:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


def tiny_checkpoint_bytes():
    model = GPT(get_config("tiny"), seed=0)
    buf = io.BytesIO()
    torch.save({"config": model.config.__dict__, "model": model.state_dict(),
                "tokenizer": data.encoding_to_state(
                    data.make_encoding({bytes([i]): i for i in range(256)}))}, buf)
    return buf.getvalue()


def saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def generated_files(folder):
    """-> [(name, path)]: every kind of file and folder a user could hand a command."""
    rng = random.Random(1234)
    out = []

    def put(name, payload):
        path = os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(payload)
        out.append((name, path))

    texts = ["this is not a checkpoint\n", "hello world", "", "\n", "{", "[1, 2, 3]",
             "PK\x03\x04 looks like a zip", "\x80\x02}q\x00.", "(lp0\n.", "cos\nsystem\n",
             "ÿþ unicode é ü", "def f():\n    return 1\n" * 50]
    for i, t in enumerate(texts):
        put(f"text{i}.txt", t.encode("utf-8"))
    for i in range(60):                                   # random bytes, random lengths
        put(f"random{i}.bin", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000))))
    good = tiny_checkpoint_bytes()
    cuts = sorted({1, 2, 4, 8, 22, 30, 64, 100, 512, 1024, len(good) // 3, len(good) // 2,
                   len(good) - 100, len(good) - 22, len(good) - 1}
                  | {rng.randrange(1, len(good)) for _ in range(45)})
    for c in cuts:                                        # a real checkpoint, truncated
        put(f"truncated{c}.pt", good[:c])
    corrupt = bytearray(good)                             # a flipped byte in the middle
    for i in range(0, len(corrupt), max(1, len(corrupt) // 20)):
        corrupt[i] ^= 0xFF
    put("corrupted.pt", bytes(corrupt))
    # pickles of every protocol: plain objects (refused or read as data) and code
    objects = [{"a": 1}, [1, 2], "text", 3.5, None, {1, 2}, b"bytes", np.arange(3),
               Evil(), EvilSystem(), {"config": Evil()}, {"model": EvilSystem()}]
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        for i, obj in enumerate(objects):
            put(f"pickle{proto}_{i}.pkl", pickle.dumps(obj, protocol=proto))
    # torch.save'd things that are not checkpoints of this repo
    cfg = get_config("tiny").__dict__
    wrong = [torch.zeros(3), [1, 2, 3], {"config": cfg}, {"model": {}},
             {"config": cfg, "model": {"x": 1}}, {"config": cfg, "model": {"x": torch.ones(2)}},
             {"config": {"n_layer": "two"}, "model": {}}, {"config": {"bogus": 1}, "model": {}},
             {"config": dict(cfg, n_layer=-1), "model": {}}, {"config": cfg, "model": [1]},
             {"config": cfg, "model": {}, "tokenizer": "bpe"},
             {"config": cfg, "model": {}, "quantization": {"format": 99}},
             {"config": cfg, "model": {}, "quantization": {"format": 1}, "quantized": 3},
             {"format": "lora-adapter"}, {"world_size": 2}, {"tokenizer": {"merges": 1}}]
    for i, obj in enumerate(wrong):
        put(f"saved{i}.pt", saved(obj))
    zbuf = io.BytesIO()                                  # a zip that is not torch's
    with zipfile.ZipFile(zbuf, "w") as z:
        z.writestr("data.pkl", "not a pickle")
    put("zip.pt", zbuf.getvalue())
    for i, obj in enumerate([{"a": 1}, [1, 2], "x", {"config": cfg}]):
        put(f"json{i}.json", json.dumps(obj).encode())
    # folders: empty, junk, half a Hugging Face folder, half a --dp save
    for name, files in [("empty_dir", {}), ("junk_dir", {"notes.txt": b"hello"}),
                        ("hf_bad_config", {"config.json": b"{"}),
                        ("hf_config_only", {"config.json": b'{"hidden_size": 32}'}),
                        ("hf_bad_weights", {"config.json": json.dumps(
                            {"architectures": ["LlamaForCausalLM"], "hidden_size": 32,
                             "num_hidden_layers": 1, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "intermediate_size": 64,
                             "vocab_size": 300}).encode(), "model.safetensors": b"\x08" * 40}),
                        ("dp_bad_meta", {"meta.pt": b"this is not a checkpoint\n"}),
                        ("dp_meta_only", {"meta.pt": saved({"world_size": 2, "save_id": "s"})})]:
        path = os.path.join(folder, name)
        os.makedirs(path)
        for fname, payload in files.items():
            with open(os.path.join(path, fname), "wb") as f:
                f.write(payload)
        out.append((name, path))
    return out


LOADERS = {
    "load_checkpoint": load_checkpoint,
    "load_model": checkpoint.load_model,
    "load_resume": lambda p: resume.load_resume(p, "--resume: checkpoint"),
    "read_generation": data_parallel.read_generation,
    "load_folder": llama_format.load_folder,
    "read_adapter": lora.read_adapter,
    "checkpoint_tokenizer": rl_models.checkpoint_tokenizer,
    "read_documents": data.read_documents,
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return generated_files(str(tmp_path_factory.mktemp("files")))


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_every_file_is_read_or_refused_in_one_line(files, loader, tmp_path):
    """The loader either returns or raises UserError with a one-line message, for every
    generated file; an evil pickle never runs (the marker file never appears)."""
    assert len(files) >= 200
    load, failures, refused = LOADERS[loader], [], 0
    for name, path in files:
        try:
            load(path)
        except UserError as e:
            refused += 1
            if "\n" in str(e) or not str(e).strip():
                failures.append(f"{name}: a UserError of more than one line: {str(e)!r}")
        except Exception as e:        # the bug this test is for: a traceback for a file
            failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[:1]}")
    assert not os.path.exists(MARKER), "a file ran code when opened"
    assert failures == [], f"{len(failures)} files escaped {loader}:\n" + "\n".join(failures[:20])
    if loader not in ("read_documents", "load_checkpoint"):   # a text file IS a corpus;
        # any plain-data pickle IS a readable .pt -- the loaders above it check the shape
        assert refused >= len(files) - 10      # nearly every one of them is refused



# The generated files that ask to run code: the Evil / EvilSystem pickles (objects 8-11
# above) of every protocol and the text "cos\nsystem\n" (protocol 0's GLOBAL os.system).
# Plain objects that pickle rebuilds by calling a function -- a numpy array
# (numpy's _reconstruct), a set and bytes at protocol 0 (set, _codecs.encode) -- ask too,
# honestly named; nothing else may mention safe loading.
PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)
PAYLOADS = {f"pickle{proto}_{i}.pkl" for proto in PROTOCOLS for i in (8, 9, 10, 11)} | {
    "text9.txt"}
REBUILT_BY_A_CALL = {f"pickle{proto}_{i}.pkl" for proto in PROTOCOLS for i in (5, 6, 7)}


def test_safe_loading_is_named_only_for_a_pickle_that_asks_to_run_code(files):
    """load_checkpoint's line for a file that is not a checkpoint says so first; it names
    safe loading (weights_only=True) only for a pickle that asks to run code -- every
    payload among them -- and then names what it asks to run. Text never reads like a
    refused payload (the old line for README.md did: "...of plain data (safe loading,
    weights_only=True, cannot read it)")."""
    named, texts = set(), []
    for name, path in files:
        try:
            load_checkpoint(path)
        except UserError as e:
            message = str(e)
            if "weights_only" in message or "safe loading" in message:
                named.add(name)
                assert message.startswith(f"{path} asks to run "), message
            elif message.startswith(f"{path} is not a PyTorch checkpoint (it holds text"):
                texts.append(name)
    assert PAYLOADS <= named <= PAYLOADS | REBUILT_BY_A_CALL, sorted(named)
    assert {"text0.txt", "text1.txt", "text5.txt", "text11.txt"} <= set(texts), texts
    assert sum(name.startswith("random") for name in texts) >= 30, texts
