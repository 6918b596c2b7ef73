"""A trajectory is a tree of calls: each call's parent is the recorded call whose prompt + completion ids its prompt
extends the furthest, not the call that arrived before it.

Agents are rarely one linear chat: a supervisor hands a task to a sub-agent (another system prompt: a new root of the
same trajectory) and then resumes its own history; parallel branches continue the same call; a retried turn with an
edited message continues the turn before it. Taking "the previous call" as the parent makes each of those a break;
taking the furthest-extended recorded call keeps every continuation on its own exact tokens.

The lookup reads the new prompt's own ids, never earlier calls' ids: every call stores `tokens_len` (its prompt +
completion length) and `tokens_key` (a hash of those ids). A new call hashes its prompt up to the longest candidate
length that fits and compares that digest first: a call that extends the newest call of its agent (every turn of a
linear agent) is placed with one pass and one digest, however many calls came before. Otherwise it hashes its prompt
incrementally and reads the digest at each candidate's length; a candidate is extended when the digests match. Work
per call then: at most twice the prompt's length in hashed ids plus one digest per distinct candidate length (the
trajectory's calls). The keys live in the database, so every gateway process finds the same parent. Ties (two
recorded calls with the same ids) go to the lowest (seq, choice), so the choice does not depend on arrival order.

A root (a call extending nothing) keeps the reason gateway.store.lineage gives against the previous call, refined by
the requests' messages: `new_root` when it shares no message with it (a sub-agent with its own system prompt, a fresh
conversation), and `compacted` when its ids diverge inside the previous prompt, it holds fewer messages, and the first
message that differs is one the previous request never held (a summary in place of the cut history), as opposed to
`truncated` (messages dropped: the first that differs is one the previous request held, also in a sliding window
that appends as many) and `history_edited` (as many messages or more, the first that differs new: a message changed
in place, also one shortened). Without messages to compare (a completions call) the ids alone decide: `truncated`
when the prompt is shorter than the previous one, else `history_edited`. Several agents' calls
interleave in one trajectory, so a root sharing no message with the previous call is also compared with the latest
earlier call whose request starts with the same message (root_anchor), and takes the reason against that one when it
plainly continues it (OWN_AGENT_REASONS): it compacts that call's history, or holds that call's whole prompt (a
re-rendered reply, a dropped tool call, a retry). An agent that compacts, or resumes on a reply its template
re-rendered, right after a sub-agent's call is then `compacted` or `completion_rerendered`, not a `new_root`.
Otherwise it stays a `new_root` (a sub-agent started again on a new task: `truncated` and `history_edited` cannot
tell it from an edit). Messages alone cannot tell a summary from a fresh task, so a sub-agent started again with fewer
messages than its last run held reads as `compacted`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from gateway.store.arrays import encode_ids
from gateway.store.lineage import (
    COMPACTED,
    COMPLETION_RERENDERED,
    FIRST_CALL,
    HISTORY_EDITED,
    NEW_ROOT,
    NO_IDS,
    RETRY,
    TEMPLATE_DROPPED_TOOL_CALL,
    TRUNCATED,
)
from gateway.store.messages import DIGEST_BYTES, shared_messages

KEY_BYTES = 16
AnchorT = TypeVar("AnchorT")
# A root's reasons against its own agent's last call that say it continues that call (root_anchor).
OWN_AGENT_REASONS = frozenset({COMPACTED, COMPLETION_RERENDERED, TEMPLATE_DROPPED_TOOL_CALL, RETRY})


class Candidate(NamedTuple):
    """A recorded call as a possible parent: where it is and what its prompt + completion hash to (a NamedTuple, as
    gateway.store.lineage.Lineage: one is built for every record the writer places)."""

    seq: int
    choice_index: int
    tokens_len: int
    tokens_key: bytes


@dataclass(slots=True)
class LookupWork:
    """What parent lookups cost, counted (not timed) so a test can tell it does not grow with earlier calls' ids."""

    ids_hashed: int = 0
    digests: int = 0


def own_key(
    prompt: Sequence[int] | None,
    completion: Sequence[int] | None,
    packed: tuple[bytes | None, bytes | None] | None = None,
) -> tuple[int, bytes] | None:
    """(tokens_len, tokens_key) of a call: the count of its prompt + completion ids and a hash of their packed bytes
    (as the ids columns hold them); None when it lacks ids (it can then be nobody's parent). `packed`: as `place`."""
    return place(prompt, completion, (), packed=packed)[1]


def find_parent(
    prompt: Sequence[int] | None, candidates: Iterable[Candidate], work: LookupWork | None = None
) -> Candidate | None:
    """The candidate whose ids the prompt starts with, the longest one; the lowest (seq, choice) on a tie."""
    return place(prompt, None, candidates, work)[0]


def place(
    prompt: Sequence[int] | None,
    completion: Sequence[int] | None,
    candidates: Iterable[Candidate],
    work: LookupWork | None = None,
    packed: tuple[bytes | None, bytes | None] | None = None,
) -> tuple[Candidate | None, tuple[int, bytes] | None]:
    """The call's parent among `candidates` (as find_parent) and its own (tokens_len, tokens_key) (as own_key, None
    without a completion), from one pass of the hash over its ids (two when the longest candidate that fits is not
    its parent): the digests at the candidates' lengths are the prefixes of the same stream that ends in its own key.
    `packed`: the prompt and completion as encode_ids packed them, where the caller has them already (the writer
    packs a record's ids once for its row, its cache and this)."""
    if prompt is None:
        return None, None
    by_length: dict[int, list[Candidate]] = {}
    for candidate in candidates:
        if 0 < candidate.tokens_len <= len(prompt):
            by_length.setdefault(candidate.tokens_len, []).append(candidate)
    packed_prompt, packed_completion = packed or (encode_ids(prompt), encode_ids(completion))
    ids = memoryview(packed_prompt or b"")
    if by_length:
        # The longest candidate that fits first: a call usually extends the newest call of its agent, which is that
        # one, and then a single digest finds it. A digest per candidate length instead grew with the trajectory's
        # calls (~2.5 µs each: 0.13 ms a call after 48 turns). On a miss the shorter lengths are tried in one pass.
        longest = max(by_length)
        hasher = hashlib.blake2b(ids[: longest * 4], digest_size=KEY_BYTES)
        if work is not None:
            work.ids_hashed += longest
            work.digests += 1
        digest = hasher.copy().digest()
        matches = [c for c in by_length[longest] if c.tokens_key == digest]
        if matches:
            parent = min(matches, key=lambda c: (c.seq, c.choice_index))
            return parent, _own_key(hasher, ids[longest * 4 :], prompt, completion, packed_completion)
    hasher = hashlib.blake2b(digest_size=KEY_BYTES)
    at = 0
    best: Candidate | None = None
    for length in sorted(by_length):
        hasher.update(ids[at * 4 : length * 4])
        if work is not None:
            work.ids_hashed += length - at
            work.digests += 1
        at = length
        digest = hasher.copy().digest()
        matches = [c for c in by_length[length] if c.tokens_key == digest]
        if matches:
            best = min(matches, key=lambda c: (c.seq, c.choice_index))
    return best, _own_key(hasher, ids[at * 4 :], prompt, completion, packed_completion)


def _own_key(
    hasher: Any, rest: memoryview, prompt: Sequence[int], completion: Sequence[int] | None, packed: bytes | None
) -> tuple[int, bytes] | None:
    """The call's own (tokens_len, tokens_key): `hasher` holds the prompt's ids before `rest`."""
    if completion is None:
        return None
    hasher.update(rest)
    hasher.update(packed or b"")
    return len(prompt) + len(completion), hasher.digest()


def root_anchor(
    own: bytes | None, previous: bytes | None, same_agent: Callable[[], AnchorT | None]
) -> AnchorT | None:
    """The earlier call a root is compared with besides the previous call by arrival: calls of several agents
    interleave in one trajectory, so a root sharing no message with the call before it (a sub-agent's, say) may
    compact the history of `same_agent()`, the latest earlier call whose request starts with the same message (the
    agent's own system prompt). None: only the previous call counts (it shares a message, there is none, or the
    root's request has no messages), or no earlier call starts like the root."""
    if not own or previous is None or shared_messages(own, previous) > 0:
        return None
    return same_agent()


def root_reason(reason: str, own: bytes | None, previous: bytes | None) -> str:
    """A root's reason against the previous call, told apart by the requests' message digests (own, previous)."""
    if reason in (FIRST_CALL, NO_IDS) or own is None or previous is None:
        return reason
    shared = shared_messages(own, previous)
    if shared == 0:
        return NEW_ROOT
    if reason in (TRUNCATED, HISTORY_EDITED) and len(own) > shared * DIGEST_BYTES:
        # The ids diverge inside the previous prompt, shorter (TRUNCATED) or not: the messages say why, whatever the
        # ids' length. The first message past the shared ones is one the previous request held: messages were dropped
        # (a sliding window too). A new one: a summary if there are fewer messages, else a message changed in place
        # (an edit that shortens a message is an edit, not a truncation).
        first_new = own[shared * DIGEST_BYTES : (shared + 1) * DIGEST_BYTES]
        known = {previous[i : i + DIGEST_BYTES] for i in range(0, len(previous), DIGEST_BYTES)}
        if first_new in known:
            return TRUNCATED
        return COMPACTED if len(own) < len(previous) else HISTORY_EDITED
    return reason


def branches(parents: dict[tuple[int, int], tuple[int, int] | None]) -> dict[tuple[int, int], int]:
    """Each call's branch id: the seq of the call its branch starts at. A root starts a branch; a child continues its
    parent's branch when it is the parent's first child by (seq, choice), else it starts one (a fork). Derived from
    the stored parents whenever it is read, so a call arriving late cannot leave stale ids behind."""
    first_child: dict[tuple[int, int], tuple[int, int]] = {}
    for key in sorted(parents):
        parent = parents[key]
        if parent is not None and parent in parents and parent not in first_child:
            first_child[parent] = key
    branch: dict[tuple[int, int], int] = {}
    for key in sorted(parents):
        parent = parents[key]
        if parent is not None and parent in branch and first_child.get(parent) == key:
            branch[key] = branch[parent]
        else:
            branch[key] = key[0]
    return branch


def parent_of(seq: int | None, choice: int | None) -> dict[str, int] | None:
    """A call's tree parent as the read API and export show it."""
    return None if seq is None else {"seq": seq, "choice_index": choice or 0}


def with_branches(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Set each read call's `branch` (gateway.store.tree.branches) from the `parent` the calls carry."""
    parents = {
        (c["seq"], c["choice_index"]): (c["parent"]["seq"], c["parent"]["choice_index"]) if c["parent"] else None
        for c in calls
    }
    ids = branches(parents)
    for call in calls:
        call["branch"] = ids[(call["seq"], call["choice_index"])]
    return calls
