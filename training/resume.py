"""
training/resume.py -- a training run on disk, so that it can stop anywhere and continue exactly:
what train.py saves, how a save knows whose it is, and how a resume finds the right one.
A part of train.py, imported one way: the run's state on disk, not the loop ("checkpoint"
here is a saved run, not activation checkpointing, which stays in train.py).

  - one file per save for one process (config, fp32 weights, optimizer and loss-scale
    state, the step = the data position, every RNG state, the losses so far); under --dp
    a sharded save (training/data_parallel.py) plus a single-file export of the weights;
  - identity: run_id (one per training run, kept by every resume), launch_id (torchrun's
    run id: one per torchrun command, the same across its restarts), save_id;
  - generations: the newest --keep saves stay; an unreadable newest falls back, with a
    line, to the previous one; a torchrun restart resumes only its own launch's save;
  - a resume with model flags that disagree with the checkpoint is refused in one line;
  - a save the disk refuses (full, read-only) is one line saying why, and the previous
    checkpoint is untouched (files.atomic_write).
  costs: disk (--keep × one checkpoint: ~12 B/param with Adam), and a save's time.
"""
import os
from dataclasses import asdict

import numpy as np
import torch

from core import data
from training import data_parallel
from model import PRESETS
from core.errors import UserError
from core.files import atomic_save, generation_paths, load_checkpoint, os_reason
from core.meters import comm
from core.runtime import attempt, print0, rng_state, set_rng_state


def save_checkpoint(path, model, optimizer, scaler, master, step, args, corpus, history,
                    identity=None):
    """One file: the config and tokenizer (so any script can rebuild the model alone), fp32
    weights, optimizer and loss-scale state, the step (= data position: batches are a
    function of the step), every RNG state, the losses so far, and the run's identity
    (run_id, launch_id); the previous --keep - 1 files stay as ckpt.pt.1, ..."""
    weights = model.state_dict()
    if master is not None:   # the fp32 master copy is the real weights
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        weights = {**weights, **{n: p.detach() for n, p in zip(names, master.params)}}
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    ckpt = dict(config=asdict(model.config), model=weights, optimizer=optimizer.state_dict(),
                scaler=scaler.state_dict(), step=step, args=vars(args), rng=plain_rng_state(),
                tokenizer=data.encoding_to_state(corpus.enc), corpus=corpus.name,
                history=history, **(identity or {}))
    atomic_save(ckpt, path, keep=args.keep)    # a crash mid-save: never half a file


def plain_rng_state():
    """runtime.rng_state() as plain data: numpy's state is a tuple holding an ndarray (a
    pickled numpy object, which torch.load(weights_only=True) refuses), so its MT19937 key
    travels as an int64 tensor and the rest as numbers."""
    state = rng_state()
    name, key, pos, has_gauss, cached = state["numpy"]
    state["numpy"] = [name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss),
                      float(cached)]
    return state


def restore_rng_state(state):
    """The inverse of plain_rng_state (also reads `python -m core.checkpoint convert`'s output)."""
    name, key, pos, has_gauss, cached = state["numpy"]
    key = np.asarray(key.tolist() if torch.is_tensor(key) else key, dtype=np.uint32)
    set_rng_state({**state, "numpy": (name, key, int(pos), int(has_gauss), float(cached))})


def load_resume(path, what, resume=None):
    """A checkpoint to resume from, read safely (weights_only=True) unless given, checked,
    or one clear error."""
    if resume is None:
        resume = load_checkpoint(path, map_location="cpu", what=what)
    if isinstance(resume, dict) and "exported_from" in resume and "optimizer" not in resume:
        raise UserError(f"{path} is a model export of a --dp run; resume it with "
                        "--dp (from its sharded checkpoint)")
    needed = ("config", "step", "rng", "tokenizer", "history", "scaler")
    if not isinstance(resume, dict) or any(k not in resume for k in needed):
        raise UserError(f"{path} is not a training checkpoint of this repo (needs "
                        f"{', '.join(needed)})")
    return resume


def shards_dir(args):
    """--dp runs save sharded checkpoints here, one folder per saved step."""
    return os.path.splitext(args.ckpt)[0] + "_shards"


def location(args):
    """Where this run's checkpoints go: the --ckpt file, or (--dp) its shards folder."""
    return shards_dir(args) if args.dp else args.ckpt


def launch_id():
    """torchrun's run id: the same for every rank and every restart of one torchrun command.
    None for a plain `python train.py`, and for a static multi-node launch without
    --rdzv-id, whose id is torchrun's default "none" in EVERY launch: it cannot tell this
    launch's saves from another's (docs/data_parallel.md, Multi-node)."""
    launch = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if launch in (None, "none") else launch


def identity(run, step):
    """What every save records about who wrote it. run_id: one per training run (a resume
    keeps it); launch_id: torchrun's run id (launch_id()); save_id: this save."""
    launch = launch_id()
    return dict(run_id=run.run_id, launch_id=launch,
                save_id=f"{run.run_id}/step_{step}/attempt-{attempt()}")


def read_generation(args, path):
    """-> (checkpoint dict, whole shards or None), read and checked: a single file, or
    (--dp) a save folder whose every shard belongs to its meta.pt."""
    if not args.dp:
        return load_resume(path, "--resume: checkpoint"), None
    meta, full = data_parallel.read_generation(path)
    return load_resume(os.path.join(path, "meta.pt"), "", meta), full


def find_resume(args, restarted=False):
    """-> (checkpoint, whole shards or None, where), or None for a fresh run. Tries the
    newest generation first and falls back, with a line, to an older one when it is
    unreadable. restarted (torchrun restarted us after a failure): resume only a save of
    this launch; another run's checkpoint in the folder is never adopted."""
    if not (args.resume or restarted):
        return None
    paths = (data_parallel.generations(shards_dir(args)) if args.dp else
             [p for p in generation_paths(args.ckpt, args.keep) if os.path.exists(p)])
    problems = []
    for path in paths:
        try:
            resume, full = read_generation(args, path)
        except UserError as e:
            problems.append(str(e))
            continue
        if restarted and (launch_id() is None or resume.get("launch_id") != launch_id()):
            # another launch's, or no launch id to tell: not adopted (check_overwrite
            # refuses it); a static multi-node launch resumes with --rdzv-id ID
            print0("restart: no save of this launch to resume" + (
                "" if launch_id() else " (a launch without --rdzv-id cannot tell its saves "
                "from another launch's: pass --rdzv-id, or --resume explicitly)"))
            return None
        if problems:
            print0(f"warning: {problems[0]}; falling back to the previous checkpoint {path} "
                   f"(step {resume['step']})")
        if restarted:
            print0(f"restart {attempt()}: resuming from the last checkpoint {path} "
                   f"(step {resume['step']})")
        check_model_flags(args, resume, path)
        return resume, full, path
    if problems and len(paths) == 1 and not restarted:
        raise UserError(problems[0])
    if problems:
        raise UserError(f"{problems[0]}; no older checkpoint to fall back on is readable")
    if restarted:
        print0(f"restart {attempt()}: no checkpoint yet, starting from step 0")
        return None
    if args.dp:
        raise UserError(f"--resume --dp: no sharded checkpoint in {shards_dir(args)!r} "
                        "(written by a --dp run with --save-interval)")
    raise UserError(f"--resume: checkpoint {args.ckpt!r} not found")


def check_overwrite(args, config, restarted=False):
    """A fresh run (no --resume) would write over args.ckpt. Refused in one line when the
    file holds a checkpoint of another model configuration, an unfinished run (--resume
    continues it), or something that is not a checkpoint of this repo; --overwrite
    forces it. A finished run of this very configuration may be trained again -- but not
    by a torchrun restart: a restart found no save of its own launch there (find_resume),
    so the file is another launch's, and a restart never writes over it. The refusal is
    the same on every attempt (exit 2 each time: torchrun retries any failed attempt, and
    each retry refuses again before building anything), so no restart changes the outcome."""
    path = args.ckpt
    if args.overwrite or not os.path.exists(path):
        return
    if restarted:
        raise UserError(f"restart {attempt()}: {path} was not written by this launch (another "
                        "run's checkpoint): a torchrun restart never writes over it; "
                        "--ckpt NEW writes elsewhere, --overwrite replaces it")
    try:
        old = load_checkpoint(path, map_location="cpu", what="checkpoint")
    except UserError:
        old = None
    ways_out = "--resume continues it, --ckpt NEW writes elsewhere, --overwrite replaces it"
    if not isinstance(old, dict) or "config" not in old:
        raise UserError(f"{path} exists and is not a checkpoint of this repo: {ways_out}")
    old_args = old.get("args") or {}
    step, steps = old.get("step"), old_args.get("steps")
    described = f"{old_args.get('preset') or 'custom'} model, step {step} of {steps}"
    if old["config"] != config:
        changed = [k for k in config if old["config"].get(k) != config[k]]
        raise UserError(f"{path} holds another model ({described}; differs in "
                        f"{', '.join(changed)}): {ways_out}")
    if step is not None and steps is not None and step < steps:
        raise UserError(f"{path} holds an unfinished run of this model ({described}): "
                        f"{ways_out}")


MODEL_FLAGS = ("n_layer", "n_embd", "n_head", "n_kv_head", "n_expert", "block_size")


def check_model_flags(args, resume, path):
    """--resume continues the checkpoint's model. Model flags given on the command line
    (--preset, --n-layer, ...) that disagree with it are refused in one line: silently
    training another model than the one asked for is worse than stopping."""
    cfg = resume["config"]
    asked = {k: v for k, v in PRESETS.get(args.preset or "", {}).items() if k in MODEL_FLAGS}
    asked.update({k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k) is not None})
    clash = [f"{k}={v} (checkpoint: {cfg.get(k)})" for k, v in asked.items()
             if cfg.get(k) != v]
    if clash:
        flags = f"--preset {args.preset}" if args.preset else "the model flags"
        raise UserError(f"--resume: {path} holds another model than {flags} asks for: "
                        f"{', '.join(clash)}; drop the model flags to continue it, or "
                        f"give another --ckpt to train a new model")


def save(args, rt, run):
    """One file for one process; sharded (training/data_parallel.py) plus a single-file export of
    the weights for the other scripts under --dp. A save the disk refuses is one line
    saying why; the previous checkpoint is untouched (atomic_write)."""
    try:
        write_checkpoint(args, rt, run)
    except (OSError, RuntimeError) as e:
        reason = os_reason(e)
        if reason is None:
            raise
        where = location(args)
        raise UserError(f"saving the checkpoint of step {run.step} to {where} failed: "
                        f"{reason.lower()}; the previous checkpoint there is untouched") \
            from None


def write_checkpoint(args, rt, run):
    ids = identity(run, run.step)
    if not args.dp:
        return save_checkpoint(args.ckpt, run.model, run.optimizer, run.scaler, run.master,
                               run.step, args, run.corpus, run.history, ids)
    meta = dict(config=asdict(run.model.config), scaler=run.scaler.state_dict(),
                step=run.step, args=vars(args), rng=plain_rng_state(),
                tokenizer=data.encoding_to_state(run.corpus.enc), corpus=run.corpus.name,
                history=run.history, world_size=rt.world_size, mode=args.dp, **ids)
    weights = data_parallel.full_state_dict(run.model, run.sync)  # collective: zero3, fsdp

    def export():             # the weights as one file, before `latest` moves (rank 0)
        if rt.is_main:
            plain = {k: v for k, v in meta.items() if k not in ("rng", "scaler")}
            atomic_save({**plain, "model": weights, "exported_from": args.dp}, args.ckpt)
    # shards, then the export, then `latest`: a failure at any point (a full disk on any
    # rank) removes the new save folder, and `latest` stays on the previous save
    data_parallel.save_sharded_checkpoint(shards_dir(args), run.step, run.sync,
                                          run.optimizer, rt, meta, args.keep,
                                          before_commit=export)
    if rt.distributed:
        comm.barrier()


def checkpoint_bytes(n_params, args):
    """About one checkpoint: fp32 weights + Adam's two moments (12 B/param), and under
    --dp the single-file export of the weights (4 B/param) next to the shards."""
    return n_params * (12 + (4 if args.dp else 0))


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nresume.py is a library: `python train.py --resume` uses it (see train.py --help).")
