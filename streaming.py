"""
streaming.py -- long runs beyond the context: a KV cache that never grows past a fixed
number of tokens, so a conversation (or a token stream) can go on long after block_size.

Run:  python streaming.py measure --bos   # per-position loss of the policies on a long stream
      python streaming.py generate --bos  # sample far past block_size, sink + window cache
Measured (docs/streaming.md; tiny model, a 2048-token stream = 32x its context, 64 tokens
attended): trained with a sink token first in every row (--bos), sinks + window scores
2.906 nats = dense recompute's 2.905 with a 16 KB cache and 1/62 of the forward tokens,
while the window alone scores 2.990; trained on random crops, the model grows no sink
(3% of its attention on the first 4 tokens) and the window alone is as good as recompute.

A plain KV cache (model.KVCache) holds every past token: it grows by 2·L·H_kv·D numbers per
token and, because RoPE positions must stay below block_size, a stream longer than the
context is refused. Three ways to go on, and what each costs (C = tokens attended):
  - Dense with recompute (the reference; StreamingLLM's "sliding window with
    re-computation"): for every new token, re-run the model on the last C tokens from
    scratch. Holds no KV at all between tokens; adds a forward of C tokens per token (C×
    the compute of cached decoding); forgets everything older than C tokens, but every
    window starts afresh with its own first token -- exactly the situation the model was
    trained on -- so it is the best a C-token model can do.
  - Sliding window (sinks = 0): keep the KV of the last W tokens only. Saves: the cache is
    bounded at W tokens, decoding stays one token of compute. Adds: when the window slides,
    the kept keys are re-rotated so that positions stay inside the cache (below). Sacrifices:
    everything older than W -- and, the StreamingLLM finding (Xiao et al. 2023, "Efficient
    Streaming Language Models with Attention Sinks"), much more than that once the very
    first tokens leave: trained models park surplus attention on the first tokens ("attention
    sinks"), and the token now at index 0 of the window was computed as a mid-text token,
    not as a first one, so the parked attention lands somewhere that does not absorb it.
  - Attention sinks + window: keep the first k tokens' KV forever (k = 4 in the paper) plus
    the last W. Same bounded cache (k + W tokens), same re-rotation work, and the first
    tokens are still there to take the parked attention; sacrifices the middle of the
    stream (what lies between the sinks and the window is gone for good: no retrieval).
    The paper reports perplexity close to dense-with-recompute over millions of tokens.

Positions: StreamingLLM assigns positions inside the cache (a key's position is its index
there), so they never reach past k + W, whatever the stream length. The model rotates keys
by RoPE (Su et al. 2021) BEFORE handing them to the cache, so when the window slides by δ,
the kept window keys must move from position p to p − δ. RoPE is a rotation of each pair of
channels by p·θ_i, and R(p − δ) = R(−δ)·R(p): rotating a stored key by −δ gives exactly the
key at its new position (up to one float rounding per slide). What we pay: every slide
rotates the W kept keys of every layer and KV head, L·H_kv·W·D·~3 FLOPs -- per token when
feeding one token at a time, W/c per token when the window slides c tokens at once. That is
small next to the ~2Ψ FLOPs of the token's forward; the other choice, caching pre-RoPE keys
and rotating all k + W of them at attention time, costs the same per step (plus the sinks),
has no accumulated rounding, but no longer stores ready-to-use keys. Here: re-rotation, the
choice of Hugging Face's SinkCache; a key lives at most W slides, so its rounding stays
~√W float epsilons (the tests compare it with keys recomputed at the new positions).

Implements model.py's cache protocol by name (length, update, advance, attention); batch of
B equal-length streams (they share one length, as model.KVCache). MLA is refused: its cache
holds latents, and the rope key sits in another slot (see cfg.kv_cache_dims).
"""
import hashlib
import json
import math
import os
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from core import data
from core import plots
from core.checkpoint import load_model
from model import GPT, KVCache, PRESETS, apply_rope, get_config, repeat_kv, rope_table, sample_next
from core.cli import ArgumentParser, HelpFormatter, add_knobs, fmt_bytes, knob
from core.errors import UserError
from core.files import atomic_save
from core.recipe import warmup_cosine
from core.runtime import run_cli, seed_everything, TimingConditions

DEFAULT_CKPT = os.path.join("out", "ckpt.pt")
OUT_DIR = os.path.join("out", "streaming")


# ----------------------------------------------------------------------------------------
# The cache

def check_counts(sinks, window):
    """The checks that need no model: one clear error each."""
    if window < 1:
        raise UserError(f"window must be at least 1 token, got {window}")
    if sinks < 0:
        raise UserError(f"sinks must be >= 0, got {sinks}")
    if sinks >= window:
        raise UserError(f"sinks ({sinks}) must be fewer than the window ({window}): the sinks "
                        f"are a few first tokens kept beside a larger recent window")


def check_policy(cfg, sinks, window):
    """One clear error for a policy the cache cannot run on this model."""
    check_counts(sinks, window)
    # the largest position used is capacity - 1: the model's RoPE table, and its training,
    # only cover positions below block_size (GPT.forward refuses the others)
    if sinks + window > cfg.block_size:
        raise UserError(f"sinks + window = {sinks + window} exceeds the model's context "
                        f"(block_size={cfg.block_size}): positions inside the cache must "
                        f"stay below it")
    if cfg.mla:
        raise UserError("the sink/window cache re-rotates cached RoPE keys; an MLA cache "
                        "holds latents (and its rope key in another slot): not supported")


class SinkWindowCache:
    """The first `sinks` tokens' K/V plus the last `window` tokens', at most
    capacity = sinks + window tokens per layer (sinks = 0: a plain sliding window).

    Layout per layer: (B, H_kv, capacity, D) buffers; slots [0, sinks) hold the sinks and
    never move, slots [sinks, length) the window, oldest first. A token's position is its
    slot. Before each forward the caller asks for room (make_room(T) evicts the oldest
    window tokens and re-rotates the rest), then runs the model at the positions it returns;
    update() only appends."""

    attention = None              # keys are plain (B, H_kv, T, D) tensors: the layer attends

    def __init__(self, cfg, sinks, window, batch_size=1, device="cpu", dtype=torch.float32):
        check_policy(cfg, sinks, window)
        self.sinks = sinks
        self.window = window
        self.capacity = sinks + window
        # (H_kv, D, D) here (MLA is refused above). All layers in one buffer, allocated
        # once: 2 · L · B · H_kv · capacity · D numbers, however long the stream
        heads, k_dim, v_dim = cfg.kv_cache_dims
        shape = (cfg.n_layer, batch_size, heads, self.capacity)
        self.k = torch.zeros(shape + (k_dim,), device=device, dtype=dtype)
        self.v = torch.zeros(shape + (v_dim,), device=device, dtype=dtype)
        # cos/sin of δ·θ_i, rows δ = 0 .. capacity - 1, the θ_i of the model's own table.
        # A slide is δ <= window, so δ < capacity needs sinks > 0: with sinks = 0 a slide
        # of the whole window (a chunk of `window` tokens into a full cache) indexes row
        # capacity, one past the table -- an IndexError, though nothing is left to rotate
        cos, sin = rope_table(cfg.rope_dim, self.capacity, cfg.rope_theta)
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)
        self.length = 0           # tokens held now (= the next token's position)
        self.seen = 0             # tokens of the stream so far, evicted ones included
        self.evicted = 0          # tokens dropped from the window so far
        self.rotated = 0          # key vectors re-rotated so far (the work this adds)

    def make_room(self, n):
        """Evict the oldest window tokens so that n more fit; -> the n new tokens'
        positions (their slots: length .. length + n - 1)."""
        # how far the n new tokens overflow the capacity: that many window tokens must go
        drop = self.length + n - self.capacity
        if drop > 0:
            # the sinks never leave: only length - sinks window tokens can be dropped, so at
            # most `window` new tokens fit beside them in one forward
            if drop > self.length - self.sinks:
                raise UserError(f"{n} new tokens do not fit beside {self.sinks} sinks in a "
                                f"cache of {self.capacity}: feed at most window={self.window} "
                                f"tokens per forward")
            self.slide(drop)
        # The new tokens go right after the kept window: distances inside the window are
        # the stream's, but sink i and window token j sit sinks + j - i slots apart however
        # far apart they are in the stream -- StreamingLLM's positions inside the cache
        return torch.arange(self.length, self.length + n, device=self.k.device)

    def slide(self, drop):
        """Forget the `drop` oldest window tokens; the kept ones move `drop` slots down and
        their keys are rotated by -drop (R(p - δ) = R(-δ)·R(p)); values carry no position."""
        start = self.sinks + drop           # the first window slot that is kept
        kept = self.length - start
        # a view into the very slots overwritten below; safe for the keys, because
        # apply_rope builds a new tensor (in float32, cast back to the cache's dtype: a
        # bf16 cache rounds each key again at every slide, ~√slides bf16 epsilons)
        old_k = self.k[:, :, :, start:self.length]
        # cos(-a) = cos a, sin(-a) = -sin a: the inverse rotation by drop·θ_i. One row of
        # the table, (D/2,), broadcast over every layer, batch row, head and kept slot
        new_k = apply_rope(old_k, self.rope_cos[drop], -self.rope_sin[drop])
        self.k[:, :, :, self.sinks:self.sinks + kept] = new_k
        # source and destination overlap whenever drop < kept: torch refuses a copy between
        # partially overlapping views of one storage ("Please clone() the tensor"), so the
        # clone reads the values out first. Values carry no position: moved, not rotated
        self.v[:, :, :, self.sinks:self.sinks + kept] = self.v[:, :, :, start:self.length].clone()
        # slots [length, old length) keep stale data: never read (update returns [:end])
        self.length -= drop
        self.evicted += drop
        # L · B · H_kv · kept key vectors of D numbers each: the work the cache adds
        self.rotated += old_k.shape[0] * old_k.shape[1] * old_k.shape[2] * kept

    def update(self, layer, k, v):
        T = k.shape[2]
        if self.length + T > self.capacity:
            raise UserError(f"SinkWindowCache holds {self.length} of {self.capacity} tokens: "
                            f"call make_room({T}) before the forward")
        # k arrives rotated to its slots (the positions make_room returned): stored as is.
        # self.length stays put until advance(): every layer writes at the same slots
        self.k[layer, :, :, self.length:self.length + T] = k
        self.v[layer, :, :, self.length:self.length + T] = v
        end = self.length + T
        # the filled prefix only: the layer attends to sinks + window + the new tokens
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n):
        # called by GPT.forward once, after its last layer
        self.length += n
        self.seen += n

    @property
    def nbytes(self):
        """Bytes allocated: fixed at capacity tokens, however long the stream."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


# ----------------------------------------------------------------------------------------
# The streaming loops

def cache_for(model, sinks, window):
    """A SinkWindowCache for one stream through `model`, in the model's device and dtype
    (the K/V the layers hand it are in that dtype)."""
    w = model.output.weight
    return SinkWindowCache(model.config, sinks, window, device=w.device, dtype=w.dtype)


def feed(model, cache, ids, chunk=1, prefill=True):
    """Run ids (B, n) through the cache: with `prefill`, the first forward fills it (up to
    capacity tokens, nothing evicted: an ordinary causal prefill); then `chunk` tokens per
    forward.
    Yields (index of the forward's first token, logits (B, T, V)) per forward.

    chunk = 1 is the exact policy: every token sees the sinks and the last W tokens (itself
    included).
    A larger chunk slides the window once per chunk (W/chunk re-rotations per token instead
    of W), and the chunk's earlier tokens see fewer recent ones (W - chunk + 1 at least)."""
    if not 1 <= chunk <= cache.window:
        raise UserError(f"chunk must be in 1..window={cache.window}, got {chunk}")
    n = ids.shape[1]
    start = 0
    while start < n:
        if prefill and start == 0 and cache.length < cache.capacity:
            # one causal forward over the first tokens: nothing evicted, so these
            # positions get exactly the dense model's logits
            size = cache.capacity - cache.length     # fill what is free: nothing evicted
        else:
            size = chunk
        size = min(size, n - start)
        # room first, then the forward: the positions come from the cache (slots), never
        # from the stream index, which GPT.forward would refuse past block_size
        positions = cache.make_room(size)          # positions inside the cache
        # the model appends this forward's K/V (update) and advances the cache by `size`
        logits, _ = model(ids[:, start:start + size], positions=positions, cache=cache)
        yield start, logits
        start += size


@torch.no_grad()
def stream_losses(model, tokens, sinks, window, chunk=1):
    """Next-token loss at every position of a 1-D token stream, fed through a
    SinkWindowCache. -> (losses (n-1,), stats: the largest cache, bytes, re-rotations)."""
    device = model.output.weight.device
    cache = cache_for(model, sinks, window)
    tokens = tokens.to(device)
    losses = []
    peak = 0
    t0 = time.perf_counter()
    for start, logits in feed(model, cache, tokens[None], chunk):
        peak = max(peak, cache.length)      # after the forward: its tokens included
        # logits at i predict token i + 1; the stream's last token has no target, so the
        # last forward scores one position fewer than it ran
        targets = tokens[start + 1:start + 1 + logits.shape[1]]
        # .float(): the log-softmax over V in float32 even for a bf16 model
        losses.append(F.cross_entropy(logits[0, :len(targets)].float(), targets,
                                      reduction="none"))
    # forward_tokens_per_token 1: each token enters exactly one forward, the cached cost
    stats = {"peak_tokens": peak, "kv_bytes": cache.nbytes, "rotated": cache.rotated,
             "evicted": cache.evicted, "seconds": time.perf_counter() - t0,
             "forward_tokens_per_token": 1.0}
    return torch.cat(losses), stats


@torch.no_grad()
def recompute_losses(model, tokens, context, batch=16, bos=None):
    """The reference: position t's next-token loss from a fresh forward over
    tokens[t-context+1 .. t], no cache kept between positions (bos: every window is
    [bos] + the last context-1 tokens, as a model trained with one expects). The first
    `context` positions share one causal forward (same numbers); then windows are batched."""
    device = model.output.weight.device
    tokens = tokens.to(device)
    n = len(tokens)
    first = min(context, n)
    t0 = time.perf_counter()
    # positions 0 .. first-1 have at most `context` tokens of history: one causal forward
    # gives each its whole history, what a fresh forward per position would give. (With
    # bos the stream already starts with it: stream_tokens)
    logits, _ = model(tokens[None, :first])
    targets = tokens[1:first + 1]
    losses = [F.cross_entropy(logits[0, :len(targets)].float(), targets, reduction="none")]
    # from t = first on: a window of exactly `context` tokens ending at t scores t + 1
    ends = list(range(first, n - 1))               # the window's last token, t
    for i in range(0, len(ends), batch):
        group = ends[i:i + batch]
        # (batch, context): `batch` windows in one forward, each at positions 0..context-1
        rows = torch.stack([tokens[t - context + 1:t + 1] for t in group])
        if bos is not None:
            # the oldest token gives way: [bos] + the last context - 1, as in training
            rows[:, 0] = bos
        # the LM head on one position per row: batch × context × V logits would cost
        # more memory and time than the windows themselves, for nothing scored
        logits, _ = model(rows, logits_at=[-1])    # only the last position is scored
        losses.append(F.cross_entropy(logits[:, -1].float(), tokens[[t + 1 for t in group]],
                                      reduction="none"))
    # no KV held between positions; the price: `context` forward tokens per scored token
    stats = {"peak_tokens": 0, "kv_bytes": 0, "rotated": 0, "evicted": 0,
             "seconds": time.perf_counter() - t0,
             "forward_tokens_per_token": (first + len(ends) * context) / max(1, n - 1)}
    return torch.cat(losses), stats


@torch.no_grad()
def stream_generate(model, prompt_ids, max_new_tokens, sinks, window, temperature=1.0,
                    top_k=None, seed=0):
    """Sample max_new_tokens after the prompt, as many as wanted: the cache slides, one token
    per forward. -> (new token ids, the cache)."""
    if not prompt_ids:
        raise UserError("stream_generate needs a prompt of at least one token")
    device = model.output.weight.device
    cache = cache_for(model, sinks, window)
    # a generator of its own: the samples depend on `seed` only, not on the global RNG
    gen = torch.Generator(device=device).manual_seed(seed)
    # the prompt: a prefill of up to capacity tokens, then one token per forward (chunk 1);
    # only the last position's logits are needed to sample from
    for _, logits in feed(model, cache, torch.tensor([prompt_ids], device=device)):
        last = logits[:, -1]
    new = []
    for i in range(max_new_tokens):
        nxt = sample_next(last, temperature, top_k, None, gen)
        new.append(int(nxt[0]))
        if i == max_new_tokens - 1:
            break                          # no forward for a token nobody samples from
        # once the cache is full, each token evicts the oldest window token: generation
        # goes on past block_size with positions that never reach capacity
        positions = cache.make_room(1)
        logits, _ = model(nxt[:, None], positions=positions, cache=cache)
        last = logits[:, -1]
    return new, cache


class SinkProbe(KVCache):
    """A plain KV cache that also measures, per layer, how much attention the queries put on
    the first `first` keys -- the "attention sink" of Xiao et al. 2023 (their Figure 2: from
    layer 2 on, most of Llama-2's attention goes to the first token). Uses the protocol's
    `attention` hook to see q and k; the output is the layer's own attn_fn. For one
    causal forward from an empty cache (the probe's weights assume the causal mask)."""

    def __init__(self, cfg, length, first):
        super().__init__(cfg, 1, length)
        self.first = first
        self.mass = []            # per layer: mean weight on the first keys, queries >= 2·first

    def attention(self, q, k, v, mask, attn_fn):
        # the layer's softmax again, to see its weights (a fused attn_fn never forms them):
        # the 1/√D scale of model.math_attention, each KV head repeated for its q heads
        k_all = repeat_kv(k, q.shape[1] // k.shape[1])
        scores = (q @ k_all.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        # a square causal mask: right only when the forward starts from an empty cache
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        # queries from 2·first on: an earlier one has few keys, so much weight on the first
        # ones is forced; from there uniform attention gives them first/(t + 1) < 1/2. The
        # mean over batch, heads and those queries of the weight on the first keys
        self.mass.append(float(probs[:, :, 2 * self.first:, :self.first].sum(-1).mean()))
        # the output is the layer's own: the probe only observes
        return attn_fn(q, k, v, mask)


@torch.no_grad()
def sink_mass(model, tokens, first, windows=8, bos=None):
    """-> (per-layer mean attention on the first `first` tokens of a window, what uniform
    attention would give), over `windows` consecutive block_size windows of the stream
    (bos: each window starts with it, as the recomputed windows do)."""
    size = model.config.block_size
    per_layer = []
    # whole block_size windows of the stream, at most `windows`: one causal forward each
    for w in range(min(windows, len(tokens) // size)):
        # .clone(): the bos write below must not change the caller's stream
        row = tokens[None, w * size:(w + 1) * size].clone()
        if bos is not None:
            row[0, 0] = bos
        probe = SinkProbe(model.config, size, first)
        model(row.to(model.output.weight.device), cache=probe)
        per_layer.append(probe.mass)
    mass = torch.tensor(per_layer).mean(0).tolist()
    # the baseline: query t has t + 1 keys, so uniform attention puts first/(t + 1) on the
    # first ones; averaged over the queries the probe averages (2·first .. size-1)
    uniform = sum(first / (t + 1) for t in range(2 * first, size)) / (size - 2 * first)
    return mass, uniform


# ----------------------------------------------------------------------------------------
# The model and the stream for the measurement

def train_fresh(cfg, corpus, steps, seed, batch_size=16, lr=3e-3, bos=None):
    """A model of `cfg` trained for `steps` AdamW steps on the train split (random crops of
    block_size tokens, as train.py), for a reader without a checkpoint. bos: a token id put
    first in every training row (StreamingLLM §3.3 pre-trains with such a "sink token": the
    same token at position 0 of every sample, an easy place to park unneeded attention)."""
    # built on the CPU and trained there whatever --device; fresh_model moves it after
    model = GPT(cfg, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    loss = torch.tensor(float("nan"))       # what steps = 0 (random init) reports
    for step in range(steps):
        for group in opt.param_groups:
            # linear warmup over 5% of the steps, then half a cosine down to lr / 10
            group["lr"] = warmup_cosine(step, steps, max(1, steps // 20), lr, lr / 10)
        # crops drawn from (seed, step): the same batches on every run of the recipe. With
        # bos, rows one token shorter, so that bos + the row is block_size long
        x, y = data.get_batch(corpus.train, batch_size, cfg.block_size - (bos is not None),
                              seed, step)
        if bos is not None:               # x = [bos, t0 .. t_T-2], y = [t0 .. t_T-1]
            x, y = torch.cat([torch.full_like(x[:, :1], bos), x], 1), torch.cat([x[:, :1], y], 1)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model.eval(), float(loss.detach())


def load_or_train(args):
    """-> (model, corpus, description). By default a fresh --preset model trained for
    --train-steps steps here (0 = random init), with <|endoftext|> first in every training
    row if --bos: the model this page's figures are measured on. --checkpoint PATH runs
    another model instead (the demo's out/ckpt.pt, say), and says what that changes."""
    path = args.checkpoint
    if path and path != "none":
        model, ckpt = load_model(path, args.device)
        # the stream comes from the corpus the checkpoint trained on (its saved --data),
        # unless --data says otherwise; another tokenizer would turn the same text into
        # other token ids, and the losses would measure nothing: refused
        data_path = args.data or (ckpt.get("args") or {}).get("data")
        corpus = data.load_corpus(data_path, model.config.vocab_size)
        if "tokenizer" in ckpt and data.encoding_from_state(ckpt["tokenizer"])._mergeable_ranks \
                != corpus.enc._mergeable_ranks:
            raise UserError(f"{path}'s tokenizer is not the one of corpus "
                            f"{data_path or 'stdlib'}: pass the --data it was trained on")
        if args.bos:
            # the sink probe looks for attention on a leading <|endoftext|>: a model trained
            # without one in front of its rows (train.py's) has no such sink to find
            print(f"note: --checkpoint {path}: a model trained elsewhere; unless it saw "
                  "<|endoftext|> first in its training rows (train.py's models do not), "
                  "--bos gives it a token it never learnt to sink on, and the losses are "
                  "its own, not the fresh sink model's of docs/streaming.md")
        # .float(): run_measure's byte counts (per_token) assume 4-byte K/V
        return model.float().eval(), corpus, path
    return fresh_model(args)


def fresh_model(args):
    """The fresh model, trained once and kept under --out (a plain-data checkpoint that
    load_model reads), so the next run with the same recipe does not train again."""
    cfg = get_config(args.preset)
    corpus = data.load_corpus(args.data, cfg.vocab_size)
    recipe = f"{args.preset}-{args.train_steps}steps-seed{args.seed}" + ("-bos" if args.bos
                                                                            else "")
    # the file name holds the recipe and the corpus, so a different one trains anew. The
    # corpus is named by its path and size, not its contents: a file edited in place to
    # the same size would reuse the older model
    corpus_id = hashlib.sha256(f"{args.data}|{corpus.n_bytes}".encode()).hexdigest()[:8]
    path = os.path.join(args.out, f"fresh-{recipe}-{corpus_id}.pt")
    if os.path.exists(path):
        model, ckpt = load_model(path, args.device)
        print(f"no checkpoint: the fresh model of an earlier run, {path}")
        return model.eval(), corpus, ckpt["what"]
    t0 = time.perf_counter()
    bos = bos_token(corpus, args)
    model, loss = train_fresh(cfg, corpus, args.train_steps, args.seed, bos=bos)
    what = (f"fresh {args.preset} model, random init (--train-steps 0)" if not args.train_steps
            else f"fresh {args.preset} model trained {args.train_steps} steps here "
                 f"({time.perf_counter() - t0:.0f} s, last train loss {loss:.3f})"
                 + (", every row starting with <|endoftext|>" if args.bos else ""))
    print(f"no checkpoint: {what}")
    atomic_save({"config": asdict(cfg), "model": model.state_dict(), "what": what,
                 "tokenizer": data.encoding_to_state(corpus.enc), "args": {"data": args.data}},
                path)
    return model.to(args.device), corpus, what


def bos_token(corpus, args):
    """The dedicated sink token with --bos (<|endoftext|>, the one the fresh model saw first
    in every training row), else None."""
    return corpus.enc.encode_single_token(data.EOT) if args.bos else None


def stream_tokens(corpus, n, offset, bos=None):
    """n consecutive tokens of the validation split (text the model never trained on);
    with bos, that token and n-1 of them."""
    take = n - (bos is not None)
    if len(corpus.val) < offset + take:
        raise UserError(f"the validation split has {len(corpus.val)} tokens: --tokens {n} "
                        f"from --offset {offset} does not fit")
    tokens = torch.from_numpy(corpus.val[offset:offset + take].astype("int64"))
    return tokens if bos is None else torch.cat([torch.tensor([bos]), tokens])


# ----------------------------------------------------------------------------------------
# Reporting

def bands(n, first, parts=4):
    """Position bands [lo, hi): [0, first) -- where no policy of capacity `first` has
    evicted anything, so those three must agree (the smaller "window (W)" evicts from W
    on) -- then the rest in `parts` equal bands."""
    # integer edges, rest · i // parts: the bands differ by at most one position
    edges = [0, min(first, n)]
    rest = n - edges[-1]
    for i in range(1, parts + 1):
        edges.append(edges[1] + rest * i // parts)
    return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]


def band_table(losses, edges):
    """Markdown rows: mean loss per band for each policy."""
    names = list(losses)
    lines = ["| positions | " + " | ".join(names) + " |",
             "|---|" + "---:|" * len(names)]
    for lo, hi in edges:
        cells = [f"{float(losses[k][lo:hi].mean()):.3f}" for k in names]
        lines.append(f"| {lo}-{hi - 1} | " + " | ".join(cells) + " |")
    return lines


def cost_table(stats, n, per_token_bytes, block_size):
    """Markdown rows: what each policy holds and computes per scored token."""
    lines = ["| policy | KV tokens held (max) | KV bytes | forward tokens / token | "
             "keys re-rotated / token | mean loss | ppl | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines.append(f"| full KV cache (model.KVCache) | {n} (refused past {block_size}) | "
                 f"{fmt_bytes(n * per_token_bytes)} | 1 | 0 | - | - | - |")
    # per scored token: n - 1 of them (the stream's first token is never a target)
    for name, s in stats.items():
        lines.append(f"| {name} | {s['peak_tokens']} | {fmt_bytes(s['kv_bytes'])} | "
                     f"{s['forward_tokens_per_token']:.1f} | {s['rotated'] / (n - 1):.0f} | "
                     f"{s['mean_loss']:.3f} | {s['ppl']:.1f} | {s['seconds']:.1f} |")
    return lines


def binned(values, width):
    """[(centre position, mean)] over consecutive bins of `width` positions."""
    return [((i + min(width, len(values) - i) / 2), float(values[i:i + width].mean()))
            for i in range(0, len(values), width)]


def output_suffix(args):
    """What tells one measurement's files from another's: --bos, a policy or chunk other
    than the defaults (sinks 4, window block_size - 4, chunk 1)."""
    tag = "_bos" if args.bos else ""
    # (--sinks other than 4 without --window reads "_windowNone": the default window)
    if args.sinks != 4 or args.window is not None:
        tag += f"_sinks{args.sinks}_window{args.window}"
    return tag + (f"_chunk{args.chunk}" if args.chunk != 1 else "")


def plot(losses, args, capacity):
    """Two SVGs: the loss along the stream (StreamingLLM's Figure 3 layout), and each cache
    policy's excess over the dense reference, where the text's own ups and downs cancel;
    the terminal shows the second. -> the paths written."""
    suffix = output_suffix(args)
    note = ", <|endoftext|> first" if args.bos else ""
    n = len(next(iter(losses.values())))
    width = max(1, n // 64)
    series = {name: binned(v, width) for name, v in losses.items()}
    raw = plots.svg_line_plot(
        "streaming_loss" + suffix, series, directory=args.plots, ylabel="loss (nats)",
        title=f"next-token loss along a {args.tokens}-token stream, {capacity} tokens{note}",
        xlabel=f"position in the stream (mean of {width})")
    # the first entry is the reference: run_measure's `runs` lists dense recompute first
    reference, *policies = losses
    width = max(1, n // 32)
    excess = {name: binned(losses[name] - losses[reference], width) for name in policies}
    over = plots.svg_line_plot(
        "streaming_excess" + suffix, excess, directory=args.plots,
        title=f"loss minus {reference}{note}", ylabel="excess loss (nats)",
        xlabel=f"position in the stream (mean of {width})")
    print(f"excess loss over {reference} (mean of {width} positions):")
    print(plots.terminal_plot(excess))
    return [raw, over]


# ----------------------------------------------------------------------------------------
# Modes

def window_of(args, cfg):
    """--window, or when not given block_size - sinks: capacity = the model's whole context."""
    return args.window if args.window is not None else cfg.block_size - args.sinks


def run_measure(args):
    model, corpus, what = load_or_train(args)
    cfg = model.config
    window = window_of(args, cfg)
    check_policy(cfg, args.sinks, window)
    if args.chunk > window:                        # before any run, not after the first
        raise UserError(f"--chunk must be in 1..window={window}, got {args.chunk}")
    capacity = args.sinks + window
    bos = bos_token(corpus, args)
    tokens = stream_tokens(corpus, args.tokens, args.offset, bos)
    print(f"model: {what} (block_size {cfg.block_size}); stream: {args.tokens} val tokens "
          f"= {args.tokens / cfg.block_size:.1f}x the context; every policy attends to "
          f"{capacity} tokens")
    # Same number of tokens attended for the first three; the fourth has the sinks' window
    # without the sinks, so (sinks + window) - (window) is what keeping the sinks buys.
    runs = {f"dense recompute ({capacity})": lambda: recompute_losses(
                model, tokens, capacity, args.batch_size, bos),
            f"window ({capacity})": lambda: stream_losses(model, tokens, 0, capacity,
                                                          args.chunk),
            f"sinks {args.sinks} + window {window}": lambda: stream_losses(
                model, tokens, args.sinks, window, args.chunk)}
    if args.sinks:
        runs[f"window ({window})"] = lambda: stream_losses(model, tokens, 0, window, args.chunk)
    # the probe's "first keys": the sinks, or the very first token with --sinks 0
    first = max(1, args.sinks)
    mass, uniform = sink_mass(model, tokens, first, bos=bos)
    print(f"attention on the first {first} token(s) of a window (queries from position "
          f"{2 * first} on), per layer: " + ", ".join(f"{m:.1%}" for m in mass)
          + f" (uniform attention: {uniform:.1%}; a sink is far above it)")
    losses, stats = {}, {}
    # one run per policy, wall clock: only the machine's load can say the times are off
    with TimingConditions() as timing:
        for name, run in runs.items():
            losses[name], stats[name] = run()
            stats[name]["mean_loss"] = float(losses[name].mean())
            stats[name]["ppl"] = float(losses[name].mean().exp())
            print(f"{name}: mean loss {stats[name]['mean_loss']:.3f} | ppl "
                  f"{stats[name]['ppl']:.1f} | {stats[name]['seconds']:.1f} s")
    # a full cache's bytes per token, 2 · L · H_kv · D · 4 (float32: load_or_train)
    heads, k_dim, v_dim = cfg.kv_cache_dims
    per_token = cfg.n_layer * heads * (k_dim + v_dim) * 4
    # n - 1 losses: position i scores token i + 1
    edges = bands(args.tokens - 1, capacity)
    table = band_table(losses, edges) + [""] + cost_table(stats, args.tokens, per_token,
                                                            cfg.block_size)
    print("\n".join(table))
    svgs = plot(losses, args, capacity)
    os.makedirs(args.out, exist_ok=True)
    result = os.path.join(args.out, f"measure{output_suffix(args)}.json")
    with open(result, "w", encoding="utf-8") as f:
        json.dump({"model": what, "tokens": args.tokens, "sinks": args.sinks,
                   "window": window, "chunk": args.chunk, "stats": stats,
                   "sink_mass": {"first": first, "per_layer": mass, "uniform": uniform},
                   "bands": [[lo, hi] for lo, hi in edges],
                   "losses": {k: v.tolist() for k, v in losses.items()}}, f, indent=1)
    print(f"wrote {', '.join(svgs)} and {result} (timings: wall clock)")
    timing.report()
    return losses, stats


def run_generate(args):
    model, corpus, what = load_or_train(args)
    window = window_of(args, model.config)
    # encode_ordinary: the user's text never produces special tokens; with --bos the one
    # sink token the fresh model was trained with goes first, by hand
    prompt = corpus.enc.encode_ordinary(args.prompt)
    if args.bos:
        prompt = [bos_token(corpus, args)] + prompt
    new, cache = stream_generate(model, prompt, args.new_tokens, args.sinks, window,
                                 args.temperature, args.top_k, args.seed)
    print(corpus.enc.decode(prompt + new))
    total = len(prompt) + len(new)
    print(f"\n{total} tokens ({total / model.config.block_size:.1f}x the context) | cache "
          f"{cache.length}/{cache.capacity} tokens, {fmt_bytes(cache.nbytes)} | evicted "
          f"{cache.evicted} | model: {what}")


# ----------------------------------------------------------------------------------------
# The command line: every knob once, a row each (flag, default, help; core/cli.py makes
# the flags, --help and the "did you mean" line from these tables)

# Both modes: the model (a checkpoint, or the fresh one trained here), the cache policy, the run
COMMON_KNOBS = [
    knob("--checkpoint", None, "model to run (not given or 'none': the fresh --preset model "
         "trained here, the one the docs measure; e.g. "
         f"{DEFAULT_CKPT}: the demo model, which was not trained with a sink token)"),
    knob("--preset", "tiny", "size of the fresh model", choices=list(PRESETS)),
    knob("--train-steps", 6000, "training steps of the fresh model (0 = random init)"),
    knob("--data", None, "corpus text file (not given: built-in)"),
    knob("--sinks", 4, "first tokens kept (StreamingLLM: 4)"),
    knob("--window", int, "recent tokens kept (not given: block_size - sinks)"),
    knob("--bos", False, "<|endoftext|> first in every training row of the fresh model, in "
         "the stream and in every recomputed window (a dedicated sink token, StreamingLLM "
         "§3.3)"),
    knob("--seed", 0, "training and sampling seed"),
    knob("--device", "cpu", "cpu or cuda"),
    knob("--threads", 1, "torch CPU threads"),
    knob("--out", OUT_DIR, "where measure*.json and the fresh model go"),
]

MEASURE_KNOBS = [
    knob("--tokens", 2048, "stream length (val split)"),
    knob("--offset", 0, "where in the val split it starts"),
    knob("--chunk", 1, "tokens per forward once the cache is full"),
    knob("--batch-size", 16, "recomputed windows per forward"),
    knob("--plots", plots.PLOT_DIR, "where the SVG goes"),
]

GENERATE_KNOBS = [
    knob("--prompt", "def ", "text to start from"),
    knob("--new-tokens", 512, "tokens to sample"),
    knob("--temperature", 0.8, "sampling temperature"),
    knob("--top-k", 50, "sample among the k likeliest"),
]

# mode -> (its line in the top-level --help, its own knobs after the common ones)
MODES = {"measure": ("per-position loss: dense recompute, window, sinks + window",
                     MEASURE_KNOBS),
         "generate": ("sample far past block_size with a sink + window cache", GENERATE_KNOBS)}


def check_args(args):
    """The counts and ranges, one line each (a mode has only some of the flags)."""
    # getattr(.., 1): each mode has only some of these flags; the absent ones pass
    for name in ("tokens", "batch_size", "new_tokens", "threads", "top_k", "chunk"):
        if getattr(args, name, 1) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got "
                            f"{getattr(args, name)}")
    if args.train_steps < 0 or getattr(args, "offset", 0) < 0:
        raise UserError("--train-steps and --offset must be >= 0")
    if getattr(args, "temperature", 1.0) <= 0:
        raise UserError(f"--temperature must be > 0, got {args.temperature}")
    if args.window is not None:                    # the rest needs the model's block_size
        check_counts(args.sinks, args.window)
    return args


def parse_args(argv=None):
    p = ArgumentParser(description="Long runs beyond the context: sliding-window and "
                       "attention-sink KV caches (StreamingLLM).", formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    for mode, (what, knobs) in MODES.items():
        add_knobs(sub.add_parser(mode, formatter_class=HelpFormatter, help=what),
                  COMMON_KNOBS + knobs)
    return check_args(p.parse_args(argv))


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    return {"measure": run_measure, "generate": run_generate}[args.mode](args)


if __name__ == "__main__":
    run_cli(main)
