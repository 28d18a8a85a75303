"""``exactspec serve --replicas``: the OpenAI app on Ray Serve, a local Ray instance on loopback with 2 replicas of a
tiny model, behind the prefix-routing ingress (the default) and behind Ray's proxy alone (--replica-routing ray).
Slow: Ray takes its time to start."""

from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_server import ids_of, plain_greedy, visible
from tiny import save_with_tokenizer, tiny_llama

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from exactspec.server import BatchSettings  # noqa: E402
from exactspec.server.replicas import APP_NAME, proxy_options, serve_app  # noqa: E402
from exactspec.server.serving import ServerOptions  # noqa: E402

pytestmark = pytest.mark.slow
REQUEST_TIMEOUT = 10.0  # seconds Ray's proxy lets a request go unanswered; the client waits three times that


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model = tiny_llama(seed=0, init_range=0.5)
    return model, save_with_tokenizer(model, tmp_path_factory.mktemp("replicas") / "tiny")


@pytest.fixture(scope="module", params=["prefix", "ray"])
def routing(request) -> str:
    """Every test runs behind the prefix-routing ingress (the default) and behind Ray's proxy alone."""
    return request.param


@pytest.fixture(scope="module")
def port(model, routing):
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 << 20, logging_level="error")
    port = free_port()
    serve.start(http_options=proxy_options("127.0.0.1", port, REQUEST_TIMEOUT))
    options = ServerOptions(model=str(model[1]), backend="lean", dtype="float32", threads=1,
                             batch=BatchSettings(max_batch_size=8, max_model_len=128, speculation="always"))
    serve.run(serve_app(options, replicas=2, routing=routing), name=APP_NAME, route_prefix="/")
    yield port
    serve.shutdown()
    ray.shutdown()


def complete(port: int, prompt: list[int], max_tokens: int = 8) -> tuple[int, dict | None, str | None]:
    """(status, body, the replica that answered); status 0 when the connection failed."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=3 * REQUEST_TIMEOUT)
    try:
        connection.request("POST", "/v1/completions", json.dumps({
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}))
        response = connection.getresponse()
        body = response.read()
        return response.status, json.loads(body) if response.status == 200 else None, \
            response.getheader("X-Exactspec-Instance")
    except (ConnectionError, http.client.HTTPException):
        return 0, None, None
    finally:
        connection.close()


def test_100_requests_are_each_answered_once_and_both_replicas_serve(model, port):
    prompts = [[3 + i % 50, 4 + i // 50, 7] for i in range(100)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: complete(port, p), prompts))
    assert [status for status, _, _ in answers] == [200] * 100
    for prompt, (_, body, _) in zip(prompts, answers):  # each its own answer: its own prompt's greedy output
        assert ids_of(body["choices"][0]["text"]) == visible(plain_greedy(model, prompt, 8))
    assert len({instance for _, _, instance in answers}) == 2


def test_streaming_and_refusals_pass_through_rays_proxy(port):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps({
        "prompt": "w3 w4", "max_tokens": 5, "stream": True, "ignore_eos": True}))
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    events = [line for line in response.read().decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    connection.request("POST", "/v1/completions", json.dumps({"prompt": "w3", "best_of": 3}))
    response = connection.getresponse()
    assert response.status == 400 and json.loads(response.read())["error"]["param"] == "best_of"
    connection.close()
    for path, body, headers, status in (("/v1/completions", b"{not json", {}, 400),
                                        ("/v1/chat/completions", b'{"messages": 3}', {}, 400),
                                        ("/v1/completions", None, {"Content-Length": str(2 << 20)}, 413)):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("POST", path, body, headers)  # the 413's body is declared, never sent
        response = connection.getresponse()
        assert response.status == status and json.loads(response.read())["error"]["message"], path
        connection.close()


def test_a_conversations_turns_land_on_one_replica_and_restore_its_cached_prefix(port, routing):
    """Routed by prefix, four conversations of three turns, taken in turns, each turn's prompt the last one's with
    its answer and a new question: every turn lands where its conversation began, the conversations spread over
    both replicas, and each later turn's prompt is restored from that replica's prefix cache (usage's
    cached_tokens)."""
    if routing != "prefix":
        pytest.skip("Ray's own router spreads a conversation's turns")
    prompts = [[3 + (11 * c + 7 * i) % 60 for i in range(40)] for c in range(4)]
    began, cached = {}, []
    for turn in range(3):
        for c, prompt in enumerate(prompts):
            status, body, instance = complete(port, prompt)
            assert status == 200
            assert began.setdefault(c, instance) == instance, (turn, c)
            if turn:
                cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            prompts[c] = prompt + ids_of(body["choices"][0]["text"]) + [5 + turn + c] * 8
    assert len(set(began.values())) == 2
    assert all(tokens > 0 for tokens in cached), cached


def test_the_live_page_works_behind_rays_proxy(port):
    """The page and its files, what it asks the server, and the stream with include_speculation, through the
    proxy (the page's addresses are relative: it works wherever the app is served)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for path, kind in (("/", "text/html"), ("/page/page.js", "text/javascript"), ("/page/page.css", "text/css")):
        connection.request("GET", path)
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Content-Type").startswith(kind) and response.read()
    connection.request("GET", "/v1/speculation")
    response = connection.getresponse()
    assert response.status == 200 and json.loads(response.read())["modes"] == ["always", "never"]
    connection.request("POST", "/v1/completions", json.dumps({
        "prompt": "w3 w4 w3 w4 w3", "max_tokens": 6, "stream": True, "ignore_eos": True, "temperature": 0,
        "stream_options": {"include_speculation": True}}))
    response = connection.getresponse()
    chunks = [json.loads(line[len("data: "):]) for line in response.read().decode().split("\n\n")
              if line.startswith("data: {")]
    assert sum(r["tokens"] for c in chunks for r in c["exactspec"]["rounds"]) == 6
    connection.close()


def replica_count() -> int:
    application = serve.status().applications[APP_NAME]
    return application.deployments["ExactspecReplica"].replica_states.get("RUNNING", 0)


def test_a_replica_killed_mid_run_is_replaced_and_no_request_hangs(port):
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, port, [5, 6 + i % 40], 100) for i in range(60)]
        while sum(f.done() for f in futures) < 10:
            time.sleep(0.01)
        victim = next(actor for actor in ray.util.list_named_actors(all_namespaces=True)
                      if "ExactspecReplica" in actor["name"])
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
        assert sum(f.done() for f in futures) < 60  # killed mid-run
        statuses = [future.result(timeout=120)[0] for future in futures]  # none hangs
    # a request the dying replica held fails, or one Ray loses ends at the proxy's timeout (408)
    assert all(status in (0, 200, 408, 500, 502, 503) for status in statuses), statuses
    assert statuses.count(200) >= 30  # the other replica kept serving
    deadline = time.monotonic() + 120
    while replica_count() < 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert replica_count() == 2  # Ray brought it back
    assert complete(port, [5, 6])[0] == 200


def test_a_request_held_past_the_request_timeout_ends_with_408_at_the_proxy(port):
    """A request whose body never comes is held by the ingress that reads it (30 s for a stalled body, as a
    replica waits): the proxy ends it at REQUEST_TIMEOUT, whatever holds it, and the replicas keep serving."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=3 * REQUEST_TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        status_line = sock.makefile("rb").readline()
    assert status_line.split()[1] == b"408"
    assert REQUEST_TIMEOUT <= time.monotonic() - started < 2 * REQUEST_TIMEOUT
    assert complete(port, [5, 6])[0] == 200
