"""
core/files.py -- writing and opening files so that nothing is lost and nothing runs:

  - atomic_write / atomic_save: a temporary file renamed into place, so a reader (another
    rank, the next run after a crash) sees the old file or the new one, never half of one;
    `keep` generations (ckpt.pt, ckpt.pt.1, ...) are the fallback for an unreadable newest;
  - load_checkpoint: torch.load(weights_only=True), every failure one line naming the file:
    "not a PyTorch checkpoint" for text or another format, and safe loading named only
    for a pickle that asks to run code (core/checkpoint.py builds models on top of it);
  - disks: `check_writable` before training; `os_reason` finds the OSError ("No space
    left on device") behind torch.save's RuntimeError.
"""
import io
import os
import pickle
import pickletools
import re
import shutil
import tempfile
import warnings
import zipfile

import torch

from core.cli import fmt_bytes
from core.errors import UserError


def atomic_write(path, write, mode="wb", before_replace=None):
    """write(f) into a fresh temporary file beside `path`, then os.replace it into place:
    a reader (another rank, the next run after a crash) sees the old file or the new one,
    never half of one. The temporary file is removed if writing fails. before_replace():
    called once the new file is complete (e.g. keep_generations moving the old one)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.tmp-")
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)      # mkstemp's 0600 would hide it from other users
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_save(obj, path, keep=1):
    """torch.save(obj, path), atomically (atomic_write); keep > 1 keeps the previous
    keep - 1 files as path.1, path.2, ... (generation_paths)."""
    atomic_write(path, lambda f: torch.save(obj, f),
                 before_replace=lambda: keep_generations(path, keep))


# Safe loading, the other half of atomic_save: a checkpoint here holds data only (dicts,
# lists, numbers, strings, tensors), so torch.load(weights_only=True) reads it. A pickle
# may name any Python callable and unpickling calls it: a file from someone else, opened
# with weights_only=False, can run anything. core/checkpoint.py builds models on top.
CONVERT_HINT = "python -m core.checkpoint convert {path} NEW.pt"
# What a file that is not a checkpoint at all (README.md, a JSON file, random bytes) gets:
# what it is first. Safe loading is no part of that answer -- nothing was refused -- so it
# is named only where a file really is a pickle that asks to run code (refusal below).
NOT_A_CHECKPOINT = "{path} is not a PyTorch checkpoint (it holds text or another format, " \
                   "not what torch.save writes)"


def load_checkpoint(path, map_location="cpu", what="checkpoint", fix=None):
    """torch.load(path, weights_only=True), every failure one UserError naming the file.
    Shared by every script that opens a .pt file a user named (or a cache it wrote).
    fix: what to tell the user when the file holds objects (default: the convert command)."""
    if not os.path.exists(path):
        raise UserError(f"{what} {path!r} not found")
    if os.path.isdir(path):
        raise UserError(f"{what} {path!r} is a folder, not a file")
    try:
        with warnings.catch_warnings():      # "pickle protocol 4" chatter from plain pickles
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(refusal(path, e, fix)) from None
    except KeyError:           # torch.load's "invalid load key": not a pickle at all
        raise UserError(NOT_A_CHECKPOINT.format(path=path)) from None
    except EOFError:
        raise UserError(f"{path} is empty or truncated (not a PyTorch checkpoint)") from None
    except Exception as e:
        # Anything else the unpickler or the zip reader throws at a file that is not a
        # checkpoint -- RuntimeError, ValueError, OSError, but also IndexError ("pop from
        # empty list" for a text file whose first byte happens to be a pickle opcode),
        # struct.error, UnicodeDecodeError... -- is the same answer to the user: this file
        # is not a checkpoint. (KeyboardInterrupt and SystemExit are not Exceptions.)
        # Text gets the text line; a damaged zip (torch.save's format) or pickle, this one.
        with open(path, "rb") as f:
            zipped = f.read(2) == b"PK"
        if not zipped and not pickle_callables(path)[0]:
            raise UserError(NOT_A_CHECKPOINT.format(path=path)) from None
        first = (str(e).splitlines() or [""])[0][:120] or type(e).__name__
        raise UserError(f"{path} is not a readable PyTorch checkpoint (truncated or another "
                        f"format: {first})") from None


def refusal(path, error, fix=None):
    """The one line for a file torch.load(weights_only=True) stopped with an
    UnpicklingError. Its restricted unpickler stops at the first opcode it does not
    handle, so README.md ('#' is no opcode) and a plain pickle.dump (protocol 4's FRAME)
    fail the same way as a planted payload: which one it is comes from torch's message
    (it names a refused callable) or from reading the file's opcodes (pickle_callables)."""
    named = re.search(r"GLOBAL (\S+) (?:was not|whose module)", str(error))
    if named:
        is_pickle, calls = True, [named[1]]
    elif zipfile.is_zipfile(path):      # torch.save's format, its pickle damaged
        first = (str(error).split("error:")[-1].strip().splitlines() or [""])[0][:120]
        return f"{path} is not a readable PyTorch checkpoint (corrupted: {first})"
    else:
        is_pickle, calls = pickle_callables(path)
    if calls:
        return (f"{path} asks to run {calls[0]} when opened, which safe loading refuses "
                f"(weights_only=True). " + (fix or "If it is an older checkpoint of this repo "
                f"and you trust its source, convert it once: {CONVERT_HINT.format(path=path)}"))
    if is_pickle:
        return (f"{path} is not a PyTorch checkpoint (a plain Python pickle, not what "
                "torch.save writes)")
    return NOT_A_CHECKPOINT.format(path=path)


# Reading a pickle's opcodes runs nothing (pickletools.genops only decodes them); the ones
# that import a callable -- the first step of every payload (GLOBAL, INST; STACK_GLOBAL
# takes the two strings pushed before it; EXTn looks one up in copyreg's registry) -- are
# what "asks to run code" means. Only the first 16 MiB are read: a file that big and not a
# checkpoint is not worth reading whole to say so.
SCAN_BYTES = 16 << 20


def pickle_callables(path):
    """-> (whether the file is a whole pickle, the callables it would import). Text that
    happens to start with an opcode ('d' is DICT, 'i' is INST) decodes a few opcodes and
    then fails, so only a pickle that decodes to its STOP counts."""
    with open(path, "rb") as f:
        blob = f.read(SCAN_BYTES)
    calls, strings = [], []
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(blob)):
            if op.name in ("GLOBAL", "INST"):
                calls.append(".".join(arg.split(" ", 1)))
            elif op.name == "STACK_GLOBAL":
                calls.append(".".join(strings[-2:]) or "a callable")
            elif op.name.startswith("EXT"):
                calls.append(f"extension callable {arg}")
            elif isinstance(arg, str):
                strings.append(arg)
            if op.name == "STOP":
                return True, [re.sub(r"^(__builtin__|builtins)\.", "", c) for c in calls]
    except Exception:          # ValueError (unknown opcode, cut short) and the like: no pickle
        pass
    return False, []


def generation_paths(path, keep):
    """path (the newest), path.1, ..., path.{keep-1} (older generations)."""
    return [path] + [f"{path}.{i}" for i in range(1, keep)]


def keep_generations(path, keep):
    """Shift path -> path.1 -> path.2 ...; the oldest beyond `keep` is dropped."""
    paths = generation_paths(path, keep)
    for older, newer in zip(reversed(paths[1:]), reversed(paths[:-1])):
        if os.path.exists(newer):
            os.replace(newer, older)


def os_reason(error):
    """What the operating system said, for an OSError or any exception raised while
    handling one (torch.save reports a full disk as "unexpected pos ..." with the
    OSError "No space left on device" as its context). None when there is none."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    return None


def check_writable(folder, need_bytes):
    """Before training: can we create files in `folder`, and is there room for about
    need_bytes? One UserError saying which, instead of a traceback at the first save."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"cannot write checkpoints to {folder}: part of that path is a "
                        "file, not a folder") from None
    except OSError as e:
        raise UserError(f"cannot write checkpoints to {folder}: {e.strerror}") from None
    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        raise UserError(f"{folder} has {fmt_bytes(free)} free; one checkpoint needs about "
                        f"{fmt_bytes(need_bytes)}: free some space or choose another --ckpt")
