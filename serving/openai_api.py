"""
serving/openai_api.py -- the OpenAI API as this server speaks it: what each request field means,
which are supported and which are refused (and why), how a request becomes the engine's
SamplingParams, and how an answer is written back (choices, stream chunks, log-probs in
the two formats, usage). No sockets here: serving/api_server.py reads the bytes and sends the
answers; this file is the contract between a client and serve.py's engine.

    python serving/openai_api.py                # the fields each endpoint supports and refuses
    python serve.py --port 8000         # where it runs: serving/api_server.py calls parse_request

What it teaches, and what each rule saves / costs:
  - Supported or refused, never ignored: every field of the request is either in the
    endpoint's table (COMPLETION_FIELDS, CHAT_FIELDS; top_k, min_tokens, stop_token_ids,
    ignore_eos and priority are vLLM's extensions) or refused with a 400 that names it
    and says why (REFUSED: tools, audio, ...); an unknown field ("temprature") is a 400
    too. Costs the client a retry; saves it from believing it got what it asked.
  - Validation at the door: every number typed (a bool is not a number), finite and in
    range, and SamplingParams.validate run before the engine sees the request: one bad
    request cannot overflow the math of the batch it would share. A temperature below
    1e-5 is greedy (vLLM). Costs a page of checks, microseconds per request.
  - One request, many choices: `prompt` may be a list of prompts and `n` choices each;
    choice j > 0 of a prompt waits for choice 0's prefill and shares its KV blocks
    (prefix caching pays for n); with `seed`, choice j draws with seed + j.
  - Log-probs in OpenAI's two shapes: completions {tokens, token_logprobs, top_logprobs,
    text_offset}, chat {content: [{token, logprob, bytes, top_logprobs}]}; a token that
    is not whole UTF-8 on its own (byte-level BPE) is named "bytes:\\xNN". They are the
    model's own log_softmax, before temperature, penalties or bias (serve.logprob_entry).
  - Structured output: `response_format` (json_object, json_schema) and vLLM's
    guided_json / guided_regex / guided_choice become SamplingParams.structured; the
    engine compiles it to an automaton and masks every step's logits
    (serving/structured.py). A schema outside the supported subset is a 400 naming the
    keyword. Costs a mask per step (cached per automaton state).
  - A minimal chat template ("### Role:\n..."): the roles are plain text and prompts are
    encoded with encode_ordinary, so user content cannot inject special tokens; the model
    starting another turn (CHAT_STOP) ends the answer. Sacrifices: no multimodal input.
"""
import argparse
import json
import math
import re
import time
import uuid
from collections import namedtuple

from serving.requests import MAX_LOGPROBS, SamplingParams, decode_tokens
from core.errors import UserError

MAX_CHOICES = 64            # prompts x n in one request
MAX_N = 16
CHAT_STOP = "\n### "        # the model starting another turn ends the answer

# Fields: what each endpoint supports (top_k, min_tokens, stop_token_ids, ignore_eos and
# priority are vLLM's extensions), and what is refused, with why.
COMMON_FIELDS = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                 "top_k", "n", "stream", "stream_options", "stop", "stop_token_ids", "seed",
                 "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
                 "min_tokens", "ignore_eos", "priority", "user"}
# structured output: OpenAI's response_format, and vLLM's guided_* extensions
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")
COMMON_FIELDS |= set(STRUCTURED_FIELDS)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls"}
REFUSED = {**dict.fromkeys(("functions", "function_call"), "the legacy functions API: send "
                                                            "'tools' and 'tool_choice'"),
           "suffix": "insertion (text after the completion) is not supported",
           **dict.fromkeys(("audio", "modalities"), "only text is supported"),
           "prediction": "predicted outputs are not supported",
           "reasoning_effort": "this is not a reasoning model",
           "service_tier": "there is one service tier",
           **dict.fromkeys(("store", "metadata"), "nothing is stored"),
           "web_search_options": "there is no web search"}


class ApiError(Exception):
    """An HTTP error with OpenAI's JSON body: {"error": {"message", "type", "param",
    "code"}}; `headers` go with it (Retry-After, Allow)."""

    def __init__(self, status, message, param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}
        self.type = {404: "not_found_error", 413: "request_too_large",
                     429: "rate_limit_error"}.get(status, "invalid_request_error"
                                                  if status < 500 else "server_error")


# ----------------------------------------------------------------------------------------
# Requests: parse and validate everything before the engine sees it

# What one request asks for: its prompts (token ids), the engine's choices
# [(prompt_ids, params, parent)], group[k] = the prompt of choice k, and how to answer.
Plan = namedtuple("Plan", "chat prompts choices group stream include_usage echo logprobs stop "
                         "model tools")


def _get(body, key, types, default=None, check=None, why=""):
    """body[key] with a type check (bool is not a number here), finite, in range."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = "/".join(t.__name__ for t in types)
        raise ApiError(400, f"'{key}' must be of type {names}, got {type(value).__name__}", key)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"'{key}' must be finite", key)
    if check is not None and not check(value):
        raise ApiError(400, f"'{key}' {why}, got {shorten(value)}", key)
    return value


def shorten(value):
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _utf8(text, param):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{param}' is not valid text (a lone UTF-16 surrogate)",
                       param) from None
    return text


def check_fields(body, allowed):
    """Every field supported or refused by name: a client must not believe it got what
    it asked for."""
    for key, value in body.items():
        if key in REFUSED and value is not None:
            raise ApiError(400, f"'{key}' is not supported: {REFUSED[key]}", key)
        if key not in allowed and key not in REFUSED:
            raise ApiError(400, f"unknown field '{shorten(key)[1:-1]}'", key)


def chat_prompt(messages, tools=None):
    """A minimal chat template. The roles are plain text: user content cannot inject
    special tokens (prompts are encoded with encode_ordinary). With tools, a system turn
    lists them first (tools_preamble)."""
    return (tools_preamble(tools) if tools else "") + "".join(
        f"### {m['role'].capitalize()}:\n{m['content']}\n\n" for m in messages) \
        + "### Assistant:\n"


# The keys each role's message may carry (OpenAI's chat format, text only)
MESSAGE_KEYS = {"system": {"content"}, "developer": {"content"}, "user": {"content"},
                "assistant": {"content", "tool_calls"}, "tool": {"content", "tool_call_id"}}


def message_text(m, i):
    """One message's text for the template: its content (a string, or text parts), and
    an assistant's earlier tool calls written back the way the model writes them."""
    content = m.get("content")
    if isinstance(content, list) and all(        # [{"type": "text", "text": ..}]
            isinstance(p, dict) and p.get("type") == "text" and set(p) == {"type", "text"}
            and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if content is None and m.get("tool_calls"):
        content = ""
    if not isinstance(content, str) or (m["role"] == "tool" and not isinstance(
            m.get("tool_call_id"), str)):
        raise ApiError(400, f"messages[{i}] needs a text 'content'" + (
            " and a 'tool_call_id'" if m["role"] == "tool" else ""), "messages")
    for call in m.get("tool_calls") or ():
        try:
            fn = call["function"]
            content += TOOL_CALL[0] + json.dumps({"name": fn["name"], "arguments": json.loads(
                fn["arguments"])}) + TOOL_CALL[1]
        except (TypeError, KeyError, ValueError):
            raise ApiError(400, f"messages[{i}].tool_calls: each call is {{'id', 'type': "
                                f"'function', 'function': {{'name', 'arguments': JSON "
                                f"text}}}}", "messages") from None
    return _utf8(content, "messages")


def chat_prompts(body, srv, tools=None):
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in MESSAGE_KEYS:
            raise ApiError(400, f"messages[{i}] needs a 'role': one of "
                                f"{', '.join(MESSAGE_KEYS)}", "messages")
        extra = sorted(set(m) - MESSAGE_KEYS[role] - {"role"})
        if extra:
            raise ApiError(400, f"messages[{i}] ({role}) may not carry {extra[0]!r}",
                           "messages")
        clean.append({"role": role, "content": message_text(m, i)})
    return [srv.enc.encode_ordinary(chat_prompt(clean, tools))]


def completion_prompts(body, srv):
    """'prompt': a string, a list of token ids, or a list of either (several prompts)."""
    prompt = body.get("prompt")

    def ids_of(x):
        if isinstance(x, str) and x:
            return srv.enc.encode_ordinary(_utf8(x, "prompt"))
        if isinstance(x, list) and x and all(type(t) is int for t in x):
            if not all(0 <= t < srv.vocab_size for t in x):
                raise ApiError(400, f"token ids must be in [0, {srv.vocab_size})", "prompt")
            return x
        raise ApiError(400, "'prompt' must be a non-empty string, a non-empty list of token "
                            "ids, or a list of those", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(x, (str, list)) for x in prompt):
        return [ids_of(x) for x in prompt]
    return [ids_of(prompt)]


def parse_max_tokens(body, chat, prompts, srv, scoring):
    """max_tokens or max_completion_tokens (both endpoints; equal if both are given).
    Default as OpenAI: 16 for completions, the rest of the context for chat."""
    given = {k: body[k] for k in ("max_tokens", "max_completion_tokens")
             if body.get(k) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise ApiError(400, "'max_tokens' and 'max_completion_tokens' disagree",
                       "max_completion_tokens")
    key = next(iter(given), "max_tokens")
    low = 0 if scoring else 1
    value = _get(body, key, (int,), None, lambda v: v >= low,
                 f"must be >= {low}{'' if scoring else ' (0 only with echo and logprobs)'}")
    longest = max(len(p) for p in prompts)
    if longest >= srv.context:
        raise ApiError(400, f"this model's maximum context length is {srv.context} tokens; "
                            f"the prompt has {longest}", "prompt", "context_length_exceeded")
    room = srv.context - longest
    if value is None:
        return min(room, srv.max_tokens_cap) if chat else min(16, room)
    if value > srv.max_tokens_cap:
        raise ApiError(400, f"'{key}' {value} is over this server's cap of "
                            f"{srv.max_tokens_cap}", key)
    if value > room:
        raise ApiError(400, f"this model's maximum context length is {srv.context} tokens; "
                            f"the prompt ({longest}) + {key} ({value}) is longer", key,
                       "context_length_exceeded")
    return value


def parse_logprobs(body, chat):
    """-> how many top alternatives per token (0 = only the chosen token's), or None.
    Completions: logprobs is that number; chat: logprobs true + top_logprobs."""
    if not chat:
        return _get(body, "logprobs", (int,), None, lambda v: 0 <= v <= MAX_LOGPROBS,
                    f"must be in [0, {MAX_LOGPROBS}]")
    on = _get(body, "logprobs", (bool,), False)
    top = _get(body, "top_logprobs", (int,), None, lambda v: 0 <= v <= MAX_LOGPROBS,
               f"must be in [0, {MAX_LOGPROBS}]")
    if top is not None and not on:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def parse_bias(body, vocab):
    bias = _get(body, "logit_bias", (dict,), {}, lambda v: len(v) <= 300, "has over 300 entries")
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab):
            raise ApiError(400, f"'logit_bias' keys must be token ids in [0, {vocab}), got "
                                f"{shorten(key)}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and -100 <= value <= 100):
            raise ApiError(400, "'logit_bias' values must be numbers in [-100, 100]",
                           "logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def parse_structured(body):
    """response_format ({"type": "text" | "json_object" | "json_schema", "json_schema":
    {"name", "schema", "strict"}}) or vLLM's guided_json / guided_regex / guided_choice ->
    the engine's spec (SamplingParams.structured), or None. The schema itself is checked
    when the engine compiles it (serving/structured.py): what it cannot honour is a 400."""
    given = [k for k in STRUCTURED_FIELDS if body.get(k) is not None]
    if len(given) > 1:
        raise ApiError(400, f"give one of {', '.join(given)}, not several", given[1])
    if not given:
        return None
    key, value = given[0], body[given[0]]
    if key == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in ("text", "json_object", "json_schema") or set(value) - {
                "type", "json_schema"}:
            raise ApiError(400, "'response_format' must be {'type': 'text'}, {'type': "
                                "'json_object'} or {'type': 'json_schema', 'json_schema': "
                                "{...}}", key)
        if kind != "json_schema":
            return None if kind == "text" else {"type": "json_object"}
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict) or \
                set(spec) - {"name", "schema", "strict", "description"}:
            raise ApiError(400, "'response_format.json_schema' must be {'name': ..., "
                                "'schema': {...}, 'strict': ...}", key)
        return {"type": "json_schema", "schema": spec["schema"]}
    if key == "guided_json":       # vLLM: a schema, as an object or as its JSON text
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            raise ApiError(400, "'guided_json' is not a JSON schema (unparsable text)", key)
        if not isinstance(schema, dict):
            raise ApiError(400, "'guided_json' must be a JSON schema object", key)
        return {"type": "json_schema", "schema": schema}
    if key == "guided_regex":
        if not isinstance(value, str) or not value:
            raise ApiError(400, "'guided_regex' must be a non-empty string", key)
        return {"type": "regex", "pattern": value}
    return {"type": "choice", "choices": value}


# ----------------------------------------------------------------------------------------
# Tool calls: the tools written into the prompt, the call constrained, the answer parsed

TOOL_CALL = ("<tool_call>", "</tool_call>")      # Hermes / Qwen2.5's tags around a call
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")    # OpenAI's rule for a function's name
MAX_TOOLS = 64


def parse_tools(body):
    """tools + tool_choice -> None, or {"functions": [{name, description, parameters}],
    "choice": "none" | "auto" | "required" | a function's name}. parallel_tool_calls is
    type-checked: an answer here carries at most one call."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    _get(body, "parallel_tool_calls", (bool,), True)
    if tools is None:
        if choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        raise ApiError(400, f"'tools' must be a list of 1 to {MAX_TOOLS} tools", "tools")
    functions = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" and \
            set(t) <= {"type", "function"} else None
        if not isinstance(f, dict) or not TOOL_NAME.fullmatch(str(f.get("name"))) or \
                set(f) - {"name", "description", "parameters", "strict"} or \
                not isinstance(f.get("parameters", {}), dict) or \
                not isinstance(f.get("description", ""), str):
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': "
                                f"{{'name': [A-Za-z0-9_-]{{1,64}}, 'description': text, "
                                f"'parameters': a JSON schema}}}}", "tools")
        functions.append({"name": f["name"], "description": f.get("description", ""),
                          "parameters": f.get("parameters",
                                              {"type": "object", "properties": {}})})
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise ApiError(400, "two tools share a name", "tools")
    if isinstance(choice, dict):       # {"type": "function", "function": {"name": ...}}
        fn = choice.get("function") if choice.get("type") == "function" else None
        choice = fn.get("name") if isinstance(fn, dict) else None
        if choice not in names:
            raise ApiError(400, "'tool_choice' names no tool of 'tools'", "tool_choice")
    elif choice not in (None, "none", "auto", "required"):
        raise ApiError(400, "'tool_choice' must be 'none', 'auto', 'required' or {'type': "
                            "'function', 'function': {'name': ...}}", "tool_choice")
    return {"functions": functions, "choice": choice or "auto"}


def tools_preamble(tools):
    """The documented template: a system turn naming the call format, then each function
    as one JSON line between <tools> tags (Hermes / Qwen2.5's layout). "none": no tools
    are offered, so none are listed."""
    if tools["choice"] == "none":
        return ""
    listed = "\n".join(json.dumps({"type": "function", "function": f})
                       for f in tools["functions"])
    return (f"### System:\nYou may call one of these tools. To call one, answer with "
            f"{TOOL_CALL[0]}{{\"name\": ..., \"arguments\": {{...}}}}{TOOL_CALL[1]} and "
            f"nothing else.\n<tools>\n{listed}\n</tools>\n\n")


def tool_call_spec(tools):
    """tool_choice "required" or a named function -> the structured-output spec that
    forces the call: {"name": ..., "arguments": ...} between TOOL_CALL's tags, the
    arguments constrained by the function's parameters schema (anyOf over the functions
    "required" lets the model choose from). "auto", "none": no constraint."""
    if tools is None or tools["choice"] in ("none", "auto"):
        return None
    calls = [{"type": "object", "required": ["name", "arguments"],
              "additionalProperties": False,
              "properties": {"name": {"enum": [f["name"]]}, "arguments": f["parameters"]}}
             for f in tools["functions"] if tools["choice"] in ("required", f["name"])]
    return {"type": "json_schema", "schema": calls[0] if len(calls) == 1 else
            {"anyOf": calls}, "wrap": list(TOOL_CALL)}


def tool_call_of(text, tools):
    """A finished answer's text -> OpenAI's tool_calls entry if it is one call to one of
    the tools (what "required" forces; what "auto" may write), else None: plain content."""
    text = text.strip()
    if tools is None or tools["choice"] == "none" or not (
            text.startswith(TOOL_CALL[0]) and text.endswith(TOOL_CALL[1])):
        return None
    try:
        call = json.loads(text[len(TOOL_CALL[0]):-len(TOOL_CALL[1])])
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict) or \
            call.get("name") not in [f["name"] for f in tools["functions"]]:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}


def parse_sampling(body, chat, srv, max_tokens, logprobs):
    """-> the SamplingParams fields every choice of the request shares."""
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4 or not all(
            isinstance(s, str) and s for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty strings",
                       "stop")
    stop_ids = _get(body, "stop_token_ids", (list,), [], lambda v: len(v) <= 16 and all(
        type(t) is int and 0 <= t < srv.vocab_size for t in v),
        f"must be up to 16 token ids in [0, {srv.vocab_size})")
    if body.get("priority") is not None and not srv.allow_priority:
        raise ApiError(400, "'priority' is accepted only by a server started with "
                            "--allow-client-priority", "priority")
    return dict(
        max_tokens=max_tokens, logprobs=logprobs, stop_token_ids=tuple(stop_ids),
        stop=tuple(_utf8(s, "stop") for s in stop or ()) + ((CHAT_STOP,) if chat else ()),
        temperature=float(_get(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2,
                               "must be in [0, 2]")),
        top_p=float(_get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1,
                         "must be in (0, 1]")),
        top_k=max(0, _get(body, "top_k", (int,), 0, lambda v: -1 <= v < 2 ** 31,
                          "must be >= -1 (-1 and 0 mean off)")),
        presence_penalty=float(_get(body, "presence_penalty", (int, float), 0.0,
                                    lambda v: -2 <= v <= 2, "must be in [-2, 2]")),
        frequency_penalty=float(_get(body, "frequency_penalty", (int, float), 0.0,
                                     lambda v: -2 <= v <= 2, "must be in [-2, 2]")),
        logit_bias=parse_bias(body, srv.vocab_size),
        structured=parse_structured(body),
        min_tokens=_get(body, "min_tokens", (int,), 0, lambda v: 0 <= v <= max_tokens,
                        "must be in [0, max_tokens]"),
        ignore_eos=_get(body, "ignore_eos", (bool,), False),
        priority=_get(body, "priority", (int,), 0, lambda v: abs(v) < 2 ** 31,
                      "must be a 32-bit integer"))


def parse_request(body, chat, srv):
    """-> Plan. Raises ApiError (400 naming the field) for anything refused or invalid."""
    check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    # the base model by its --model-name, or a LoRA adapter by its name (serve.py --lora,
    # as vLLM's --lora-modules): requests of different adapters share the engine's batches
    model = _get(body, "model", (str,), srv.model_name)
    served = [srv.model_name, *srv.adapters]
    if model not in served:
        raise ApiError(404, f"model {shorten(model)} does not exist; this server serves "
                            f"{', '.join(map(repr, served))}", "model", "model_not_found")
    adapter = None if model == srv.model_name else model
    tools = parse_tools(body) if chat else None
    prompts = chat_prompts(body, srv, tools) if chat else completion_prompts(body, srv)
    n = _get(body, "n", (int,), 1, lambda v: 1 <= v <= MAX_N, f"must be in [1, {MAX_N}]")
    if _get(body, "best_of", (int,), 1) not in (1, n):
        raise ApiError(400, "'best_of' > n (ranking candidates on the server) is not "
                            "supported", "best_of")
    cap = min(MAX_CHOICES, srv.loop.max_in_flight)
    if len(prompts) * n > cap:
        raise ApiError(400, f"{len(prompts)} prompts x n={n} is over this server's {cap} "
                            f"choices per request", "n")
    echo = _get(body, "echo", (bool,), False)
    logprobs = parse_logprobs(body, chat)
    max_tokens = parse_max_tokens(body, chat, prompts, srv, echo and logprobs is not None)
    kw = parse_sampling(body, chat, srv, max_tokens, logprobs)
    forced = tool_call_spec(tools)
    if forced is not None:             # the call itself is the structured output
        if kw["structured"] is not None:
            raise ApiError(400, "tool_choice 'required' or a named function already "
                                "constrains the answer: drop response_format", "tool_choice")
        kw["structured"] = forced
    _get(body, "user", (str,), "")                       # an end-user id: type-checked only
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), None)
    if options is not None and (not stream or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise ApiError(400, "'stream_options' is {'include_usage': bool}, with stream: true",
                       "stream_options")
    seed = _get(body, "seed", (int,), None, lambda v: 0 <= v < 2 ** 63, "must be in [0, 2^63)")
    choices, group = [], []
    for i, ids in enumerate(prompts):
        parent = len(choices)
        for j in range(n):     # choice j of a seeded request: seed + j (distinct samples)
            params = SamplingParams(
                **kw, seed=None if seed is None else (seed + j) % 2 ** 63,
                prompt_logprobs=logprobs if echo and j == 0 else None, adapter=adapter)
            try:
                params.validate(srv.vocab_size)
            except UserError as e:
                raise ApiError(400, str(e)) from None
            choices.append((ids, params, None if j == 0 else parent))
            group.append(i)
    include_usage = bool((options or {}).get("include_usage"))
    return Plan(chat, prompts, choices, group, stream, include_usage, echo, logprobs, kw["stop"],
                model, tools)


# ----------------------------------------------------------------------------------------
# Answers: choices, log-probs in OpenAI's two formats, usage

def token_bytes(enc, tok):
    return enc.decode_single_token_bytes(tok) if tok < enc.n_vocab else b""


def token_str(enc, tok):
    """A token as OpenAI names it: its text, or "bytes:\\xe2\\x80" for a token that is not
    whole UTF-8 on its own (byte-level BPE splits characters)."""
    b = token_bytes(enc, tok)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def format_logprobs(enc, entries, chat, offset=0):
    """entries: [(token, logprob or None, [(id, logprob)] or None)]. Completions:
    {tokens, token_logprobs, top_logprobs, text_offset}; chat: {content: [...]}."""
    if chat:
        def one(tok, lp):
            return {"token": token_str(enc, tok), "logprob": lp,
                    "bytes": list(token_bytes(enc, tok))}
        return {"content": [{**one(tok, lp), "top_logprobs": [one(t, v) for t, v in top]}
                            for tok, lp, top in entries], "refusal": None}
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, lp, top in entries:
        out["tokens"].append(token_str(enc, tok))
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(None if top is None else
                                   {token_str(enc, t): v for t, v in top})
        out["text_offset"].append(offset)
        offset += len(token_bytes(enc, tok).decode("utf-8", "ignore"))
    return out


def prompt_entries(ids, scored):
    """The prompt's log-prob entries: the first token has none (nothing before it)."""
    return [(ids[0], None, None)] + list(scored)


def usage(plan, outputs):
    prompt = sum(len(p) for p in plan.prompts)
    completion = sum(len(o["ids"]) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}

def response_head(chat, model_name):
    """The fields every answer (and every stream chunk) of one request starts with."""
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model_name}


def answer_choice(enc, plan, k, out, scored):
    """Choice k of a whole (non-streamed) answer. out: its ids, log-prob entries, finish
    reason and text; scored: prompt index -> the prompt's log-probs (for echo)."""
    ids = plan.prompts[plan.group[k]]
    entries = out["lps"]
    text = decode_tokens(enc, ids) + out["text"] if plan.echo else out["text"]
    if plan.echo:
        entries = prompt_entries(ids, scored.get(plan.group[k], ())) + entries
    lp = format_logprobs(enc, entries, plan.chat) if plan.logprobs is not None else None
    choice = {"index": k, "logprobs": lp, "finish_reason": out["finish"]}
    call = tool_call_of(text, plan.tools) if out["finish"] == "stop" else None
    if call is not None:               # OpenAI's shape: no content, the call, its reason
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
        choice["finish_reason"] = "tool_calls"
    elif plan.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return choice


def stream_chunk(enc, plan, head, k, text="", entries=(), state=None, finish=None,
                 role=False, call=None):
    """One server-sent event's object for choice k: a piece of text (chat: a delta; the
    first chat event carries only the role), its log-probs, a whole tool call (`call`:
    delta.tool_calls), or the finish reason. state["offset"]: the completion's
    text_offset so far (advanced here)."""
    lp = None
    if plan.logprobs is not None and entries:
        lp = format_logprobs(enc, entries, plan.chat, state["offset"])
        if not plan.chat:
            state["offset"] = lp["text_offset"][-1] + len(
                token_bytes(enc, entries[-1][0]).decode("utf-8", "ignore"))
    if plan.chat:
        delta = {"role": "assistant", "content": ""} if role else (
            {"tool_calls": [{"index": 0, **call}]} if call else
            {"content": text} if text else {})
        choice = {"index": k, "delta": delta, "logprobs": lp, "finish_reason": finish}
    else:
        choice = {"index": k, "text": text, "logprobs": lp, "finish_reason": finish}
    return {**head, "choices": [choice]}


# ----------------------------------------------------------------------------------------
# `python -m serving.openai_api`: the contract, printed

def main(argv=None):
    """A library: print the fields each endpoint takes and what is refused, with why."""
    argparse.ArgumentParser(description="serving/openai_api.py is a library: "
                            "serving/api_server.py (python serve.py --port 8000) parses "
                            "every request with parse_request. "
                            "Run alone, it prints the fields each endpoint supports and "
                            "those it refuses, with why.").parse_args(argv)
    print(f"/v1/completions: {', '.join(sorted(COMPLETION_FIELDS))}")
    print(f"\n/v1/chat/completions: {', '.join(sorted(CHAT_FIELDS))}")
    print("\nrefused with a 400 naming the field:")
    for key, why in REFUSED.items():
        print(f"  {key}: {why}")
    print(f"\nany other field: a 400 'unknown field'; n <= {MAX_N}, prompts x n <= "
          f"{MAX_CHOICES}, logprobs <= {MAX_LOGPROBS}")
    print("\n(a library: the server is `python serve.py --port 8000`, serving/api_server.py)")

if __name__ == "__main__":
    main()
