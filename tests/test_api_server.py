"""The HTTP layer (api_server.py) and the protocol it speaks (openai_api.py) over real
sockets on 127.0.0.1: hostile and malformed input, isolation of a poisoned request,
idle/slow connections, disconnects, the OpenAI parameters (checked against the engine and
the model), /metrics."""
import concurrent.futures
import http.client
import json
import math
import re
import socket
import threading
import time

import pytest
import torch

from core import data
from serving import openai_api
from serving.api_server import make_server
from model import GPT, get_config
from serve import Engine, SamplingParams, decode_tokens

POISON = "POISON!"


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread


def byte_encoding():
    return data.make_encoding({bytes([i]): i for i in range(256)})


def server_model(enc):
    """Tiny, random, 256-token context, <|endoftext|> logit pinned to 0 (greedy runs to
    max_tokens)."""
    model = GPT(get_config("tiny", vocab_size=enc.n_vocab, block_size=256), seed=4).eval()
    with torch.no_grad():
        model.output.weight[enc.eot_token] = 0
    return model


def poison_hook(enc):
    """The engine's fault seam: any step that includes a prompt starting with POISON
    raises in the forward (as a bug triggered by one request's data would)."""
    marker = enc.encode_ordinary(POISON)

    def hook(stage, seqs):
        if stage == "forward" and any(s.tokens[:len(marker)] == marker for s in seqs):
            raise RuntimeError("poisoned request")
    return hook


def start(model=None, engine_kw=None, **kw):
    enc = byte_encoding()
    model = model or server_model(enc)
    eng = Engine(model, enc, **{**dict(block_size=8, num_blocks=600, max_num_seqs=32,
                                       fault_hook=poison_hook(enc)), **(engine_kw or {})})
    srv = make_server(eng, enc, "127.0.0.1", 0, **{**dict(model_name="tiny",
                                                          max_body_bytes=16384,
                                                          max_tokens_cap=200), **kw})
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.model, srv.enc, srv.port = model, enc, srv.server_address[1]
    return srv


def stop(srv):
    srv.shutdown()
    srv.server_close()
    srv.loop.stop()


@pytest.fixture(scope="module")
def server():
    srv = start(header_timeout=1.0, body_timeout=1.0)
    yield srv
    stop(srv)


def post(srv, path, body, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers=headers or {})
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), json.loads(r.read())
    conn.close()
    return out


def get(srv, path):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("GET", path)
    r = conn.getresponse()
    out = r.status, r.read()
    conn.close()
    return out[0], json.loads(out[1]) if path != "/metrics" else out[1].decode()


def raw(srv, data, timeout=10):
    """Send raw bytes, read until the server closes -> (status or None, headers, body)."""
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)
    try:
        s.sendall(data)
        chunks = []
        while True:
            try:
                c = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not c:
                break
            chunks.append(c)
    finally:
        s.close()
    resp = b"".join(chunks)
    if not resp:
        return None, {}, b""
    head, _, body = resp.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def sse(srv, path, body):
    """POST with stream: true -> the list of events (JSON), checking [DONE] ends it."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}))
    r = conn.getresponse()
    assert r.status == 200
    lines = [ln for ln in r.read().decode().split("\n\n") if ln]
    conn.close()
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def wait_idle(srv, timeout=20):
    t = time.time()
    while time.time() - t < timeout:
        h = srv.loop.health()
        if h["running"] == 0 and h["waiting"] == 0 and h["in_flight"] == 0:
            return h
        time.sleep(0.02)
    raise AssertionError(f"server not idle: {h}")


def ids_of(enc, tokens):
    """OpenAI token strings back to ids (byte tokenizer: one byte per token)."""
    out = []
    for t in tokens:
        if t.startswith("bytes:"):
            b = bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", t))
        else:
            b = t.encode()
        out.append(enc.eot_token if b == b"<|endoftext|>" else enc.encode_single_token(b))
    return out


def log_softmax(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0][0].float(), -1)


# ----------------------------------------------------------------------------------------
# Hostile input: >= 60 distinct malformed requests, each a 4xx JSON answer

def req(body=b"", method="POST", path="/v1/completions", headers=None, length=True):
    body = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"Host": "x", **({"Content-Length": str(len(body))} if length else {}),
         **(headers or {})}
    return (f"{method} {path} HTTP/1.1\r\n".encode()
            + b"".join(f"{k}: {v}\r\n".encode() for k, v in h.items()) + b"\r\n" + body)


OK = {"prompt": "x", "max_tokens": 2}
def nested_schema(depth):
    """An object schema `depth` objects deep: past serving/structured.py's MAX_DEPTH (32)."""
    schema = {"type": "boolean"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP_SCHEMA = nested_schema(40)
HOSTILE = [
    # the request line and the protocol
    (b"GARBAGE\r\n\r\n", 400), (b"GET\r\n\r\n", 400), (b"GET / HTTP/1.1 extra\r\n\r\n", 400),
    (b"GET / HTTX/1.1\r\n\r\n", 400), (b"GET / HTTP/1\r\n\r\n", 400),
    (b"GET / HTTP/a.b\r\n\r\n", 400), (b"GET /health\r\n\r\n", 400),      # HTTP/0.9
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET / HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n", 431),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"X%d: y\r\n" % i for i in range(120)) + b"\r\n", 431),
    # methods other than GET/POST, on any path
    (req(method="PUT"), 405), (req(method="DELETE", path="/v1/models"), 405),
    (req(method="PATCH"), 405), (req(method="OPTIONS", path="*"), 405),
    (req(method="TRACE", path="/"), 405), (req(method="CONNECT", path="x:443"), 405),
    (req(method="BREW", path="/pot"), 405), (req(method="get", path="/health"), 405),
    # paths
    (req(OK, path="/v1/nothing"), 404), (req(OK, path="/"), 404),
    (req(method="GET", path="/v1/completions"), 405), (req(method="GET", path="/admin"), 404),
    (req(OK, path="/v1/completions/../models"), 404),
    # headers that lie or are missing
    (req(OK, length=False), 411),
    (req(OK, length=False, headers={"Content-Length": "\u0663"}), 400),       # Arabic 3
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: \xb2\r\n\r\nab", 400),  # latin-1 ²
    (req(OK, length=False, headers={"Content-Length": "-5"}), 400),
    (req(OK, length=False, headers={"Content-Length": "1e3"}), 400),
    (req(OK, length=False, headers={"Content-Length": "99999999999999999999"}), 400),
    (req(OK, length=False, headers={"Content-Length": "20000"}), 413),
    (req(OK, headers={"Content-Length": "3"}), 400),                          # doubled
    (req(OK, length=False, headers={"Transfer-Encoding": "chunked"}), 411),
    (req(OK, headers={"Transfer-Encoding": "chunked"}), 400),                 # smuggling
    (req(b'{"prompt": "x"', length=False, headers={"Content-Length": "40"}), 408),  # short
    # bodies that are not a JSON object
    (req(b""), 400), (req(b"{"), 400), (req(b'{"prompt": "x",}'), 400), (req(b"null"), 400),
    (req(b"[1, 2]"), 400), (req(b'"text"'), 400), (req(b"\xff\xfe{}"), 400),
    (req('{"prompt": "x"}'.encode("utf-16")), 400), (req(b'{"prompt": NaN}'), 400),
    (req(b'{"prompt": "x", "temperature": Infinity}'), 400),
    (req(b'{"prompt": "x", "prompt": "y"}'), 400),                            # duplicate
    (req(b"[" * 2000 + b"]" * 2000), 400), (req(b'{"a":' * 40 + b"1" + b"}" * 40), 400),
    (req(b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"), 400),
    (req(b'{"prompt": "\\ud800"}'), 400),                                     # surrogate
    # fields: types, ranges, refused, unknown
    (req(b'{"prompt": "x", "temperature": 1e400}'), 400), (req({"prompt": "x", "top_p": 0}), 400),
    (req({"prompt": "x", "temperature": 2.5}), 400), (req({"prompt": "x", "n": 17}), 400),
    (req({"prompt": "x", "logprobs": 21}), 400), (req({"prompt": "x", "logprobs": True}), 400),
    (req({"prompt": "x", "max_tokens": 0}), 400),
    (req({"prompt": "x", "presence_penalty": -3}), 400),
    (req({"prompt": "x", "logit_bias": {"abc": 1}}), 400),
    (req({"prompt": "x", "logit_bias": {"5": 101}}), 400),
    (req({"prompt": "x", "stop_token_ids": [9999]}), 400),
    (req({"prompt": "x", "min_tokens": 5, "max_tokens": 2}), 400),
    (req({"prompt": "x", "stream_options": {"include_usage": True}}), 400),
    (req({"prompt": "x", "max_tokens": 3, "max_completion_tokens": 4}), 400),
    (req({"prompt": [[]]}), 400), (req({"prompt": []}), 400),
    (req({"prompt": "x", "tools": [{"type": "function"}]}), 400),
    # structured output: what the automaton cannot honour is a 400 naming why
    (req({"prompt": "x", "response_format": {"type": "xml"}}), 400),
    (req({"prompt": "x", "response_format": {"type": "json_schema"}}), 400),
    (req({"prompt": "x", "guided_json": {"type": "object", "patternProperties": {}}}), 400),
    (req({"prompt": "x", "guided_json": DEEP_SCHEMA}), 400),
    (req({"prompt": "x", "guided_json": {"enum": list(range(300))}}), 400),
    (req({"prompt": "x", "guided_regex": "(a"}), 400),
    (req({"prompt": "x", "guided_choice": "yes"}), 400),
    (req({"prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}}), 400),
    (req({"prompt": "x", "suffix": "end"}), 400), (req({"prompt": "x", "best_of": 3}), 400),
    (req({"prompt": "x", "priority": -10}), 400), (req({"prompt": "x", "frobnicate": 1}), 400),
    (req({"prompt": "x", "echo": True}, path="/v1/chat/completions"), 400),
    (req({"messages": [{"role": "tool", "content": "x"}]}, path="/v1/chat/completions"), 400),
    (req({"messages": [{"role": "user", "content": "x", "name": "a"}]},
         path="/v1/chat/completions"), 400),
    (req({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
         path="/v1/chat/completions"), 400),
]


def test_hostile_requests_each_get_a_json_4xx_and_the_server_answers_the_same_after(server):
    assert len(HOSTILE) >= 60 and len(set(h for h, _ in HOSTILE)) == len(HOSTILE)
    status, _, before = post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 8,
                                                         "temperature": 0})
    assert status == 200
    print(f"\nhostile requests: {len(HOSTILE)} + HEAD, statuses "
          f"{sorted(set(w for _, w in HOSTILE))}")
    for data_, want in HOSTILE:
        status, headers, body = raw(server, data_)
        assert status == want, (data_[:80], status, body[:200])
        assert headers.get("content-type") == "application/json", (data_[:80], headers)
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["type"], err
    status, headers, body = raw(server, req(method="HEAD", path="/health"))
    assert status == 405 and headers["allow"] == "GET, POST" and body == b""   # no body
    status, _, after = post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 8,
                                                        "temperature": 0})
    assert status == 200 and after["choices"] == before["choices"]
    assert after["usage"] == before["usage"]
    h = wait_idle(server)
    assert h["used_blocks"] == 0 and h["failed"] == 0


def test_refused_fields_are_named():
    srv = start()
    try:
        for field, value in (("tools", []), ("tool_choice", "auto"), ("response_format", {}),
                             ("suffix", "x"), ("zzz", 1), ("priority", 1)):
            status, _, err = post(srv, "/v1/completions", {"prompt": "x", field: value})
            assert status == 400 and err["error"]["param"] == field, (field, err)
            assert field in err["error"]["message"]
        srv.allow_priority = True         # what --allow-client-priority sets
        assert post(srv, "/v1/completions", {"prompt": "x", "priority": 1})[0] == 200
    finally:
        stop(srv)


def test_every_refused_field_is_refused_with_its_reason_and_listed(capsys):
    """openai_api.REFUSED is the contract: each of its fields gets a 400 naming it and
    saying why, and `python openai_api.py` lists it with that reason."""
    srv = start()
    try:
        for field, why in openai_api.REFUSED.items():
            status, _, err = post(srv, "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "x"}], field: 1})
            assert status == 400 and err["error"]["param"] == field, (field, err)
            assert why in err["error"]["message"], (field, err)
    finally:
        stop(srv)
    openai_api.main([])
    out = capsys.readouterr().out
    for field, why in openai_api.REFUSED.items():
        assert f"  {field}: {why}\n" in out


# ----------------------------------------------------------------------------------------
# Isolation: a poisoned request among concurrent healthy ones

def test_a_poisoned_request_fails_alone_among_concurrent_healthy_ones(server):
    prompts = [f"healthy {i}: " for i in range(8)]
    body = {"max_tokens": 24, "temperature": 0}
    alone = [post(server, "/v1/completions", {**body, "prompt": p})[2]["choices"][0]["text"]
             for p in prompts]
    failed_before = server.loop.health()["failed"]
    retries_before = server.loop.health()["isolation_retries"]
    go = threading.Barrier(9)

    def one(prompt):
        go.wait()
        return post(server, "/v1/completions", {**body, "prompt": prompt})

    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        results = list(pool.map(one, prompts[:4] + [POISON + " x"] + prompts[4:]))
    poisoned = results.pop(4)
    assert poisoned[0] == 500 and "poisoned request" in poisoned[2]["error"]["message"]
    assert [r[0] for r in results] == [200] * 8
    assert [r[2]["choices"][0]["text"] for r in results] == alone
    h = wait_idle(server)
    print(f"\nisolation: poisoned request -> {poisoned[0]}; healthy 8/8 identical to alone; "
          f"{h['isolation_retries'] - retries_before} isolation retries")
    assert h["failed"] == failed_before + 1 and h["isolation_retries"] > retries_before
    assert h["used_blocks"] == 0


# ----------------------------------------------------------------------------------------
# Idle and slow connections; disconnects

def test_hundreds_of_idle_and_slow_connections_do_not_starve_a_request():
    """300 hostile connections against a cap of 16: 100 silent, 100 trickling a request
    line, 100 sending headers and half a body. A normal request is still answered, its
    text unchanged; the hostile ones are evicted (oldest first) or timed out."""
    srv = start(max_connections=16, header_timeout=1.0, body_timeout=1.0)
    try:
        want = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 5,
                                             "temperature": 0})[2]["choices"]
        socks = []
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            if i % 3 == 1:
                s.sendall(b"POST /v1/comp")
            elif i % 3 == 2:
                s.sendall(req(b'{"prompt": "x"', length=False,
                              headers={"Content-Length": "30"}))
            socks.append(s)
        t = time.perf_counter()
        status, _, body = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 5,
                                                        "temperature": 0})
        latency = time.perf_counter() - t
        assert status == 200 and body["choices"] == want
        closed = 0
        for s in socks:                       # every hostile socket ends (EOF or a 408)
            try:
                data_ = s.recv(4096)
                closed += data_ == b"" or b" 408 " in data_ or b" 503 " in data_
            except (ConnectionResetError, socket.timeout):
                closed += 1
            s.close()
        stats = srv.conn_stats()
        print(f"\n300 hostile connections, cap 16: normal request answered in "
              f"{latency * 1e3:.0f} ms; evicted {stats['evicted']}, refused {stats['refused']}")
        assert closed == 300 and stats["evicted"] >= 300 - 16
    finally:
        stop(srv)


def test_a_non_streaming_client_that_disconnects_is_aborted_and_its_blocks_freed(server):
    h0 = wait_idle(server)
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(req({"prompt": "a long answer", "max_tokens": 200, "temperature": 0}))
    t = time.time()
    while server.loop.health()["used_blocks"] == 0:
        assert time.time() - t < 20
        time.sleep(0.005)
    s.close()                                  # gone before its answer is ready
    h = wait_idle(server)
    assert h["client_disconnects"] == h0["client_disconnects"] + 1
    assert h["aborted"] == h0["aborted"] + 1 and h["used_blocks"] == 0
    generated = h["output_tokens"] - h0["output_tokens"]
    print(f"\ndisconnect: aborted after {generated} of 200 tokens")
    assert generated < 200
    server.loop.engine.alloc.check(tables=[])


def test_429_carries_retry_after():
    srv = start(engine_kw=dict(max_num_seqs=1), max_queue=0)
    try:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        s.sendall(req({"prompt": "x", "max_tokens": 200, "temperature": 0}))
        t = time.time()
        while srv.loop.health()["in_flight"] < 1:
            assert time.time() - t < 20
            time.sleep(0.005)
        status, headers, err = post(srv, "/v1/completions", {"prompt": "y"})
        assert status == 429 and headers["Retry-After"] == "1"
        assert err["error"]["type"] == "rate_limit_error"
        s.close()
    finally:
        stop(srv)


# ----------------------------------------------------------------------------------------
# The OpenAI parameters

def test_n_and_a_list_of_prompts_share_prefix_blocks_and_equal_the_engine(server):
    enc, model = server.enc, server.model
    body = {"prompt": ["shared prefix of forty characters, then A", "B"], "n": 3,
            "max_tokens": 6, "temperature": 0.9, "seed": 7}
    cached0 = server.loop.health()["cached_tokens"]
    status, _, r = post(server, "/v1/completions", body)
    assert status == 200 and [c["index"] for c in r["choices"]] == list(range(6))
    eng = Engine(model, enc, block_size=8, num_blocks=100)
    n_tokens = 0
    for k, c in enumerate(r["choices"]):
        prompt = body["prompt"][k // 3]
        want = eng.generate([prompt], SamplingParams(max_tokens=6, temperature=0.9,
                                                     seed=7 + k % 3))[0]
        assert c["text"] == want.text and c["finish_reason"] == want.finish_reason, k
        n_tokens += len(want.output_ids)
    ids = enc.encode_ordinary(body["prompt"][0])
    # choices 2 and 3 of the long prompt hit its full blocks (the last token recomputed)
    assert server.loop.health()["cached_tokens"] - cached0 >= 2 * ((len(ids) - 1) // 8 * 8)
    assert r["usage"]["prompt_tokens"] == len(ids) + 1
    assert r["usage"]["completion_tokens"] == n_tokens


@pytest.mark.parametrize("chat", [False, True])
def test_logprobs_equal_log_softmax_of_the_model_logits(server, chat):
    enc, model = server.enc, server.model
    if chat:
        body = {"messages": [{"role": "user", "content": "score me"}], "logprobs": True,
                "top_logprobs": 3, "max_completion_tokens": 7, "temperature": 0}
        prompt = enc.encode_ordinary("### User:\nscore me\n\n### Assistant:\n")
    else:
        body = {"prompt": "score me", "logprobs": 3, "max_completion_tokens": 7,
                "temperature": 0.7, "seed": 1}
        prompt = enc.encode_ordinary("score me")
    status, _, r = post(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert status == 200
    lp = r["choices"][0]["logprobs"]
    if chat:
        out = [enc.eot_token if bytes(e["bytes"]) == b"<|endoftext|>" else
               enc.encode_single_token(bytes(e["bytes"])) for e in lp["content"]]
        values = [e["logprob"] for e in lp["content"]]
        tops = [[(enc.encode_single_token(bytes(t["bytes"])), t["logprob"])
                 for t in e["top_logprobs"]] for e in lp["content"]]
    else:
        out = ids_of(enc, lp["tokens"])
        values = lp["token_logprobs"]
        tops = [[(ids_of(enc, [t])[0], v) for t, v in d.items()] for d in lp["top_logprobs"]]
    assert len(out) == r["usage"]["completion_tokens"] == 7
    ref = log_softmax(model, prompt + out)
    for i, (tok, v, top) in enumerate(zip(out, values, tops)):
        row = ref[len(prompt) - 1 + i]
        assert abs(v - row[tok].item()) < 1e-5
        want = row.topk(3)
        got = sorted(top, key=lambda x: -x[1])
        if len({t for t, _ in got}) == 3:      # (distinct names: no byte collision)
            assert [t for t, _ in got] == want.indices.tolist()
            assert max(abs(a - b) for (_, a), b in zip(got, want.values.tolist())) < 1e-5


def test_echo_scores_the_prompt_with_max_tokens_0(server):
    """echo + logprobs + max_tokens 0: the prompt's log-probs (calibration through the
    API); the first token has none."""
    enc, model = server.enc, server.model
    text = "the quick brown fox"
    status, _, r = post(server, "/v1/completions", {"prompt": text, "echo": True,
                                                    "logprobs": 0, "max_tokens": 0})
    assert status == 200
    c = r["choices"][0]
    assert c["text"] == text and c["finish_reason"] == "length"
    ids = enc.encode_ordinary(text)
    assert ids_of(enc, c["logprobs"]["tokens"]) == ids and c["logprobs"]["token_logprobs"][0] is None
    ref = log_softmax(model, ids)
    assert max(abs(v - ref[i, ids[i + 1]].item())
               for i, v in enumerate(c["logprobs"]["token_logprobs"][1:])) < 1e-5
    assert c["logprobs"]["text_offset"] == list(range(len(text)))


def test_penalties_bias_stop_token_ids_min_tokens_through_the_api_equal_the_engine(server):
    enc, model = server.enc, server.model
    eng = Engine(model, enc, block_size=8, num_blocks=100)
    prompt = "abcabc"
    first = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].output_ids
    cases = [dict(presence_penalty=1.2, frequency_penalty=0.8), dict(logit_bias={"65": 100}),
             dict(stop_token_ids=[first[3]]), dict(stop_token_ids=[first[3]], min_tokens=6),
             dict(frequency_penalty=-2.0, max_completion_tokens=12)]
    for case in cases:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, **case}
        status, _, r = post(server, "/v1/completions", body)
        assert status == 200, r
        params = SamplingParams(max_tokens=12, temperature=0,
                                presence_penalty=case.get("presence_penalty", 0.0),
                                frequency_penalty=case.get("frequency_penalty", 0.0),
                                logit_bias=tuple((int(k), float(v)) for k, v in
                                                 case.get("logit_bias", {}).items()),
                                stop_token_ids=tuple(case.get("stop_token_ids", ())),
                                min_tokens=case.get("min_tokens", 0))
        want = eng.generate([prompt], params)[0]
        assert r["choices"][0]["text"] == want.text, case
        assert r["choices"][0]["finish_reason"] == want.finish_reason, case
    assert post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 12,
                                            "logit_bias": {"65": 100},
                                            "temperature": 0})[2]["choices"][0]["text"] == "A" * 12
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                         "stop_token_ids": [first[3]]})[2]
    assert r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_n_logprobs_and_usage_equal_the_non_streaming_answer(server, chat):
    body = {"max_tokens": 10, "temperature": 0.8, "seed": 5, "n": 2, "logprobs": 2}
    if chat:
        body = {**body, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                "top_logprobs": 2}
    else:
        body = {**body, "prompt": "stream me", "echo": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    whole = post(server, path, body)[2]
    events = sse(server, path, {**body, "stream_options": {"include_usage": True}})
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    for k, c in enumerate(whole["choices"]):
        mine = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == k]
        assert mine[-1]["finish_reason"] == c["finish_reason"]
        if chat:
            text = "".join(m["delta"].get("content", "") for m in mine)
            lps = [x for m in mine if m["logprobs"] for x in m["logprobs"]["content"]]
            assert text == c["message"]["content"] and lps == c["logprobs"]["content"]
        else:
            text = "".join(m["text"] for m in mine)
            toks = [x for m in mine if m["logprobs"] for x in m["logprobs"]["tokens"]]
            offs = [x for m in mine if m["logprobs"] for x in m["logprobs"]["text_offset"]]
            assert text == c["text"] and toks == c["logprobs"]["tokens"]
            assert offs == c["logprobs"]["text_offset"]


# ----------------------------------------------------------------------------------------
# /metrics

def parse_prometheus(text):
    """The text exposition format: # HELP / # TYPE lines, then `name{labels} value`."""
    types, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z]+="[^"]*"\})? (\S+)', line)
            assert m, line
            samples[m[1] + (m[2] or "")] = float(m[3])
    for key in samples:
        base = re.sub(r"(_bucket|_sum|_count)?(\{.*\})?$", "", key)
        assert base in types or re.sub(r"\{.*\}$", "", key) in types, key
    return types, samples


def test_metrics_in_prometheus_text_format(server):
    post(server, "/v1/completions", {"prompt": "metrics", "max_tokens": 4})
    wait_idle(server)
    status, text = get(server, "/metrics")
    assert status == 200
    types, s = parse_prometheus(text)
    h = server.loop.health()
    assert types["nanoscale_time_to_first_token_seconds"] == "histogram"
    assert types["nanoscale_preemptions_total"] == "counter"
    assert s["nanoscale_requests_running"] == 0 and s["nanoscale_requests_waiting"] == 0
    assert sum(s[f'nanoscale_kv_blocks{{state="{k}"}}'] for k in ("used", "cached", "free")) \
        == h["num_blocks"]
    assert s['nanoscale_kv_blocks{state="cached"}'] == h["cached_blocks"]
    assert s["nanoscale_prefix_cache_hit_tokens_total"] == h["cached_tokens"]
    assert s["nanoscale_generation_tokens_total"] == h["output_tokens"]
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        buckets = [v for k, v in s.items() if k.startswith(f"nanoscale_{name}_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == s[f"nanoscale_{name}_count"] > 0
    assert not math.isnan(s["nanoscale_time_to_first_token_seconds_sum"])


def test_a_stream_cut_by_a_stop_string_equals_the_non_streamed_answer(server):
    """A stop string can span two tokens: the stream must hold back the characters that
    could begin it (len(stop) - 1 of them) until the next token settles whether the string
    is there, or the streamed text runs past the cut the non-streamed answer makes."""
    base = {"prompt": "def ", "max_tokens": 24, "temperature": 0.8}
    cut = 0
    for seed in range(6):
        free = post(server, "/v1/completions", {**base, "seed": seed, "logprobs": 0})[2]
        tokens = free["choices"][0]["logprobs"]["tokens"]
        # a two-character stop across a token boundary past the third token (two tokens
        # that are text, not "bytes:..." pieces of a character)
        text = lambda t: t and not t.startswith("bytes:")
        j = next((i for i in range(3, len(tokens) - 1) if text(tokens[i]) and
                  text(tokens[i + 1])), None)
        if j is None:
            continue
        body = {**base, "seed": seed, "stop": [tokens[j][-1] + tokens[j + 1][0]]}
        whole = post(server, "/v1/completions", body)[2]["choices"][0]
        streamed = "".join(e["choices"][0]["text"] for e in sse(server, "/v1/completions", body))
        assert streamed == whole["text"], (seed, body["stop"])
        cut += whole["finish_reason"] == "stop"
    assert cut >= 3                  # the stop string really cut most of the answers
