"""Issue #44: kvwall serve speaks the OpenAI API as its clients use it. Each field is served (and checked against a
reference computed here: transformers' model on the same tokens, the sampling rules written out by hand) or
refused with an error naming it. A tiny random llama (context 512, no EOS) with a word-level tokenizer ("w0".."w159"
<-> ids 0..159), driven through the `openai` client where it can send the field, httpx where not."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from kvwall.engine.generate import Sampling, generate  # noqa: E402
from kvwall.engine.tokenizer import Text  # noqa: E402
from kvwall.serve import serving_in_thread  # noqa: E402
from kvwall.serve.runner import Runner  # noqa: E402
from kvwall.serve.server import Api  # noqa: E402
from kvwall.serve.worker import Worker  # noqa: E402

NAME, VOCAB, KEY = "tiny", 160, "k3y"
BLOCK = 4


def word_tokenizer(path) -> Text:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return Text(path)


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    path, model = tiny_model("llama")
    tok = word_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    # chunk 16: a 40-token prompt is prefilled in three chunks, beside other requests' rows
    runner = Runner(model, n_blocks=300, block_size=BLOCK, chunk=16, max_batch=8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with serving_in_thread(Api(Worker(runner), tok, NAME).app()) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
        yield SimpleNamespace(url=url, runner=runner, model=model, tok=tok, hf=hf, client=client)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `ids`: (T, V); row t scores token t + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def words(ids: list[int]) -> str:
    return " ".join(f"w{t}" for t in ids)


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def post(s, path: str, **body) -> httpx.Response:
    return httpx.post(s.url + path, json={"model": NAME, **body}, timeout=60)


def assert_error(r, status: int, param, fragment: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param and fragment in err["message"], err
    return err


# -- logprobs: the same forward as the token, equal to transformers' log-softmax ----------------------------

def check_completion_logprobs(s, prompt: list[int], got: dict, k: int) -> None:
    """An echo + logprobs choice against transformers on prompt + the generated tokens."""
    lp = got["logprobs"]
    ids = ids_of(" ".join(lp["tokens"]))
    out = ids[len(prompt):]
    assert ids[:len(prompt)] == prompt and got["text"] == words(prompt) + words(out)  # the prompt's text, then the
    #                                                       choice's (this word-level tokenizer decodes no spaces)
    ref = hf_logprobs(s.hf, ids)  # (T, V)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing comes before token 0
    for t in range(1, len(ids)):
        assert lp["token_logprobs"][t] == pytest.approx(float(ref[t - 1, ids[t]]), abs=2e-5)
        best = ref[t - 1].topk(k)
        want = {f"w{i}": v for i, v in zip(best.indices.tolist(), best.values.tolist())}
        top = lp["top_logprobs"][t]
        assert {w: top[w] for w in want} == pytest.approx(want, abs=2e-5)
        assert set(top) <= set(want) | {lp["tokens"][t]}  # the top k, and the token itself (as vLLM lists it)
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(w) for a, b, w in zip(offsets, offsets[1:], lp["tokens"]))


def test_echo_and_logprobs_equal_transformers_log_softmax(served):
    prompt = [7, 3, 9, 3, 150, 42, 7]
    r = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                         logprobs=3)
    got = r.choices[0].model_dump()
    assert len(got["logprobs"]["tokens"]) == len(prompt) + 5
    check_completion_logprobs(served, prompt, got, 3)
    greedy = generate(served.model, [prompt], 5).tokens[0]
    assert ids_of(" ".join(got["logprobs"]["tokens"]))[len(prompt):] == greedy


def test_logprobs_in_a_continuous_batch_equal_transformers(served):
    """Six prompts of 3 to 45 tokens at once: prefill chunks of 16 beside other requests' decode rows, their
    logprobs taken from those same forwards (no second pass)."""
    prompts = [[(5 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((3, 45, 17, 8, 33, 16))]
    answers: dict[int, dict] = {}

    def ask(i):
        body = {"prompt": prompts[i], "max_tokens": 4 + i, "temperature": 0, "echo": True, "logprobs": 2}
        answers[i] = post(served, "/v1/completions", **body).json()["choices"][0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, p in enumerate(prompts):
        check_completion_logprobs(served, p, answers[i], 2)


def test_max_tokens_0_with_echo_scores_the_prompt(served):
    prompt = [11, 12, 13, 14, 15, 16]
    r = post(served, "/v1/completions", prompt=prompt, max_tokens=0, echo=True, logprobs=1).json()
    c = r["choices"][0]
    assert c["text"] == words(prompt) and c["finish_reason"] == "length"
    assert len(c["logprobs"]["token_logprobs"]) == len(prompt)  # no generated token
    ref = hf_logprobs(served.hf, prompt)
    total = sum(c["logprobs"]["token_logprobs"][1:])
    assert total == pytest.approx(sum(float(ref[t - 1, prompt[t]]) for t in range(1, len(prompt))), abs=1e-4)
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == len(prompt)
    assert_error(post(served, "/v1/completions", prompt=prompt, max_tokens=0), 400, "max_tokens", "max_tokens")


def test_a_scored_prompt_is_computed_not_taken_from_the_prefix_cache(served):
    """Blocks cached by an earlier request hold K/V, not logits: a prompt whose logprobs are asked for computes
    every token (cached_tokens 0), and its logprobs are whole."""
    prompt = [90 + i for i in range(13)]  # 3 full blocks of 4
    first = post(served, "/v1/completions", prompt=prompt, max_tokens=1, temperature=0).json()
    again = post(served, "/v1/completions", prompt=prompt, max_tokens=1, temperature=0).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 12  # the 3 sealed blocks
    scored = post(served, "/v1/completions", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    scored = scored.json()
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    check_completion_logprobs(served, prompt, scored["choices"][0], 1)


def test_chat_logprobs_and_top_logprobs_equal_transformers(served):
    tok = served.tok
    prompt = tok.encode("user: w5 w6 w7\nassistant:")  # the plain chat format of a tokenizer without a template
    r = served.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "w5 w6 w7"}],
                                              max_completion_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    out = ids_of(r.choices[0].message.content)
    ref = hf_logprobs(served.hf, prompt + out)
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [f"w{t}" for t in out]
    for i, e in enumerate(content):
        row = ref[len(prompt) - 1 + i]
        assert e.logprob == pytest.approx(float(row[out[i]]), abs=2e-5)
        assert e.bytes == list(e.token.encode())
        best = row.topk(2)
        assert [a.token for a in e.top_logprobs] == [f"w{t}" for t in best.indices.tolist()]
        assert [a.logprob for a in e.top_logprobs] == pytest.approx(best.values.tolist(), abs=2e-5)
    streamed = [e for chunk in served.client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "w5 w6 w7"}], max_completion_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2, stream=True) for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)  # float32 sums
    assert_error(post(served, "/v1/chat/completions", messages=[{"role": "user", "content": "w1"}], top_logprobs=2),
                 400, "top_logprobs", "logprobs: true")


def test_a_streamed_echo_sends_the_prompt_first(served):
    chunks = list(served.client.completions.create(model=NAME, prompt="w4 w5", max_tokens=3, temperature=0,
                                                   echo=True, logprobs=1, stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith("w4 w5") and first.logprobs.tokens[:2] == ["w4", "w5"]
    assert first.logprobs.token_logprobs[0] is None
    whole = post(served, "/v1/completions", prompt="w4 w5", max_tokens=3, temperature=0, echo=True).json()
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole["choices"][0]["text"]


# -- several prompts, n, best_of ---------------------------------------------------------------------------

def test_a_list_of_prompts_gets_one_choice_each_in_order(served):
    texts = ["w1 w2 w3", "w9 w8", "w40 w41 w42 w43"]
    r = served.client.completions.create(model=NAME, prompt=texts, max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, text in zip(r.choices, texts):
        assert c.text == words(generate(served.model, [ids_of(text)], 3).tokens[0])
    ids = [ids_of(t) for t in texts]
    by_ids = served.client.completions.create(model=NAME, prompt=ids, max_tokens=3, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in r.choices]
    assert r.usage.prompt_tokens == 9 and r.usage.completion_tokens == 9


def test_n_samples_share_the_prompts_blocks(served):
    """n = 3 with a seed: choice j is the sample of seed + j (one seed for all would give three equal choices),
    and choices 1 and 2 take the prompt's 3 full blocks of 4 from the prefix cache (its last token recomputed for
    their logits: 11 cached tokens each)."""
    prompt = [100 + i for i in range(12)]
    before = served.runner.sched.pool.hits
    r = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=1.0, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for j, c in enumerate(r.choices):
        want = generate(served.model, [prompt], 6, sampling=Sampling(temperature=1.0, seed=5 + j)).tokens[0]
        assert ids_of(c.text) == want
    assert served.runner.sched.pool.hits - before == 2 * 3
    assert r.usage.prompt_tokens_details.cached_tokens == 2 * 11
    assert r.usage.completion_tokens == 18
    two = served.client.completions.create(model=NAME, prompt=["w1 w2", "w3"], max_tokens=2, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text != two.choices[2].text == two.choices[3].text


def test_best_of_returns_the_choices_of_highest_total_logprob(served):
    prompt = [20, 21, 22]
    body = dict(prompt=prompt, max_tokens=5, temperature=1.0, seed=9, logprobs=0)
    every = post(served, "/v1/completions", n=4, **body).json()["choices"]
    totals = [sum(c["logprobs"]["token_logprobs"]) for c in every]
    best = post(served, "/v1/completions", n=2, best_of=4, **body).json()["choices"]
    ranked = sorted(range(4), key=lambda j: -totals[j])[:2]
    assert [c["text"] for c in best] == [every[j]["text"] for j in ranked] and [c["index"] for c in best] == [0, 1]
    assert_error(post(served, "/v1/completions", prompt=prompt, n=2, best_of=1), 400, "best_of", "best_of")
    assert_error(post(served, "/v1/completions", prompt=[[1]] * 2049, n=2), 400, "prompt", "2,049 prompts x 2")
    assert_error(post(served, "/v1/completions", prompt=prompt, best_of=2, stream=True), 400, "best_of", "stream")


def test_a_stream_of_two_prompts_and_n_2_carries_every_choice_and_its_logprobs(served):
    stream = served.client.completions.create(model=NAME, prompt=["w1 w2", "w7"], max_tokens=3, temperature=0,
                                              n=2, logprobs=1, stream=True, stream_options={"include_usage": True})
    texts, lps, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs if c.logprobs else [])
    assert sorted(texts) == [0, 1, 2, 3] and usage.completion_tokens == 12
    for i, prompt in ((0, [1, 2]), (1, [1, 2]), (2, [7]), (3, [7])):
        out = generate(served.model, [prompt], 3).tokens[0]
        assert texts[i].split() == [f"w{t}" for t in out]
        ref = hf_logprobs(served.hf, prompt + out)
        assert lps[i] == pytest.approx([float(ref[len(prompt) - 1 + j, t]) for j, t in enumerate(out)], abs=2e-5)


# -- sampling rules against a reference by hand -------------------------------------------------------------

def by_hand(logits: list[float], prompt: list[int], out: list[int], *, frequency=0.0, presence=0.0, repetition=1.0,
            bias=None, min_tokens=0, stops=()) -> list[float]:
    """vLLM's order, one token at a time: min_tokens, logit_bias, repetition (prompt + output), frequency and
    presence (output only)."""
    x = list(logits)
    for t in range(len(x)):
        if len(out) < min_tokens and t in stops:
            x[t] = -math.inf
        x[t] += (bias or {}).get(t, 0.0)
        if t in prompt or t in out:
            x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
        x[t] -= frequency * out.count(t) + presence * (out.count(t) > 0)
    return x


def greedy_by_hand(hf, prompt: list[int], n: int, **rules) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].tolist()
        x = by_hand(logits, prompt, out, **rules)
        out.append(max(range(len(x)), key=x.__getitem__))
        if out[-1] in rules.get("stops", ()) and len(out) > rules.get("min_tokens", 0):
            break
    return out


@pytest.mark.parametrize("fields, rules", [
    ({"frequency_penalty": 1.5}, {"frequency": 1.5}),
    ({"presence_penalty": 2.0}, {"presence": 2.0}),
    ({"frequency_penalty": -0.4, "presence_penalty": 0.3}, {"frequency": -0.4, "presence": 0.3}),
    ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition": 1.8}),
    ({"extra_body": {"repetition_penalty": 0.5}}, {"repetition": 0.5}),
    ({"logit_bias": {"17": 3.0, "30": -100}}, {"bias": {17: 3.0, 30: -100.0}}),
    ({"frequency_penalty": 0.7, "logit_bias": {"5": 0.5}, "extra_body": {"repetition_penalty": 1.3}},
     {"frequency": 0.7, "bias": {5: 0.5}, "repetition": 1.3}),
])
def test_penalties_and_bias_equal_the_rules_by_hand(served, fields, rules):
    prompt = [5, 6, 5, 7, 8, 5, 30]
    plain = generate(served.model, [prompt], 8).tokens[0]
    want = greedy_by_hand(served.hf, prompt, 8, **rules)
    r = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, **fields)
    assert ids_of(r.choices[0].text) == want
    assert want != plain or rules.get("frequency", 0) < 0  # the rule changed what greedy decoding picks


def test_top_k_1_samples_the_most_likely_token(served):
    prompt = [33, 34, 35]
    greedy = words(generate(served.model, [prompt], 6).tokens[0])
    r = post(served, "/v1/completions", prompt=prompt, max_tokens=6, temperature=1.5, seed=3, top_k=1).json()
    assert r["choices"][0]["text"] == greedy
    for off in (0, -1):  # vLLM's values for "no top-k"
        assert post(served, "/v1/completions", prompt=prompt, max_tokens=1, top_k=off).status_code == 200


def test_min_tokens_and_stop_token_ids(served):
    prompt = [60, 61, 62]
    first = generate(served.model, [prompt], 1).tokens[0][0]
    # stop_token_ids ends at the model's own first token, which stays in the output (as vLLM keeps it)
    r = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"stop_token_ids": [first]})
    assert ids_of(r.choices[0].text) == [first] and r.choices[0].finish_reason == "stop"
    # min_tokens 3 holds it back for 3 tokens
    r = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"stop_token_ids": [first], "min_tokens": 3})
    want = greedy_by_hand(served.hf, prompt, 8, min_tokens=3, stops={first})
    assert ids_of(r.choices[0].text) == want and len(want) > 3 and first not in want[:3]
    assert_error(post(served, "/v1/completions", prompt="w1", max_tokens=2, min_tokens=3), 400, "min_tokens",
                 "more than max_tokens")
    assert_error(post(served, "/v1/completions", prompt="w1", logit_bias={"999": 1}), 400, "logit_bias",
                 "vocabulary")
    assert_error(post(served, "/v1/completions", prompt="w1", logit_bias={"3": 101}), 400, "logit_bias", "-100")
    assert_error(post(served, "/v1/completions", prompt="w1", frequency_penalty=3), 400, "frequency_penalty", "[-2")


# -- chat content --------------------------------------------------------------------------------------------

def test_chat_content_parts_null_assistant_content_and_max_completion_tokens(served):
    c = served.client.chat.completions
    plain = c.create(model=NAME, messages=[{"role": "user", "content": "w3 w4\nw5"}], max_tokens=4, temperature=0)
    parts = c.create(model=NAME, temperature=0, max_completion_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "w3 w4"}, {"type": "text", "text": "w5"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.completion_tokens == 4
    turns = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": None},
             {"role": "user", "content": "w2"}]
    null = c.create(model=NAME, messages=turns, max_tokens=3, temperature=0).choices[0].message.content
    ids = served.tok.encode("user: w1\nassistant: \nuser: w2\nassistant:")
    assert ids_of(null) == generate(served.model, [ids], 3).tokens[0]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert_error(post(served, "/v1/chat/completions", messages=[{"role": "user", "content": [image]}]), 400,
                 "messages[0].content[0].type", "image_url")
    assert_error(post(served, "/v1/chat/completions", messages=[{"role": "user", "content": None}]), 400,
                 "messages[0].content", "null only on an assistant turn")


# -- what is not served, and the error shape -----------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/chat/completions", {"tools": [TOOL]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"functions": [TOOL["function"]]}, "functions"),
    ("/v1/chat/completions", {"modalities": ["audio"]}, "modalities"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"suffix": "w9"}, "suffix"),
    ("/v1/completions", {"min_p": 0.1}, "min_p"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
])
def test_fields_not_served_are_refused_by_name(served, path, fields, param):
    base = {"messages": [{"role": "user", "content": "w1"}]} if "chat" in path else {"prompt": "w1"}
    err = assert_error(post(served, path, **base, **fields), 400, param, param)
    assert err["code"] == "unsupported_parameter" and err["type"] == "invalid_request_error"


def test_nothing_asked_and_null_fields_are_served(served):
    """What clients send by default: null fields, n null, response_format text, no tools."""
    r = post(served, "/v1/chat/completions", messages=[{"role": "user", "content": "w1"}], max_tokens=2,
             temperature=0, n=None, tools=[], tool_choice="none", response_format={"type": "text"}, stop=None,
             logit_bias=None, user="u1", top_logprobs=None)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


def test_unknown_model_route_and_method_get_the_error_shape(served):
    with pytest.raises(openai.NotFoundError) as e:
        served.client.completions.create(model="gpt-4", prompt="w1", max_tokens=1)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    assert_error(httpx.post(served.url + "/v1/embeddings", json={}), 404, None, "no route /v1/embeddings")
    err = assert_error(httpx.get(served.url + "/v1/completions"), 405, None, "GET is not allowed")
    assert err["code"] == "method_not_allowed"


def test_max_tokens_past_the_context_names_the_field(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(model=NAME, prompt=[1] * 500, max_tokens=13)
    assert e.value.body["param"] == "max_tokens" and "give max_tokens at most 12" in e.value.body["message"]
    assert "--" not in e.value.body["message"]


def test_every_v1_route_needs_the_key(tiny_model, tmp_path):
    _, model = tiny_model("llama")
    api = Api(Worker(Runner(model, n_blocks=20, block_size=BLOCK)), word_tokenizer(tmp_path / "t.json"), NAME, KEY)
    with serving_in_thread(api.app()) as url:
        for path in ("/v1/models", "/v1/nothing-here"):
            assert_error(httpx.get(url + path), 401, None, "API key")
        keyed = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert [m.id for m in keyed.models.list()] == [NAME]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


# -- langchain (where it is installed: optional, not a project dependency) ---------------------------------

def test_langchain_chat_and_completion_batch(served):
    """ChatOpenAI with logprobs, and the completion model's batch(), which sends a list of prompts in one
    request (a 400 before issue #44)."""
    lc = pytest.importorskip("langchain_openai")
    chat = lc.ChatOpenAI(model=NAME, base_url=served.url + "/v1", api_key="none", temperature=0, max_tokens=3,
                         max_retries=0, logprobs=True)
    msg = chat.invoke("w5 w6 w7")
    ids = served.tok.encode("user: w5 w6 w7\nassistant:")
    out = generate(served.model, [ids], 3).tokens[0]
    assert ids_of(msg.content) == out
    assert [e["token"] for e in msg.response_metadata["logprobs"]["content"]] == [f"w{t}" for t in out]
    llm = lc.OpenAI(model=NAME, base_url=served.url + "/v1", api_key="none", temperature=0, max_tokens=2,
                    max_retries=0, batch_size=4)
    prompts = ["w1 w2", "w3", "w9 w9 w9"]
    want = [words(generate(served.model, [ids_of(p)], 2).tokens[0]) for p in prompts]
    assert llm.batch(prompts) == want
    result = llm.generate(prompts)  # one request: its prompt a list of 3 (batch_size 4)
    assert [g[0].text for g in result.generations] == want
