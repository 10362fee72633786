"""
serving/workloads.py -- the seeded request streams the serving measurements replay: a
request (prompt, output length, arrival time, SLO class), lengths drawn from a range, a
mix of long and short prompts, and multi-turn agent sessions whose every turn re-sends the
conversation so far (what prefix caching is for).

Shared by scripts/serve_bench.py, disagg.py and kv_router.py, so each measures its engine,
its disaggregation or its router on the same traffic; a pure function of its seed. With
it, what those measurements share around the traffic: the model they serve (a checkpoint,
or a random-init preset from the seed) and the nearest-rank percentile of their tables.
"""
import math
import random
from dataclasses import dataclass

from core.checkpoint import load_model
from core.errors import UserError
from model import GPT, get_config


@dataclass
class BenchRequest:
    prompt: list
    out_len: int
    arrival: float          # seconds after the start
    interactive: bool       # SLO class: tight TTFT (priority 0) or batch (priority 1)
    session: int = 0        # multi-turn workloads: which conversation, which turn
    turn: int = 0
    history: int = 0        # leading prompt tokens an earlier turn already computed


def length_range(text, name):
    """A length flag: "N" (exactly N) or "LO:HI" (uniform in LO..HI) -> (lo, hi)."""
    try:
        parts = text.split(":") if ":" in text else [text, text]
        lo, hi = (int(x) for x in parts)
    except ValueError:
        raise UserError(f"--{name} takes N or LO:HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise UserError(f"--{name} needs 1 <= LO <= HI, got {text!r}")
    return lo, hi


def mixed_workload(num_requests, short_len, long_len, long_frac, output_len, rate, cfg,
                   eos_id, seed=0):
    """Mixed long-prompt / short-prompt load (the prefill-decode interference case that
    chunked prefill and disaggregation address: a long prefill stalls the decodes batched
    with it). Seeded; lengths are (LO, HI) ranges; a request is long with probability
    long_frac; arrivals all at t=0 (rate inf) or Poisson. -> [BenchRequest]; the long
    ones are the batch class (interactive=False)."""
    rng = random.Random(seed)
    vocab = [t for t in range(cfg.vocab_size) if t != eos_id]
    reqs, t = [], 0.0
    for _ in range(num_requests):
        long = rng.random() < long_frac
        plen = rng.randint(*(long_len if long else short_len))
        olen = min(rng.randint(*output_len), cfg.block_size - plen)
        if olen < 1:
            raise UserError(f"a {plen}-token prompt leaves no room for output in the "
                            f"context of {cfg.block_size}: lower --long-len")
        if rate != math.inf:
            t += rng.expovariate(rate)
        reqs.append(BenchRequest([rng.choice(vocab) for _ in range(plen)], olen, t, not long))
    return reqs


class AgentSessions:
    """Multi-turn agent sessions, seeded: the workload where prefix reuse decides the
    cost. Every session starts from one shared system prompt; turn k's prompt is turn
    k-1's prompt + its answer (the engine's own output) + a new message (a tool result,
    a user reply), so each turn re-sends the whole conversation. Sessions start at once
    (rate inf) or Poisson at `rate`; a turn arrives think_time after the previous one
    finished, so sessions interleave and their cached prefixes compete for the pool.

    Reusable by any driver: `first_turns()` -> the first turn of every session;
    `next_turn(request, output_ids, finish)` -> the session's next BenchRequest, arriving
    at finish + think_time (seconds after the start), or None when the session is over
    (its turns done, or the next turn would not fit the context). A turn's new message
    depends only on (seed, session, turn), never on the schedule: every system sees
    the same conversations as long as its outputs are the same."""

    def __init__(self, cfg, eos_id, sessions=16, turns=4, system_len=32, message_len=(8, 24),
                 answer_len=(8, 24), think_time=0.0, rate=math.inf, seed=0):
        if min(sessions, turns) < 1 or system_len < 0 or think_time < 0 or rate <= 0:
            raise UserError("agent sessions need --sessions, --turns >= 1, --system-len, "
                            "--think-time >= 0 and --rate > 0")
        self.cfg, self.seed, self.turns = cfg, seed, turns
        self.message_len, self.answer_len, self.think_time = message_len, answer_len, think_time
        self.vocab = [t for t in range(cfg.vocab_size) if t != eos_id]
        rng = random.Random(seed)
        self.system = [rng.choice(self.vocab) for _ in range(system_len)]
        self.starts, t = [], 0.0
        for _ in range(sessions):
            self.starts.append(t)
            if rate != math.inf:
                t += rng.expovariate(rate)

    def _turn(self, session, turn, history, arrival):
        rng = random.Random(f"{self.seed}:{session}:{turn}")
        prompt = history + [rng.choice(self.vocab) for _ in range(rng.randint(*self.message_len))]
        out_len = rng.randint(*self.answer_len)
        if len(prompt) + out_len > self.cfg.block_size:
            return None
        return BenchRequest(prompt, out_len, arrival, True, session, turn, len(history))

    def first_turns(self):
        turns = [self._turn(s, 0, list(self.system), t) for s, t in enumerate(self.starts)]
        if None in turns:
            raise UserError(f"the first turn does not fit the context of "
                            f"{self.cfg.block_size}: lower --system-len/--message-len")
        return turns

    def next_turn(self, req, output_ids, finish):
        if req.turn + 1 >= self.turns:
            return None
        return self._turn(req.session, req.turn + 1, req.prompt + list(output_ids),
                          finish + self.think_time)


# ----------------------------------------------------------------------------------------
# Around the traffic: the model served, and the percentiles reported

def bench_model(checkpoint, preset, context, seed):
    """The model a measurement serves, in eval mode: the checkpoint when one is named, else
    a random-init `preset` model of `context` tokens (None: the preset's) from `seed`. A
    pure function of its arguments, so every process that calls it (disagg.py's two
    ranks) holds the very same weights."""
    if checkpoint:
        model, _ = load_model(checkpoint)
    else:
        model = GPT(get_config(preset, block_size=context), seed=seed)
    return model.eval()


def pct(xs, p):
    """Nearest-rank percentile: the ceil(p/100 · n)-th smallest, no interpolation (so the
    p99 of fewer than 100 samples is their maximum); nan for no samples."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))] if xs else math.nan
