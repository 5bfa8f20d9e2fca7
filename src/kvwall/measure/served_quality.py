"""`kvwall quality MODEL --server URL`: quality's perplexity and pass-key measurement through any OpenAI-compatible
server that returns prompt logprobs (`echo` + `logprobs` on /v1/completions: kvwall serve, vLLM), so that one
command compares a served model and its cache strategy against another engine's.

The rows and pass-key prompts are quality's own (measure/quality.py), made with MODEL's tokenizer and sent as token
ids (the server must serve a model of the same vocabulary). Per row, one request scores every token in the forward
that computes it: token_logprobs[t] is log p(row[t] | row[:t]), and the positions scored are quality's, prefill + 1
.. L - 1. What a server can tell without its full distributions:
    ppl   exp(mean negative logprob of the scored tokens): quality's exact-cache figure when the server is exact
    top1  the share of scored tokens that were the server's most likely one (next-token accuracy; quality's top-1
          column instead compares a cache's argmax with the exact cache's)
KL needs every logit and is not measured. Pass key: each prompt greedy (temperature 0), as many new tokens as
quality generates, the first number of the answer against the key.
"""

from __future__ import annotations

import math

from kvwall.errors import KvwallError
from kvwall.measure.quality import Plan, Tokens, answer_ok, passkey_prompts, split_rows


class Server:
    """POST /v1/completions with token-id prompts; one-line errors for a server that is down or refuses."""

    def __init__(self, url: str, model: str | None, api_key: str | None, timeout: float = 600.0):
        import httpx

        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=timeout, headers=headers)
        self.model = model or self._only_model()

    def _get(self, path: str) -> dict:
        return self._answer(lambda: self.http.get(self.url + path), path)

    def _answer(self, send, path: str) -> dict:
        import httpx

        try:
            r = send()
        except httpx.HTTPError as e:
            raise KvwallError(f"--server {self.url}: {path} failed ({e}); is the server up?") from None
        if r.status_code != 200:
            raise KvwallError(f"--server {self.url}: {path} answered HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def _only_model(self) -> str:
        models = [m.get("id") for m in self._get("/v1/models").get("data", [])]
        if len(models) != 1:
            raise KvwallError(f"--server {self.url} serves {len(models)} models ({', '.join(map(str, models))}); "
                              "name one with --server-model")
        return models[0]

    def complete(self, **body) -> dict:
        return self._answer(lambda: self.http.post(self.url + "/v1/completions", json={"model": self.model, **body}),
                            "/v1/completions")["choices"][0]

    def prompt_logprobs(self, ids: list[int]) -> tuple[list[float | None], list[dict | None]]:
        """Each prompt token's logprob and top-1 alternative (max_tokens 1: vLLM and OpenAI's legacy API take
        no 0; the one new token is dropped)."""
        lp = self.complete(prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0).get("logprobs") or {}
        got, top = lp.get("token_logprobs"), lp.get("top_logprobs")
        if not got or len(got) < len(ids) or not top:
            raise KvwallError(f"--server {self.url} returned no logprobs for the prompt's tokens (echo + logprobs on "
                              "/v1/completions); it needs a server that scores prompts (kvwall serve, vLLM)")
        return got[:len(ids)], top[:len(ids)]


def measure(server: Server, tok, plan: Plan, text: str, source: str, on_step=None) -> dict:
    """Quality's table data for one served model: one row "served" (ppl, top-1 accuracy), pass-key cells."""
    tokens = Tokens(tok)
    ids = tokens.plain(text)
    rows = split_rows(ids, plan.tokens, plan.rows, tokens.prefix).tolist()
    nll, agree, n = 0.0, 0, 0
    for row in rows:
        got, top = server.prompt_logprobs(row)
        for t in range(plan.prefill + 1, len(row)):  # quality's scored positions (measure/quality.perplexity)
            nll -= got[t]
            agree += got[t] >= max(top[t].values())  # the same float when the token is the top one
            n += 1
        if on_step:
            on_step()
    name = f"served ({server.model})"
    out = {"model": server.model, "server": server.url,
           "text": {"source": source, "tokens": len(ids), "used": sum(map(len, rows)), "rows": plan.rows,
                    "row_tokens": len(rows[0]), "prefill": plan.prefill},
           "quality": [{"cache": name, "ppl": math.exp(nll / n), "top1_accuracy": agree / n, "predictions": n}]}
    if plan.passkey:
        pk = plan.passkey
        cells = []
        for (length, depth), prompts in passkey_prompts(tokens, ids, pk).items():
            answer = len(tokens.plain(" " + prompts[0].key)) + 3  # as quality.retrieve generates
            ok = [answer_ok(server.complete(prompt=p.ids, max_tokens=answer, temperature=0)["text"], p.key)
                  for p in prompts]
            cells.append({"cache": name, "length": length, "depth": depth, "correct": sum(ok), "keys": len(ok),
                          "accuracy": sum(ok) / len(ok)})
            if on_step:
                on_step()
        out["passkey"] = {"lengths": pk.lengths, "depths": list(pk.depths), "keys": pk.keys, "seed": pk.seed,
                          "cells": cells}
    return out
