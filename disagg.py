"""
disagg.py -- prefill/decode disaggregation: one rank runs the prompts' prefills, the other
decodes; after a prefill the sequence's KV blocks travel between them over
torch.distributed point-to-point (gloo on the CPU, NCCL on GPUs).

    torchrun --standalone --nproc_per_node=2 disagg.py run      # serve a workload, check it
    torchrun --standalone --nproc_per_node=2 disagg.py bench    # vs colocated engines
    python disagg.py run --help

What it teaches (DistServe, Zhong et al. OSDI 2024; Splitwise, Patel et al. ISCA 2024;
Mooncake, Qin et al. 2024):
  - The two phases of a request want different things. A prefill is one big
    compute-bound forward over the prompt (it sets the time to first token, TTFT); a
    decode is many small memory-bound steps (they set the inter-token latency, ITL). In
    one engine they share every step: a long prompt's prefill chunk rides in the same
    forward as every running decode, so the decodes' ITL jumps whenever a long prompt
    arrives (prefill-decode interference; chunked prefill, serve.py, bounds it but does
    not remove it), and one parallel layout must serve both phases.
  - Disaggregation puts them on different devices: rank 0 runs the prefills (and samples
    the first token: Splitwise's "prompt machine"), rank 1 runs the decodes. After the
    prefill the sequence's KV cache -- block contents, in the pool's dtype (int8 codes
    with their scales, bf16, fp32) -- goes to the decode rank: a header tensor with the
    sizes first, then the token ids, the request's parameters (JSON bytes, never a
    pickle), the sampler's state, and the payload tensors; the decode rank allocates
    blocks of its own (its block table is its own: only the contents travel), writes the
    KV in (serve.Engine.import_kv) and continues decoding as if it had prefilled itself.
  - Only the computed slots are sent: a prompt of n tokens sends exactly
    n · L · (key width + value width) · heads · bytes = 2·L·H_kv·D·bytes per prompt token
    for GQA, (d_c + d_R)·L·bytes for MLA (model.GPTConfig.kv_cache_dims), plus 2·L·H·4
    bytes of scales per token for int8 -- printed next to the bytes measured.
  - Results (each request's tokens and times) come back to rank 0 for the client.

What it saves / adds / sacrifices: saves the interference (decode steps never carry a
prefill, so ITL stays flat under long prompts) and lets each phase be provisioned on its
own; adds the KV transfer (bytes above, on the critical path between the first and the
second token) and a second copy of the weights; sacrifices utilisation when the load is
unbalanced between the phases (here one prefill rank and one decode rank, fixed) and the
prefix cache of the decode side (each request's whole prompt KV is sent).

The benchmark compares, on the same mixed long/short workload and the same two
processes (the same total compute): two colocated engines, each serving half of the
requests (prefill and decode together), against one prefill rank + one decode rank.
"""
import argparse
import datetime
import json
import math
import queue
import statistics
import time

import torch
import torch.distributed as dist

from kvcache import blocks_for
from core.cli import ArgumentParser, add_knobs, fmt_bytes, knob, require_at_least_one
from core.distributed import setup_runtime
from core.errors import UserError
from core.meters import comm
from core.runtime import job_store, run_cli, TimingConditions
from serve import FINISHED, PREFILLED, Engine, PoolFull, SamplingParams
from serving.workloads import bench_model, length_range, mixed_workload, pct

# Every message starts with a header of exactly HEADER int64s (control messages pad it
# with zeros), so the receiver can always post the same first irecv: a point-to-point
# receive must be posted with the size of the send it pairs with, and the sizes of the
# rest of a message are only known once its header is read. 8 · 8 = 64 bytes of header
# per message: all a control message costs (tests/dist_disagg_check.py counts HEADER * 8
# on the meter for each abort and for DONE).
PREFILL, DECODE = 0, 1                  # the ranks' roles
KV, ABORT, DONE, RESULTS = 1, 2, 3, 4   # message kinds (the header's first field)
HEADER = 8                              # int64 fields: kind, request id, then per kind


# ----------------------------------------------------------------------------------------
# The wire: a request's KV as a header + tensors. The receiver knows the shapes of the
# payload from its own pool (same model, block size and KV dtype) and the header's sizes.

def kv_formula(cfg, kv_dtype, n_tokens):
    """Bytes of n tokens' KV: n · L · heads · (key width + value width) · bytes, + n · L ·
    heads · 2 · 4 bytes of float32 scales when int8. GQA: heads = H_kv, both widths D
    (2·L·H_kv·D·bytes per token); MLA: one "head" holding d_c + d_R."""
    # (H_kv, D, D) for GQA, (1, d_c, d_R) for MLA: the same dims the pool is built from,
    # so tests/test_disagg.py can check this against PagedKVCache.bytes_per_token
    heads, k_dim, v_dim = cfg.kv_cache_dims
    if kv_dtype == "int8":
        # 1 byte per code, plus one float32 scale per (layer, head, token) for the key and
        # one for the value (the pool's k_scale/v_scale have width 1): + 2 · 4 bytes. So
        # int8 moves (k + v + 8) / (4 · (k + v)) of fp32's bytes, a bit more than 1/4
        per_token = cfg.n_layer * heads * (k_dim + v_dim + 2 * 4)
    else:
        # the pool's dtype by name ("float32", "bfloat16"): itemsize 4 or 2
        per_token = cfg.n_layer * heads * (k_dim + v_dim) * getattr(torch, kv_dtype).itemsize
    return n_tokens * per_token


def encode(exported, rid):
    """export_kv's dict -> the tensors to send, in order: header, token ids, JSON
    metadata, the sampler state (if seeded), the payload parts trimmed to the computed
    slots (a block's unfilled tail is not sent). -> (tensors, KV payload bytes)."""
    # n = num_computed = the prompt's length: the first sampled token has no K/V yet (the
    # decode rank's first step computes them), so n slots travel, not n + 1
    n = exported["num_computed"]
    # JSON, never pickle: unpickling a peer's bytes can run arbitrary code, and these
    # fields are plain numbers, lists and strings (SamplingParams as a dict)
    meta = json.dumps(dict(params=exported["params"], logprobs=exported["logprobs"],
                           prompt_logprobs=exported["prompt_logprobs"],
                           block_size=exported["block_size"],
                           kv_dtype=exported["kv_dtype"])).encode()
    # a seeded sampler's torch.Generator state (a uint8 tensor of a few KB): the decode
    # rank continues the same random stream, so a seeded request samples the same tokens
    # disaggregated or not; None when greedy
    gen = exported["generator"]
    # read_blocks gave whole blocks, (n_layer, heads, blocks · block_size, width): keep the
    # first n slots. That slice is a strided view (the slot axis is not the outermost), and
    # a send needs one dense buffer, so .contiguous() makes the copy that goes on the wire.
    # The order of the parts (k, v[, k_scale, v_scale]) is PagedKVCache.parts()' order,
    # the same on both ranks: receive() reads them back in that order
    parts = [t[:, :, :n].contiguous() for t in exported["kv"].values()]
    # after kind and id, what receive() needs to size each irecv that follows: tokens
    # (prompt + first token), prompt length, computed slots, JSON bytes, generator bytes
    # (0 = no generator tensor follows), number of KV parts (2, or 4 with int8 scales)
    header = torch.tensor([KV, rid, len(exported["tokens"]), exported["num_prompt"], n,
                           len(meta), 0 if gen is None else gen.numel(), len(parts)])
    # bytearray, not bytes: frombuffer shares the buffer and warns on a read-only one
    tensors = [header, torch.tensor(exported["tokens"]),
               torch.frombuffer(bytearray(meta), dtype=torch.uint8)]
    tensors += ([] if gen is None else [gen]) + parts
    # only the KV parts count as payload; the caller books the rest as metadata
    return tensors, sum(t.numel() * t.element_size() for t in parts)


def send(tensors, dst):
    """Blocking point-to-point sends, in order (gloo pairs them with the receives in
    order), counted by the communication meter."""
    for t in tensors:
        # .cpu(): gloo moves CPU tensors; waiting on each send before the next keeps the
        # (possibly temporary) copy alive until its bytes are out. Used only for the
        # results and step logs at the end, where nothing else needs to run meanwhile
        comm.isend(t.cpu(), dst).wait()


def recv(shape, dtype, src):
    """One blocking receive of a tensor whose shape and dtype the caller already knows
    (from a header): the receiver allocates the buffer, nothing on the wire describes it."""
    t = torch.empty(shape, dtype=dtype)
    comm.irecv(t, src).wait()
    return t


def receive(engine, take):
    """The receiving side of `encode`: -> (kind, request id, export_kv-style dict or None).
    take(shape, dtype) -> the next tensor off the wire (`recv` from the prefill rank; a
    test hands the tensors of `encode` directly). The payload is padded back to whole
    blocks (the tail slots are never read: they lie past the sequence's length until the
    decode overwrites them)."""
    # .tolist(): plain Python ints, usable as shapes below
    header = take((HEADER,), torch.int64).tolist()
    kind, rid = header[0], header[1]
    if kind != KV:                      # a control message is its header alone
        return kind, rid, None
    # The takes below mirror encode's list exactly, in order: take one out of turn and
    # every later tensor is read with the wrong size or dtype: at best an error from the
    # transport, at worst (same byte count) silently wrong numbers
    n_tokens, num_prompt, n, meta_len, gen_len, n_parts = header[2:]
    tokens = take((n_tokens,), torch.int64).tolist()
    meta = json.loads(bytes(take((meta_len,), torch.uint8).tolist()).decode())
    gen = take((gen_len,), torch.uint8) if gen_len else None
    # The payload's shapes come from this rank's own pool: both ranks build it from the
    # same flags. A different --kv-dtype shows up as 2 parts against 4 (or as a dtype
    # import_kv refuses): refused here by name, before reading with the wrong shapes
    parts = engine.cache.parts()
    if n_parts != len(parts):
        raise UserError(f"the prefill rank sends {n_parts} KV parts, this pool has "
                        f"{len(parts)}: both ranks need the same --kv-dtype")
    # import_kv -> PagedKVCache.write_blocks wants whole blocks: ceil(n / bs) · bs slots
    slots = blocks_for(n, engine.block_size) * engine.block_size
    kv = {}
    for name, pool in parts.items():
        # the wire's dtype is the pool's (int8 codes, float32 scales, bf16): no cast on the
        # way, so the imported KV is bit for bit the prefill rank's
        n_layer, heads, _, width = pool.shape
        x = take((n_layer, heads, n, width), pool.dtype)
        # fewer than bs zero slots of padding; the cat is one more copy of the payload
        kv[name] = torch.cat([x, x.new_zeros(n_layer, heads, slots - n, width)], 2)
    exported = dict(tokens=tokens, num_prompt=num_prompt, num_computed=n, kv=kv,
                    generator=gen, **meta)
    return kind, rid, exported


def control(kind, rid):
    """A control message (ABORT, DONE): a header alone, zero-padded to HEADER fields."""
    return [torch.tensor([kind, rid] + [0] * (HEADER - 2))]


class Outbox:
    """The prefill rank's side of the channel. post(): the message's tensors go out with
    non-blocking sends (the prefill loop goes on at once), then the doorbell rings: key
    msg/<i> is set in the job's key-value store. The tensors are kept until flush(),
    which waits for every send (gloo cannot tell a send finished without waiting)."""

    def __init__(self, store):
        self.store, self.n, self.pending = store, 0, []

    def post(self, tensors):
        for t in tensors:
            # keep the tensor with its Work: one freed before its send completes could have
            # its memory reused under the transfer
            self.pending.append((comm.isend(t, DECODE), t))
        # the doorbell after the sends are posted: the decode rank posts its irecvs only
        # once it sees msg/<n>, so none of them waits on a send not yet started. The keys
        # number the messages in posting order, the order the irecvs must follow
        self.store.set(f"msg/{self.n}", "1")
        self.n += 1

    def flush(self):
        # Called once, at the end (prefill_loop): until then every message's tensors stay
        # referenced, i.e. all the KV this rank ever sent. A long-running server would
        # wait on the oldest sends as it goes to bound that memory
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


class Inbox:
    """The decode rank's side, as a queue: get(block=False) looks for the next doorbell
    key (one store round trip) and raises queue.Empty when it is not there; when it is,
    or with block=True once it is, the message is received (its bytes are in flight
    already). No receiver thread: one fights the decode loop for Python's GIL -- measured
    on this bench, a blocking send of one request's KV (183 KB) to a receiver thread took
    24 ms at the median, about one decode step, against ~1 ms for the bytes themselves."""

    def __init__(self, engine, store, timeout):
        self.engine, self.store, self.n = engine, store, 0
        self.timeout = datetime.timedelta(seconds=timeout)

    def get(self, block=True):
        key = f"msg/{self.n}"
        if block:
            # nothing to step and nothing waiting: sleep in the store until the doorbell
            # rings; past rt.timeout store.wait raises, so a dead prefill rank is an error
            # here, not a hang
            self.store.wait([key], self.timeout)
        elif not self.store.check([key]):
            # the poll between decode steps: one store round trip, no tensor touched
            raise queue.Empty
        self.n += 1
        # the sends were posted before the key was set: these irecvs pair with them at once
        return receive(self.engine, lambda shape, dtype: recv(shape, dtype, PREFILL))


# ----------------------------------------------------------------------------------------
# The prefill rank

def add(engine, req, t0, prefill_only):
    """One workload request into `engine`, greedy and ignore_eos: every system then makes
    exactly out_len tokens, the same work, and outputs comparable token for token. The
    arrival is stamped on this rank's clock (t0 + the request's offset), not 'now'."""
    return engine.add_request(req["prompt"], SamplingParams(
        max_tokens=req["out_len"], temperature=0, ignore_eos=True),
        arrival=t0 + req["arrival"], seq_id=req["id"], prefill_only=prefill_only)


def prefill_loop(engine, outbox, reqs, t0, abort_prefilled=(), abort_sent=()):
    """Rank 0: admit requests as they arrive (prefill_only), step, and ship each
    prefilled sequence's KV to the decode rank. abort_prefilled: request ids the client
    cancels once prefilled, before the transfer (freed here, never sent); abort_sent:
    cancelled right after the transfer, before any decode (the decode rank frees them).
    -> per request: first token, its time, KV bytes sent, metadata bytes sent."""
    pending, out = sorted(reqs, key=lambda r: r["arrival"]), {}
    while pending or engine.has_work():
        # admit every request whose arrival time has passed (the client, replayed)
        while pending and t0 + pending[0]["arrival"] <= time.perf_counter():
            add(engine, pending.pop(0), t0, prefill_only=True)
        if not engine.has_work():
            # idle: sleep until the next arrival (pending is not empty here, else the loop
            # had ended; parked PREFILLED sequences do not count as work)
            time.sleep(max(0.0, t0 + pending[0]["arrival"] - time.perf_counter()))
            continue
        # step() returns the sequences that sampled a token in this step: here, the ones
        # whose prompt just finished (their first token), now PREFILLED or FINISHED
        for seq in engine.step():
            # the first token is sampled on this rank: TTFT holds no transfer (Splitwise's
            # prompt machine answers the client at once); the transfer delays token 2
            rec = out[seq.id] = dict(first=seq.tokens[seq.num_prompt],
                                     t_first=seq.token_times[0], kv_bytes=0, meta_bytes=0,
                                     arrival=seq.arrival,
                                     finished=seq.status == FINISHED)
            if seq.status != PREFILLED:     # max_tokens=1: done here, nothing to send
                continue
            if seq.id in abort_prefilled:
                engine.abort(seq.id)        # cancelled before the transfer: freed here
                continue
            # Export at once, in the step that parked it: a PREFILLED sequence keeps its
            # blocks, and enough parked ones make the next step raise PoolFull
            # (serve.Engine.step). release=True: the KV is copied out and the blocks go
            # back to this pool now, so the prefill pool only holds prompts in progress
            tensors, rec["kv_bytes"] = encode(engine.export_kv(seq.id), seq.id)
            # everything on the wire but the KV: header, token ids, JSON, generator state
            rec["meta_bytes"] = sum(t.numel() * t.element_size() for t in tensors) - \
                rec["kv_bytes"]
            outbox.post(tensors)
            if seq.id in abort_sent:
                # the abort rides the same ordered channel behind the KV: the decode rank
                # always has the KV (waiting or imported) when the abort reaches it
                outbox.post(control(ABORT, seq.id))
    # DONE: nothing more will come; the decode rank finishes what it holds, then returns
    outbox.post(control(DONE, -1))
    outbox.flush()
    return out


# ----------------------------------------------------------------------------------------
# The decode rank: between steps, take what arrived (Inbox, or any queue in a test);
# import it, apply aborts, decode.

def decode_loop(engine, inbox):
    """Rank 1: import what arrived (PoolFull: it waits in line until a step frees
    blocks), apply aborts, step. -> ({id: (output tokens, token times)}, stats)."""
    # waiting: (id, exported) received but not yet imported, in arrival order; done: DONE
    # seen, nothing more will arrive
    waiting, done, results = [], False, {}
    stats = dict(imported=0, aborted_imported=0, aborted_waiting=0, import_waits=0)
    while True:
        # Block on the inbox only when there is nothing else to do. Otherwise poll: a
        # running decode never waits for a message not yet sent; it pays one store check
        # per step, plus the receive of whatever has arrived
        block = not (engine.has_work() or waiting or done)
        while True:                     # drain what has arrived, then step
            try:
                kind, rid, exported = inbox.get(block=block)
            except queue.Empty:
                break
            block = False               # after the first message: only what is there
            if kind == KV:
                waiting.append((rid, exported))
            elif kind == DONE:
                done = True
            elif kind == ABORT:
                _abort(engine, waiting, rid, stats)
            # import as soon as it arrives: it then rides in the very next decode step
            _import(engine, waiting, stats)
        # again with an empty inbox: the last step may have freed the blocks the head needs
        _import(engine, waiting, stats)
        if engine.has_work():
            for seq in engine.step():
                if seq.status == FINISHED:     # the tokens made here (not the first)
                    # output_ids starts with the prefill rank's first token; token_times
                    # holds this engine's tokens only (import_kv), hence the slice
                    made = seq.output_ids[len(seq.output_ids) - len(seq.token_times):]
                    # arrival nan: rank 0 knows it (prefill_loop's record)
                    results[seq.id] = (made, seq.token_times, math.nan)
        elif done and not waiting:
            return results, stats
        # (no work yet something waiting cannot last: with nothing running the pool is all
        # free or cached, and serve.Engine refuses a pool too small for one max-length
        # sequence, so the head's import succeeds. Build the pool without that check and
        # this loop could spin: PoolFull does not tell "later" from "never")


def _import(engine, waiting, stats):
    """Import the waiting sequences in arrival order until one does not fit (PoolFull: no
    free blocks or no running slot; import_kv then changed nothing, so it is retried after
    a step). Strict FIFO: letting a smaller one pass the head could starve a long prompt."""
    while waiting:
        rid, exported = waiting[0]
        try:
            engine.import_kv(exported, seq_id=rid)
        except PoolFull:
            stats["import_waits"] += 1
            return
        waiting.pop(0)
        stats["imported"] += 1


def _abort(engine, waiting, rid, stats):
    """The client cancelled `rid` after its KV was sent: imported -> abort it here; still
    in line for blocks -> drop it from the line; already finished -> too late, nothing."""
    if rid in engine.live:
        engine.abort(rid)               # its imported blocks go back to the pool
        stats["aborted_imported"] += 1
    elif any(r == rid for r, _ in waiting):
        # waiting[:] =, not waiting =: decode_loop holds this same list; rebinding a local
        # would leave the request in the caller's line, to be imported and decoded anyway
        waiting[:] = [(r, e) for r, e in waiting if r != rid]
        stats["aborted_waiting"] += 1


# ----------------------------------------------------------------------------------------
# Results back to rank 0. Per request: (tokens, their times, its arrival or nan) as
# [id, n, tokens...] in int64 and [arrival, times...] in float64; the header carries the
# sender's pool state (the tests check that the decode rank ends with every block free).

def send_results(engine, results, dst, stats=None):
    # two flat tensors for all requests: three sends in all, not three per request
    flat, times = [], []
    for rid, (toks, ts, arrival) in sorted(results.items()):
        flat += [rid, len(toks)] + list(toks)   # n lets the receiver cut the list apart
        # float64: perf_counter counts seconds since boot (Linux), and at ~1e5 s float32's
        # 24-bit mantissa resolves only ~8 ms -- coarser than an inter-token latency
        times += [arrival] + list(ts)
    stats = stats or {}
    # kind, the two lengths, then five numbers of the sender's pool in the header's free
    # fields (free blocks, live sequences, references held, aborted / imported counts):
    # the leak check of tests/dist_disagg_check.py costs no extra message
    header = [RESULTS, len(flat), len(times), engine.alloc.num_free, len(engine.live),
              sum(engine.alloc.refcount), stats.get("aborted_imported", 0),
              stats.get("imported", 0)]
    send([torch.tensor(header), torch.tensor(flat, dtype=torch.int64),
          torch.tensor(times, dtype=torch.float64)], dst)


def recv_results(src):
    """-> ({id: (tokens, times, arrival)}, the sender's pool state)."""
    header = recv((HEADER,), torch.int64, src).tolist()
    flat = recv((header[1],), torch.int64, src).tolist()
    times = recv((header[2],), torch.float64, src).tolist()
    # i walks the [id, n, tokens...] records, j the [arrival, times...] ones: each record
    # is n long plus its prefix (2 fields, 1 field)
    out, i, j = {}, 0, 0
    while i < len(flat):
        rid, n = flat[i], flat[i + 1]
        out[rid] = (flat[i + 2:i + 2 + n], times[j + 1:j + 1 + n], times[j])
        i, j = i + 2 + n, j + 1 + n
    pool = dict(num_free=header[3], live=header[4], refs=header[5],
                aborted_imported=header[6], imported=header[7])
    return out, pool


def serve_disaggregated(rt, engine, reqs, abort_prefilled=(), abort_sent=(), tag="run"):
    """Both ranks call this, with the same tag (it names this run's doorbell keys). -> on rank
    0: ({id: dict(out, times, arrival, kv_bytes, meta_bytes)} for every request -- the
    first token from the prefill rank, the rest from the decode rank; out None for an
    aborted one --, the decode rank's pool state); on rank 1: (None, the decode loop's
    stats)."""
    check_roles(rt)
    # the doorbell keys under a prefix of this run: store keys outlive the run, so a
    # second run under the same tag (the bench runs several) would find the previous
    # run's msg/<i> already set -- the doorbell rings for messages not sent yet, and the
    # decode rank blocks inside an irecv, its running decodes stalled, instead of polling
    store = dist.PrefixStore(f"disagg/{tag}", job_store("disagg", rt.timeout))
    # both ranks start together: the arrivals are offsets from t0
    comm.barrier()
    t0 = time.perf_counter()
    if rt.rank == PREFILL:
        pre = prefill_loop(engine, Outbox(store), reqs, t0, abort_prefilled, abort_sent)
        # blocks until the decode rank has seen DONE and finished every sequence it holds
        decoded, pool = recv_results(DECODE)
        out = {}
        for rid, rec in pre.items():
            # delivered: finished here (max_tokens = 1) or reported by the decode rank;
            # an aborted request is neither, and its out is None
            delivered = rec["finished"] or rid in decoded
            toks, ts, _ = decoded.get(rid, ([], [], None))
            # the first token's time is rank 0's clock, the rest rank 1's: comparable only
            # because both processes share one host (perf_counter is CLOCK_MONOTONIC on
            # Linux, system-wide). Across hosts the 1st->2nd gap would need a clock offset
            out[rid] = dict(out=[rec["first"]] + toks if delivered else None,
                            times=[rec["t_first"]] + ts, arrival=rec["arrival"],
                            kv_bytes=rec["kv_bytes"], meta_bytes=rec["meta_bytes"])
        return out, pool
    results, stats = decode_loop(engine, Inbox(engine, store, rt.timeout))
    send_results(engine, results, PREFILL, stats)
    return None, stats


def serve_colocated(rt, engine, reqs, replicas):
    """The baseline: `replicas` ordinary engines (prefill and decode in the same steps),
    rank r serving requests r, r + replicas, ...; replicas=1 leaves rank 1 idle.
    -> on rank 0 {id: dict(out, times, arrival)} for all requests; on rank 1 None (an
    empty dict when replicas=1: it served nothing)."""
    comm.barrier()
    t0 = time.perf_counter()
    mine = reqs[rt.rank::replicas] if rt.rank < replicas else []
    done = {}
    if mine:
        pending, seqs = sorted(mine, key=lambda r: r["arrival"]), []
        while pending or engine.has_work():
            while pending and t0 + pending[0]["arrival"] <= time.perf_counter():
                seqs.append(add(engine, pending.pop(0), t0, prefill_only=False))
            if engine.has_work():
                # one step packs prefill chunks with the running decodes (chunked prefill,
                # --max-num-batched-tokens per step): the interference being measured
                engine.step()
            else:
                time.sleep(max(0.0, t0 + pending[0]["arrival"] - time.perf_counter()))
        done = {s.id: (s.output_ids, s.token_times, s.arrival) for s in seqs}
    if replicas == 2 and rt.rank == DECODE:
        send_results(engine, done, PREFILL)
        return None
    if replicas == 2:
        done.update(recv_results(DECODE)[0])
    return {rid: dict(out=t, times=ts, arrival=a) for rid, (t, ts, a) in done.items()}


def check_roles(rt):
    """Exactly two ranks, refused on every rank before any message: with a third, rank 2
    would wait forever for messages no role sends."""
    if rt.world_size != 2:
        raise UserError(f"disaggregation needs exactly 2 ranks (rank 0 prefills, rank 1 "
                        f"decodes): run `torchrun --standalone --nproc_per_node=2 "
                        f"disagg.py ...`, got world size {rt.world_size}")


# ----------------------------------------------------------------------------------------
# Measuring

def latency(results, reqs):
    """TTFT (from arrival), inter-token latencies from the second token on, and the gap
    between the first and the second token apart (for disaggregation it holds the
    transfer, the import and the wait for the decode rank's step: counted in the ITL it
    would be the p99, 1 gap in ~60 here), split by short and long prompts."""
    row = dict(ttft_short=[], ttft_long=[], itl_short=[], itl_long=[], gap2=[], tokens=0)
    end = 0.0
    for r in reqs:
        rec = results[r["id"]]
        t, kind = rec["times"], "long" if r["long"] else "short"
        row[f"ttft_{kind}"].append(t[0] - rec["arrival"])
        # gaps t[i+1] - t[i] from i = 1 on: the 1st->2nd gap goes to gap2 alone
        row[f"itl_{kind}"] += [b - a for a, b in zip(t[1:], t[2:])]
        row["gap2"] += [t[1] - t[0]] if len(t) > 1 else []
        row["tokens"] += len(t)
        end = max(end, t[-1])
    # throughput over the whole run: first arrival to last token, all requests' tokens
    start = min(results[r["id"]]["arrival"] for r in reqs)
    row["tok_s"] = row["tokens"] / (end - start)
    return row


def gather_steps(rt, engine):
    """Both ranks call this: -> on rank 0, (the step logs of both engines -- serve.Engine's
    step_log: seconds, tokens, decodes, context, sequences per step --, their preemptions
    together); on rank 1 None."""
    if rt.rank == DECODE:
        # reshape(-1, 5): an empty log (rank 1 idle, colocated x1) is (0, 5), not (0,);
        # the row count goes first, so rank 0 can allocate the (n, 5) buffer
        log = torch.tensor(engine.step_log, dtype=torch.float64).reshape(-1, 5)
        send([torch.tensor([log.shape[0], engine.stats["preemptions"]]), log], PREFILL)
        return None
    n, preempted = recv((2,), torch.int64, DECODE).tolist()
    log = recv((n, 5), torch.float64, DECODE).tolist()
    return engine.step_log + [tuple(r) for r in log], preempted + engine.stats["preemptions"]


def step_stats(steps, preemptions):
    """The interference, step by step: the durations of decode-only steps and of steps
    that carried a prefill chunk, and how many decode tokens rode in the latter (each of
    them waited for the prefill's compute: what disaggregation removes)."""
    # a row: (seconds, tokens, decodes, context, sequences). Decode-only: every token is a
    # decode; mixed: at least one prefill token (a pure prefill step is "mixed" but delays
    # no decode). serve.Engine._account counts any 1-token row as a decode, so a prefill
    # chunk of exactly one token is booked as a decode
    dec = [st for st in steps if st[1] == st[2] and st[2] > 0]
    mixed = [st for st in steps if st[1] > st[2]]
    return dict(dec_s=[st[0] for st in dec], mixed_s=[st[0] for st in mixed],
                batch=statistics.mean(st[2] for st in dec) if dec else 0.0,
                delayed=int(sum(st[2] for st in mixed)), preemptions=preemptions,
                decodes=int(sum(st[2] for st in steps)))


def make_engine(model, args):
    return Engine(model, block_size=args.block_size, num_blocks=args.num_blocks,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=args.max_num_seqs, kv_dtype=args.kv_dtype)


def workload(args, cfg):
    """serving/workloads.mixed_workload: short and long prompts mixed, Poisson arrivals. ->
    plain dicts (id, prompt, out_len, arrival, long)."""
    reqs = mixed_workload(args.num_requests,
                          length_range(args.short_len, "short-len"),
                          length_range(args.long_len, "long-len"),
                          args.long_frac,
                          length_range(args.output_len, "output-len"),
                          args.rate, cfg, None, args.seed)
    return [dict(id=i, prompt=r.prompt, out_len=r.out_len, arrival=r.arrival,
                 long=not r.interactive) for i, r in enumerate(reqs)]


# ----------------------------------------------------------------------------------------
# The modes

def run(rt, args):
    """Serve the workload disaggregated; on rank 0 print the bytes moved per request
    next to the formula, check the outputs against one engine, show the decode rank's
    pool at the end."""
    model = bench_model(args.checkpoint, args.preset, args.context, args.seed)
    cfg = model.config
    reqs = workload(args, cfg)
    engine = make_engine(model, args)
    out, pool = serve_disaggregated(rt, engine, reqs)
    if rt.rank != PREFILL:
        return
    kv_dtype = engine.cache.kv_dtype
    print(f"{len(reqs)} requests, disaggregated: rank 0 prefilled, rank 1 decoded; KV "
          f"{kv_dtype}, {kv_formula(cfg, kv_dtype, 1)} B per prompt token by the formula")
    print(f"{'request':>8}{'prompt':>8}{'KV sent B':>11}{'formula B':>11}{'metadata B':>12}")
    for r in reqs[:args.show]:
        rec = out[r["id"]]
        print(f"{r['id']:>8}{len(r['prompt']):>8}{rec['kv_bytes']:>11}"
              f"{kv_formula(cfg, kv_dtype, len(r['prompt'])):>11}{rec['meta_bytes']:>12}")
    # equal by construction: encode sends exactly the n computed slots. Send the padded
    # blocks instead (t[:, :, :slots]) and the total reads DIFFERENT
    kv = sum(out[r["id"]]["kv_bytes"] for r in reqs)
    want = sum(kv_formula(cfg, kv_dtype, len(r["prompt"])) for r in reqs)
    meta = sum(out[r["id"]]["meta_bytes"] for r in reqs)
    print(f"total: KV {kv} B sent, formula {want} B ({'equal' if kv == want else 'DIFFERENT'})"
          f"; metadata {meta} B ({meta / max(kv, 1):.2%} of it)")
    print(comm.report("rank 0 point-to-point (the meter)"))
    # the reference: one ordinary engine on rank 0, all prompts at once; greedy, so the
    # disaggregated tokens must match one for one (the KV crossed unchanged)
    ref = make_engine(model, args).generate(
        [r["prompt"] for r in reqs],
        [SamplingParams(max_tokens=r["out_len"], temperature=0, ignore_eos=True) for r in reqs])
    same = sum(out[r["id"]]["out"] == s.output_ids for r, s in zip(reqs, ref))
    print(f"greedy outputs == one engine's, token for token: {same}/{len(reqs)}")
    print(f"decode rank at the end: {pool['num_free']}/{args.num_blocks} blocks free or "
          f"cached, {pool['live']} live sequences, {pool['refs']} references held")


def bench(rt, args):
    """The same workload through one colocated engine (rank 0 alone), two colocated
    engines (one per rank: the same total compute as disaggregation) and one prefill +
    one decode rank. Rank 0 prints the tables."""
    model = bench_model(args.checkpoint, args.preset, args.context, args.seed)
    reqs = workload(args, model.config)
    systems = (("colocated x1 (rank 0 alone)", lambda e, i: serve_colocated(rt, e, reqs, 1)),
               ("colocated x2 (half each)", lambda e, i: serve_colocated(rt, e, reqs, 2)),
               ("disaggregated 1P + 1D",
                lambda e, i: serve_disaggregated(rt, e, reqs, tag=f"bench{i}")[0]))
    rows, per_token = [], {}     # per_token: seconds per output token of every repeat
    with TimingConditions() as timing:
        for name, serve_all in systems:
            best, per_token[name] = None, []
            for i in range(args.repeats):   # the fastest run: the least disturbed by neighbours
                engine = make_engine(model, args)
                results = serve_all(engine, i)
                # both ranks call it (a send/recv pair), whatever the system: rank 1 idle too
                steps = gather_steps(rt, engine)
                if rt.rank == PREFILL:
                    row = latency(results, reqs)
                    row.update(step_stats(*steps))
                    per_token[name].append(1 / row["tok_s"])
                    if best is None or row["tok_s"] > best[1]["tok_s"]:
                        best = (name, row, results)
            rows.append(best)
    if rt.rank == PREFILL:
        print_bench(rows, reqs, args, model.config)
        timing.report(per_token)


def print_bench(rows, reqs, args, cfg):
    n_long = sum(r["long"] for r in reqs)
    kv_dtype = args.kv_dtype or "float32"
    print(f"workload: {len(reqs)} requests ({n_long} long prompts {args.long_len}, the rest "
          f"{args.short_len}), outputs {args.output_len}, Poisson {args.rate}/s; "
          f"{cfg.n_layer}-layer model, KV {kv_dtype}; wall clock, 2 processes with 1 thread "
          f"each (on a loaded 2-core CPU they contend with each other and with other jobs)")

    def two(xs):
        return f"{pct(xs, 50) * 1e3:.1f}/{pct(xs, 99) * 1e3:.1f}"
    print(f"\n{'system':<28}{'tok/s':>7}{'TTFT p50/p99 ms short':>23}{'long':>15}"
          f"{'ITL p50/p99 ms short':>22}{'long':>15}{'1st->2nd p50/p99 ms':>21}")
    for name, s, _ in rows:
        print(f"{name:<28}{s['tok_s']:>7.0f}{two(s['ttft_short']):>23}{two(s['ttft_long']):>15}"
              f"{two(s['itl_short']):>22}{two(s['itl_long']):>15}{two(s['gap2']):>21}")
    print(f"\n{'engine steps (both ranks)':<28}{'decode-only p50/p99 ms':>23}{'batch':>7}"
          f"{'with a prefill chunk':>22}{'p50 ms':>8}{'decode tokens delayed by a prefill':>36}"
          f"{'preempted':>11}")
    for name, s, _ in rows:
        share = s["delayed"] / max(s["decodes"], 1)
        print(f"{name:<28}{pct(s['dec_s'], 50) * 1e3:>14.1f}/{pct(s['dec_s'], 99) * 1e3:<8.1f}"
              f"{s['batch']:>7.1f}{len(s['mixed_s']):>22}{pct(s['mixed_s'], 50) * 1e3:>8.1f}"
              f"{s['delayed']:>25} of {s['decodes']:<6} ({share:.0%}){s['preemptions']:>8}")
    outs = [{rid: rec["out"] for rid, rec in res.items()} for _, _, res in rows]
    same = sum(outs[0][k] == outs[1][k] == outs[2][k] for k in outs[0])
    print(f"greedy outputs identical in the three systems: {same}/{len(reqs)}")
    kv = sum(rec["kv_bytes"] for rec in rows[2][2].values())
    # a request with out_len 1 finishes on the prefill rank: no KV of it travels
    want = sum(kv_formula(cfg, kv_dtype, len(r["prompt"])) for r in reqs if r["out_len"] > 1)
    print(f"KV moved by disaggregation: {fmt_bytes(kv)} ({kv} B = the formula's {want} B), "
          f"{fmt_bytes(kv / sum(r['out_len'] > 1 for r in reqs))} per request")
    co, dis = rows[1][1], rows[2][1]
    print("\nledger row:")
    print(f"  prefill/decode disaggregation | decode tokens delayed by a prefill: "
          f"{dis['delayed']} vs {co['delayed']} of {co['decodes']} colocated x2; short TTFT "
          f"p99 {pct(dis['ttft_short'], 99) * 1e3:.0f} vs {pct(co['ttft_short'], 99) * 1e3:.0f}"
          f" ms | {fmt_bytes(kv)} of KV over P2P (= the formula); 1st->2nd token p50 "
          f"{pct(dis['gap2'], 50) * 1e3:.1f} vs {pct(co['gap2'], 50) * 1e3:.1f} ms | a fixed "
          f"1:1 prefill:decode split (tok/s {dis['tok_s']:.0f} vs {co['tok_s']:.0f}); the "
          f"decode side's prefix cache")


# ----------------------------------------------------------------------------------------
# The command line

# Every knob once, a row each (flag, default, help; core/cli.py turns the rows into flags).
# Both modes take the model, engine and workload tables; each adds a knob of its own.
MODEL_KNOBS = [
    knob("--checkpoint", None, "a model from train.py; None = a random-init --preset model"),
    knob("--preset", "small", "model preset without --checkpoint"),
    knob("--context", int, "the --preset model's context (None = the preset's)"),
    knob("--threads", 1, "torch CPU threads per rank"),
]

ENGINE_KNOBS = [                # both ranks build their engine from these
    knob("--block-size", 16, "tokens per KV block"),
    knob("--num-blocks", 256, "KV blocks per rank"),
    knob("--max-num-batched-tokens", 128, "token budget of one step"),
    knob("--max-num-seqs", 32, "running sequences at most"),
    knob("--kv-dtype", None, "KV pool dtype; None = the model's",
         choices=["float32", "bfloat16", "int8"]),
]


def workload_knobs(num_requests, rate):
    """serving/workloads.mixed_workload's knobs. Only two defaults differ by mode: `run`
    checks a few requests arriving at once, `bench` measures a longer Poisson stream."""
    return [
        knob("--num-requests", num_requests, "requests"),
        knob("--short-len", "8:32", "short prompts, LO:HI tokens"),
        knob("--long-len", "160:224", "long prompts, LO:HI tokens"),
        knob("--long-frac", 0.25, "share of long prompts"),
        knob("--output-len", "16:32", "output tokens, LO:HI"),
        knob("--rate", rate, "Poisson arrivals per second (inf = all at once)"),
        knob("--seed", 0, "workload and model seed"),
    ]


# mode: (its help, its workload table, its own knobs)
MODES = {
    "run": ("serve a workload disaggregated; bytes vs the formula, outputs vs one engine",
            workload_knobs(12, math.inf),
            [knob("--show", 6, "requests listed in the table")]),
    "bench": ("colocated x1, colocated x2 and disaggregated on one workload: TTFT, ITL",
              workload_knobs(48, 16.0),
              [knob("--repeats", 1, "run each system this many times, report the fastest run")]),
}


def build_parser():
    # argparse's formatter, not core.cli's: "(default: None)" by the "None = ..." flags, as ever
    formatter = argparse.ArgumentDefaultsHelpFormatter
    p = ArgumentParser(description="Prefill/decode disaggregation over torch.distributed "
                       "point-to-point: torchrun --standalone --nproc_per_node=2 disagg.py "
                       "{run,bench}.", formatter_class=formatter)
    sub = p.add_subparsers(dest="mode", required=True)
    for mode, (text, workload_table, own) in MODES.items():
        m = sub.add_parser(mode, help=text, formatter_class=formatter)
        add_knobs(m, MODEL_KNOBS)
        add_knobs(m, ENGINE_KNOBS, "engines (both ranks)")
        add_knobs(m, workload_table, "workload (serving/workloads.mixed_workload)")
        add_knobs(m, own)           # after the groups: last in the usage line, as ever
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    require_at_least_one(args, ("block_size", "num_blocks", "max_num_batched_tokens",
                                "max_num_seqs", "num_requests", "threads")
                         + (("repeats",) if args.mode == "bench" else ()))
    if not 0 <= args.long_frac <= 1 or args.rate <= 0:
        raise UserError("--long-frac must be in [0, 1] and --rate > 0")
    # the engines run on the CPU and every tensor sent is a CPU tensor: gloo. On NCCL
    # each one, headers included, would have to live on the GPU
    with setup_runtime("cpu") as rt:
        check_roles(rt)
        torch.set_num_threads(args.threads)
        (run if args.mode == "run" else bench)(rt, args)


if __name__ == "__main__":
    run_cli(main)
