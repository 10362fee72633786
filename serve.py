"""
serve.py -- serving the shared GPT to many users at once: a paged-KV engine with
continuous batching, chunked prefill, recompute preemption, prefix caching and SLO-aware
scheduling; an OpenAI-compatible HTTP server (standard library only); and a benchmark
that measures all of it against the two baselines it replaces.

    python serve.py --port 8000                 # serve out/ckpt.pt on 127.0.0.1:8000
    python serve.py bench                       # 64 requests: sequential vs static vs engine

What it teaches, and what each technique saves / adds / sacrifices:
  - Sequential generate() (the reference): one request at a time. Decoding a token reads
    every weight to do 2 FLOPs per weight for ONE token: memory-bound, the hardware idles.
  - Static batching (FasterTransformer-era): B requests padded to the longest prompt and
    run until the longest output is done. Saves weight reads (one pass serves B tokens);
    wastes the padded prompt tokens, every finished row's slot until the whole batch ends,
    and reserves KV for B · (longest prompt + longest output).
  - Continuous (iteration-level) batching (Orca, Yu et al. OSDI 2022): the batch is
    re-formed every step; a finished sequence leaves and a waiting one joins at once.
    Needs per-sequence lengths in attention (the paged cache, kvcache.py) -- no padding.
  - Chunked prefill (Sarathi-Serve, Agrawal et al. OSDI 2024): a step has a token budget;
    decodes go first (one token each), the rest of the budget carries chunks of prompts.
    Saves decode stalls behind a long prompt (ITL stays flat); adds more, smaller steps
    for a long prompt (its TTFT grows a little).
  - Recompute preemption (vLLM): when the block pool is full, the lowest-priority running
    sequence gives its blocks back and returns to the front of the queue with the tokens
    it already has; later its KV is recomputed (a prefill of prompt + output so far).
    Saves: admission can be optimistic, memory is used by running sequences only. Costs:
    the recomputation (and its latency), never correctness -- nothing is lost.
  - Prefix caching (kvcache.py): requests sharing a prefix reuse its KV blocks. Saves the
    prefill compute of the shared part (TTFT) and the memory of duplicates.
  - SLO-aware scheduling: requests carry a priority and a TTFT target; admission and
    preemption follow (priority, deadline) instead of arrival order (earliest deadline
    first). Saves goodput (requests meeting their SLOs) under overload; costs fairness:
    low-priority work waits.
  - int8 KV (kvcache.py): ~3.5x less KV memory (fp32 model) for a small logit error.

The engine drives the unmodified model: the step's tokens (decodes and prefill chunks of
all running sequences) are packed into one row, run through `model.layers` with a
PagedKVCache whose paged attention replaces each layer's attn_fn for the step. Greedy
outputs equal model.generate() per request, token for token (tests/test_serve.py).
"""
import argparse
import bisect
import errno
import http.server
import itertools
import json
import math
import os
import queue
import random
import signal
import statistics
import threading
import time
import traceback
import uuid
from collections import namedtuple
from dataclasses import dataclass
from typing import Optional

import torch

import data
from kvcache import BlockAllocator, PagedKVCache, blocks_for, extend_hash_chain
from model import KVCache, load_model, sample_next
from plumbing import UserError, fmt_bytes, pick_device, run_cli

DEFAULT_CHECKPOINT = "out/ckpt.pt"
POLICIES = ("fcfs", "slo")
WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


# ----------------------------------------------------------------------------------------
# Requests

@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    stop: tuple = ()                # stop strings (the text is cut before the first one)
    seed: Optional[int] = None      # per-request generator: same seed, same sample
    ignore_eos: bool = False        # keep going past <|endoftext|> (benchmarks)
    priority: int = 0               # SLO policy: lower runs first
    ttft_slo: Optional[float] = None   # seconds; the SLO policy's admission deadline

    def validate(self):
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise UserError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature <= 100:
            raise UserError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            raise UserError(f"seed must be in [0, 2^63), got {self.seed}")
        return self


class Sequence:
    """One request inside the engine: its tokens (prompt + output so far), how many of
    them have their K/V in the cache, its block table, and its timings."""

    def __init__(self, seq_id, prompt_ids, params, arrival, device):
        self.id, self.params, self.arrival = seq_id, params, arrival
        self.tokens, self.num_prompt = list(prompt_ids), len(prompt_ids)
        # the SLO policy's deadline: when the first token is due
        self.deadline = arrival + (params.ttft_slo if params.ttft_slo is not None else math.inf)
        self.status, self.num_computed = WAITING, 0
        self.block_table, self.block_hashes, self.num_registered = [], [], 0
        self.token_times, self.finish_time, self.finish_reason, self.text = [], None, None, None
        self.num_preemptions, self.num_cached_tokens, self.num_pushed = 0, None, 0
        self.generator = None
        if params.temperature > 0:   # the same stream of numbers generate(seed=...) uses
            seed = params.seed if params.seed is not None else random.getrandbits(62)
            self.generator = torch.Generator(device=device).manual_seed(seed)

    @property
    def output_ids(self):
        return self.tokens[self.num_prompt:]


def decode_tokens(enc, ids):
    """Token ids -> text; incomplete UTF-8 at the end becomes U+FFFD (streaming holds those
    characters back until the next token completes them)."""
    ids = [i for i in ids if i < enc.n_vocab]
    return enc.decode_bytes(ids).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------
# The engine

class Engine:
    """Waiting and running queues, a KV block pool, and `step()`: schedule -> one forward
    over the packed batch -> sample -> finish/free. Single-threaded on purpose: the HTTP
    server talks to it through EngineLoop's inbox."""

    def __init__(self, model, enc=None, block_size=16, num_blocks=1024,
                 max_num_batched_tokens=256, max_num_seqs=64, policy="fcfs",
                 prefix_caching=True, chunked_prefill=True, kv_dtype=None, eos_id=None,
                 clock=time.perf_counter):
        cfg = model.config
        if policy not in POLICIES:
            raise UserError(f"unknown policy {policy!r}: use {' or '.join(POLICIES)}")
        if block_size < 1 or num_blocks < 1 or max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise UserError("block_size, num_blocks, max_num_seqs and max_num_batched_tokens "
                            "must all be >= 1")
        if num_blocks * block_size < cfg.block_size:
            raise UserError(f"KV block pool too small: {num_blocks} blocks x {block_size} "
                            f"tokens = {num_blocks * block_size} slots cannot hold one "
                            f"max-length sequence ({cfg.block_size} tokens); raise "
                            f"--num-blocks to at least {blocks_for(cfg.block_size, block_size)}")
        if not chunked_prefill and max_num_batched_tokens < cfg.block_size:
            raise UserError(f"without chunked prefill a whole prompt must fit one step: "
                            f"--max-num-batched-tokens must be >= the context "
                            f"({cfg.block_size}), got {max_num_batched_tokens}")
        self.model, self.enc, self.cfg, self.clock = model.eval(), enc, cfg, clock
        self.eos_id = eos_id if eos_id is not None else (enc.eot_token if enc else None)
        weight = model.output.weight
        self.device = weight.device
        self.block_size, self.policy, self.chunked_prefill = block_size, policy, chunked_prefill
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.cache = PagedKVCache(cfg, num_blocks, block_size, weight.dtype, weight.device,
                                  kv_dtype)
        self.alloc = BlockAllocator(num_blocks, block_size, prefix_caching)
        self.waiting, self.running, self.live = [], [], {}
        self.ids = itertools.count()
        self.stats = dict(steps=0, preemptions=0, aborted=0, finished=0, prompt_tokens=0,
                          cached_tokens=0, computed_tokens=0, output_tokens=0,
                          max_waste=0, waste_sum=0, waste_samples=0, peak_blocks=0)
        self.step_log = []   # per step: seconds, tokens, decodes, context read, sequences

    # -- requests -------------------------------------------------------------------------
    def add_request(self, prompt, params=None, arrival=None, seq_id=None):
        """prompt: a string (needs the tokenizer) or a list of token ids."""
        params = (params or SamplingParams()).validate()
        if isinstance(prompt, str):
            if self.enc is None:
                raise UserError("a text prompt needs the engine's tokenizer (enc=...)")
            prompt = self.enc.encode_ordinary(prompt)   # user text never makes special tokens
        if not prompt:
            raise UserError("the prompt is empty")
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt):
            raise UserError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        if len(prompt) + params.max_tokens > self.cfg.block_size:
            raise UserError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens})"
                            f" exceeds the model's context of {self.cfg.block_size} tokens")
        seq = Sequence(next(self.ids) if seq_id is None else seq_id, prompt, params,
                       self.clock() if arrival is None else arrival, self.device)
        self.live[seq.id] = seq
        bisect.insort(self.waiting, seq, key=self._key)
        return seq

    def abort(self, seq_id):
        seq = self.live.get(seq_id)
        if seq is not None:
            self._finish(seq, "abort")
            self.stats["aborted"] += 1
        return seq

    def has_work(self):
        return bool(self.waiting or self.running)

    def generate(self, prompts, params=None):
        """In-process use: run a list of prompts to completion -> their Sequences
        (`.output_ids`, `.text`, `.finish_reason`, `.token_times`), in order."""
        if not isinstance(params, (list, tuple)):
            params = [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while self.has_work():
            self.step()
        return seqs

    def _key(self, seq):
        """Order of admission and of preemption (the last is preempted first). FCFS:
        arrival. SLO: priority, then earliest TTFT deadline (EDF). A preempted sequence
        keeps its key, so under FCFS it goes back to the front of the queue."""
        if self.policy == "slo":
            return seq.params.priority, seq.deadline, seq.arrival, seq.id
        return seq.arrival, seq.id

    # -- scheduling -----------------------------------------------------------------------
    def _schedule(self):
        """-> [(seq, n_new_tokens)] for this step, within the token budget.
        1. running decodes first (1 token each), then running prefill chunks: growing a
           block table may need a block; if none is free, preempt the running sequence
           with the last key (taking it out of this step if it was scheduled already;
           possibly the sequence itself);
        2. if nothing was preempted, admit waiting sequences in key order while the budget,
           max_num_seqs and the free blocks allow, using prefix-cache hits."""
        budget, batch, preempted = self.max_num_batched_tokens, {}, False   # seq -> n
        decodes = [s for s in self.running if len(s.tokens) - s.num_computed == 1]
        prefills = [s for s in self.running if len(s.tokens) - s.num_computed > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status != RUNNING:            # preempted earlier in this loop
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self.alloc.grow(seq.block_table, seq.num_computed + n):
                victim = self.running[-1]        # the last key: lowest priority / newest
                if victim in batch:              # scheduled already: take it back out
                    budget += batch.pop(victim)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status == RUNNING:
                batch[seq] = n
                budget -= n
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            hits = self.alloc.match_prefix(seq.tokens, seq.block_hashes)
            cached = len(hits) * self.block_size
            n = len(seq.tokens) - cached
            if n > budget:
                if not self.chunked_prefill:
                    break
                n = budget
            if not self.alloc.can_allocate(blocks_for(cached + n, self.block_size) - len(hits),
                                           hits):
                break
            self.waiting.pop(0)
            for block in hits:
                self.alloc.acquire(block)
            seq.block_table = list(hits)
            self.alloc.grow(seq.block_table, cached + n)
            seq.num_computed, seq.num_registered, seq.status = cached, len(hits), RUNNING
            if seq.num_cached_tokens is None:    # first admission: prefix-cache statistics
                seq.num_cached_tokens = cached
                self.stats["prompt_tokens"] += seq.num_prompt
                self.stats["cached_tokens"] += cached
            bisect.insort(self.running, seq, key=self._key)
            batch[seq] = n
            budget -= n
        return list(batch.items())

    def _preempt(self, seq):
        """Recompute preemption: give back every block, keep the tokens, requeue."""
        self.running.remove(seq)
        self.alloc.release_table(seq.block_table)
        seq.num_computed, seq.num_registered, seq.status = 0, 0, WAITING
        seq.num_preemptions += 1
        self.stats["preemptions"] += 1
        bisect.insort(self.waiting, seq, key=self._key)

    def _finish(self, seq, reason):
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == WAITING:
            self.waiting.remove(seq)
        self.alloc.release_table(seq.block_table)
        seq.status, seq.finish_reason, seq.finish_time = FINISHED, reason, self.clock()
        del self.live[seq.id]
        if self.enc is not None and seq.text is None:
            out = seq.output_ids
            if out and out[-1] == self.eos_id and not seq.params.ignore_eos:
                out = out[:-1]
            seq.text = decode_tokens(self.enc, out)
        self.stats["finished"] += reason != "abort"

    # -- one step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self):
        """Schedule, run the model once over the packed batch, sample where a sequence's
        computed tokens reached its end, finish what is done. -> the sequences that got a
        token this step (finished ones included)."""
        batch = self._schedule()
        if not batch:
            if self.has_work():     # the start-up checks make this impossible: a bug
                raise RuntimeError("the scheduler made no progress")
            return []
        t0 = self.clock()
        logits, sampled = self._forward(batch)
        for seq, n in batch:
            seq.num_computed += n
            self._register_full_blocks(seq)
        new_tokens = self._sample(logits, sampled) if sampled else []
        now = self.clock()
        self._account(batch, now - t0)
        for seq, tok in zip(sampled, new_tokens):
            seq.tokens.append(tok)
            seq.token_times.append(now)
            self.stats["output_tokens"] += 1
            reason = self._stop_reason(seq, tok)
            if reason:
                self._finish(seq, reason)
        return sampled

    def _forward(self, batch):
        """The model on the packed step: (1, T) tokens with their own positions; the
        layers are the model's, attention is the paged one. Logits only for the last token
        of sequences that are now complete (a mid-prompt chunk needs none)."""
        model = self.model
        ids = [t for seq, n in batch for t in seq.tokens[seq.num_computed:seq.num_computed + n]]
        self.cache.prepare([(seq.block_table, seq.num_computed, n) for seq, n in batch])
        idx = torch.tensor([ids], device=self.device)
        cos, sin = model.rope(self.cache.positions[None])
        x = model.tok_embeddings(idx)
        with self.cache.installed(model):
            for i, layer in enumerate(model.layers):
                x = layer(x, cos, sin, None, self.cache, i)
        rows, sampled, end = [], [], 0
        for seq, n in batch:
            end += n
            if seq.num_computed + n == len(seq.tokens):
                rows.append(end - 1)
                sampled.append(seq)
        if not rows:
            return None, []
        return model.output(model.norm(x[0, rows])), sampled

    def _sample(self, logits, seqs):
        """Greedy rows in one argmax; sampled rows with model.sample_next and their own
        generator (so a seeded request draws what generate(seed=...) draws)."""
        out = logits.argmax(-1).tolist()
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.temperature > 0:
                out[i] = int(sample_next(logits[i:i + 1], p.temperature, p.top_k or None,
                                         p.top_p, seq.generator)[0])
        return out

    def _stop_reason(self, seq, tok):
        p = seq.params
        if tok == self.eos_id and not p.ignore_eos:
            return "stop"
        if p.stop and self.enc is not None:
            text = decode_tokens(self.enc, seq.output_ids)
            cuts = [i for i in (text.find(s) for s in p.stop) if i >= 0]
            if cuts:
                seq.text = text[:min(cuts)]
                return "stop"
        if len(seq.output_ids) >= p.max_tokens or len(seq.tokens) >= self.cfg.block_size:
            return "length"
        return None

    def _register_full_blocks(self, seq):
        """Blocks that just became full (and hold computed K/V) join the prefix cache."""
        if not self.alloc.prefix_caching:
            return
        bs, full = self.block_size, seq.num_computed // self.block_size
        extend_hash_chain(seq.block_hashes, seq.tokens, full, bs)
        for i in range(seq.num_registered, full):
            self.alloc.register(seq.block_table[i], seq.block_hashes[i],
                                seq.tokens[i * bs:(i + 1) * bs])
        seq.num_registered = max(seq.num_registered, full)

    def _account(self, batch, seconds):
        """Step log (roofline) and KV waste: slots reserved in a sequence's blocks but not
        holding a computed token -- paging keeps it < block_size per sequence."""
        st = self.stats
        st["steps"] += 1
        st["computed_tokens"] += sum(n for _, n in batch)
        n_dec = sum(n == 1 for _, n in batch)
        ctx = sum(seq.num_computed for seq, _ in batch)
        self.step_log.append((seconds, sum(n for _, n in batch), n_dec, ctx, len(batch)))
        for seq in self.running:
            waste = len(seq.block_table) * self.block_size - seq.num_computed
            st["max_waste"] = max(st["max_waste"], waste)
            st["waste_sum"] += waste
            st["waste_samples"] += 1
        st["peak_blocks"] = max(st["peak_blocks"], self.alloc.num_used)


# ----------------------------------------------------------------------------------------
# Static batching, the baseline: pad to the longest prompt, run to the longest output.

@torch.no_grad()
def static_batch_generate(model, prompts, max_new_tokens, on_step=None):
    """Greedy decoding of a batch of prompts of different lengths with the contiguous
    model.KVCache: prompts left-padded to the longest, pad keys masked out, each row with
    its own RoPE positions (so every row computes exactly what generate() would), all rows
    decoded for max_new_tokens steps. -> (B, max_new_tokens) list of lists."""
    dev = model.output.weight.device
    B, P = len(prompts), max(len(p) for p in prompts)
    pad = torch.tensor([P - len(p) for p in prompts], device=dev)
    idx = torch.tensor([[0] * (P - len(p)) + list(p) for p in prompts], device=dev)
    col = torch.arange(P, device=dev)
    positions = (col[None] - pad[:, None]).clamp(min=0)
    valid = col[None] >= pad[:, None]                                   # (B, P) real keys
    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
    mask = (causal[None] & valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=dev)
    cache = KVCache(model.config, B, P + max_new_tokens, device=dev,
                    dtype=model.output.weight.dtype)
    logits, _ = model(idx, positions=positions, mask=mask[:, None], cache=cache)
    out = []
    for step in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1)
        out.append(nxt)
        if on_step:
            on_step()
        if step == max_new_tokens - 1:
            break
        valid = torch.cat([valid, torch.ones(B, 1, dtype=torch.bool, device=dev)], 1)
        logits, _ = model(nxt[:, None], positions=(P + step - pad)[:, None],
                          mask=valid[:, None, None, :], cache=cache)
    return torch.stack(out, 1).tolist()


# ----------------------------------------------------------------------------------------
# The HTTP server: OpenAI's /v1/completions and /v1/chat/completions, standard library only.

class ApiError(Exception):
    """An HTTP error with OpenAI's JSON body: {"error": {"message", "type", "param",
    "code"}}."""

    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.type = {404: "not_found_error", 413: "request_too_large",
                     429: "rate_limit_error"}.get(status, "invalid_request_error"
                                                  if status < 500 else "server_error")


# What the engine thread hands a request's handler: new token ids, and at the end the
# finish reason and the final text (or an error).
Update = namedtuple("Update", "tokens finish_reason text error", defaults=(None, None, None))


class EngineLoop:
    """Runs the engine in its own thread. Handler threads never touch the engine: they put
    'add' and 'abort' into an inbox and read their own queue of Updates. The in-flight cap
    (running + queued) answers 429 instead of letting a queue grow without bound."""

    def __init__(self, engine, max_queue):
        self.engine, self.cond, self.inbox, self.outboxes = engine, threading.Condition(), [], {}
        self.ids, self.in_flight, self.stopping = itertools.count(), 0, False
        self.max_in_flight = engine.max_num_seqs + max_queue
        self.thread = threading.Thread(target=self.run, daemon=True, name="engine")
        self.thread.start()

    def submit(self, prompt_ids, params):
        with self.cond:
            if self.in_flight >= self.max_in_flight:
                raise ApiError(429, f"server busy: {self.in_flight} requests in flight (cap "
                                    f"{self.max_in_flight} = max_num_seqs + max_queue); retry")
            sid, q = next(self.ids), queue.Queue()
            self.outboxes[sid] = q
            self.in_flight += 1
            self.inbox.append(("add", sid, prompt_ids, params))
            self.cond.notify()
        return sid, q

    def abort(self, sid):
        with self.cond:
            self.inbox.append(("abort", sid, None, None))
            self.cond.notify()

    def stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=10)

    def _push(self, sid, update):
        q = self.outboxes.get(sid)
        if q is None:
            return
        q.put(update)
        if update.finish_reason or update.error:
            with self.cond:
                del self.outboxes[sid]
                self.in_flight -= 1

    def run(self):
        eng = self.engine
        while True:
            with self.cond:
                while not (self.inbox or eng.has_work() or self.stopping):
                    self.cond.wait()
                if self.stopping:
                    return
                ops, self.inbox = self.inbox, []
            for op, sid, prompt_ids, params in ops:
                if op == "add":
                    try:
                        eng.add_request(prompt_ids, params, seq_id=sid)
                    except Exception as e:     # UserError: a bad request; else a bug
                        self._push(sid, Update([], error=ApiError(
                            400 if isinstance(e, UserError) else 500, str(e))))
                elif eng.abort(sid) is not None:
                    self._push(sid, Update([], "abort", ""))
            try:
                updated = eng.step()
            except Exception as e:        # a bug: fail every request, keep serving
                traceback.print_exc()
                for seq in list(eng.live.values()):
                    eng.abort(seq.id)
                    self._push(seq.id, Update([], error=ApiError(500, f"engine error: {e}")))
                continue
            for seq in updated:
                new = seq.output_ids[seq.num_pushed:]
                seq.num_pushed += len(new)
                self._push(seq.id, Update(new, seq.finish_reason, seq.text))


def chat_prompt(messages):
    """A minimal chat template. The roles are plain text: user content cannot inject
    special tokens (prompts are encoded with encode_ordinary)."""
    return "".join(f"### {m['role'].capitalize()}:\n{m['content']}\n\n" for m in messages) \
        + "### Assistant:\n"


CHAT_STOP = "\n### "   # the model starting another turn ends the answer


def _field(body, key, types, default, check=None, why=""):
    """body[key] with a type check (bool is not a number here) and a range check."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = "/".join(t.__name__ for t in types)
        raise ApiError(400, f"'{key}' must be of type {names}, got {type(value).__name__}", key)
    if check is not None and not check(value):
        raise ApiError(400, f"'{key}' {why}, got {value!r}", key)
    return value


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "nanoscale-serve"
    timeout = 60          # a client that stops sending mid-request cannot hold a thread

    def log_message(self, fmt, *args):
        if self.server.verbose:
            super().log_message(fmt, *args)

    # -- plumbing -------------------------------------------------------------------------
    def send_json(self, status, obj, close=False):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def send_error_json(self, e):
        # close the connection after an error: the body may not have been read
        self.send_json(e.status, {"error": {"message": str(e), "type": e.type,
                                            "param": e.param, "code": e.code}}, close=True)

    def handle_one_request(self):
        try:
            super().handle_one_request()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def read_json(self):
        length = self.headers.get("Content-Length")
        if length is None:
            raise ApiError(411, "a Content-Length header is required")
        if not length.isdigit():
            raise ApiError(400, "bad Content-Length")
        if int(length) > self.server.max_body_bytes:
            raise ApiError(413, f"request body of {length} bytes is over the "
                                f"{self.server.max_body_bytes}-byte limit")
        try:
            body = json.loads(self.rfile.read(int(length)))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"invalid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    # -- routes ---------------------------------------------------------------------------
    def do_GET(self):
        srv = self.server
        try:
            if self.path == "/health":
                eng, alloc = srv.loop.engine, srv.loop.engine.alloc
                self.send_json(200, {
                    "status": "ok", "running": len(eng.running), "waiting": len(eng.waiting),
                    "in_flight": srv.loop.in_flight, "num_blocks": alloc.num_blocks,
                    "free_blocks": len(alloc.free), "cached_blocks": len(alloc.evictable),
                    "used_blocks": alloc.num_used, **eng.stats})
            elif self.path == "/v1/models":
                self.send_json(200, {"object": "list", "data": [{
                    "id": srv.model_name, "object": "model", "created": srv.created,
                    "owned_by": "nanoscale", "max_model_len": srv.context}]})
            elif self.path in ("/v1/completions", "/v1/chat/completions"):
                raise ApiError(405, f"use POST for {self.path}")
            else:
                raise ApiError(404, f"no route {self.path}")
        except ApiError as e:
            self.send_error_json(e)

    def do_POST(self):
        try:
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                raise ApiError(404, f"no route {self.path}")
            self.completion(self.read_json(), chat=self.path.endswith("chat/completions"))
        except ApiError as e:
            self.send_error_json(e)

    def do_PUT(self):
        self.send_error_json(ApiError(405, f"method {self.command} not allowed"))

    do_DELETE = do_PATCH = do_PUT

    # -- the completion endpoints -----------------------------------------------------------
    def parse(self, body, chat):
        srv = self.server
        model = _field(body, "model", (str,), srv.model_name)
        if model != srv.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves "
                                f"{srv.model_name!r}", "model", "model_not_found")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "'messages' must be a non-empty list", "messages")
            clean = []
            for m in messages:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, list) and all(     # [{"type": "text", "text": ..}]
                        isinstance(p, dict) and p.get("type") == "text"
                        and isinstance(p.get("text"), str) for p in content):
                    content = "".join(p["text"] for p in content)
                if not isinstance(content, str) or m.get("role") not in (
                        "system", "user", "assistant", "developer"):
                    raise ApiError(400, "each message needs a 'role' (system, user, assistant "
                                        "or developer) and a text 'content'", "messages")
                clean.append({"role": m["role"], "content": content})
            prompt_ids = srv.enc.encode_ordinary(chat_prompt(clean))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str) and prompt:
                prompt_ids = srv.enc.encode_ordinary(prompt)
            elif isinstance(prompt, list) and prompt and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                prompt_ids = prompt
                if not all(0 <= t < srv.vocab_size for t in prompt_ids):
                    raise ApiError(400, f"token ids must be in [0, {srv.vocab_size})", "prompt")
            else:
                raise ApiError(400, "'prompt' must be a non-empty string or list of token "
                                    "ids (one prompt per request)", "prompt")
        if len(prompt_ids) >= srv.context:
            raise ApiError(400, f"this model's maximum context length is {srv.context} "
                                f"tokens; the prompt has {len(prompt_ids)}", "prompt",
                           "context_length_exceeded")
        for key, bad in (("n", lambda v: v != 1), ("best_of", lambda v: v != 1),
                         ("logprobs", bool), ("echo", bool)):
            if key in body and body[key] is not None and bad(body[key]):
                raise ApiError(400, f"'{key}' is not supported by this server", key)
        room = srv.context - len(prompt_ids)
        max_key = "max_completion_tokens" if chat and "max_completion_tokens" in body \
            else "max_tokens"
        max_tokens = _field(body, max_key, (int,), None, lambda v: v >= 1, "must be >= 1")
        if max_tokens is None:   # OpenAI: 16 for completions, the rest of the context for chat
            max_tokens = min(room, srv.max_tokens_cap) if chat else min(16, room)
        if max_tokens > srv.max_tokens_cap:
            raise ApiError(400, f"'{max_key}' {max_tokens} is over this server's cap of "
                                f"{srv.max_tokens_cap}", max_key)
        if max_tokens > room:
            raise ApiError(400, f"this model's maximum context length is {srv.context} tokens"
                                f"; the prompt ({len(prompt_ids)}) + {max_key} ({max_tokens}) "
                                f"is longer", max_key, "context_length_exceeded")
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and (not isinstance(stop, list) or len(stop) > 4 or not all(
                isinstance(s, str) and s for s in stop)):
            raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty "
                                "strings", "stop")
        stop = tuple(stop or ()) + ((CHAT_STOP,) if chat else ())
        options = _field(body, "stream_options", (dict,), {})
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=float(_field(body, "temperature", (int, float), 1.0,
                                     lambda v: 0 <= v <= 2, "must be in [0, 2]")),
            top_p=float(_field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1,
                               "must be in (0, 1]")),
            top_k=max(0, _field(body, "top_k", (int,), 0, lambda v: v >= -1,
                                "must be >= -1 (-1 and 0 mean off)")),
            stop=stop, seed=_field(body, "seed", (int,), None),
            priority=_field(body, "priority", (int,), 0))
        stream = _field(body, "stream", (bool,), False)
        return prompt_ids, params, stream, bool(options.get("include_usage"))

    def completion(self, body, chat):
        srv = self.server
        prompt_ids, params, stream, include_usage = self.parse(body, chat)
        sid, q = srv.loop.submit(prompt_ids, params)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": srv.model_name}
        if stream:
            return self.stream(sid, q, head, chat, prompt_ids, params, include_usage)
        ids = []
        while True:
            up = q.get()
            if up.error:
                raise up.error
            ids += up.tokens
            if up.finish_reason:
                break
        choice = {"index": 0, "logprobs": None, "finish_reason": up.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": up.text}
        else:
            choice["text"] = up.text
        self.send_json(200, {**head, "choices": [choice], "usage": _usage(prompt_ids, ids)})

    def stream(self, sid, q, head, chat, prompt_ids, params, include_usage):
        """Server-sent events: `data: {chunk}\\n\\n` per piece of text, then `data: [DONE]`.
        Text is released only when it cannot change: incomplete UTF-8 (U+FFFD at the end)
        and the last len(longest stop string) - 1 characters are held back. A client that
        goes away makes the next write fail: the sequence is aborted, its blocks freed."""
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def event(delta=None, finish=None, usage=None):
            if usage is not None:
                obj = {**head, "choices": [], "usage": usage}
            elif chat:
                obj = {**head, "choices": [{"index": 0, "delta": delta or {}, "logprobs": None,
                                            "finish_reason": finish}]}
            else:
                obj = {**head, "choices": [{"index": 0, "text": (delta or {}).get("content", ""),
                                            "logprobs": None, "finish_reason": finish}]}
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        hold = max((len(s) for s in params.stop), default=1) - 1
        ids, sent = [], 0
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")    # the body ends when the socket does
            self.close_connection = True
            self.end_headers()
            if chat:
                event({"role": "assistant", "content": ""})
            while True:
                up = q.get()
                if up.error:
                    self.wfile.write(b"data: " + json.dumps({"error": {
                        "message": str(up.error), "type": up.error.type}}).encode() + b"\n\n")
                    break
                ids += up.tokens
                if up.finish_reason:
                    if len(up.text) > sent:
                        event({"content": up.text[sent:]})
                    event(finish=up.finish_reason)
                    if include_usage:
                        event(usage=_usage(prompt_ids, ids))
                    break
                text = decode_tokens(self.server.enc, ids)
                safe = len(text.rstrip("\ufffd")) - hold
                if safe > sent:
                    event({"content": text[sent:safe]})
                    sent = safe
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.server.loop.abort(sid)                # the client left: free its blocks


def _usage(prompt_ids, ids):
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
            "total_tokens": len(prompt_ids) + len(ids)}


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True      # one thread per connection; many clients at once
    request_queue_size = 256   # listen() backlog (socketserver's 5 resets a burst of clients)


def make_server(engine, enc, host="127.0.0.1", port=8000, model_name="nanoscale",
                max_body_bytes=1 << 20, max_tokens_cap=None, max_queue=256, verbose=False):
    """Bind (127.0.0.1 unless told otherwise: serving to a network is a decision), start
    the engine thread. Call serve_forever() on the result; shutdown() + loop.stop()."""
    try:
        srv = Server((host, port), Handler)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is already in use: stop the other "
                            f"server or pick another --port") from None
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    srv.loop, srv.enc, srv.model_name, srv.verbose = EngineLoop(engine, max_queue), enc, \
        model_name, verbose
    srv.context, srv.vocab_size = engine.cfg.block_size, engine.cfg.vocab_size
    srv.max_body_bytes, srv.created = max_body_bytes, int(time.time())
    srv.max_tokens_cap = max_tokens_cap or engine.cfg.block_size
    return srv


# ----------------------------------------------------------------------------------------
# The benchmark: the same requests through sequential generate(), static batching and the
# engine, in one run; latency percentiles, goodput, KV usage, the decode roofline.

@dataclass
class BenchRequest:
    prompt: list
    out_len: int
    arrival: float          # seconds after the start
    interactive: bool       # SLO class: tight TTFT (priority 0) or batch (priority 1)


def _range(text, name):
    try:
        lo, hi = (int(x) for x in text.split(":")) if ":" in text else (int(text),) * 2
    except ValueError:
        raise UserError(f"--{name} takes N or LO:HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise UserError(f"--{name} needs 1 <= LO <= HI, got {text!r}")
    return lo, hi


def make_workload(args, cfg, eos_id):
    """Seeded: prompt and output lengths uniform in their ranges, prompt tokens random
    (never <|endoftext|>; an optional shared prefix in front, e.g. a system prompt),
    arrivals all at t=0 (--rate inf) or Poisson at --rate requests/s."""
    rng = random.Random(args.seed)
    (plo, phi), (olo, ohi) = _range(args.prompt_len, "prompt-len"), _range(args.output_len,
                                                                           "output-len")
    vocab = [t for t in range(cfg.vocab_size) if t != eos_id]
    shared = [rng.choice(vocab) for _ in range(args.shared_prefix)]
    reqs, t = [], 0.0
    for _ in range(args.num_requests):
        plen = len(shared) + rng.randint(plo, phi)
        olen = min(rng.randint(olo, ohi), cfg.block_size - plen)
        if olen < 1:
            raise UserError(f"prompts of up to {plen} tokens leave no room for output in the "
                            f"context of {cfg.block_size}: lower --prompt-len/--shared-prefix")
        prompt = shared + [rng.choice(vocab) for _ in range(plen - len(shared))]
        if args.rate != math.inf:
            t += rng.expovariate(args.rate)
        reqs.append(BenchRequest(prompt, olen, t, rng.random() < args.interactive_frac))
    return reqs


# The bench's clock: wall time (time.perf_counter), or this process's CPU time
# (time.process_time, --clock cpu): on a machine shared with other jobs the wall clock
# measures the neighbours too; CPU time measures our work as if the core were ours
# (arrivals must then be all at once: CPU time does not pass while we sleep).
clock = time.perf_counter


def _wait_until(t):
    delay = t - clock()
    if delay > 0:
        time.sleep(delay)


def run_sequential(model, reqs):
    """The reference: model.generate() one request at a time, in arrival order. A forward
    hook timestamps every forward pass: pass i of generate() yields output token i."""
    stamps = []
    hook = model.register_forward_hook(lambda *_: stamps.append(clock()))
    t0, recs = clock(), []
    try:
        for r in reqs:
            _wait_until(t0 + r.arrival)
            stamps.clear()
            out = model.generate(r.prompt, r.out_len, temperature=0)
            recs.append(dict(out=out, times=stamps[:len(out)], finish=stamps[len(out) - 1]))
    finally:
        hook.remove()
    return t0, recs


def run_static(model, reqs, batch_size):
    """Static batching: batches of batch_size in arrival order; a batch starts when its
    last request has arrived, is padded to its longest prompt, decodes until its longest
    output is done, and only then frees its slots for the next batch."""
    t0, recs = clock(), []
    reserved = used = computed = 0
    for i in range(0, len(reqs), batch_size):
        group = reqs[i:i + batch_size]
        _wait_until(t0 + max(r.arrival for r in group))
        stamps = []
        n_max = max(r.out_len for r in group)
        outs = static_batch_generate(model, [r.prompt for r in group], n_max,
                                     on_step=lambda: stamps.append(clock()))
        end = clock()
        reserved += len(group) * (max(len(r.prompt) for r in group) + n_max)
        computed += len(group) * (max(len(r.prompt) for r in group) + n_max - 1)
        used += sum(len(r.prompt) + r.out_len for r in group)
        recs += [dict(out=o[:r.out_len], times=stamps[:r.out_len], finish=end)
                 for r, o in zip(group, outs)]
    return t0, recs, (used, reserved, computed)


def engine_from_args(model, enc, args, policy, clock=time.perf_counter):
    return Engine(model, enc, block_size=args.block_size, num_blocks=args.num_blocks,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=args.max_num_seqs, policy=policy,
                  prefix_caching=not args.no_prefix_caching,
                  chunked_prefill=not args.no_chunked_prefill, kv_dtype=args.kv_dtype,
                  clock=clock)


def run_engine(model, enc, reqs, args, policy):
    """The engine with arrivals injected as they happen (in-process, no HTTP)."""
    eng = engine_from_args(model, enc, args, policy, clock)
    t0, pending, seqs = clock(), list(reqs), []
    while pending or eng.has_work():
        while pending and t0 + pending[0].arrival <= clock():
            r = pending.pop(0)
            seqs.append(eng.add_request(r.prompt, SamplingParams(
                max_tokens=r.out_len, temperature=0, ignore_eos=True,
                priority=0 if r.interactive else 1,
                ttft_slo=args.slo_ttft if r.interactive else args.slo_ttft_batch),
                arrival=t0 + r.arrival))
        if eng.has_work():
            eng.step()
        elif pending:
            _wait_until(t0 + pending[0].arrival)
    recs = [dict(out=s.output_ids, times=s.token_times, finish=s.finish_time) for s in seqs]
    return t0, recs, eng


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))] if xs else math.nan


def summarize(t0, recs, reqs, args):
    """Throughput, TTFT / TPOT / ITL percentiles and goodput (requests meeting all their
    SLOs per second of the run), each request timed from its arrival."""
    ttft, tpot, itl, good = [], [], [], 0
    for r, rec in zip(reqs, recs):
        t = rec["times"]
        ttft.append(t[0] - (t0 + r.arrival))
        tp = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0
        tpot.append(tp)
        itl += [b - a for a, b in zip(t, t[1:])]
        good += ttft[-1] <= (args.slo_ttft if r.interactive else args.slo_ttft_batch) \
            and tp <= args.slo_tpot
    wall = max(rec["finish"] for rec in recs) - t0
    return dict(wall=wall, tok_s=sum(len(rec["out"]) for rec in recs) / wall, ttft=ttft,
                tpot=tpot, itl=itl, good=good, goodput=good / wall,
                ttft_interactive=[x for x, r in zip(ttft, reqs) if r.interactive])


def measure_machine(device):
    """Copy bandwidth (read + write bytes / s of a 64 MB tensor copy) and dense matmul
    FLOP/s, best of 3: the two roofs of the roofline."""
    x, a = torch.randn(16 << 20, device=device), torch.randn(1024, 1024, device=device)
    y = torch.empty_like(x)                      # float(...) waits for the device
    copy = min(_timed(lambda: float(y.copy_(x)[0])) for _ in range(3))
    mm = min(_timed(lambda: float((a @ a)[0, 0])) for _ in range(3))
    return 2 * x.numel() * 4 / copy, 2 * 1024 ** 3 / mm


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench(args, model, enc):
    global clock
    if args.clock == "cpu" and args.rate != math.inf:
        raise UserError("--clock cpu needs --rate inf (CPU time does not pass while waiting "
                        "for an arrival)")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    cfg, dev = model.config, model.output.weight.device
    reqs = make_workload(args, cfg, enc.eot_token)
    bw, flops = measure_machine(dev)
    print(f"clock: {args.clock}; machine: {dev}, {torch.get_num_threads()} thread(s): copy bandwidth "
          f"{bw / 1e9:.1f} GB/s, matmul {flops / 1e9:.1f} GFLOP/s (best of 3; a shared CPU "
          f"makes every timing here contended)")
    n_int = sum(r.interactive for r in reqs)
    print(f"workload: {len(reqs)} requests, prompt {args.prompt_len} (+{args.shared_prefix} "
          f"shared) tokens, mean {statistics.mean(len(r.prompt) for r in reqs):.0f}; output "
          f"{args.output_len}, mean {statistics.mean(r.out_len for r in reqs):.0f}; arrivals "
          f"{'all at once' if args.rate == math.inf else f'Poisson {args.rate}/s'}; seed "
          f"{args.seed}")
    print(f"SLOs: {n_int} interactive (priority 0) TTFT <= {args.slo_ttft} s, "
          f"{len(reqs) - n_int} batch TTFT <= {args.slo_ttft_batch} s; all TPOT <= "
          f"{args.slo_tpot * 1e3:.0f} ms")
    rows, outs, extra = [], {}, {}

    def measure(name, key, run):
        """Run a system --repeats times; keep the fastest run (the least disturbed by
        other jobs on the machine)."""
        best = None
        for _ in range(args.repeats):
            t0, recs, *rest = run()
            s = summarize(t0, recs, reqs, args)
            if best is None or s["wall"] < best[0]["wall"]:
                best = s, recs, rest
        rows.append((name, best[0]))
        outs[key] = [rec["out"] for rec in best[1]]
        extra[key] = best[2][0] if best[2] else None

    if not args.no_baselines:
        measure("sequential generate()", "sequential", lambda: run_sequential(model, reqs))
        measure(f"static batching B={args.static_batch}", "static",
                lambda: run_static(model, reqs, args.static_batch))
    policies = [args.policy] if args.policy else POLICIES
    for policy in policies:
        measure(f"engine ({policy})", policy, lambda: run_engine(model, enc, reqs, args, policy))
    engines = {p: extra[p] for p in policies}
    kv = {"static": extra["static"]} if "static" in extra else {}

    base = rows[0][1]["tok_s"]
    print(f"\n{'system':<24}{'wall s':>7}{'out tok/s':>10}{'speedup':>8}  {'TTFT p50/p90/p99 s':>18}"
          f"  {'p90 inter':>10}  {'TPOT p50/p99 ms':>15}  {'ITL p50/p99 ms':>14}  goodput req/s")
    for name, s in rows:
        q = {k: [pct(s[k], p) for p in (50, 90, 99)] for k in ("ttft", "tpot", "itl")}
        print(f"{name:<24}{s['wall']:>7.2f}{s['tok_s']:>10.0f}{s['tok_s'] / base:>7.1f}x  "
              f"{q['ttft'][0]:>6.2f}/{q['ttft'][1]:>5.2f}/{q['ttft'][2]:>5.2f}  "
              f"{pct(s['ttft_interactive'], 90):>10.2f}  {q['tpot'][0] * 1e3:>7.1f}/"
              f"{q['tpot'][2] * 1e3:>6.1f}  {q['itl'][0] * 1e3:>6.1f}/{q['itl'][2] * 1e3:>6.1f}"
              f"  {s['goodput']:>6.2f} ({s['good']}/{len(reqs)})")
    for name, o in outs.items():
        if name != "sequential" and "sequential" in outs and args.kv_dtype != "int8":
            same = sum(a == b for a, b in zip(o, outs["sequential"]))
            print(f"greedy outputs of {name} == sequential generate(): {same}/{len(reqs)}")

    eng = engines[list(engines)[-1]]
    st, bs = eng.stats, args.block_size
    # positions that must run through the model: the prompt and every output token but
    # the last (sampled, never fed back)
    useful = sum(len(r.prompt) + r.out_len - 1 for r in reqs)
    print(f"\nwork (token positions run through the model): needed {useful}; engine "
          f"{st['computed_tokens']} (+ recomputed after preemption, - prefix-cache hits)",
          end="")
    if "static" in kv:
        used, reserved, computed = kv["static"]
        print(f"; static batching {computed} = {computed / useful:.2f}x needed (padding): "
              f"the most continuous batching can gain over it here; measured "
              f"{max(r[1]['tok_s'] for r in rows[2:]) / rows[1][1]['tok_s']:.2f}x")
    print()
    print(f"KV cache ({eng.cache.kv_dtype}, {eng.cache.bytes_per_token} B/token, block "
          f"{bs} tokens, pool {args.num_blocks} blocks = {fmt_bytes(eng.cache.nbytes)}):")
    print(f"  engine: peak {st['peak_blocks']} blocks in use; unfilled slots per running "
          f"sequence: mean {st['waste_sum'] / max(st['waste_samples'], 1):.1f}, max "
          f"{st['max_waste']} (< one block of {bs}: paging wastes less than a block)")
    if "static" in kv:
        print(f"  static batching reserves B x (longest prompt + longest output): "
              f"{reserved} slots for {used} tokens = {1 - used / reserved:.0%} wasted")
    print(f"  a contiguous cache reserving the full context ({cfg.block_size}) per request: "
          f"{1 - useful / len(reqs) / cfg.block_size:.0%} wasted")
    print(f"  prefix cache: {st['cached_tokens']}/{st['prompt_tokens']} prompt tokens hit "
          f"({st['cached_tokens'] / max(st['prompt_tokens'], 1):.0%}); preemptions "
          f"{st['preemptions']}; steps {st['steps']}")

    # The decode roofline: a decode step reads every weight (the embedding table aside: B
    # rows of it) and the context's K/V, and does 2 FLOPs per weight per token plus
    # 4·L·d per context token (QKᵀ and AV). Intensity = FLOPs / bytes; the machine's
    # ridge point = peak FLOP/s / bandwidth: below it a step is memory-bound.
    n_w = model.num_params() - model.tok_embeddings.weight.numel()
    w_bytes = n_w * model.output.weight.element_size()
    kv_tok = eng.cache.bytes_per_token
    dec = [(s, n, c) for s, n, nd, c, ns in eng.step_log if nd == ns == n and n > 1]
    if dec:
        s, n, c = sorted(dec)[len(dec) // 2]            # the median decode step by time
        moved, fl = w_bytes + c * kv_tok, 2 * n_w * n + 4 * cfg.n_layer * cfg.n_embd * c
        print(f"\ndecode roofline (median decode-only step: B={n}, {c} context tokens):")
        print(f"  bytes read {fmt_bytes(moved)} (weights {fmt_bytes(w_bytes)} + KV "
              f"{fmt_bytes(c * kv_tok)}) in {s * 1e3:.1f} ms = {moved / s / 1e9:.2f} GB/s = "
              f"{moved / s / bw:.0%} of the measured copy bandwidth")
        print(f"  intensity {fl / moved:.1f} FLOP/B (2NB / (N·w + B·ctx·s)), ridge point "
              f"{flops / bw:.1f} FLOP/B -> {'memory' if fl / moved < flops / bw else 'compute'}"
              f"-bound; achieved {fl / s / 1e9:.1f} of {flops / 1e9:.0f} GFLOP/s. (An H100: "
              f"989 TFLOP/s bf16 / 3.35 TB/s = ridge 295: memory-bound to B in the hundreds)")
        if rows[0][0] == "sequential generate()":
            itl1 = pct(rows[0][1]["itl"], 50)
            print(f"  B=1 (sequential): {itl1 * 1e3:.1f} ms per token; B={n}: "
                  f"{s * 1e3 / n:.2f} ms per token -- the weights are read once per step")
    best = max(rows, key=lambda r: r[1]["tok_s"])
    print("\nledger rows:")
    print(f"  continuous batching + paged KV | KV waste < 1 block/seq (max {st['max_waste']} "
          f"slots) | block tables, a K/V gather per layer | {best[0]}: "
          f"{best[1]['tok_s'] / base:.1f}x the throughput of {rows[0][0]}")
    if "static" in kv:
        print(f"  static batching | weight reads shared by B | {1 - used / reserved:.0%} of its "
              f"KV reservation and compute is padding | {rows[1][1]['tok_s'] / base:.1f}x "
              f"sequential")
    if len(engines) == 2:
        f, s_ = rows[-2][1], rows[-1][1]
        print(f"  SLO-aware (priority, EDF) vs FCFS | goodput {s_['goodput']:.2f} vs "
              f"{f['goodput']:.2f} req/s | interactive TTFT p90 {pct(s_['ttft_interactive'], 90):.2f}"
              f" vs {pct(f['ttft_interactive'], 90):.2f} s | batch requests wait longer")
    return rows, outs, engines


# ----------------------------------------------------------------------------------------
# main

def build_parser():
    p = argparse.ArgumentParser(
        description="Serve the checkpoint over an OpenAI-compatible HTTP API, or benchmark "
                    "the engine against sequential generate() and static batching.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("mode", nargs="?", default="serve", choices=["serve", "bench"],
                   help="serve over HTTP, or run the benchmark")
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="written by train.py")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1 is fastest on a busy 2-core machine; 0 = torch's "
                        "default)")
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-blocks", type=int, default=1024, help="KV blocks in the pool")
    g.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="token budget of one step (decodes + prefill chunks)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="running sequences at most")
    g.add_argument("--policy", choices=POLICIES, default=None,
                   help="scheduling; default: slo for serve (FCFS order when requests carry "
                        "no priority), both for bench")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    g.add_argument("--no-chunked-prefill", action="store_true",
                   help="a prompt must fit one step's budget whole")
    g.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16", "int8"],
                   help="KV pool dtype; None = the model's")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="interface to bind (0.0.0.0 exposes the server to the network)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free one)")
    g.add_argument("--model-name", default="nanoscale", help="the id /v1/models lists")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="413 above this")
    g.add_argument("--max-tokens-cap", type=int, default=0,
                   help="400 if max_tokens is above this (0 = the context length)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="429 when this many requests wait beyond max-num-seqs")
    g.add_argument("--verbose", action="store_true", help="log every HTTP request")
    g = p.add_argument_group("bench")
    g.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    g.add_argument("--rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (inf = all at once)")
    g.add_argument("--prompt-len", default="32:128", help="uniform range LO:HI of prompt tokens")
    g.add_argument("--output-len", default="16:128", help="uniform range LO:HI of output tokens")
    g.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens every prompt starts with (a system prompt; prefix caching)")
    g.add_argument("--interactive-frac", type=float, default=0.25,
                   help="fraction of requests with the tight TTFT SLO and priority 0")
    g.add_argument("--slo-ttft", type=float, default=0.5, help="interactive TTFT SLO, s")
    g.add_argument("--slo-ttft-batch", type=float, default=30.0, help="batch TTFT SLO, s")
    g.add_argument("--slo-tpot", type=float, default=0.25, help="TPOT SLO (all requests), s")
    g.add_argument("--static-batch", type=int, default=64, help="static batching's batch size")
    g.add_argument("--no-baselines", action="store_true",
                   help="skip sequential and static batching")
    g.add_argument("--seed", type=int, default=0, help="workload seed")
    g.add_argument("--repeats", type=int, default=1,
                   help="run each system this many times, report the fastest run")
    g.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="time with the wall clock, or with this process's CPU time (fair on "
                        "a machine other jobs share; needs --rate inf)")
    return p


def _interrupt(*_):
    raise KeyboardInterrupt


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if min(args.num_requests, args.static_batch, args.repeats) < 1 or args.rate <= 0:
        raise UserError("--num-requests, --static-batch, --repeats and --rate must be positive")
    if not 0 <= args.interactive_frac <= 1 or not 0 <= args.port <= 65535:
        raise UserError("--interactive-frac must be in [0, 1] and --port in [0, 65535]")
    if not os.path.exists(args.checkpoint):
        raise UserError(f"checkpoint {args.checkpoint!r} not found: train one with "
                        f"`python train.py` (writes {DEFAULT_CHECKPOINT}) or pass --checkpoint")
    model, ckpt = load_model(args.checkpoint, pick_device(args.device))
    if "tokenizer" not in ckpt:
        raise UserError(f"{args.checkpoint} carries no tokenizer (not written by train.py?)")
    enc = data.encoding_from_state(ckpt["tokenizer"])
    if args.mode == "bench":
        return bench(args, model, enc)
    engine = engine_from_args(model, enc, args, args.policy or "slo")
    srv = make_server(engine, enc, args.host, args.port, args.model_name, args.max_body_bytes,
                      args.max_tokens_cap, args.max_queue, args.verbose)
    host, port = srv.server_address[:2]
    print(f"serving {args.checkpoint} as {args.model_name!r} on http://{host}:{port}/v1 "
          f"(KV pool {args.num_blocks} x {args.block_size} tokens = "
          f"{fmt_bytes(engine.cache.nbytes)}, {engine.cache.kv_dtype}); Ctrl-C stops", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)          # `kill` stops it like Ctrl-C
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
        srv.loop.stop()
        st = engine.stats
        print(f"\nledger: {st['finished']} requests, {st['output_tokens']} tokens in "
              f"{st['steps']} steps, {st['aborted']} aborted, {st['preemptions']} preemptions,"
              f" prefix-cache hits {st['cached_tokens']}/{st['prompt_tokens']} prompt tokens, "
              f"peak {st['peak_blocks']}/{args.num_blocks} KV blocks")


if __name__ == "__main__":
    run_cli(main)
