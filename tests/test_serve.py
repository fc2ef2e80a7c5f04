"""``mlx-llm serve`` (serve/): a live server on a free loopback port in a subprocess, spoken to with the official
``openai`` client and raw HTTP — greedy replies equal ``generate``'s, log-probs the trainer's score, streaming with
usage and [DONE], seeded n = 4, stop strings across tokens, token ids in and out, every error as OpenAI's error
JSON (the server answering afterwards), a client that disconnects, 64 concurrent streams, a full queue, SIGTERM
with requests in flight; and in process, the parts with no HTTP (a run without a chat template, the CLI's flags)."""

import asyncio
import json
import queue
import signal
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import LazyModule, cli, cli_in_process

openai = LazyModule("openai")
httpx = LazyModule("httpx")

KEY = "test-key-123"


class Live:
    def __init__(self, proc, url: str, lines: queue.Queue):
        self.proc, self.url, self.lines = proc, url, lines
        self.root = url[:-len("/v1")]

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=120, **kw)

    def post(self, path: str, body, *, key=KEY, **kw):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        return httpx.post(self.root + path, content=body, headers={"Content-Type": "application/json", **headers},
                          timeout=120, **kw)

    def metrics(self) -> dict:
        text = httpx.get(self.root + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line and not line.startswith("#")}


def start(run, *args) -> Live:
    proc = cli("serve", "--run", run, "--port", "0", "--no-warm-up", "--api-key", KEY, *args, popen=True)
    lines: queue.Queue = queue.Queue()
    errors: list = []  # stderr read all along, so a chatty server never blocks on a full pipe
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    threading.Thread(target=lambda: [errors.append(x) for x in proc.stderr], daemon=True).start()
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert proc.poll() is None, "".join(errors)[-3000:]
            continue
        if line.startswith("serving "):
            return Live(proc, line.split(" at ")[1].split()[0], lines)
    proc.kill()
    raise AssertionError("the server did not start in 120 s")


slow = pytest.mark.slow  # the live server's tests (one server process for the file)


@pytest.fixture(scope="module")
def server(arithmetic_sft):
    live = start(arithmetic_sft, "--max-seqs", "8", "--max-queue", "80", "--grace", "60")
    try:
        yield live
    finally:
        if live.proc.poll() is None:
            live.proc.kill()
        live.proc.wait(30)


@pytest.fixture(scope="module")
def local(arithmetic_sft):
    """The run's parameters, tokenizer and template in this process (the references)."""
    from mlx_llm.data import tokenizer as tok_lib
    from mlx_llm.post.prologue import run_template
    from mlx_llm.runs.load import load_params
    from mlx_llm.runs.record import open_run

    run = open_run(arithmetic_sft)
    tok = tok_lib.load(run.path)
    return load_params(run), run.cfg, tok, run_template(run.record, tok)


def chat_ids(local, text):
    _, _, tok, template = local
    ids, _ = template.encode([{"role": "user", "content": text}], tok, generation_prompt=True)
    return [int(t) for t in ids]


@slow
def test_models_health_and_the_api_key(server, arithmetic_sft):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [Path(arithmetic_sft).name]  # --served-name's default
    assert models.data[0].max_model_len == 64 and models.data[0].model_extra["root"] == str(arithmetic_sft)
    assert httpx.get(server.root + "/health").json() == {"status": "ok"}  # no key needed
    for key in (None, "wrong"):
        r = httpx.get(server.url + "/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()


@slow
def test_greedy_replies_are_generates_token_for_token(server, local):
    from mlx_llm.decode.generate import generate
    from mlx_llm.runs.sample import generate_from_run

    c, name = server.client(), server.client().models.list().data[0].id
    # completions: `mlx-llm generate`'s continuation (greedy, to EOS or max tokens)
    for prompt in ("12 + 7 =", "What is 3 + 4?"):
        got = c.completions.create(model=name, prompt=prompt, temperature=0, max_tokens=10)
        want = generate_from_run(local_run(server), prompt, max_new_tokens=10)
        assert got.choices[0].text == want["continuation"]
    # chat: generate() on the template's prompt, stopping at the end-of-turn token
    params, cfg, tok, template = local
    end = tok.token_id(template.end)
    for text in ("What is 12 + 7?", "What is 30 + 11?"):
        ids = chat_ids(local, text)
        got = c.chat.completions.create(model=name, messages=[{"role": "user", "content": text}], temperature=0,
                                        max_tokens=12, extra_body={"return_token_ids": True})
        out = generate(params, cfg, np.asarray([ids], np.int32), 12, eos_id=end, pad_id=tok.pad_id)
        want = np.asarray(out.tokens[0])[:int(out.lengths[0])].tolist()
        assert got.model_extra["prompt_token_ids"] == ids
        assert got.choices[0].model_extra["token_ids"] == want
        assert got.choices[0].message.content == tok.decode(np.asarray(want, np.int32), skip_special=True)
        assert got.choices[0].finish_reason == ("stop" if want[-1] == end else "length")
        assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want)


def local_run(server):
    return server.client().models.list().data[0].model_extra["root"]


@slow
def test_logprobs_are_the_trainers_score(server, local):
    from mlx_llm.model import forward

    params, cfg, tok, _ = local
    c = server.client()
    name = c.models.list().data[0].id
    r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "What is 5 + 9?"}],
                                  temperature=0.8, top_p=0.9, seed=3, max_tokens=12, logprobs=True, top_logprobs=3,
                                  extra_body={"return_token_ids": True})
    prompt, reply = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    content = r.choices[0].logprobs.content
    assert len(content) == len(reply) >= 1
    logits = forward(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params),
                     jnp.asarray([prompt + reply], jnp.int32), cfg)
    lp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
    want = [lp[len(prompt) - 1 + k, t] for k, t in enumerate(reply)]
    np.testing.assert_allclose([e.logprob for e in content], want, atol=2e-5)
    for k, e in enumerate(content):
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        np.testing.assert_allclose(tops, np.sort(lp[len(prompt) - 1 + k])[::-1][:3], atol=2e-5)
        # log q (the extension): the token's log-prob under the distribution it was drawn from, ≥ log p_τ
        assert e.model_extra["logq"] <= 0 and e.model_extra["log_mass"] <= 1e-6


@slow
def test_streaming_sends_deltas_then_usage_then_done(server):
    body = {"model": local_name(server), "messages": [{"role": "user", "content": "What is 8 + 8?"}],
            "temperature": 0, "max_tokens": 10}
    whole = server.post("/v1/chat/completions", body).json()
    with httpx.stream("POST", server.root + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks[:-1])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert {ch["id"] for ch in chunks} == {chunks[0]["id"]} and chunks[0]["object"] == "chat.completion.chunk"


def local_name(server):
    return server.client().models.list().data[0].id


@slow
def test_n_replies_with_a_seed_are_reproducible(server):
    c, name = server.client(), local_name(server)
    ask = lambda seed: c.completions.create(model=name, prompt="1", n=4, seed=seed, temperature=2.0, max_tokens=8,
                                            extra_body={"return_token_ids": True})
    a, b, other = ask(11), ask(11), ask(12)
    assert [ch.index for ch in a.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert len({ch.text for ch in a.choices}) > 1  # four draws, not one copied
    assert [ch.text for ch in other.choices] != [ch.text for ch in a.choices]
    assert a.usage.completion_tokens == sum(len(ch.model_extra["token_ids"]) for ch in a.choices)


@slow
def test_a_stop_string_across_two_tokens_ends_the_reply_before_it(server):
    c, name = server.client(), local_name(server)
    base = c.completions.create(model=name, prompt="What is 12 + 30?", temperature=0, max_tokens=12,
                                extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) >= 6
    stop = base[3:5]  # byte-level tokens: two characters are two tokens
    cut = base[:base.find(stop)]
    got = c.completions.create(model=name, prompt="What is 12 + 30?", temperature=0, max_tokens=12, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model=name, prompt="What is 12 + 30?", temperature=0, max_tokens=12,
                                    stop=stop, stream=True, extra_body={"ignore_eos": True})
    parts = list(streamed)
    assert "".join(p.choices[0].text for p in parts) == cut  # no prefix of the stop string leaked mid-stream
    assert parts[-1].choices[0].finish_reason == "stop"


@slow
def test_token_ids_in_and_out(server, local):
    _, _, tok, _ = local
    c, name = server.client(), local_name(server)
    text = c.completions.create(model=name, prompt="12 + 7 =", temperature=0, max_tokens=6,
                                extra_body={"return_token_ids": True})
    ids = text.choices[0].model_extra["prompt_token_ids"]
    assert ids == [int(t) for t in np.concatenate([tok.bos_prefix, tok.encode("12 + 7 =")])]
    by_ids = c.completions.create(model=name, prompt=[ids, ids[:-1]], temperature=0, max_tokens=6,
                                  extra_body={"return_token_ids": True})
    assert by_ids.choices[0].text == text.choices[0].text
    assert by_ids.choices[0].model_extra["token_ids"] == text.choices[0].model_extra["token_ids"]
    assert by_ids.choices[1].model_extra["prompt_token_ids"] == ids[:-1]
    assert by_ids.usage.prompt_tokens == 2 * len(ids) - 1


ERRORS = [  # (what, path, body, status, param)
    ("unsupported field", "/v1/completions", {"prompt": "1", "logit_bias": {"5": 3}}, 400, "logit_bias"),
    ("unknown field", "/v1/completions", {"prompt": "1", "bogus": 1}, 400, "bogus"),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}]}, 400,
     "tools"),
    ("bad temperature", "/v1/completions", {"prompt": "1", "temperature": -1}, 400, "temperature"),
    ("bad n", "/v1/completions", {"prompt": "1", "n": 0}, 400, "n"),
    ("bad top_p", "/v1/completions", {"prompt": "1", "top_p": 0}, 400, "top_p"),
    ("bad stop", "/v1/completions", {"prompt": "1", "stop": [""]}, 400, "stop"),
    ("bad ids", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("too many tokens", "/v1/completions", {"prompt": "1", "max_tokens": 1000}, 400, "max_tokens"),
    ("prompt over the context", "/v1/completions", {"prompt": [5] * 100}, 413, "prompt"),
    ("unknown model", "/v1/completions", {"prompt": "1", "model": "nope"}, 404, "model"),
    ("unknown path", "/v1/nothing", {"prompt": "1"}, 404, None),
    ("malformed JSON", "/v1/completions", b'{"prompt": ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("10 MB body", "/v1/completions", b'{"prompt": "' + b"a" * 10_000_000 + b'"}', 413, None),
    ("100,000-deep JSON", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("not UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
]


@slow
@pytest.mark.parametrize("what,path,body,status,param", ERRORS, ids=[e[0] for e in ERRORS])
def test_every_error_is_openais_error_json_and_the_server_goes_on(server, what, path, body, status, param):
    if isinstance(body, dict) and "model" not in body:
        body = {"model": local_name(server), **body}
    start = time.perf_counter()
    r = server.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "\n" not in err["message"] and err["param"] == param and err["code"] == status
    assert time.perf_counter() - start < 30  # bounded time, whatever the body
    ok = server.post("/v1/completions", {"model": local_name(server), "prompt": "1", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


@slow
def test_a_client_that_disconnects_mid_stream_frees_its_pages(server):
    """A stream that goes away after its first chunk (the engine busy with 32 other replies, so it is still
    queued or decoding): its request is aborted, and once the others finish every page is back."""
    name, idle = local_name(server), server.metrics()
    assert idle["mlx_llm_requests_running"] == 0
    aborted = idle.get('mlx_llm_requests_total{finish_reason="abort"}', 0)
    busy = {"model": name, "prompt": "1", "max_tokens": 60, "ignore_eos": True, "n": 8, "temperature": 1.0}
    others = [threading.Thread(target=lambda: server.post("/v1/completions", busy)) for _ in range(4)]
    for t in others:
        t.start()
    body = {"model": name, "messages": [{"role": "user", "content": "1"}], "max_tokens": 40, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.root + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        first = next(r.iter_lines())
        assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
    for t in others:
        t.join(120)
    deadline = time.time() + 30
    while time.time() < deadline:
        m = server.metrics()
        if m["mlx_llm_requests_running"] == 0 and m['mlx_llm_requests_total{finish_reason="abort"}'] > aborted:
            break
        time.sleep(0.1)
    assert m['mlx_llm_requests_total{finish_reason="abort"}'] == aborted + 1
    assert m["mlx_llm_requests_running"] == 0 and m["mlx_llm_requests_queued"] == 0
    assert m["mlx_llm_pages_available"] == idle["mlx_llm_pages_available"]


@slow
def test_metrics_count_tokens_and_latencies(server):
    m = server.metrics()
    for name in ("mlx_llm_requests_queued", "mlx_llm_requests_running", "mlx_llm_pages_used", "mlx_llm_pages_free",
                 "mlx_llm_prefix_cache_hit_rate", "mlx_llm_prompt_tokens_total", "mlx_llm_generation_tokens_total",
                 "mlx_llm_time_to_first_token_seconds_count", "mlx_llm_inter_token_latency_seconds_count"):
        assert name in m, name
    assert m["mlx_llm_prompt_tokens_total"] > 0 and m["mlx_llm_generation_tokens_total"] > 0
    assert m["mlx_llm_time_to_first_token_seconds_count"] > 0 and 0 <= m["mlx_llm_prefix_cache_hit_rate"] <= 1


@slow
def test_64_concurrent_streams_complete_and_a_full_queue_answers_429(server):
    name = local_name(server)
    prompts = ["What is 1 + 2?", "What is 20 + 5?", "What is 7 + 7?", "What is 40 + 13?"]
    want = {p: server.post("/v1/chat/completions", {"model": name, "temperature": 0, "max_tokens": 8,
                                                    "messages": [{"role": "user", "content": p}]}).json()
            ["choices"][0]["message"]["content"] for p in prompts}
    client = openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)

    async def one(p):
        stream = await client.chat.completions.create(model=name, messages=[{"role": "user", "content": p}],
                                                      temperature=0, max_tokens=8, stream=True)
        return p, "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def burst(n, max_tokens):
        async with httpx.AsyncClient(timeout=300) as h:
            rs = await asyncio.gather(*[h.post(server.root + "/v1/completions", headers={
                "Authorization": f"Bearer {KEY}"}, json={"model": name, "prompt": "1", "max_tokens": max_tokens,
                                                          "ignore_eos": True}) for _ in range(n)])
        return rs

    async def main():
        out = await asyncio.gather(*[one(prompts[i % 4]) for i in range(64)])
        return out, await burst(120, 40)

    out, rs = asyncio.run(main())
    assert len(out) == 64 and all(text == want[p] for p, text in out)
    codes = [r.status_code for r in rs]
    assert set(codes) == {200, 429} and codes.count(429) >= 120 - 80
    full = next(r for r in rs if r.status_code == 429)
    assert full.headers["retry-after"] == "1" and full.json()["error"]["type"] == "rate_limit_error"


GEN_TASK = """task: gen_serve
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
"""


@slow
def test_lm_eval_runs_a_task_through_the_server_as_in_process(server, arithmetic_sft, tmp_path, monkeypatch):
    """lm-eval's local-completions model pointed at the server answers a generation task with the replies (and
    the score) of the harness's in-process model class on the same run."""
    lm_eval = LazyModule("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    docs = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(3, 4), (12, 30), (8, 77), (50, 1)]]
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "gen_serve.yaml").write_text(GEN_TASK.format(data=tmp_path / "gen.jsonl"))
    tasks = lambda: LazyModule("lm_eval.tasks").TaskManager(include_path=str(tmp_path), include_defaults=False)
    served = lm_eval.simple_evaluate(
        model="local-completions", tasks=["gen_serve"], task_manager=tasks(), log_samples=True,
        model_args={"model": local_name(server), "base_url": server.url + "/completions", "tokenizer_backend": None,
                    "tokenized_requests": False, "num_concurrent": 2, "max_retries": 1})
    own = lm_eval.simple_evaluate(model=LazyModule("mlx_llm.eval.harness").MLXLM(str(arithmetic_sft)),
                                  tasks=["gen_serve"], task_manager=tasks(), log_samples=True)
    replies = lambda res: [s["resps"][0][0] for s in sorted(res["samples"]["gen_serve"], key=lambda s: s["doc_id"])]
    assert replies(served) == replies(own) and len(replies(own)) == 4
    assert any(replies(own))  # not four empty strings
    assert served["results"]["gen_serve"]["exact_match,none"] == own["results"]["gen_serve"]["exact_match,none"]


def same_reply(got, want, path="reply"):
    """Two response bodies alike but for their id and time, floats within 2e-5."""
    if isinstance(want, dict):
        keys = want.keys() - ({"id", "created"} if path == "reply" else set())
        assert got.keys() - {"id", "created"} == keys if path == "reply" else got.keys() == keys, path
        for k in keys:
            same_reply(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            same_reply(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=2e-5), path
    else:
        assert got == want, path


@slow
def test_two_replicas_behind_ray_serve_share_the_requests_and_answer_as_one_engine(server, arithmetic_sft):
    """--replicas 2: Ray Serve's proxy spreads waves of 16 concurrent requests over both engines (each response
    names its replica); every reply — greedy chat and completions, seeded n = 2 draws, log-probs, token ids — is the
    single server's for the same body; errors are still OpenAI's JSON; SIGTERM drains and exits 0."""
    live = start(arithmetic_sft, "--max-seqs", "8", "--replicas", "2", "--grace", "30")
    try:
        name = local_name(server)
        bodies = [("/v1/chat/completions", {"model": name, "temperature": 0, "max_tokens": 8, "logprobs": True,
                                            "messages": [{"role": "user", "content": f"What is {i} + {i + 3}?"}]})
                  for i in range(6)]
        bodies += [("/v1/completions", {"model": name, "prompt": f"{i} + 9 =", "temperature": 0, "max_tokens": 6,
                                        "return_token_ids": True}) for i in range(6)]
        bodies += [("/v1/completions", {"model": name, "prompt": "1", "n": 2, "seed": 5 + i, "temperature": 1.5,
                                        "max_tokens": 6, "logprobs": 1}) for i in range(4)]

        async def ask(root):
            async with httpx.AsyncClient(timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as h:
                return await asyncio.gather(*[h.post(root + path, json=body) for path, body in bodies])

        # Ray's router skips a replica whose queue-length probe is slow (one compiling its first programs on a
        # loaded machine): a fresh concurrent wave of the same requests, up to 4, until both have answered
        single = [server.post(path, body) for path, body in bodies]
        assert "x-mlx-llm-replica" not in single[0].headers
        seen = set()
        for wave in range(4):
            replicated = asyncio.run(ask(live.root))
            assert [r.status_code for r in replicated] == [200] * len(bodies)
            seen |= {r.headers["x-mlx-llm-replica"] for r in replicated}
            for got, want in zip(replicated, single):  # the same tokens; log-probs to the engine's tolerance (a
                same_reply(got.json(), want.json())      # batch of other rows changes a matmul's rounding)
            if len(seen) == 2:
                break
        assert len(seen) == 2
        bad = live.post("/v1/completions", {"model": name, "prompt": "1", "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        assert live.post("/v1/completions", {"model": name, "prompt": "1"}, key="wrong").status_code == 401
        live.proc.send_signal(signal.SIGTERM)
        assert live.proc.wait(60) == 0
    finally:
        if live.proc.poll() is None:  # a failed assertion: Ray's processes go with a SIGTERM; SIGKILL after
            live.proc.send_signal(signal.SIGTERM)
            try:
                live.proc.wait(60)
            except Exception:
                live.proc.kill()
        live.proc.wait(30)


@slow
def test_sigterm_finishes_requests_in_flight_then_exits_0(server):
    """The file's last test of the live server (it stops it). SIGTERM while 3 streams and 4 requests of n = 8 are queued or decoding: every one finishes whole (its
    length, not an abort), the streams end with [DONE], the process exits 0 and listens no more."""
    name = local_name(server)
    streams, whole, started = [], [], threading.Barrier(4)

    def stream():
        with httpx.stream("POST", server.root + "/v1/chat/completions", timeout=120, headers={
                "Authorization": f"Bearer {KEY}"}, json={"model": name, "max_tokens": 40, "ignore_eos": True,
                                                          "messages": [{"role": "user", "content": "1"}],
                                                          "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines)]  # the role chunk: the request is in the server
            started.wait()
            streams.append(got + [line for line in lines if line])

    busy = {"model": name, "prompt": "1", "max_tokens": 60, "ignore_eos": True, "n": 8, "temperature": 1.0}
    threads = [threading.Thread(target=lambda: whole.append(server.post("/v1/completions", busy)))
               for _ in range(4)]
    for t in threads:
        t.start()
    threads += [threading.Thread(target=stream) for _ in range(3)]
    for t in threads[4:]:
        t.start()
    started.wait()
    assert server.metrics()["mlx_llm_requests_running"] > 0
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert server.proc.wait(120) == 0
    assert [r.status_code for r in whole] == [200] * 4
    assert all(c["finish_reason"] == "length" for r in whole for c in r.json()["choices"])
    assert len(streams) == 3 and all(s[-1] == "data: [DONE]" for s in streams)
    for s in streams:
        chunks = [json.loads(x[6:]) for x in s[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.root + "/health", timeout=5)


@slow
def test_sigterm_aborts_what_is_left_when_the_grace_runs_out(arithmetic_sft):
    """--grace 1 with 24 streams of 60 tokens on one engine row (seconds of decoding): SIGTERM once the first
    token is out, and a second later the streams still open are cut (no [DONE]) and the process exits 0 — it does
    not wait for them."""
    live = start(arithmetic_sft, "--max-seqs", "1", "--grace", "1")
    try:
        name, ended = local_name(live), []
        first = threading.Barrier(2)

        def stream(i):
            try:
                with httpx.stream("POST", live.root + "/v1/completions", timeout=120, headers={
                        "Authorization": f"Bearer {KEY}"}, json={"model": name, "prompt": "1", "max_tokens": 60,
                                                                  "ignore_eos": True, "stream": True}) as r:
                    lines = (line for line in r.iter_lines() if line)
                    got = [next(lines)]
                    if i == 0:
                        first.wait()  # a token is out: the engine is decoding
                    ended.append(got + list(lines))
            except httpx.HTTPError:
                ended.append(None)  # cut before or while streaming
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        first.wait()
        live.proc.send_signal(signal.SIGTERM)
        assert live.proc.wait(60) == 0
        for t in threads:
            t.join(60)
        done = [s for s in ended if s is not None and s[-1] == "data: [DONE]"]
        assert len(ended) == 24 and len(done) < 24  # (seconds of decoding were left: the grace cut them)
    finally:
        if live.proc.poll() is None:
            live.proc.kill()
        live.proc.wait(30)


# ----- in process -------------------------------------------------------------------------------------------
@slow
def test_a_run_without_a_chat_template_serves_completions_only(arithmetic_sft, tmp_path):
    import shutil

    from mlx_llm.serve.app import open_model
    from mlx_llm.serve.protocol import APIError

    run = tmp_path / "plain"
    shutil.copytree(arithmetic_sft, run)
    record = json.loads((run / "run.json").read_text())
    record["template"] = None
    (run / "run.json").write_text(json.dumps(record))
    said = []
    model = open_model(run, max_seqs=1, warm_up=False, log=said.append)
    assert said == [f"chat is not served: {run} records no chat template (a pretraining run); /v1/completions is"]
    with pytest.raises(APIError, match="no chat template") as err:
        model.encode_chat([{"role": "user", "content": "hi"}])
    assert err.value.status == 400
    assert model.encode_prompt("ab")[-2:] == [int(t) for t in model.tok.encode("ab")]


@slow
@pytest.mark.parametrize("flags,message", [
    (("--port", "70000"), "--port = 70000 is invalid"),
    (("--max-seqs", "0"), "--max-seqs = 0 is invalid"),
    (("--grace", "-1"), "--grace = -1.0 is invalid"),
    (("--ray-address", "auto"), "--ray-address only applies with --replicas N"),
    (("--replicas", "0"), "--replicas = 0 is invalid"),
    (("--replicas", "2", "--replica-cpus", "0"), "--replica-cpus = 0 is invalid"),
    (("--replicas", "2", "--replica-cpus", "1000"), "needs 2000 CPUs; this machine has"),
])
def test_bad_flags_are_one_line_errors(arithmetic_sft, flags, message):
    r = cli_in_process("serve", "--run", arithmetic_sft, *flags)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1 and r.stdout == ""


def test_a_missing_run_is_a_one_line_error(tmp_path):
    r = cli_in_process("serve", "--run", tmp_path / "none", "--no-warm-up")
    assert r.returncode == 2 and r.stderr.startswith("mlx-llm serve: error:") and r.stderr.count("\n") == 1


FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "min_tokens", "stop_token_ids",
          "ignore_eos", "return_token_ids", "user", "logit_bias", "echo", "frequency_penalty", "tools", "bogus"]
VALUE = st.recursive(st.none() | st.booleans() | st.integers(-5, 70) | st.floats(-3, 3) | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                  max_size=2), max_leaves=6)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["chat", "completion"]),
       body=st.dictionaries(st.sampled_from(FIELDS), VALUE, max_size=8), model=st.booleans())
def test_any_body_is_parsed_or_refused_in_one_line(kind, body, model):
    """Random request bodies: parse gives engine requests within the limits, or an APIError (400/404/413) of one
    line naming a field — never another exception."""
    from mlx_llm.serve.protocol import APIError, parse

    if model:
        body = {**body, "model": "m"}
    encode = lambda text: [1] + [ord(c) % 50 for c in text]
    try:
        parsed = parse(body, kind, served="m", encode_prompt=encode,
                       encode_chat=lambda ms: encode("".join(m["content"] for m in ms)),
                       stop_ids_of=lambda ignore: () if ignore else (2,), vocab=50, max_len=64, max_n=8)
    except APIError as err:
        assert err.status in (400, 404, 413) and err.message and "\n" not in err.message
        return
    for r in parsed.requests:
        assert 1 <= r.n <= 8 and len(r.prompt) + r.max_tokens <= 64 and 0 <= r.temperature <= 2
        assert all(0 <= t < 50 for t in r.prompt) and 0 <= r.min_tokens <= r.max_tokens


def test_the_docs_table_is_rendered_from_the_results_file():
    """docs/serving.md holds ``bench_serve --render`` of experiments/results/bench_serve.json verbatim."""
    from experiments import bench_serve, common

    page = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    assert bench_serve.render(common.load_result("bench_serve")) in page
