"""
training/rl_models.py -- the models rl.py's runs start from: the SFT'd policy (the
distillation student too) and the teacher, each trained once (sft: supervised fine-tuning
on the answers) and cached in train.py's
checkpoint format (so load_model reads them), keyed by everything their weights depend on;
and the tokenizer a checkpoint carries, read as plain data.

Set-up, not a lesson: rl.py's algorithms and loop read without it. π_ref is a copy of the
policy and PPO's critic is rl.make_critic's; both are made in rl.py's loop.
"""
import os
from dataclasses import asdict

import numpy as np
import torch

from core import data
from core.checkpoint import load_model
from core.errors import UserError
from core.files import atomic_save, load_checkpoint
from core.runtime import Progress
from model import GPT, get_config
from training.rl_rollout import pack, token_logprobs


def sft(model, enc, problems, steps, lr=1e-3, batch=32, seed=0, label="sft"):
    """Supervised fine-tuning on "a+b=" -> "c\\n", loss on the answer tokens only."""
    # (prompt, answer + terminator) as token lists: the answer ends with the stop token, so
    # the policy learns to stop -- RL's rewards need the newline (core/data.py's score)
    pairs = [(enc.encode_ordinary(p.prompt), enc.encode_ordinary(p.answer + data.TERMINATOR))
             for p in problems]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # a stream of its own: the SFT'd weights depend only on what cached()'s key records
    rng = np.random.default_rng([seed, 1234])
    progress = Progress(label, steps)      # a first run builds its caches for minutes
    for step in range(steps):
        progress.update(step)
        # with replacement, `batch` problems a step; the prompt is context, not a target
        rows = [pairs[i] for i in rng.integers(0, len(pairs), batch)]
        seq, mask = pack([p for p, _ in rows], [a for _, a in rows], model.output.weight.device)
        opt.zero_grad(set_to_none=True)
        # -token mean of log π over the answer tokens = the answer-only cross-entropy (rl.py's
        # aggregate "bnpo", written out: the same operations, the same weights bit for bit)
        m = mask.float()
        (-((token_logprobs(model, seq) * m).sum() / m.sum().clamp_min(1))).backward()
        opt.step()
    progress.update(steps)
    return model


def same_tokenizer(ck, enc):       # a teacher must score the student's very tokens
    """Whether checkpoint `ck` carries the tokenizer `enc` (compared as plain data)."""
    return data.encoding_to_state(data.encoding_from_state(ck["tokenizer"])) == \
        data.encoding_to_state(enc)


def cached(path, meta, enc, build, rt):
    """Load the model cached at `path` if it was built with the same `meta`, else build it
    and (rank 0) save it in train.py's checkpoint format, so load_model reads it too."""
    if path and os.path.exists(path):
        model, ck = load_model(path, rt.device)
        same = same_tokenizer(ck, enc)
        # valid only for the same settings AND tokenizer; anything else rebuilds and overwrites
        if ck.get("rl_meta") == meta and same:
            return model
    # Every rank runs build() (seeded): the same model as long as the kernels are deterministic
    # (CPU; on CUDA torch.use_deterministic_algorithms would ensure it). No broadcast follows.
    model = build()
    if path and rt.is_main:
        atomic_save({"config": asdict(model.config), "model": model.state_dict(),
                     "rl_meta": meta, "tokenizer": data.encoding_to_state(enc)}, path)
    return model


def checkpoint_tokenizer(path):
    """The tokenizer a checkpoint carries, read as plain data (model.load_checkpoint: never
    unpickles objects); a file that is not one of ours is one UserError line."""
    ck = load_checkpoint(path)
    if not isinstance(ck, dict) or not isinstance(ck.get("tokenizer"), dict):
        raise UserError(f"{path} carries no tokenizer (not a checkpoint written by train.py)")
    return data.encoding_from_state(ck["tokenizer"])


def build_models(args, rt, need_teacher):
    """The SFT'd policy (= the distillation student) and the teacher, from fresh inits: `small`
    (Python-pretrained or fresh) learnt this task no faster per step than `draft`, at 3x the
    cost (measured: 8.5% held-out after 400 steps vs draft's 6.6% after 500). Cached."""
    if args.ckpt == "none":        # 256 bytes: tests, no corpus, no checkpoint
        enc = data.make_encoding({bytes([i]): i for i in range(256)})
        desc = "256-byte"
    elif not os.path.exists(args.ckpt):
        raise UserError(f"checkpoint {args.ckpt!r} not found (train one: python train.py)")
    else:                          # the repo's BPE, carried by the checkpoint
        enc = checkpoint_tokenizer(args.ckpt)
        desc = f"BPE of {args.ckpt}"
    # SFT's own problems (sft_seed); the RL prompts are main's draw (seed). key: all that the
    # SFT'd weights depend on (fresh adds the preset and the steps).
    train = data.make_problems(args.n_train, args.sft_seed, args.digits, args.ops, "train")
    key = dict(tokenizer=desc, digits=args.digits, ops=args.ops, n_train=args.n_train,
               seed=args.sft_seed, lr=args.sft_lr, batch=args.sft_batch)

    def fresh(name, preset, steps):
        """The SFT'd model `name`: from its cache file when one was built with these
        settings, else trained here (with a progress line) and cached."""
        path = os.path.join(args.cache_dir, f"rl_{name}.pt") if args.cache_dir else ""
        if args.ckpt == "none":
            path = ""                      # byte tokenizer runs (tests) are never cached
        meta = {**key, "preset": preset, "steps": steps}

        def build():
            model = GPT(get_config(preset, vocab_size=enc.n_vocab), seed=args.sft_seed)
            label = f"SFT of the {name} model ({preset}, cached in {path or 'no file'})"
            return sft(model.to(rt.device), enc, train, steps, args.sft_lr, args.sft_batch,
                       args.sft_seed, label=label)
        return cached(path, meta, enc, build, rt)
    out = dict(enc=enc, desc=desc, policy=fresh("sft", args.preset, args.sft_steps))
    if need_teacher:                # a distillation algorithm runs
        if args.teacher == "auto":
            out["teacher"] = fresh("teacher", args.teacher_preset, args.teacher_sft_steps)
        else:
            out["teacher"], ck = load_model(args.teacher, rt.device)
            same = same_tokenizer(ck, enc)
            # distill scores the student's token ids with the teacher: the ids must mean the same
            if not same or out["teacher"].config.vocab_size != enc.n_vocab:
                raise UserError(f"teacher {args.teacher} has a different tokenizer from the "
                                f"student's ({desc}): its log-probs score other tokens")
    return out
