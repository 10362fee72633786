"""
serving/requests.py -- what a request asks of the serving engine, in one place: the
sampling parameters (every field checked at the door), and how token ids become text.

serve.py's engine, the OpenAI protocol layer (serving/openai_api.py) and the processes of
disagg.py / kv_router.py all speak this vocabulary, so it sits below all of them: none of
them imports another to learn what a request is.
"""
import math
from dataclasses import dataclass
from typing import Optional

from core.errors import UserError


# A temperature below this samples greedily (vLLM's _SAMPLING_EPS): logits / 1e-40 would
# overflow float32 to inf and the softmax to NaN, and the limit T -> 0 is argmax anyway.
GREEDY_EPS = 1e-5


MAX_LOGPROBS = 20          # top alternatives per position, at most (OpenAI: 20)
STRUCTURED_TYPES = ("json_object", "json_schema", "regex", "choice")


@dataclass
class SamplingParams:
    max_tokens: int = 16            # 0 only with prompt_logprobs: score the prompt
    temperature: float = 1.0        # < GREEDY_EPS = greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    stop: tuple = ()                # stop strings (the text is cut before the first one)
    seed: Optional[int] = None      # per-request generator: same seed, same sample
    ignore_eos: bool = False        # keep going past <|endoftext|> (benchmarks)
    priority: int = 0               # SLO policy: lower runs first
    ttft_slo: Optional[float] = None   # seconds; the SLO policy's admission deadline
    min_tokens: int = 0             # <|endoftext|> and stop_token_ids masked until then
    stop_token_ids: tuple = ()      # sampling one of these ends the sequence ("stop")
    presence_penalty: float = 0.0   # logit -= presence · [token already in the output]
    frequency_penalty: float = 0.0  # logit -= frequency · (its count in the output)
    logit_bias: tuple = ()          # ((token id, bias), ...) added to the logits
    logprobs: Optional[int] = None  # per output token: its log-prob + this many top ones
    prompt_logprobs: Optional[int] = None   # the same for every prompt token but the first
    adapter: Optional[str] = None   # a LoRA adapter the server loaded (serve.py --lora), by name
    # structured output (serving/structured.py), as plain data: {"type": "json_object"},
    # {"type": "json_schema", "schema": {...}}, {"type": "regex", "pattern": "..."} or
    # {"type": "choice", "choices": [...]}; None: free text
    structured: Optional[dict] = None

    @classmethod
    def from_dict(cls, d):
        """The inverse of dataclasses.asdict, for params that crossed a process (lists
        back to the tuples the fields hold)."""
        d = dict(d, stop=tuple(d["stop"]), stop_token_ids=tuple(d["stop_token_ids"]))
        return cls(**dict(d, logit_bias=tuple(tuple(p) for p in d["logit_bias"])))

    def validate(self, vocab_size=None):
        """Every number checked at the door -- finite and in range -- so that the math
        inside a step cannot overflow for one request and fail the batch it shares."""
        def number(name, lo, hi):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    math.isfinite(v) and lo <= v <= hi):
                raise UserError(f"{name} must be a finite number in [{lo}, {hi}], got {v!r}")

        def integer(name, lo, hi, v=None):
            v = getattr(self, name) if v is None else v
            if type(v) is not int or not lo <= v <= hi:
                raise UserError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
        integer("max_tokens", 0 if self.prompt_logprobs is not None else 1, 2 ** 31)
        integer("min_tokens", 0, self.max_tokens)
        number("temperature", 0, 100)
        number("top_p", 1e-9, 1)
        integer("top_k", 0, 2 ** 31)
        number("presence_penalty", -2, 2)
        number("frequency_penalty", -2, 2)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                integer(name, 0, MAX_LOGPROBS)
        if self.seed is not None:
            integer("seed", 0, 2 ** 63 - 1)
        if self.structured is not None:
            if not isinstance(self.structured, dict) or self.structured.get("type") not in \
                    STRUCTURED_TYPES:
                raise UserError(f"structured must be a dict with 'type' one of "
                                f"{', '.join(STRUCTURED_TYPES)}")
            if self.ignore_eos:     # the automaton ends the output with EOS when it accepts
                raise UserError("ignore_eos cannot be combined with structured output")
        top = (vocab_size or 2 ** 31) - 1
        for t in self.stop_token_ids:
            integer("stop_token_ids", 0, top, t)
        for t, b in self.logit_bias:
            integer("logit_bias token", 0, top, t)
            if not (isinstance(b, (int, float)) and math.isfinite(b) and -100 <= b <= 100):
                raise UserError(f"logit_bias values must be finite in [-100, 100], got {b!r}")
        return self


def decode_tokens(enc, ids):
    """Token ids -> text; incomplete UTF-8 at the end becomes U+FFFD (streaming holds those
    characters back until the next token completes them)."""
    ids = [i for i in ids if i < enc.n_vocab]
    return enc.decode_bytes(ids).decode("utf-8", errors="replace")
