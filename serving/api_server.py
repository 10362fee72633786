"""
serving/api_server.py -- the OpenAI-compatible HTTP server around serve.py's engine, standard
library only: /v1/completions, /v1/chat/completions (streaming or not), /v1/models,
/health and /metrics (Prometheus text). It talks to the engine only through EngineLoop's
inbox; the engine never sees a socket. What a request's fields mean -- parsing,
validation, what is refused, the answers' shapes -- is serving/openai_api.py (the protocol, split
from the transport): this file reads the bytes and writes the answers.

    python serve.py --port 8000        # the entry point; this file holds the server

What it teaches -- a server that one bad request cannot break -- and what each defence
costs:
  - Validation at the door (openai_api.parse_request): every field typed, finite and in
    range, or refused with a 400 that names it, before the engine sees it (NaN/Infinity
    are not JSON here). Saves the batch the request would share.
  - JSON errors for everything a client can send wrong: bodies too deep, too big, not an
    object, not UTF-8, duplicate keys; Content-Length missing, non-ASCII or doubled;
    chunked bodies; methods other than GET/POST; the standard library's own HTML error
    pages (bad request line, header too long) replaced by the same JSON shape.
  - Deadlines, not per-read timeouts: the request line + headers must arrive within
    --header-timeout and the body within --body-timeout *in total*, so a client trickling
    one byte a second (slowloris) holds its thread for the deadline, not forever.
  - A connection cap: at --max-connections, a new connection evicts the oldest one still
    sending its request (idle keep-alive or slow), so hundreds of idle sockets cannot
    starve a client that sends a whole request at once; only when every connection is
    busy being answered does a newcomer get a 503 with Retry-After. Costs: a slow but
    honest client may be evicted under attack.
  - Disconnects: a non-streaming client that goes away is noticed while its answer is
    computed (the socket polled every POLL_S) and its sequences aborted, their KV blocks
    freed; a streaming one is noticed at the next write. Both counted in /health.
  - 429 with Retry-After when more sequences are in flight than max_num_seqs + max_queue;
    `priority` from a client only with --allow-client-priority (under the SLO policy a
    negative priority would jump the queue).
"""
import errno
import http.server
import itertools
import json
import math
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections import OrderedDict, namedtuple
from http import HTTPStatus
from urllib.parse import urlsplit

from serving.requests import decode_tokens
from serving.openai_api import (ApiError, answer_choice, parse_request, prompt_entries,
                                response_head, shorten, stream_chunk, tool_call_of, usage)
from core.cli import fmt_bytes, knob
from core.errors import UserError

MAX_REQUEST_LINE = 8192     # bytes; 414 above
MAX_JSON_DEPTH = 32         # nesting levels of the body; 400 above
POLL_S = 0.05               # how often a waiting handler checks that its client is there
WRITE_TIMEOUT = 60.0        # seconds a send may block (a client that stops reading)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class ClientGone(Exception):
    """The client closed its connection while its answer was being computed."""


# What the engine thread hands a request's handler, per choice: new token ids and their
# log-probs; the prompt's log-probs with the first update; at the end the finish reason
# and the final text (or an error).
Update = namedtuple("Update", "index tokens logprobs finish_reason text error prompt_logprobs",
                    defaults=(0, (), (), None, None, None, None))


# ----------------------------------------------------------------------------------------
# The engine's thread

class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, x):
        for i, le in enumerate(self.buckets):
            self.counts[i] += x <= le
        self.sum, self.count = self.sum + x, self.count + 1

    def lines(self, name):
        out = [f'{name}_bucket{{le="{le}"}} {c}' for le, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}",
                      f"{name}_count {self.count}"]


class EngineLoop:
    """Runs the engine in its own thread. Handler threads never touch the engine: they put
    'add' and 'abort' into an inbox and read their own queue of Updates; what they report
    (/health, /metrics) is a snapshot the engine thread publishes between steps. The
    in-flight cap (sequences running + queued) answers 429 instead of letting a queue grow
    without bound."""

    def __init__(self, engine, max_queue):
        self.engine, self.cond, self.inbox, self.outboxes = engine, threading.Condition(), [], {}
        self.ids, self.in_flight, self.stopping = itertools.count(), 0, False
        self.max_in_flight = engine.max_num_seqs + max_queue
        self.counters = dict(rejected=0, client_disconnects=0)
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self.snapshot = {}
        self._publish()
        self.thread = threading.Thread(target=self.run, daemon=True, name="engine")
        self.thread.start()

    def submit(self, choices):
        """choices: [(prompt_ids, params, parent)], parent = the index (in this list) of
        the choice whose prefill this one waits for, or None. -> (sequence ids, queue)."""
        with self.cond:
            if self.in_flight + len(choices) > self.max_in_flight:
                self.counters["rejected"] += 1
                raise ApiError(429, f"server busy: {self.in_flight} sequences in flight (cap "
                                    f"{self.max_in_flight} = max_num_seqs + max_queue); retry",
                               headers={"Retry-After": "1"})
            sids, q = [next(self.ids) for _ in choices], queue.Queue()
            for index, sid in enumerate(sids):
                self.outboxes[sid] = q, index
            self.in_flight += len(sids)
            self.inbox.append(("add", list(zip(sids, choices))))
            self.cond.notify()
        return sids, q

    def abort(self, sids, disconnected=False):
        with self.cond:
            self.inbox.append(("abort", sids))
            self.counters["client_disconnects"] += disconnected
            self.cond.notify()

    def stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=10)

    def health(self):
        with self.cond:
            return {**self.snapshot, "in_flight": self.in_flight, **self.counters}

    def _publish(self):
        eng, a = self.engine, self.engine.alloc
        self.snapshot = dict(status="ok", running=len(eng.running), waiting=len(eng.waiting),
                             held=sum(map(len, eng.held.values())), num_blocks=a.num_blocks,
                             free_blocks=len(a.free), cached_blocks=len(a.evictable),
                             used_blocks=a.num_used, **eng.stats)

    def _push(self, sid, update):
        q, index = self.outboxes.get(sid, (None, None))
        if q is None:
            return
        q.put(update._replace(index=index))
        if update.finish_reason or update.error:
            with self.cond:
                del self.outboxes[sid]
                self.in_flight -= 1

    def run(self):
        eng = self.engine
        while True:
            with self.cond:
                self._publish()
                while not (self.inbox or eng.has_work() or self.stopping):
                    self.cond.wait()
                if self.stopping:
                    return
                ops, self.inbox = self.inbox, []
            for op, items in ops:
                if op == "add":
                    self._add(items)
                    continue
                for sid in items:
                    if eng.abort(sid) is not None:
                        self._push(sid, Update(finish_reason="abort", text=""))
            try:
                updated = eng.step()      # a fault of one request fails only that one
            except Exception as e:        # a bug outside any request: fail all, keep serving
                traceback.print_exc()
                for seq in list(eng.live.values()):
                    eng.abort(seq.id)
                    self._push(seq.id, Update(error=ApiError(500, f"engine error: {e}")))
                continue
            for seq in updated:
                try:
                    self._deliver(seq)
                except Exception as e:    # a bug in one answer: that request fails alone
                    traceback.print_exc()
                    eng.abort(seq.id)
                    self._push(seq.id, Update(error=ApiError(500, f"internal error: {e}")))

    def _add(self, items):
        seqs = []
        for sid, (prompt_ids, params, parent) in items:
            try:
                after = seqs[parent] if parent is not None else None
                seqs.append(self.engine.add_request(prompt_ids, params, seq_id=sid, after=after))
            except Exception as e:     # UserError: a bad request; else a bug
                seqs.append(None)
                self._push(sid, Update(error=ApiError(
                    400 if isinstance(e, UserError) else 500, str(e))))

    def _deliver(self, seq):
        """The sequence's new tokens to its handler; TTFT and inter-token latency into the
        histograms (one new token per step, so each gap is one decode's latency)."""
        if seq.finish_reason == "error":
            self._push(seq.id, Update(error=ApiError(
                500, f"this request failed inside the engine (other requests were not "
                     f"affected): {seq.error}")))
            return
        k = seq.num_pushed
        with self.cond:
            for i in range(k, len(seq.token_times)):
                prev = seq.token_times[i - 1] if i else seq.arrival
                (self.itl if i else self.ttft).observe(seq.token_times[i] - prev)
        new = seq.output_ids[k:]
        seq.num_pushed += len(new)
        first = k == 0 and seq.params.prompt_logprobs is not None
        self._push(seq.id, Update(0, new, seq.logprobs[k:k + len(new)], seq.finish_reason,
                                  seq.text if seq.finish_reason else None, None,
                                  seq.prompt_logprobs if first else None))


def render_metrics(h, loop):
    """/metrics in the Prometheus text exposition format (version 0.0.4)."""
    out = []

    def metric(name, kind, about, samples):
        out.extend([f"# HELP nanoscale_{name} {about}", f"# TYPE nanoscale_{name} {kind}"])
        out.extend(f"nanoscale_{name}{labels} {value}" for labels, value in samples)
    metric("requests_waiting", "gauge", "Sequences queued for admission.",
           [("", h["waiting"] + h["held"])])
    metric("requests_running", "gauge", "Sequences in the running batch.", [("", h["running"])])
    metric("sequences_in_flight", "gauge", "Sequences submitted and not finished.",
           [("", h["in_flight"])])
    metric("kv_blocks", "gauge", "KV cache blocks by state.",
           [(f'{{state="{s}"}}', h[f"{s}_blocks"]) for s in ("used", "cached", "free")])
    for name, key, about in (("preemptions_total", "preemptions", "Recompute preemptions."),
                             ("aborts_total", "aborted", "Sequences aborted."),
                             ("failures_total", "failed", "Sequences failed in the engine."),
                             ("client_disconnects_total", "client_disconnects",
                              "Requests whose client went away."),
                             ("rejected_total", "rejected", "Requests answered 429."),
                             ("prefix_cache_hit_tokens_total", "cached_tokens",
                              "Prompt tokens served from the prefix cache."),
                             ("prompt_tokens_total", "prompt_tokens", "Prompt tokens admitted."),
                             ("generation_tokens_total", "output_tokens", "Tokens generated."),
                             ("steps_total", "steps", "Engine steps.")):
        metric(name, "counter", about, [("", h[key])])
    with loop.cond:
        histograms = [("time_to_first_token_seconds", loop.ttft, "Arrival to first token."),
                      ("inter_token_latency_seconds", loop.itl, "Between tokens.")]
        for name, hist, about in histograms:
            metric(name, "histogram", about, [])      # HELP and TYPE; the samples:
            out.extend(hist.lines(f"nanoscale_{name}"))
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------
# HTTP: a reader with deadlines, the handler, the server with its connection cap

class DeadlineReader:
    """The connection's input with one deadline for a whole read phase (request line +
    headers; then the body), not a timeout per recv: a client trickling a byte a second
    gets TimeoutError at the deadline. readline/read as http.server expects of rfile."""

    def __init__(self, sock):
        self.sock, self.buf, self.deadline = sock, bytearray(), math.inf

    def deadline_in(self, seconds):
        self.deadline = time.monotonic() + seconds

    def _fill(self):
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the client took too long to send its request")
        self.sock.settimeout(left)
        try:
            chunk = self.sock.recv(65536)
        finally:
            self.sock.settimeout(WRITE_TIMEOUT)
        self.buf += chunk
        return bool(chunk)

    def readline(self, limit=-1):
        while self.buf.find(b"\n") < 0 and (limit < 0 or len(self.buf) < limit) and self._fill():
            pass
        end = self.buf.find(b"\n") + 1 or len(self.buf)
        return self._take(end if limit < 0 else min(end, limit))

    def read(self, n):
        while len(self.buf) < n and self._fill():
            pass
        return self._take(min(n, len(self.buf)))

    def _take(self, n):
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def close(self):
        pass


def _no_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        raise ValueError("duplicate keys in an object (which one counts is ambiguous)")
    return dict(pairs)


def _depth(obj, limit):
    """Nesting depth of a parsed body, counting no further than limit + 1."""
    if limit < 0 or not isinstance(obj, (dict, list)):
        return 0
    children = obj.values() if isinstance(obj, dict) else obj
    return 1 + max((_depth(c, limit - 1) for c in children), default=0)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"   # a garbled request line still gets a status line
    server_version = "nanoscale-serve"
    timeout = WRITE_TIMEOUT

    def setup(self):
        super().setup()
        self.rfile = DeadlineReader(self.connection)

    def log_message(self, fmt, *args):
        if self.server.verbose:
            super().log_message(fmt, *args)

    # -- one request ----------------------------------------------------------------------
    def handle_one_request(self):
        """Read a request within the header deadline and answer it. Every error becomes a
        JSON answer (or, for a client that left or never spoke, a closed connection)."""
        srv, self.raw_requestline, self.command = self.server, b"", None
        srv.track(self.connection, reading=True)
        self.rfile.deadline_in(srv.header_timeout)
        try:
            self.raw_requestline = self.rfile.readline(MAX_REQUEST_LINE + 1)
            if not self.raw_requestline:
                self.close_connection = True
            elif len(self.raw_requestline) > MAX_REQUEST_LINE:
                self.requestline, self.request_version = "", "HTTP/1.0"
                self.send_error(414, f"request line over {MAX_REQUEST_LINE} bytes")
            elif self.parse_request():              # else it answered (send_error below)
                self.route()
        except ApiError as e:
            self.send_error_json(e)
        except TimeoutError:
            if self.raw_requestline or self.rfile.buf:
                self.send_error_json(ApiError(408, "the request did not arrive in time"))
            self.close_connection = True
        except (ClientGone, ConnectionError):
            self.close_connection = True
        except Exception as e:                      # a bug: answer 500, keep serving
            traceback.print_exc()
            self.send_error_json(ApiError(500, f"internal error: {type(e).__name__}"))

    def send_error(self, code, message=None, explain=None):
        """The standard library's own refusals (bad request line or version, header line
        too long, too many headers) in the same JSON shape as ours."""
        self.send_error_json(ApiError(int(code), message or HTTPStatus(code).phrase))

    def send_json(self, status, obj, close=False, headers=()):
        self.send_body(status, json.dumps(obj).encode(), "application/json", close, headers)

    def send_body(self, status, body, content_type, close=False, headers=()):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in dict(headers).items():
            self.send_header(key, value)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":                  # a HEAD answer has no body (RFC 9110)
            self.wfile.write(body)

    def send_error_json(self, e):
        # close the connection after an error: the body may not have been read
        try:
            self.send_json(e.status, {"error": {"message": str(e), "type": e.type,
                                                "param": e.param, "code": e.code}},
                           close=True, headers=e.headers)
        except OSError:
            self.close_connection = True

    def route(self):
        path = urlsplit(self.path).path
        if len(self.requestline.split()) != 3:
            raise ApiError(400, "HTTP/0.9 requests are not supported")
        if self.command == "GET":
            self.server.track(self.connection, reading=False)
            return self.get(path)
        if self.command != "POST":
            raise ApiError(405, f"method {shorten(self.command)[1:-1]} not allowed: use GET "
                                f"or POST", headers={"Allow": "GET, POST"})
        if path not in ("/v1/completions", "/v1/chat/completions"):
            raise ApiError(404, f"no route {shorten(path)}")
        body = self.read_json()
        self.server.track(self.connection, reading=False)    # busy: not evictable
        self.completion(body, chat=path == "/v1/chat/completions")

    def get(self, path):
        srv = self.server
        if path == "/health":
            self.send_json(200, srv.loop.health())
        elif path == "/metrics":
            body = render_metrics({**srv.loop.health(), **srv.conn_stats()}, srv.loop).encode()
            self.send_body(200, body, "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            # the base, then each adapter with its parent (vLLM's listing of LoRA modules)
            self.send_json(200, {"object": "list", "data": [{
                "id": name, "object": "model", "created": srv.created, "owned_by": "nanoscale",
                "max_model_len": srv.context, "root": srv.model_name,
                "parent": None if name == srv.model_name else srv.model_name}
                for name in [srv.model_name, *srv.adapters]]})
        elif path in ("/v1/completions", "/v1/chat/completions"):
            raise ApiError(405, f"use POST for {path}", headers={"Allow": "POST"})
        else:
            raise ApiError(404, f"no route {shorten(path)}")

    def read_json(self):
        h, srv = self.headers, self.server
        lengths = h.get_all("Content-Length") or []
        if h.get("Transfer-Encoding") is not None:
            raise ApiError(400 if lengths else 411, "Transfer-Encoding (a chunked body) is "
                                                    "not supported: send a Content-Length")
        if not lengths:
            raise ApiError(411, "a Content-Length header is required")
        length = lengths[0].strip()
        if len(lengths) > 1 or not (length.isascii() and length.isdigit()) or len(length) > 15:
            raise ApiError(400, "Content-Length must be one number in ASCII digits")
        if int(length) > srv.max_body_bytes:
            raise ApiError(413, f"request body of {length} bytes is over the "
                                f"{srv.max_body_bytes}-byte limit")
        self.rfile.deadline_in(srv.body_timeout)
        raw = self.rfile.read(int(length))
        if len(raw) < int(length):
            raise ClientGone()
        try:
            body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant,
                              object_pairs_hook=_no_duplicates)
        except UnicodeDecodeError:
            raise ApiError(400, "the body is not UTF-8") from None
        except RecursionError:
            raise ApiError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
        except ValueError as e:             # JSONDecodeError, ours, an int over 4300 digits
            raise ApiError(400, f"invalid JSON: {shorten(str(e))[1:-1]}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if _depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise ApiError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        return body

    # -- the completion endpoints ---------------------------------------------------------
    def completion(self, body, chat):
        srv = self.server
        plan = parse_request(body, chat, srv)
        sids, q = srv.loop.submit(plan.choices)
        head = response_head(chat, plan.model)
        try:
            (self.stream if plan.stream else self.respond)(plan, q, head)
        except (ClientGone, ConnectionError):
            srv.loop.abort(sids, disconnected=True)     # free its blocks now
            raise
        except BaseException:
            srv.loop.abort(sids)
            raise

    def client_gone(self):
        """Has the client closed its end? (Readable with nothing to read = EOF.)"""
        if self.rfile.buf:
            return False
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def updates(self, q, n):
        """The engine's updates for this request until its n choices have finished;
        ClientGone as soon as the client is seen to have left."""
        checked = time.monotonic()
        while n:
            try:
                up = q.get(timeout=POLL_S)
            except queue.Empty:
                up = None
            if time.monotonic() - checked >= POLL_S:      # (updates may never pause)
                checked = time.monotonic()
                if self.client_gone():
                    raise ClientGone()
            if up is None:
                continue
            if up.error:
                raise up.error
            n -= up.finish_reason is not None
            yield up

    def respond(self, plan, q, head):
        enc = self.server.enc
        outs = [dict(ids=[], lps=[], finish=None, text="") for _ in plan.choices]
        scored = {}                                   # prompt index -> its log-probs
        for up in self.updates(q, len(plan.choices)):
            o = outs[up.index]
            o["ids"] += up.tokens
            o["lps"] += up.logprobs
            if up.prompt_logprobs is not None:
                scored[plan.group[up.index]] = up.prompt_logprobs
            if up.finish_reason:
                o["finish"], o["text"] = up.finish_reason, up.text
        choices = [answer_choice(enc, plan, k, o, scored) for k, o in enumerate(outs)]
        self.send_json(200, {**head, "choices": choices, "usage": usage(plan, outs)})

    def stream(self, plan, q, head):
        """Server-sent events: `data: {chunk}\\n\\n` per piece of a choice's text, then
        `data: [DONE]`. Text is released only when it cannot change: incomplete UTF-8
        (U+FFFD at the end) and the last len(longest stop string) - 1 characters are held
        back. Log-probs go out with the first event after their token arrives."""
        enc = self.server.enc
        head = {**head, "object": "chat.completion.chunk" if plan.chat else "text_completion"}
        hold = max((len(s) for s in plan.stop), default=1) - 1
        # with tools on offer, the answer may be a call, known only once it is whole: its
        # text is held to the end, then sent as delta.tool_calls or as content
        calls = plan.tools is not None and plan.tools["choice"] != "none"
        outs = [dict(ids=[], lps=[], sent=0, lp_sent=0, offset=0, started=False)
                for _ in plan.choices]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")       # the body ends when the socket does
        self.close_connection = True
        self.end_headers()
        if plan.chat:
            for k in range(len(plan.choices)):
                self.sse(stream_chunk(enc, plan, head, k, role=True))
        scored = {}
        try:
            for up in self.updates(q, len(plan.choices)):
                o, k = outs[up.index], up.index
                if up.prompt_logprobs is not None:
                    scored[plan.group[k]] = up.prompt_logprobs
                prefix, entries = "", []
                if not o["started"] and plan.echo:    # the prompt first (its log-probs:
                    ids = plan.prompts[plan.group[k]]  # the first choice's prefill has run)
                    prefix = decode_tokens(enc, ids)
                    entries = prompt_entries(ids, scored.get(plan.group[k], ()))
                o["started"] = True
                o["ids"] += up.tokens
                o["lps"] += up.logprobs
                text = up.text if up.finish_reason else decode_tokens(enc, o["ids"])
                safe = len(text) if up.finish_reason else 0 if calls else \
                    len(text.rstrip("\ufffd")) - hold
                call = tool_call_of(text, plan.tools) if calls and \
                    up.finish_reason == "stop" else None
                if call is not None:
                    self.sse(stream_chunk(enc, plan, head, k, call=call))
                    self.sse(stream_chunk(enc, plan, head, k, finish="tool_calls"))
                    continue
                delta = text[o["sent"]:safe] if safe > o["sent"] else ""
                o["sent"] = max(o["sent"], safe)
                entries += o["lps"][o["lp_sent"]:]
                o["lp_sent"] = len(o["lps"])
                if prefix or delta or (entries and plan.logprobs is not None):
                    self.sse(stream_chunk(enc, plan, head, k, prefix + delta, entries, o))
                if up.finish_reason:
                    self.sse(stream_chunk(enc, plan, head, k, finish=up.finish_reason))
            if plan.include_usage:
                self.sse({**head, "choices": [], "usage": usage(plan, outs)})
        except ApiError as e:
            self.sse({"error": {"message": str(e), "type": e.type}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def sse(self, obj):
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


class Server(http.server.ThreadingHTTPServer):
    """One thread per connection, at most max_connections of them. The oldest connection
    still sending its request (idle keep-alive or slow) is evicted for a newcomer; only if
    every connection is busy being answered is the newcomer refused (503)."""
    daemon_threads = True
    request_queue_size = 1024      # listen() backlog: a burst of clients is not reset

    def __init__(self, engine, enc, host, port, model_name, max_body_bytes, max_tokens_cap,
                 verbose, max_connections, header_timeout, body_timeout, allow_priority):
        """Not bound yet (make_server binds it); what the handlers and
        openai_api.parse_request read as `self.server` / `srv`."""
        super().__init__((host, port), Handler, bind_and_activate=False)
        self.conns, self.conn_lock = OrderedDict(), threading.Lock()
        self.conn_counts = dict(evicted=0, refused=0)
        self.loop = None                # the engine's thread: started once bound (start)
        self.enc, self.model_name, self.verbose = enc, model_name, verbose
        # the LoRA adapters the engine serves beside the base (serve.py --lora), by name
        self.adapters = engine.lora.adapter_set.names[1:] if engine.lora is not None else []
        self.context, self.vocab_size = engine.cfg.block_size, engine.cfg.vocab_size
        self.max_body_bytes, self.created = max_body_bytes, int(time.time())
        self.max_tokens_cap = max_tokens_cap or engine.cfg.block_size
        self.max_connections, self.header_timeout, self.body_timeout = max_connections, \
            header_timeout, body_timeout
        self.allow_priority = allow_priority

    def start(self, engine, max_queue):
        """The engine thread (EngineLoop), started only once the port is ours."""
        self.loop = EngineLoop(engine, max_queue)

    def process_request(self, sock, addr):
        with self.conn_lock:
            room = len(self.conns) < self.max_connections or self._evict_oldest_reader()
            if room:
                self.conns[sock] = True                  # reading its request
            else:
                self.conn_counts["refused"] += 1
        if room:
            return super().process_request(sock, addr)
        body = json.dumps({"error": {"message": "too many connections; retry", "type":
                                     "server_error", "param": None, "code": None}}).encode()
        try:
            sock.settimeout(1)
            sock.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json"
                         b"\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
        except OSError:
            pass
        self.shutdown_request(sock)

    def _evict_oldest_reader(self):
        for sock, reading in self.conns.items():          # oldest first
            if reading:
                del self.conns[sock]
                self.conn_counts["evicted"] += 1
                try:
                    sock.shutdown(socket.SHUT_RDWR)        # its reader sees EOF and ends
                except OSError:
                    pass
                return True
        return False

    def track(self, sock, reading):
        """A connection's phase: reading a request (evictable) or being answered."""
        with self.conn_lock:
            if sock in self.conns:
                self.conns[sock] = reading
                self.conns.move_to_end(sock)

    def shutdown_request(self, sock):
        with self.conn_lock:
            self.conns.pop(sock, None)
        super().shutdown_request(sock)

    def conn_stats(self):
        with self.conn_lock:
            return {"connections_open": len(self.conns), **self.conn_counts}

    def handle_error(self, request, client_address):
        print(f"connection from {client_address[0]}: {sys.exc_info()[1]!r}", file=sys.stderr)


def make_server(engine, enc, host="127.0.0.1", port=8000, model_name="nanoscale",
                max_body_bytes=1 << 20, max_tokens_cap=None, max_queue=256, verbose=False,
                max_connections=256, header_timeout=10.0, body_timeout=30.0,
                allow_priority=False):
    """Bind (127.0.0.1 unless told otherwise: serving to a network is a decision), start
    the engine thread. Call serve_forever() on the result; shutdown() + loop.stop()."""
    try:
        srv = Server(engine, enc, host, port, model_name, max_body_bytes, max_tokens_cap,
                     verbose, max_connections, header_timeout, body_timeout, allow_priority)
        srv.server_bind()
        srv.server_activate()
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is already in use: stop the other "
                            f"server or pick another --port") from None
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    srv.start(engine, max_queue)
    return srv


# The server's knobs, a row each (serve.py's parser shows them under "server")
SERVER_KNOBS = [
    knob("--host", "127.0.0.1", "interface to bind (0.0.0.0 exposes the server to the network)"),
    knob("--port", 8000, "TCP port (0 = any free one)"),
    knob("--model-name", "nanoscale", "the id /v1/models lists"),
    knob("--max-body-bytes", 1 << 20, "413 above this"),
    knob("--max-tokens-cap", 0, "400 if max_tokens is above this (0 = the context length)"),
    knob("--max-queue", 256, "429 when this many sequences wait beyond max-num-seqs"),
    knob("--max-connections", 256, "open connections at most (the oldest idle one is evicted "
                                   "first)"),
    knob("--header-timeout", 10.0, "seconds for the request line + headers to arrive (in "
                                   "total)"),
    knob("--body-timeout", 30.0, "seconds for the body to arrive (in total)"),
    knob("--allow-client-priority", False, "accept 'priority' from clients (the SLO policy's "
                                           "queue order)"),
    knob("--verbose", False, "log every HTTP request"),
]


def _interrupt(*_):
    raise KeyboardInterrupt


def run_server(args, engine, enc):
    """`python serve.py ...`: the engine (built by serve.py) behind the HTTP server until
    Ctrl-C."""
    if not 0 <= args.port <= 65535 or min(args.max_connections, args.max_body_bytes) < 1 \
            or min(args.header_timeout, args.body_timeout) <= 0 or args.max_queue < 0:
        raise UserError("--port must be in [0, 65535]; --max-connections, --max-body-bytes "
                        "and the timeouts positive; --max-queue >= 0")
    srv = make_server(engine, enc, args.host, args.port, args.model_name, args.max_body_bytes,
                      args.max_tokens_cap, args.max_queue, args.verbose, args.max_connections,
                      args.header_timeout, args.body_timeout, args.allow_client_priority)
    host, port = srv.server_address[:2]
    adapters = f" + LoRA adapters {', '.join(srv.adapters)}" if srv.adapters else ""
    print(f"serving {args.checkpoint} as {args.model_name!r}{adapters} on http://{host}:{port}/v1 "
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
        print(f"\nledger: {st['finished']} sequences, {st['output_tokens']} tokens in "
              f"{st['steps']} steps, {st['aborted']} aborted, {st['failed']} failed, "
              f"{st['preemptions']} preemptions, prefix-cache hits {st['cached_tokens']}/"
              f"{st['prompt_tokens']} prompt tokens, peak {st['peak_blocks']}/"
              f"{args.num_blocks} KV blocks")
