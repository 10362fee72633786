"""
core/checkpoint.py -- what a checkpoint file is, and the one way every script opens one.

A checkpoint of this repo is ONE file holding plain data only (dicts, lists, numbers,
strings, tensors): the config as a dict, the weights, the tokenizer's state, the run's
history. So `torch.load(weights_only=True)` reads it, and opening a file a stranger sent
never runs code -- a pickle may name any Python callable and unpickling calls it.

Three layouts come back as the same (model, checkpoint dict):
  - train.py's file (model.GPT's state_dict + config);
  - a quantized file (quantize.py --save: integer codes + fp16 scales, core/quant_format.py),
    rebuilt as a plain GPT with the dequantized weights;
  - a Hugging Face Llama folder (config.json, model.safetensors, tokenizer.json;
    core/llama_format.py), so a model trained here runs in transformers and back.

    python -m core.checkpoint export --checkpoint out/ckpt.pt --to out/model/hf
    python -m core.checkpoint convert OLD.pt NEW.pt     # an old pickle you trust, once

Costs: loading is a read of the file (no copy kept); `convert` is the ONE place in the repo
that unpickles with weights_only=False, and only because the user typed it.
"""
import argparse
import os
from dataclasses import asdict, is_dataclass

import numpy as np
import torch

from core import llama_format, quant_format
from core.cli import add_knobs, ArgumentParser, fmt_bytes, knob
from core.errors import UserError
from core.files import load_checkpoint
from core.runtime import run_cli
from model import GPT, GPTConfig

# ----------------------------------------------------------------------------------------
# Loading (the file itself is opened by files.load_checkpoint: weights_only=True)

def load_model(path, device="cpu"):
    """-> (model, checkpoint dict). The checkpoint carries its config (a plain dict) and its
    tokenizer (`ckpt["tokenizer"]`, rebuilt with data.encoding_from_state), so no corpus is
    needed. `path` may also be a Hugging Face Llama folder (config.json, model.safetensors,
    tokenizer.json): the same (model, ckpt) comes back, so every script runs on it."""
    if not os.path.exists(path):
        raise UserError(f"checkpoint {path!r} not found (train one first: python train.py)")
    if os.path.isdir(path):
        # the Hugging Face layout (core/llama_format.py)
        model, ckpt = llama_format.load_folder(path, device)
        return model, ckpt
    ckpt = load_checkpoint(path, map_location=device)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("config"), dict) \
            or not isinstance(ckpt.get("model"), dict):
        kind = type(ckpt).__name__ if not isinstance(ckpt, dict) else "a dict without " \
            "'config' and 'model'"
        raise UserError(f"{path} holds {kind}, not a checkpoint of this repo (train.py writes "
                        "one dict with 'config', 'model', 'tokenizer')")
    if "quantization" in ckpt:
        # A checkpoint written by `quantize.py --save` stores integer codes + scales
        # (core/quant_format.py): a plain GPT comes back with the dequantized weights.
        return quant_format.model_from_checkpoint(ckpt, device), ckpt
    try:
        cfg = GPTConfig(**ckpt["config"]).validate()
    except TypeError as e:
        raise UserError(f"{path}: its config does not fit this GPTConfig ({e})") from None
    model = GPT(cfg, seed=None).to(device)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else "mismatch"
        raise UserError(f"{path}: the weights do not match its config ({first[:160]})") from None
    return model, ckpt


# ----------------------------------------------------------------------------------------
# `python -m core.checkpoint export | convert`

def plain(obj, where="checkpoint"):
    """An old checkpoint's contents as plain data: dataclasses and argparse namespaces to
    dicts, numpy arrays to tensors, numpy scalars to numbers; anything else is refused."""
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.Tensor)):
        return obj
    if isinstance(obj, dict):
        return {k: plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    if is_dataclass(obj):
        return plain(asdict(obj), where)
    if isinstance(obj, argparse.Namespace):
        return plain(vars(obj), where)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.astype(np.int64) if obj.dtype == np.uint32 else obj.copy())
    if isinstance(obj, np.generic):
        return obj.item()
    raise UserError(f"cannot convert {where}: a {type(obj).__module__}.{type(obj).__name__}")


def convert(old, new):
    """Rewrite a trusted old checkpoint as plain data. The ONE place in this repo that
    unpickles with weights_only=False, and only because the user typed this command."""
    if not os.path.isfile(old):
        raise UserError(f"checkpoint {old!r} not found")
    print(f"convert: opening {old} with weights_only=False -- this runs whatever code the "
          "file contains; do it only for a file you trust")
    try:
        ckpt = torch.load(old, map_location="cpu", weights_only=False)
    except Exception as e:      # any failure of an arbitrary pickle: report it, one line
        raise UserError(f"{old} could not be read at all ({type(e).__name__}: {e})") from None
    converted = plain(ckpt)
    tmp = new + ".tmp"
    os.makedirs(os.path.dirname(new) or ".", exist_ok=True)
    torch.save(converted, tmp)
    torch.load(tmp, weights_only=True)           # the point of it: prove it reads safely
    os.replace(tmp, new)
    print(f"convert: wrote {new} ({os.path.getsize(new) / 1e6:.1f} MB), loadable with "
          "weights_only=True")


# ----------------------------------------------------------------------------------------
# `python -m core.checkpoint export|convert`: a row per knob of each command

EXPORT_KNOBS = [
    knob("--checkpoint", "out/ckpt.pt", "a checkpoint of this repo (train.py, quantize.py) or "
         "a folder"),
    knob("--to", "out/model/hf", "folder to write"),
    knob("--dtype", "float32", "dtype of the exported weights",
         choices=["float32", "bfloat16", "float16"]),
]

CONVERT_KNOBS = [
    knob("old", str, "the old checkpoint"),
    knob("new", str, "where to write the converted one"),
]


def main(argv=None):
    p = ArgumentParser(description="Checkpoint formats of the shared GPT: export to the "
                       "Hugging Face Llama layout, convert an old pickle.")
    sub = p.add_subparsers(dest="command", required=True)
    add_knobs(sub.add_parser("export", help="checkpoint -> Hugging Face Llama folder",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter),
              EXPORT_KNOBS)
    add_knobs(sub.add_parser("convert", help="old checkpoint (pickled objects) -> plain data; "
                             "unpickles OLD with weights_only=False: only for files you trust"),
              CONVERT_KNOBS)
    args = p.parse_args(argv)
    if args.command == "convert":
        return convert(args.old, args.new)
    model, ckpt = load_model(args.checkpoint)
    if "tokenizer" not in ckpt:
        raise UserError(f"{args.checkpoint} carries no tokenizer to export")
    sizes = llama_format.export_model(model, ckpt["tokenizer"], args.to, args.dtype)
    for name, n in sizes.items():
        print(f"{os.path.join(args.to, name)}: {fmt_bytes(n)}")


if __name__ == "__main__":
    run_cli(main)
