"""`structkv serve` over loopback with the official `openai` client: answers equal the library's
own, the compressed-context cache, concurrency, every bad request, queue limits, disconnects.

Servers listen on 127.0.0.1 on a free port in a daemon thread and stop at the end of each test or
module; every client call has a timeout, so nothing here can hang the suite.
"""
import json
import threading
import time

import httpx
import pytest

import structkv
from structkv import methods
from structkv.serve import app_for
from structkv.serve.engine import Settings
from structkv.serve.launch import Background
from structkv.text import chat

openai = pytest.importorskip("openai")

NAME = "tiny-chat"
DOC = " ".join(f"Fact {i}: the {w} key opens door {i * 7 % 13}." for i, w in
               enumerate(["red", "blue", "green", "amber", "violet", "grey", "white", "black", "gold", "silver"] * 3))
QUESTIONS = ["Which key opens door 5?", "What is fact 12?", "Name a colour."]


def settings(**kw):
    base = dict(model_name=NAME, method="snapkv", context_method="snapkv", kv_budget=0.3, compile=False, max_tokens=64,
                default_max_tokens=8, room=64, min_context_tokens=32, max_queue=8)
    return Settings(**{**base, **kw})


@pytest.fixture(scope="module")
def server(chat_model):
    with Background(app_for(chat_model, settings())) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def alone(model, messages, max_new=8, **kw):
    """What the library answers for the same request, without the server."""
    method = methods.get("snapkv", kv_budget=0.3)
    return structkv.generate(model, messages=messages, method=method, max_new_tokens=max_new, temperature=0,
                             compile=False, **kw).text


def from_context(model, context, question, max_new=8):
    """The library's compress-once answer: the context cached with serve's default archive (int4:
    each question recalls from it), the question appended uncompressed."""
    from structkv.serve.engine import _split_at_context

    prefix, rest = _split_at_context(model.tokenizer, [{"role": "user", "content": question}], context)
    method = methods.get("snapkv", kv_budget=0.3)
    state = structkv.prefill(model, prefix, method, room=64, archive=methods.context_archive(method))
    return structkv.generate(model, rest, state=state, max_new_tokens=max_new, temperature=0, compile=False).text


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert "# TYPE structkv_request_seconds histogram" in text and "structkv_context_cache_bytes" in text


def test_chat_answers_as_the_library_does(chat_model, client):
    messages = [{"role": "user", "content": "Say something about keys."}]
    out = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=8)
    assert out.choices[0].message.content == alone(chat_model, messages)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(chat.encode(chat_model.tokenizer, messages))
    extra = out.model_extra["structkv"]
    assert extra["method"] == "snapkv" and extra["context_cache"] == "off" and extra["kv_bytes_kept"] > 0


def test_streaming_chat_equals_the_whole_answer(chat_model, client):
    messages = [{"role": "user", "content": "Tell me about door 3."}]
    pieces, finish, usage = [], None, None
    for part in client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=8,
                                               stream=True, stream_options={"include_usage": True}):
        if part.choices:
            pieces.append(part.choices[0].delta.content or "")
            finish = part.choices[0].finish_reason or finish
        if part.usage is not None:
            usage = part.usage
    assert "".join(pieces) == alone(chat_model, messages)
    assert finish in ("stop", "length") and usage.completion_tokens > 0


def test_completions_plain_and_streamed(chat_model, client):
    want = structkv.generate(chat_model, "The door", method=methods.get("snapkv", kv_budget=0.3), max_new_tokens=6,
                             temperature=0, compile=False).text
    assert client.completions.create(model=NAME, prompt="The door", max_tokens=6, temperature=0).choices[0].text == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="The door", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == want


def test_second_question_about_a_document_is_a_cache_hit(chat_model, client):
    """The document is compressed once; the second question reuses it and prefills only itself."""
    doc = DOC + " (copy for the cache test)"
    answers = []
    for q in QUESTIONS[:2]:
        out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": q}], temperature=0,
                                             max_tokens=8, extra_body={"context": doc})
        answers.append(out)
    first, second = (a.model_extra["structkv"] for a in answers)
    assert (first["context_cache"], second["context_cache"]) == ("miss", "hit")
    assert first["context_tokens"] == second["context_tokens"] > 500
    assert answers[1].usage.prompt_tokens_details.cached_tokens == second["context_tokens"]
    for q, out in zip(QUESTIONS[:2], answers):
        assert out.choices[0].message.content == from_context(chat_model, doc, q)


def test_history_before_the_last_user_turn_is_cached(client):
    """Without a context field, a long conversation before the last user turn is the cached part."""
    history = [{"role": "user", "content": DOC}, {"role": "assistant", "content": "Noted."}]
    status = [client.chat.completions.create(model=NAME, messages=[*history, {"role": "user", "content": q}],
                                             max_tokens=4, temperature=0).model_extra["structkv"]["context_cache"]
              for q in QUESTIONS[:2]]
    assert status == ["miss", "hit"]


def test_cached_contexts_get_the_context_method(chat_model):
    """A context compressed before its question gets --context-method (default: the model kind's
    `context_default` at its own R_KV, with its int4 archive, so the question recalls), a whole
    prompt --method; a request naming a method gets that one."""
    default, kv = methods.context_default(chat_model.config)
    assert Settings(model_name=NAME).context_method is None  # resolved from the model by the engine
    with Background(app_for(chat_model, settings(context_method=None, kv_budget=None))) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        question = [{"role": "user", "content": QUESTIONS[0]}]
        cached = client.chat.completions.create(model=NAME, messages=question, temperature=0, max_tokens=8,
                                                extra_body={"context": DOC})
        whole = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC}], max_tokens=4,
                                               temperature=0)
        named = client.chat.completions.create(model=NAME, messages=question, temperature=0, max_tokens=4,
                                               extra_body={"context": DOC + " (named)", "method": "snapkv"})
    assert cached.model_extra["structkv"]["method"] == default
    assert cached.model_extra["structkv"]["options"]["kv_budget"] == kv
    assert whole.model_extra["structkv"]["method"] == named.model_extra["structkv"]["method"] == "snapkv"
    from structkv.serve.engine import _split_at_context

    prefix, rest = _split_at_context(chat_model.tokenizer, question, DOC)
    state = structkv.prefill(chat_model, prefix, methods.build(default, kv=kv), room=64, archive="int4")
    expected = structkv.generate(chat_model, rest, state=state, max_new_tokens=8, temperature=0, compile=False).text
    assert cached.choices[0].message.content == expected


def test_method_and_budget_per_request(client):
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC}], max_tokens=4,
                                         temperature=0, extra_body={"method": "fastkv", "kv_budget": 0.2})
    extra = out.model_extra["structkv"]
    assert extra["method"] == "fastkv" and extra["options"]["kv_budget"] == 0.2 and extra["prefill_fraction"] < 1


def test_kv_bound_per_request_and_as_the_server_default(chat_model, server, client):
    """"max_kv_tokens" bounds a request's cache while it generates (its answer is the library's
    with the same bound); a server default applies to requests that name none."""
    from structkv.modules import DecodeBound

    messages = [{"role": "user", "content": "Tell a long story about keys."}]
    out = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=40,
                                         extra_body={"max_kv_tokens": 24})
    want = alone(chat_model, messages, max_new=40, max_kv_tokens=DecodeBound(24))
    assert out.choices[0].message.content == want
    with Background(app_for(chat_model, settings(max_kv_tokens=24))) as bounded:
        c = openai.OpenAI(base_url=bounded.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        out = c.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=40)
        assert out.choices[0].message.content == want
    for bound in (0, 4):  # 4: a bound that would evict the prompt before the first token
        r = post(server, "/v1/chat/completions", {"model": NAME, "messages": messages, "max_kv_tokens": bound})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_kv_tokens", r.text


def test_token_count_budgets_per_request(client):
    """The server speaks the same budgets as every door: an integer is a token count, a ratio a share."""
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC}], max_tokens=4,
                                         temperature=0, extra_body={"method": "structkv", "kv_budget": 24,
                                                                    "struct_budget": 40})
    extra = out.model_extra["structkv"]
    assert extra["options"]["kv_budget"] == 24 and extra["options"]["struct_budget"] == 40
    with pytest.raises(openai.BadRequestError, match="write it as an integer"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": DOC}], max_tokens=4,
                                       extra_body={"kv_budget": 512.0})


def test_concurrent_clients_get_their_own_answers(chat_model, server):
    prompts = [[{"role": "user", "content": f"Question {i}: {QUESTIONS[i % 3]}"}] for i in range(6)]
    got = {}

    def ask(i):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
        got[i] = c.chat.completions.create(model=NAME, messages=prompts[i], temperature=0,
                                           max_tokens=8).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [got.get(i) for i in range(len(prompts))] == [alone(chat_model, p) for p in prompts]


def test_sampling_with_a_seed_repeats_and_stop_strings_cut(client):
    ask = dict(model=NAME, messages=[{"role": "user", "content": "Go."}], max_tokens=12, temperature=1.0,
               top_p=0.9, seed=7)
    a, b = (client.chat.completions.create(**ask).choices[0].message.content for _ in range(2))
    assert a == b
    if len(a) > 2:
        stop = a[1:3]
        cut = client.chat.completions.create(**ask, stop=[stop]).choices[0]
        assert cut.message.content == a[:a.index(stop)] and cut.finish_reason == "stop"


def post(server, path, body, timeout=30):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"content-type": "application/json"}, timeout=timeout)


BAD = [
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "method": "magic"}, 400, "unknown_method"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "kv_budget": -1}, 400, "invalid_value"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "kv_budget": "big"}, 400, "invalid_value"),
    ({"model": NAME, "messages": "hello"}, 400, "invalid_value"),
    ({"model": NAME, "messages": [{"content": "no role"}]}, 400, "invalid_value"),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400, "invalid_value"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "unsupported_value"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x" * 3000}]}, 400, "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "missing_required_parameter"),
    ([1, 2], 400, "invalid_json"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_token": 5}, 400, "unknown_parameter"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "seed": 2**64}, 400, "invalid_value"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "seed": -1}, 400, "invalid_value"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "struct_budget": 0.2}, 400,
     "unsupported_parameter"),  # the server's method, snapkv, has no structural budget
    ({"model": NAME, "messages": [{"role": "user", "content": "x\ud800"}]}, 400, "invalid_value"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "temperature": 10**400}, 400, "invalid_value"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_p": -10**400}, 400, "invalid_value"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "method": ""}, 400, "unknown_method"),
]


@pytest.mark.parametrize("body,status,code", BAD, ids=[c for _, _, c in BAD])
def test_bad_requests_get_openai_errors(server, body, status, code):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and "Traceback" not in r.text


def test_malformed_json_oversized_bodies_and_unknown_routes(server, client):
    r = post(server, "/v1/chat/completions", b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = post(server, "/v1/chat/completions", b"x" * (17 << 20))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(server.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    # and it keeps serving
    assert client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2).choices[0].message.content is not None


def test_bodies_that_used_to_be_500s_are_400s(server):
    """Integers over Python's 4300 digits, JSON nested past the parser's depth, a lone surrogate in
    a raw body; and a large value is not echoed back whole. None of it is a server error."""
    msgs = '"messages": [{"role": "user", "content": "x"}]'
    for raw, code in ((f'{{"model": "{NAME}", {msgs}, "seed": {"9" * 5000}}}', "invalid_json"),
                      ("[" * 100_000 + "]" * 100_000, "invalid_json"),
                      (f'{{"model": "{NAME}", "messages": [{{"role": "user", "content": "a\\udc00b"}}]}}',
                       "invalid_value")):
        r = post(server, "/v1/chat/completions", raw.encode())
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text[:300]
    big = "t" * 200_000
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                              "temperature": big})
    assert r.status_code == 400 and len(r.text) < 2000 and "200002 characters" in r.json()["error"]["message"]
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'status="500"' not in metrics


def test_guard_rules():
    """API key, Host, Origin and content type, rule by rule (structkv.serve.guard.Guard.check)."""
    from structkv.serve.guard import LOOPBACK_HOSTS, Guard

    g = Guard(None, api_key="s3cret", allowed_hosts=LOOPBACK_HOSTS, allowed_origins=["http://localhost:3000"])
    ok = {"host": "127.0.0.1:8000", "authorization": "Bearer s3cret", "content-type": "application/json"}
    assert g.check("POST", "/v1/completions", ok) is None
    assert g.check("POST", "/v1/completions", {**ok, "host": "[::1]:8000"}) is None
    assert g.check("POST", "/v1/completions", {**ok, "content-type": "application/json; charset=utf-8"}) is None
    cases = [({**ok, "host": "evil.example:8000"}, 400, "invalid_host"),  # DNS rebinding
             ({**ok, "origin": "http://evil.example"}, 403, "origin_not_allowed"),
             ({**ok, "authorization": "Bearer wrong"}, 401, "invalid_api_key"),
             ({k: v for k, v in ok.items() if k != "authorization"}, 401, "invalid_api_key"),
             ({**ok, "content-type": "text/plain"}, 415, "unsupported_media_type")]
    for headers, status, code in cases:
        got = g.check("POST", "/v1/completions", headers)
        assert got is not None and got[:1] == (status,) and got[2] == code, (headers, got)
    assert g.check("POST", "/v1/completions", {**ok, "origin": "http://localhost:3000"}) is None
    assert g.check("POST", "/v1/completions", {**ok, "origin": "http://127.0.0.1:8000"}) is None  # its own pages
    assert g.check("GET", "/health", {"host": "localhost"}) is None  # open for load balancers
    assert Guard(None).check("POST", "/x", {"host": "anything", "content-type": "application/json"}) is None


def test_api_key_and_host_over_http(chat_model):
    with Background(app_for(chat_model, settings(), api_key="k3y", allowed_hosts=["127.0.0.1"])) as srv:
        ask = dict(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).chat.completions.create(**ask)
        keyed = openai.OpenAI(base_url=srv.url + "/v1", api_key="k3y", timeout=60, max_retries=0)
        assert keyed.chat.completions.create(**ask).choices[0].message.content is not None
        r = httpx.post(srv.url + "/v1/chat/completions", content=json.dumps(ask), timeout=30,
                       headers={"authorization": "Bearer k3y", "content-type": "text/plain"})
        assert r.status_code == 415  # what a web page can send without a preflight
        r = httpx.get(srv.url + "/v1/models", headers={"host": "rebound.example", "authorization": "Bearer k3y"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        metrics = httpx.get(srv.url + "/metrics", headers={"authorization": "Bearer k3y"}, timeout=10).text
        assert 'status="401"' in metrics and 'status="415"' in metrics


def test_idle_and_excess_connections_are_closed(chat_model):
    """Connections that never send a request head are closed after the head timeout, and beyond
    twice --max-connections a new one is closed when accepted: an idle flood cannot hold the
    server's file descriptors (issue 32: 1030 idle sockets locked every client out)."""
    import socket

    with Background(app_for(chat_model, settings()), max_connections=4, head_timeout_s=1.0, per_client=12) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
        time.sleep(0.3)

        assert sum(_closed(s, 0.05) for s in idle) == 12 - 8  # over 2 x 4: closed at once
        time.sleep(1.5)
        assert all(_closed(s, 0.05) for s in idle)  # the rest: no request head within 1 s
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # a head sent halfway
        time.sleep(1.5)
        assert _closed(half, 0.05)
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        for s in idle + [half]:
            s.close()


def test_a_slowloris_client_does_not_crowd_out_an_honest_one(chat_model):
    """One client holds more idle sockets than the hard limit and reopens every one the server
    closes; a client that sends its request at once is still answered (new connections take the
    place of the oldest waiting ones; the newest used to be aborted, honest ones included)."""
    import socket

    with Background(app_for(chat_model, settings()), max_connections=4, head_timeout_s=10.0) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        stop = threading.Event()

        def flood():
            socks = []
            while not stop.is_set():
                socks = [s for s in socks if not _closed(s)]
                while len(socks) < 12:
                    try:
                        socks.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                    except OSError:
                        break
                time.sleep(0.01)
            for s in socks:
                s.close()

        attacker = threading.Thread(target=flood, daemon=True)
        attacker.start()
        time.sleep(0.5)
        answered = 0
        for _ in range(20):
            try:
                answered += httpx.get(srv.url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                pass
        stop.set()
        attacker.join(10)
    assert answered >= 18, f"{answered} of 20 honest requests answered"


def test_one_address_holds_at_most_its_share_of_connections(chat_model):
    """A client address past its share (default three quarters of the open-connection limit)
    loses its own oldest waiting connections, not another address's, even past the limit: a second
    client's idle connections stay open and its requests are answered while the first keeps 20
    sockets open."""
    import socket

    def from_address(host, port):
        s = socket.socket()
        s.bind((host, 0))
        s.connect(("127.0.0.1", port))
        return s

    with Background(app_for(chat_model, settings()), max_connections=4, head_timeout_s=10.0) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        other = [from_address("127.0.0.3", port) for _ in range(3)]
        flood = [from_address("127.0.0.2", port) for _ in range(20)]
        time.sleep(0.3)
        assert sum(not _closed(s, 0.02) for s in flood) == 5  # its share (6), less room for the 3 others
        assert not any(_closed(s, 0.02) for s in other)
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        for s in other + flood:
            s.close()


def test_requests_beyond_the_limit_in_flight_get_503_at_once():
    """--max-connections bounds the requests in flight (503 server_busy beyond it), not the sockets."""
    import asyncio

    from structkv.serve.connections import RequestLimit

    async def slow(scope, receive, send):
        await asyncio.sleep(0.2)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def run():
        limited, sent = RequestLimit(slow, 2), []

        async def one():
            out = []
            await limited({"type": "http"}, None, lambda m: asyncio.sleep(0, out.append(m)))
            sent.append(out[0]["status"])

        await asyncio.gather(*(one() for _ in range(5)))
        await one()  # the earlier ones have finished: room again
        return sent, limited.in_flight

    sent, left = asyncio.run(run())
    assert sorted(sent[:5]) == [200, 200, 503, 503, 503] and sent[5] == 200 and left == 0


def _closed(s, wait: float = 0.001) -> bool:
    """Whether the server closed socket `s` (waiting up to `wait` seconds for a byte)."""
    s.settimeout(wait)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_a_half_sent_body_is_answered_408_within_the_timeout(chat_model):
    """A client that sends half a body and waits gets 408 after --body-timeout and its connection
    closes, instead of holding it for as long as it likes."""
    import socket

    with Background(app_for(chat_model, settings(), body_timeout_s=1.0)) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        t0 = time.monotonic()
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": ")
            reply = b""
            while chunk_ := sock.recv(4096):
                reply += chunk_
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
        assert time.monotonic() - t0 < 10


def test_a_client_leaving_mid_body_logs_no_traceback(chat_model, caplog, capfd):
    """A client that sends half a body and leaves is not a server error: no traceback is logged
    (each one was a 3.4 KB starlette ClientDisconnect traceback, ~400 MiB an hour from 8 threads),
    and the server answers the next request."""
    import logging
    import socket

    with caplog.at_level(logging.INFO), Background(app_for(chat_model, settings())) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port)), timeout=20) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{\"model\": ")
                time.sleep(0.2)
        time.sleep(0.5)
        assert httpx.get(f"{srv.url}/health", timeout=20).status_code == 200
        metrics = httpx.get(f"{srv.url}/metrics", timeout=20).text
    assert 'status="499"} 3' in metrics, [m for m in metrics.splitlines() if "499" in m]
    noisy = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not noisy, [r.getMessage()[:200] for r in noisy]
    err = capfd.readouterr().err  # uvicorn's own loggers do not propagate to the root one
    assert "Traceback" not in err and "ClientDisconnect" not in err, err[-2000:]


def test_prompt_token_limit_and_oversized_text_refused_before_tokenizing(chat_model, monkeypatch):
    """--max-prompt-tokens bounds each request; a text too long to fit whatever its tokens is
    refused without being tokenized (a 15 MiB document used to take 14 s of CPU and GBs first)."""
    calls = []
    encode = chat_model.tokenizer.encode
    monkeypatch.setattr(chat_model.tokenizer, "encode",
                        lambda text, **kw: calls.append(len(text)) or encode(text, **kw))
    with Background(app_for(chat_model, settings(max_prompt_tokens=40))) as srv:
        ask = {"model": NAME, "messages": [{"role": "user", "content": "word " * 60}], "max_tokens": 2}
        r = post(srv, "/v1/chat/completions", ask)
        assert r.status_code == 400 and "--max-prompt-tokens" in r.json()["error"]["message"]
        calls.clear()
        t0 = time.monotonic()
        r = post(srv, "/v1/chat/completions", {**ask, "messages": [{"role": "user", "content": "w" * 5_000_000}]})
        assert r.status_code == 400 and "before tokenizing" in r.json()["error"]["message"]
        assert calls == [] and time.monotonic() - t0 < 10
        ok = post(srv, "/v1/chat/completions", {**ask, "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200


def test_a_text_over_the_token_limit_is_refused_after_counting_about_the_limit(chat_model, monkeypatch):
    """A text under the character bound but over --max-prompt-tokens is counted in pieces that stop
    once past the limit: refused after tokenizing about the limit's worth, not the whole text (it
    used to be tokenized whole, with its chat template, before the limit was checked)."""
    import structkv.serve.engine as engine

    monkeypatch.setattr(engine, "COUNT_PIECE", 50)
    calls = []
    encode = chat_model.tokenizer.encode
    monkeypatch.setattr(chat_model.tokenizer, "encode",
                        lambda text, **kw: calls.append(len(text)) or encode(text, **kw))
    with Background(app_for(chat_model, settings(max_prompt_tokens=40))) as srv:
        text = "word " * 140  # 700 characters: under the bound of 40 tokens x the longest token x 4
        r = post(srv, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": text}],
                                               "max_tokens": 2})
        assert r.status_code == 400 and "refused after counting" in r.json()["error"]["message"]
        assert sum(calls) <= 200, calls


class Gate:
    """Slows every generated token of a server's engine so that requests overlap for sure; counts
    the tokens in `produced`."""

    def __init__(self, monkeypatch, delay):
        import structkv.serve.engine as engine

        real, self.produced = engine._Run.on_token, []

        def slow(run, token):
            time.sleep(delay)
            self.produced.append(token)
            return real(run, token)

        monkeypatch.setattr(engine._Run, "on_token", slow)


def test_full_queue_answers_503_with_retry_after(chat_model, monkeypatch):
    Gate(monkeypatch, 0.05)
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "temperature": 0}
    with Background(app_for(chat_model, settings(max_queue=1, max_batch=1))) as srv:
        codes = []
        threads = [threading.Thread(target=lambda: codes.append(post(srv, "/v1/chat/completions", body).status_code))
                   for _ in range(2)]
        threads[0].start()
        time.sleep(0.5)  # the first is running
        threads[1].start()
        time.sleep(0.3)  # the second waits in the queue of one
        r = post(srv, "/v1/chat/completions", body)
        for t in threads:
            t.join(60)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
        assert sorted(codes) == [200, 200]


def test_disconnect_mid_stream_frees_the_model(chat_model, monkeypatch):
    Gate(monkeypatch, 0.05)
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 60, "stream": True,
            "temperature": 0}  # greedy: a sampled end-of-turn could end it early by chance
    with Background(app_for(chat_model, settings())) as srv:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the role chunk: it is running
        t0 = time.perf_counter()  # 60 tokens would take 3 s; the next request must not wait for them
        out = post(srv, "/v1/chat/completions", {**body, "stream": False, "max_tokens": 2}).json()
        assert out["structkv"]["queue_s"] < 1.0 and time.perf_counter() - t0 < 2.5
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up is noticed too
            post(srv, "/v1/chat/completions", {**body, "stream": False}, timeout=0.5)
        t0 = time.perf_counter()
        out = post(srv, "/v1/chat/completions", {**body, "stream": False, "max_tokens": 2}).json()
        assert out["structkv"]["queue_s"] < 1.0 and time.perf_counter() - t0 < 2.5
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert "structkv_cancelled_total 2" in metrics


def test_concurrent_requests_decode_in_one_batch(chat_model, monkeypatch):
    """Three slowed requests overlap: they share decode steps (continuous batching) and each gets
    its lone answer; with --max-batch 1 they run one at a time."""
    Gate(monkeypatch, 0.02)
    asks = [[{"role": "user", "content": f"Question {i}: {QUESTIONS[i]}"}] for i in range(3)]
    for max_batch, shared in ((8, True), (1, False)):
        got = {}
        with Background(app_for(chat_model, settings(max_batch=max_batch))) as srv:
            def ask(i):
                got[i] = post(srv, "/v1/chat/completions", {"model": NAME, "messages": asks[i], "max_tokens": 24,
                                                            "temperature": 0}, timeout=120).json()
            threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        rows = [got[i]["structkv"]["batch_rows_max"] for i in range(3)]
        assert (max(rows) > 1) == shared, rows
        assert [got[i]["choices"][0]["message"]["content"] for i in range(3)] == [
            alone(chat_model, a, max_new=24) for a in asks]


def test_a_long_prompt_is_prefilled_between_the_running_steps(chat_model, monkeypatch):
    """A prompt arriving while another request decodes is prefilled in slices with decode steps
    between them (every pause point yields at share 0); both answers are their lone ones, a prompt
    compressed with its context included; `--prefill-rows 0` runs it alone."""
    gate = Gate(monkeypatch, 0.01)
    running = [{"role": "user", "content": "Tell me about the keys."}]
    arriving = [{"role": "user", "content": DOC[:600] + " Which key opens door 5?"}]
    for rows, sliced in ((16, True), (0, False)):
        got = {}
        with Background(app_for(chat_model, settings(prefill_rows=rows, prefill_share=0.0))) as srv:
            def ask(name, messages, n):
                got[name] = post(srv, "/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": n,
                                                               "temperature": 0}, timeout=120).json()
            first = threading.Thread(target=ask, args=("running", running, 40))
            first.start()
            while not gate.produced:  # it is decoding
                time.sleep(0.005)
            ask("arriving", arriving, 8)
            first.join(120)
            metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        steps = [line for line in metrics.splitlines() if line.startswith("structkv_prefill_interleaved_steps_total")]
        # sliced: a decode step of the running request at every pause point while it runs
        # (3 layers, each 2 x ceil(tokens / 16) slices)
        assert bool(steps) == sliced and (not sliced or int(float(steps[0].split()[-1])) > 3 * 4), steps
        assert got["running"]["choices"][0]["message"]["content"] == alone(chat_model, running, max_new=40)
        assert got["arriving"]["choices"][0]["message"]["content"] == alone(chat_model, arriving)
    with pytest.raises(ValueError, match="--prefill-rows"):
        settings(prefill_rows=-1)
    with pytest.raises(ValueError, match="--prefill-share"):
        settings(prefill_share=float("nan"))


def test_cache_is_bounded_in_bytes(chat_model):
    from structkv.serve.context_cache import ContextCache, context_key, state_bytes

    states = [structkv.prefill(chat_model, DOC[: 400 + 100 * i], "snapkv", room=16) for i in range(3)]
    sizes = [state_bytes(s) for s in states]
    cache = ContextCache(max_bytes=sizes[1] + sizes[2])
    for i, s in enumerate(states):
        assert cache.put(context_key(("snapkv",), [i]), s)
    assert cache.nbytes <= cache.max_bytes and len(cache) == 2 and cache.evictions == 1
    assert cache.get(context_key(("snapkv",), [0])) is None  # the least recently used went first
    assert not ContextCache(max_bytes=sizes[0] - 1).put(("k",), states[0])  # too big alone: not kept


def test_cli_refuses_bad_settings_before_serving(chat_model, capsys):
    from structkv.cli import main
    from structkv.serve.engine import Engine

    with pytest.raises(SystemExit):
        main(["serve", "--cache-bytes", "lots"])
    assert "512MiB" in capsys.readouterr().err
    for option, value, message in (("--body-timeout", "-1", "positive number of seconds"),
                                   ("--max-connections", "0", "positive integer"),
                                   ("--port", "70000", "port"), ("--port", "-1", "port"),
                                   ("--max-request-bytes", "0", "positive integer")):
        with pytest.raises(SystemExit):
            main(["serve", option, value])
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        Engine(chat_model, settings(method="magic"))


def test_api_key_scheme_is_case_insensitive_and_a_key_no_client_can_send_is_refused(chat_model, capsys):
    """`authorization: bearer <key>` is the same scheme as `Bearer` (RFC 9110); a non-ASCII key could
    never match (headers carry ASCII) and is refused at start; a 60 KB path is not echoed back."""
    from structkv.cli import main

    with Background(app_for(chat_model, settings(), api_key="k3y")) as srv:
        for header in ("Bearer k3y", "bearer k3y", "BEARER  k3y"):
            assert httpx.get(srv.url + "/v1/models", headers={"authorization": header}, timeout=10).status_code == 200
        assert httpx.get(srv.url + "/v1/models", headers={"authorization": "Basic k3y"}, timeout=10).status_code == 401
        long = httpx.get(srv.url + "/" + "a" * 60_000, headers={"authorization": "Bearer k3y"}, timeout=10)
        assert long.status_code == 404 and len(long.content) < 1000
    assert main(["serve", "--api-key", "clé"]) == 2
    assert "printable ASCII" in capsys.readouterr().err


def test_serving_beyond_loopback_needs_a_key_or_no_auth(monkeypatch, capsys):
    """Refused before the model loads: beyond loopback without --api-key (or $STRUCTKV_API_KEY)
    unless --no-auth, and --no-auth with a key."""
    from structkv.cli import main

    monkeypatch.delenv("STRUCTKV_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "needs an API key" in capsys.readouterr().err
    assert main(["serve", "--host", "0.0.0.0", "--no-auth", "--api-key", "k"]) == 2
    assert "contradict" in capsys.readouterr().err


def test_shutdown_lets_running_requests_finish(chat_model, monkeypatch):
    messages = [{"role": "user", "content": "x"}]
    want = alone(chat_model, messages, max_new=30)  # greedy: sampling could end the answer early by chance
    assert len(chat_model.tokenizer.encode(want, add_bos=False)) >= 20  # long enough to be running at stop()
    Gate(monkeypatch, 0.05)
    body = {"model": NAME, "messages": messages, "max_tokens": 30, "temperature": 0}
    srv = Background(app_for(chat_model, settings()))
    result = {}
    t = threading.Thread(target=lambda: result.update(r=post(srv, "/v1/chat/completions", body)))
    t.start()
    time.sleep(0.5)  # running: 30 tokens take 1.5 s
    srv.stop()  # what SIGTERM does: stop accepting, finish what runs, close the engine
    t.join(30)
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["message"]["content"] == want


def test_shutdown_after_the_grace_period_drops_queued_work(chat_model, monkeypatch):
    """When the grace period ends, running requests stop at their next token and queued ones are
    dropped: nothing is generated for clients that are gone, and the server stops promptly."""
    produced = Gate(monkeypatch, 0.05).produced
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 30, "temperature": 0}
    srv = Background(app_for(chat_model, settings(max_batch=1)), grace_s=0.5)

    def ask():
        try:
            post(srv, "/v1/chat/completions", body)
        except httpx.HTTPError:
            pass  # the server went away mid-request: expected

    clients = [threading.Thread(target=ask) for _ in range(3)]
    for c in clients:
        c.start()
    time.sleep(0.5)  # one request running (30 tokens take 1.5 s), two queued
    t0 = time.monotonic()
    srv.stop()
    stopped = time.monotonic() - t0
    for c in clients:
        c.join(30)
    assert stopped < 8
    assert len(produced) < 45  # three whole answers would be 90 tokens


def test_shutdown_after_the_grace_period_stops_a_running_batch(chat_model, monkeypatch):
    """Requests decoding together are all stopped when the grace period ends, and their clients get
    an OpenAI error object (503 server_shutdown), not a plain-text 500."""
    produced = Gate(monkeypatch, 0.05).produced
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 60, "temperature": 0}
    srv = Background(app_for(chat_model, settings()), grace_s=0.5)
    answers = []
    clients = [threading.Thread(target=lambda: answers.append(_ignore_errors(post, srv, "/v1/chat/completions",
                                                                             body))) for _ in range(3)]
    for c in clients:
        c.start()
    time.sleep(0.6)  # all three in the batch: 60 tokens each take at least 3 s
    t0 = time.monotonic()
    srv.stop()
    stopped = time.monotonic() - t0
    for c in clients:
        c.join(30)
    assert stopped < 8 and len(produced) < 120  # three whole answers would be 180 tokens
    told = [r for r in answers if r is not None]
    assert told and all(r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown" for r in told)


def test_a_stream_stopped_by_the_shutdown_ends_with_an_error_event(chat_model, monkeypatch):
    Gate(monkeypatch, 0.05)
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 60, "temperature": 0,
            "stream": True}
    srv = Background(app_for(chat_model, settings()), grace_s=0.5)
    lines = []

    def read():
        try:
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
                lines.extend(r.iter_lines())
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=read)
    t.start()
    time.sleep(0.6)
    srv.stop()
    t.join(30)
    sent = [x for x in lines if x]
    events = [json.loads(x[6:]) for x in sent if x.startswith("data: {")]
    assert events and events[-1]["error"]["code"] == "server_shutdown" and sent[-1] == "data: [DONE]"


def _ignore_errors(f, *a):
    try:
        return f(*a)
    except httpx.HTTPError:
        return None  # the server went away mid-request: expected


def test_a_second_signal_ends_the_server_at_once(chat_dir):
    """SIGINT starts the graceful shutdown, which waits for an open half-sent body and a running
    generation; a second SIGINT exits at once with status 130 (it used to end in SIGABRT)."""
    import argparse
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = "import sys; from structkv.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--model", str(chat_dir), "--port", str(port),
                             "--method", "snapkv", "--compile", "never", "--body-timeout", "60",
                             "--shutdown-grace", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        busy = threading.Thread(target=_ignore_errors, args=(post, argparse.Namespace(url=url), "/v1/completions",
                                {"model": str(chat_dir), "prompt": "x" * 500, "max_tokens": 1000}), daemon=True)
        busy.start()  # the model thread is inside a generation when the signals come
        held = socket.create_connection(("127.0.0.1", port))
        held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None  # waiting for the half-sent body, as a graceful shutdown does
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 130 and time.monotonic() - t0 < 5
        held.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Abort" not in proc.stdout.read()


def test_archived_contexts_recall_survive_a_restart_and_refuse_damaged_files(chat_model, tmp_path):
    """With --archive/--archive-dir each cached context is a file (hot set + archive): answers equal
    the library's with the same recall; a restarted server answers from the file (no compression);
    a damaged file is never read: the context is compressed again. The bound counts the hot sets;
    the archives on disk apart."""
    from structkv.serve.engine import _split_at_context

    question = [{"role": "user", "content": QUESTIONS[0]}]
    kw = dict(archive="int4", recall=24, archive_dir=str(tmp_path))

    def ask(doc):
        with Background(app_for(chat_model, settings(**kw))) as running:
            client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", timeout=60, max_retries=0)
            out = client.chat.completions.create(model=NAME, messages=question, temperature=0, max_tokens=8,
                                                 extra_body={"context": doc})
            metrics = httpx.get(running.url + "/metrics", timeout=10).text
        return out, metrics

    first, metrics = ask(DOC)
    assert first.model_extra["structkv"]["context_cache"] == "miss"
    assert "structkv_context_cache_archive_disk_bytes" in metrics
    files = list(tmp_path.iterdir())
    assert len(files) == 1
    prefix, rest = _split_at_context(chat_model.tokenizer, question, DOC)
    state = structkv.prefill(chat_model, prefix, methods.get("snapkv", kv_budget=0.3), room=64, archive="int4",
                             recall=24)
    expected = structkv.generate(chat_model, rest, state=state, max_new_tokens=8, temperature=0, compile=False)
    assert expected.stats["recalled_entries"] > 0
    assert first.choices[0].message.content == expected.text
    again, _ = ask(DOC)  # a new server: the file, not a new compression
    assert again.model_extra["structkv"]["context_cache"] == "disk"
    assert again.choices[0].message.content == expected.text
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[0].write_bytes(bytes(data))
    damaged, _ = ask(DOC)
    assert damaged.model_extra["structkv"]["context_cache"] == "miss"  # compressed again, not read
    assert damaged.choices[0].message.content == expected.text


def test_an_archive_folder_that_cannot_be_written_falls_back_to_ram(chat_model, tmp_path, monkeypatch):
    """A full disk, a read-only folder or a file size limit under --archive-dir used to answer every
    request with a context 500 forever; the context is now kept in RAM (a warning says why) and the
    answer is the same as a server without the folder."""
    import errno

    import structkv.serve.engine as engine

    question = [{"role": "user", "content": QUESTIONS[0]}]

    def ask(**kw):
        with Background(app_for(chat_model, settings(archive="int4", recall=24, **kw))) as running:
            client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", timeout=60, max_retries=0)
            return client.chat.completions.create(model=NAME, messages=question, temperature=0, max_tokens=8,
                                                  extra_body={"context": DOC})

    want = ask()

    def full_disk(state, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(engine, "save_state", full_disk)
    got = ask(archive_dir=str(tmp_path))
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.model_extra["structkv"]["context_cache"] == "miss"


def test_a_context_over_the_whole_cache_bound_is_reported(chat_model, caplog):
    """A context larger than --cache-bytes on its own is not cached: a warning and a metric say so
    (it used to be dropped silently, each question compressing it again)."""
    question = [{"role": "user", "content": QUESTIONS[0]}]
    with Background(app_for(chat_model, settings(cache_bytes=1000))) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        for _ in range(2):
            out = client.chat.completions.create(model=NAME, messages=question, temperature=0, max_tokens=4,
                                                 extra_body={"context": DOC})
            assert out.model_extra["structkv"]["context_cache"] == "miss"
        metrics = httpx.get(running.url + "/metrics", timeout=10).text
    assert "structkv_context_cache_oversized 2" in metrics
    assert any("over --cache-bytes" in r.getMessage() for r in caplog.records)


def test_stale_temporary_files_are_cleaned_at_start(chat_model, tmp_path):
    """A killed writer leaves `.<name>.safetensors.XXXX` files behind: the engine removes the old
    ones when it starts (they used to pile up), keeps a recent one (another server's write) and
    every finished file."""
    import os

    from structkv.serve.engine import Engine

    stale, fresh, done = (tmp_path / ".a.safetensors.x1", tmp_path / ".b.safetensors.x2", tmp_path / "c.safetensors")
    for p in (stale, fresh, done):
        p.write_bytes(b"partial")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    engine = Engine(chat_model, settings(archive="int4", archive_dir=str(tmp_path)))
    engine.close()
    assert not stale.exists() and fresh.exists() and done.exists()


def test_serve_refuses_an_archive_dir_that_is_a_file_at_start(tmp_path):
    """`serve --archive-dir <a file>` used to start and then fail every request with a context; it
    now stops at once with the option's name and the fix."""
    import subprocess
    import sys

    afile = tmp_path / "not-a-folder"
    afile.write_text("x")
    try:
        out = subprocess.run([sys.executable, "-m", "structkv.cli", "serve", "--archive-dir", str(afile), "--port",
                              "0"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("serve started with a file as --archive-dir")
    assert out.returncode != 0 and "--archive-dir" in out.stderr and "is a file" in out.stderr, out.stderr[-1000:]


def test_archived_states_count_apart_in_the_bound(chat_model, tmp_path):
    from structkv.serve.context_cache import ContextCache, hot_bytes, state_bytes

    state = structkv.prefill(chat_model, chat_model.tokenizer.encode(DOC), methods.get("snapkv", kv_budget=0.3),
                             room=64, archive="int4")
    assert state_bytes(state) == hot_bytes(state) + state.archive.nbytes()  # in RAM: counted
    cache = ContextCache(1 << 30)
    cache.put("ram", state)
    on_file = structkv.prefill(chat_model, chat_model.tokenizer.encode(DOC), methods.get("snapkv", kv_budget=0.3),
                               room=64, archive="int4", archive_dir=tmp_path)
    assert state_bytes(on_file) == hot_bytes(on_file)  # on disk: not in the RAM bound
    cache.put("disk", on_file)
    split = cache.split()
    assert split == {"hot_bytes": hot_bytes(state) + hot_bytes(on_file), "archive_ram_bytes": state.archive.nbytes(),
                     "archive_disk_bytes": on_file.archive.nbytes()}
    assert cache.nbytes == state_bytes(state) + state_bytes(on_file)


def test_a_named_method_without_an_archive_is_served_by_a_recalling_server(chat_model):
    """A server that archives every cached context (--archive int4) still answers a request that
    names GemFilter (it re-encodes what it keeps: nothing to archive) from a plain cached state."""
    with Background(app_for(chat_model, settings(archive="int4"))) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                             temperature=0, max_tokens=4,
                                             extra_body={"context": DOC + " (gemfilter)", "method": "gemfilter"})
    assert out.model_extra["structkv"]["method"] == "gemfilter" and out.choices[0].message.content is not None
