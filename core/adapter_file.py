"""
core/adapter_file.py -- what a LoRA adapter file is (lora.py --save writes it; lora.py --load
and serve.py --lora read it), and the one way to open one: the format tag and version, the
settings and methods it may record, the base model's fingerprint it was trained against.

One file, plain types only (dicts, lists, strings, numbers, tensors), written atomically:
torch.load(weights_only=True) reads it, so opening a file a stranger sent runs no code.
An adapter is a difference from ONE base: the file names that base by a sha256 of its
weights, and every reader refuses it on another.
"""
import hashlib

import torch

from core.errors import UserError
from core.files import load_checkpoint

# A format tag and a version: read_adapter refuses other files and other versions instead
# of guessing. Not saved: QLoRA's NF4 codes, a deterministic function of the (hashed) W0.
ADAPTER_FORMAT, ADAPTER_VERSION = "nanoscale-lora-adapter", 1
ADAPTER_TENSORS = ("lora_A", "lora_B", "magnitude", "vera_d", "vera_b")   # per layer
VERA_PAIR = ("vera_shared.A", "vera_shared.B")                           # once per model
# What a file may hold: the methods with an adapter to save ("full" changes every weight),
# and the settings lora.apply_adapters takes (tests/test_lora.py checks they agree): a file
# recording another setting comes from another lora.py, and is refused rather than
# rebuilt with the setting dropped -- that could give an adapter of another shape or scale.
FILE_METHODS = ("lora", "loraplus", "qlora", "vera", "dora")
SETTINGS = ("targets", "rank", "alpha", "rslora", "dropout", "seed", "quant_block",
            "double_quant", "dq_block", "vera_rank", "vera_d_init")


def base_fingerprint(model):
    """sha256 of the base model's state (names, dtypes, shapes, bytes): its identity. An
    adapter is a difference from ONE W0; added to another base it is noise."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        # cpu: the same hash on any device; contiguous: .view(uint8) needs it, and the bytes must
        # come in logical order. Names, dtypes and shapes are hashed too: a bf16 cast or a reshape
        # of the same bytes is another base. Bit-exact: a base one ulp away is refused.
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def read_adapter(path):
    """-> the adapter file's dict, or one UserError line: missing, unreadable (corrupt, or
    not plain data: model.load_checkpoint never unpickles objects), not an adapter file."""
    ad = load_checkpoint(path, what="adapter file", fix="Write a new one with lora.py --save.")
    # The types every later line relies on, checked up front: a hand-edited or foreign file
    # fails here in one line, not with a KeyError three functions later.
    shape = dict(method=str, hparams=dict, targets=list, base=dict, tensors=dict)
    if not isinstance(ad, dict) or ad.get("format") != ADAPTER_FORMAT or \
            not all(isinstance(ad.get(k), t) for k, t in shape.items()) or \
            not isinstance(ad["base"].get("sha256"), str) or \
            not all(isinstance(t, torch.Tensor) for t in ad["tensors"].values()):
        raise UserError(f"{path!r} is not a lora.py adapter file (write one with --save)")
    if ad.get("version") != ADAPTER_VERSION:
        raise UserError(f"adapter file {path!r} has version {ad.get('version')!r}; this "
                        f"lora.py reads version {ADAPTER_VERSION}")
    # Settings this format does not know (a file from another lora.py): refused, not
    # silently dropped -- dropping one could rebuild an adapter of another shape or scale.
    unknown = set(ad["hparams"]) - set(SETTINGS)
    if ad["method"] not in FILE_METHODS or unknown:
        raise UserError(f"adapter file {path!r}: unknown method {ad['method']!r} or "
                        f"settings {sorted(unknown)}")
    return ad
