"""Each completion token's text for the trajectory page, asked of vLLM when the page is first shown.

The gateway stores ids and logprobs, not text per token, and holds no tokenizer (loading one per base model at page
time is what this avoids). vLLM has what is needed: its `/v1/completions/derender` endpoint (scale-out, the one
token_in mode already requires) takes generate-shaped answers, one per call, and resolves every sampled id of their
`logprobs.content` to the token's string the same way its chat logprobs do, U+FFFD repaired from the preceding ids
when a character spans tokens. It runs the tokenizer only (no forward pass): one request carries every call of a
page, up to TOKENS_PER_REQUEST tokens (a longer trajectory takes several requests, one after another, so vLLM's
renderer thread, which token_in's live calls share, is never held long). `/detokenize` would answer one joined
string per request, and `/tokenize` takes text, not ids.

Recording the strings instead would add bytes to every call on the hot path (and chat-mode responses are the only
ones that carry them) for a page read now and then; token_in calls and rows written before would still lack them.
A call's tokens never change once recorded, so the strings are kept per call id (TokenTextCache): a page seen again
asks nothing.

When vLLM cannot answer (unreachable, too slow, started without --enable-scale-out: 403), the page shows the ids
and says why: the page never fails because of it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from gateway.proxy.hot_path import Proxy

DERENDER_COMPLETIONS = "/v1/completions/derender"
# Tokens per derender request (vLLM resolves ~0.1 ms of tokenizer work per token on a loaded 2-core CPU box).
TOKENS_PER_REQUEST = 4096
# Token strings kept across page views, by call id.
CACHE_TOKENS = 500_000


class TokenTextCache:
    """Token strings per call id, the least recently shown dropped first past `max_tokens` strings in all."""

    def __init__(self, max_tokens: int = CACHE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, list[str]] = OrderedDict()
        self._tokens = 0

    def get(self, call_id: str) -> list[str] | None:
        found = self._entries.get(call_id)
        if found is not None:
            self._entries.move_to_end(call_id)
        return found

    def put(self, call_id: str, texts: list[str]) -> None:
        if call_id in self._entries:
            return
        self._entries[call_id] = texts
        self._tokens += len(texts)
        while self._tokens > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self._tokens -= len(dropped)


def batches(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Positions of `sizes` in order, grouped so each group's sizes sum to at most `limit` (a larger one alone)."""
    out: list[list[int]] = []
    total = limit
    for i, size in enumerate(sizes):
        if total + size > limit:
            out.append([])
            total = 0
        out[-1].append(i)
        total += size
    return out


@dataclass(slots=True)
class TokenTexts:
    """Per call (in the order asked) its tokens' strings, or None where they are not known; `error` says why not."""

    texts: list[list[str] | None]
    error: str | None = None


def derender_body(completions: Sequence[Sequence[int]], first: int = 0) -> dict[str, object]:
    """The derender request for these calls' completion ids: one generate answer each, every id with a logprob (the
    string does not depend on its value, so 0.0 is sent, which also keeps -inf out of the JSON)."""
    return {
        "generate_responses": [
            {
                "request_id": f"trajgate-ui-{first + i}",
                "choices": [
                    {
                        "index": 0,
                        "token_ids": list(ids),
                        "logprobs": {"content": [{"token_id": token, "logprob": 0.0} for token in ids]},
                    }
                ],
            }
            for i, ids in enumerate(completions)
        ],
        # Empty prompts: the strings of the logprobs do not read them, and an omitted list makes vLLM warn.
        "prompt_token_ids": [[] for _ in completions],
    }


def parse_derendered(answer: object, completions: Sequence[Sequence[int]]) -> list[list[str] | None]:
    """Each call's token strings from a derender answer (choice i is call i); None for a call whose answer does not
    hold one string per id."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    by_index = {c.get("index"): c for c in choices or () if isinstance(c, dict)}
    out: list[list[str] | None] = []
    for i, ids in enumerate(completions):
        logprobs = (by_index.get(i) or {}).get("logprobs") or {}
        tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
        ok = isinstance(tokens, list) and len(tokens) == len(ids) and all(isinstance(t, str) for t in tokens)
        out.append(tokens if ok else None)
    return out


async def token_texts(
    proxy: Proxy, cache: TokenTextCache, calls: Sequence[tuple[str, Sequence[int]]], timeout_s: float
) -> TokenTexts:
    """The strings of the completion tokens of `calls` ((call id, completion ids) each; those without ids get None),
    from the cache or the least-busy replica; on a failure, the calls not yet known get None and `error` the reason,
    in one line."""
    texts: list[list[str] | None] = [cache.get(call_id) if ids else None for call_id, ids in calls]
    wanted = [i for i, (_, ids) in enumerate(calls) if ids and texts[i] is None]
    if not wanted or proxy.session is None:
        return TokenTexts(texts)
    replica = proxy.replicas.pick(None, None)
    try:
        async with asyncio.timeout(timeout_s):
            for group in batches([len(calls[i][1]) for i in wanted], TOKENS_PER_REQUEST):
                batch = [wanted[j] for j in group]
                asked = [calls[i][1] for i in batch]
                body = orjson.dumps(derender_body(asked, group[0]))
                async with proxy.session.post(
                    replica.root_url + DERENDER_COMPLETIONS, data=body, headers=proxy.upstream_headers
                ) as response:
                    raw = await response.read()
                    if response.status != 200:
                        hint = " (start vLLM with --enable-scale-out)" if response.status in (403, 404) else ""
                        return TokenTexts(texts, f"vLLM answered {response.status} on {DERENDER_COMPLETIONS}{hint}")
                for i, found in zip(batch, parse_derendered(orjson.loads(raw), asked), strict=True):
                    texts[i] = found
                    if found is not None:
                        cache.put(calls[i][0], found)
    except TimeoutError:
        return TokenTexts(texts, f"vLLM did not answer {DERENDER_COMPLETIONS} in {timeout_s:g} s")
    except (aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        return TokenTexts(texts, f"vLLM unreachable: {type(exc).__name__}")
    missing = sum(1 for i in wanted if texts[i] is None)
    return TokenTexts(texts, f"vLLM gave no token strings for {missing} call(s)" if missing else None)
