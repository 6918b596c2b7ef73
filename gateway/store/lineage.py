"""How a call's prompt relates to its predecessor's tokens: the merge diagnostics and the linear storage layout.

The predecessor of a call is the previous seq's choice 0 in the same trajectory (every choice of an `n > 1` call has
the same predecessor; a later call continues from choice 0 unless the agent picked another choice, which then shows
as `history_edited`). A token_in call (gateway.proxy.token_in) instead names the recorded (seq, choice) its prompt was
built on, and is compared with that one: a repeated turn or a parallel branch then extends the turn it continues
rather than counting as a `retry` or an edit of its sibling at the previous seq. A call *extends* its predecessor
when its prompt ids start with the predecessor's prompt + completion ids; the trainer merges such calls into one row
(docs/design.md §7.5). Otherwise the reason says why not:

- `first_call`: no predecessor in the trajectory.
- `no_ids`: the call or its predecessor has no token ids (an upstream error, a failed capture).
- `retry`: the prompt equals the predecessor's prompt (the agent sent the same request again as a new call).
- `template_dropped_tool_call`: the divergence is inside the predecessor's completion and that completion held a
  tool call (the chat template re-rendered the call without it; SmolLM2's does, docs/design.md §4).
- `completion_rerendered`: the divergence is inside the predecessor's completion, which held no tool call (e.g. a
  template that trims reasoning).
- `truncated`: the prompt is shorter than the predecessor's prompt and diverges inside it (history was cut).
- `history_edited`: the prompt diverges inside the predecessor's prompt (messages changed or removed).
  These two are told by the ids' length only; where both requests carry messages, gateway.store.tree.root_reason
  tells them by the messages instead (messages dropped: `truncated`; a message changed, shortened or not:
  `history_edited`).
- `new_root`, `compacted`: a call that extends no recorded call of its trajectory and shares no message with its
  predecessor (a sub-agent), or whose shorter history goes on with a message its predecessor never held (a summary);
  see gateway.store.tree, which also makes `extends` mean "extends its tree parent", any earlier call.

`divergence` is the index of the first prompt token that differs from predecessor prompt + completion (null when
the call extends it or has no predecessor). Storage: a call stores only its prompt ids past the prefix it shares with
the predecessor's prompt + completion (`prefix_len` tokens, taken from the row at `parent_seq`), or with its call-tree
parent's where that is longer (gateway.store.records: a supervisor resuming after a sub-agent), so a trajectory's
stored ids grow with its length, not with the square of its turns; `Rebuilder` puts full prompts back together from
any earlier seq, a trajectory in order, and `StoredCalls` one call along its chain of storage parents.
The request's chat messages are stored the same way against the same predecessor (gateway.store.messages): only the
messages past those it shares with the predecessor's request, `messages_prefix_len` of them from
`messages_parent_seq`. That holds even when the ids do not extend (a template that drops tool calls still sees the
messages grow by appending), so it has its own pair of columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from gateway.store.arrays import decode_ids

EXTENDS = "extends"
FIRST_CALL = "first_call"
NO_IDS = "no_ids"
RETRY = "retry"
TEMPLATE_DROPPED_TOOL_CALL = "template_dropped_tool_call"
COMPLETION_RERENDERED = "completion_rerendered"
TRUNCATED = "truncated"
HISTORY_EDITED = "history_edited"
NEW_ROOT = "new_root"
COMPACTED = "compacted"
REASONS = (
    EXTENDS,
    FIRST_CALL,
    NO_IDS,
    RETRY,
    TEMPLATE_DROPPED_TOOL_CALL,
    COMPLETION_RERENDERED,
    TRUNCATED,
    HISTORY_EDITED,
    NEW_ROOT,
    COMPACTED,
)


class Predecessor(NamedTuple):
    """What a call is compared against: the predecessor's seq and full ids, and whether it answered a tool call.

    A NamedTuple, as `Lineage`: built for every record the writer handles."""

    seq: int
    prompt_ids: list[int] | None
    completion_ids: list[int] | None
    tool_call: bool
    # Digests of the predecessor's request messages (gateway.store.messages), None if it had no message list.
    messages: bytes | None = None

    @property
    def tokens(self) -> list[int] | None:
        if self.prompt_ids is None or self.completion_ids is None:
            return None
        return self.prompt_ids + self.completion_ids


class Lineage(NamedTuple):
    """A call's merge diagnostics and how its prompt is stored: `prefix_len` ids from `parent_seq`, then the rest.

    A NamedTuple, not a frozen dataclass: the writer builds one or more for every record, and a frozen dataclass's
    `__init__` (an `object.__setattr__` a field) cost ~2.6 µs against a NamedTuple's ~0.8."""

    reason: str
    divergence: int | None
    parent_seq: int | None
    prefix_len: int
    messages_parent_seq: int | None = None
    messages_prefix_len: int = 0
    # The call tree (gateway.store.tree): the (seq, choice) this call extends, None for a root; and the call's own
    # (tokens_len, tokens_key) as a parent for later calls, None without ids.
    tree_parent: tuple[int, int] | None = None
    tokens: tuple[int, bytes] | None = None


# Ids compared a block at a time as list slices (C speed) before the one block that differs is scanned id by id.
_PREFIX_BLOCK = 256


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share. Called for every record on the writer thread (against its predecessor)
    and for every token_in turn on the event loop, on prompts of thousands of ids: a Python loop over each id cost
    ~33 ns an id (97 µs at 2,900 ids), the slices ~11 (33 µs)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case: one extends the other
        return n
    at = 0
    while at + _PREFIX_BLOCK <= n and a[at : at + _PREFIX_BLOCK] == b[at : at + _PREFIX_BLOCK]:
        at += _PREFIX_BLOCK
    end = min(at + _PREFIX_BLOCK, n)
    while at < end and a[at] == b[at]:
        at += 1
    return at


def classify(prompt: list[int] | None, predecessor: Predecessor | None) -> Lineage:
    """The call's reason, divergence position and storage prefix against its predecessor."""
    if predecessor is None:
        return Lineage(FIRST_CALL, None, None, 0)
    before = predecessor.tokens
    if prompt is None or before is None or predecessor.prompt_ids is None:
        return Lineage(NO_IDS, None, None, 0)
    shared = common_prefix(prompt, before)
    parent = predecessor.seq if shared else None
    if shared == len(before):
        return Lineage(EXTENDS, None, parent, shared)
    prompt_len = len(predecessor.prompt_ids)
    if prompt == predecessor.prompt_ids:
        reason = RETRY
    elif shared >= prompt_len:
        reason = TEMPLATE_DROPPED_TOOL_CALL if predecessor.tool_call else COMPLETION_RERENDERED
    elif len(prompt) < prompt_len:
        reason = TRUNCATED
    else:
        reason = HISTORY_EDITED
    return Lineage(reason, shared, parent, shared)


class Rebuilder:
    """Restores full prompt ids and requests from stored rows fed in (seq, choice_index) order, one trajectory at a
    time.

    A row's stored prompt is its ids past `prefix_len`; the prefix comes from the full prompt + completion of choice 0
    at `parent_seq`, which always precedes it. Its stored request holds only the messages past `messages_prefix_len`,
    whose leading ones are choice 0's full messages at `messages_parent_seq`. Rows written before linear storage have
    no parent and hold their full prompt and request, so they pass through unchanged.
    """

    def __init__(self) -> None:
        self._tokens: dict[int, list[int] | None] = {}
        self._messages: dict[int, list[Any] | None] = {}

    def prompt(
        self,
        seq: int,
        choice_index: int,
        stored_prompt: list[int] | None,
        completion: list[int] | None,
        parent_seq: int | None,
        prefix_len: int | None,
    ) -> list[int] | None:
        """The call's full prompt ids; raises LookupError if its parent was not fed first (a broken chain)."""
        full = stored_prompt
        if parent_seq is not None and prefix_len:
            parent = self._tokens.get(parent_seq)
            if parent is None or len(parent) < prefix_len:
                raise LookupError(f"call at seq {seq} refers to seq {parent_seq}, which is missing or too short")
            full = parent[:prefix_len] + (stored_prompt or [])
        if choice_index == 0:
            self._tokens[seq] = None if full is None or completion is None else full + completion
        return full

    def tokens(self, seq: int) -> list[int] | None:
        """Full prompt + completion of choice 0 at `seq`, if it was fed."""
        return self._tokens.get(seq)

    def request(
        self,
        seq: int,
        choice_index: int,
        stored: dict[str, Any] | None,
        parent_seq: int | None,
        prefix_len: int | None,
    ) -> dict[str, Any] | None:
        """The call's full request, its keys in stored order; raises LookupError on a broken chain, as `prompt`."""
        full = stored
        if parent_seq is not None and prefix_len:
            parent = self._messages.get(parent_seq)
            own = (stored or {}).get("messages")
            if parent is None or len(parent) < prefix_len or stored is None or not isinstance(own, list):
                raise LookupError(f"call at seq {seq} refers to the messages of seq {parent_seq}, which are missing")
            full = {**stored, "messages": parent[:prefix_len] + own}
        if choice_index == 0:
            messages = (full or {}).get("messages")
            self._messages[seq] = messages if isinstance(messages, list) else None
        return full

    def messages(self, seq: int) -> list[Any] | None:
        """Full request messages of choice 0 at `seq`, if it was fed."""
        return self._messages.get(seq)


_Key = tuple[int, int]


@dataclass(frozen=True, slots=True)
class StoredCall:
    """One call as linear storage holds it: its own ids (packed) and messages past what it takes from a parent."""

    prompt: bytes | None
    completion: bytes | None
    parent_seq: int | None
    prefix_len: int | None
    request: dict[str, Any] | None = None
    messages_parent_seq: int | None = None
    messages_prefix_len: int | None = None


class StoredCalls:
    """A trajectory's stored calls, keyed by (seq, choice_index), each put back together in full only when asked for.

    `Rebuilder` restores every call in order, each full prompt a fresh copy of its parent's: work of the order of the
    calls times the prompt's length. The writer rebuilds a stored predecessor whenever its lineage cache does not hold
    it (another gateway wrote it, or this one restarted), once per batch, so that cost every call of a long
    trajectory. Here one call is rebuilt along its chain of storage parents by extending one list in place: work of
    the order of its own prompt (and what the chain truncates). The rules and the errors are `Rebuilder`'s: a parent
    is choice 0 of an earlier seq, and a broken chain raises LookupError, when that call is asked for.
    """

    def __init__(self, calls: dict[_Key, StoredCall]) -> None:
        self._calls = calls
        self._prompts: dict[_Key, list[int] | None] = {}
        self._requests: dict[_Key, dict[str, Any] | None] = {}

    def prompt(self, key: _Key) -> list[int] | None:
        """The call's full prompt ids (None if it has none, or no call is stored at `key`). Do not modify it."""
        if key not in self._calls:
            return None
        if key not in self._prompts:
            chain = self._chain(key, lambda call: call.parent_seq if call.prefix_len else None)
            full = decode_ids(self._calls[chain[0]].prompt)
            for parent, child in zip(chain, chain[1:]):
                completion = decode_ids(self._calls[parent].completion)
                prefix_len = self._calls[child].prefix_len or 0
                if full is None or completion is None or len(full) + len(completion) < prefix_len:
                    raise LookupError(
                        f"call at seq {child[0]} refers to seq {parent[0]}, which is missing or too short"
                    )
                full.extend(completion)
                del full[prefix_len:]
                full.extend(decode_ids(self._calls[child].prompt) or [])
            self._prompts[key] = full
        return self._prompts[key]

    def completion(self, key: _Key) -> list[int] | None:
        """The call's completion ids (None if it has none, or no call is stored at `key`)."""
        call = self._calls.get(key)
        return None if call is None else decode_ids(call.completion)

    def request(self, key: _Key) -> dict[str, Any] | None:
        """The call's full request, its keys in stored order (None if no call is stored at `key`). Do not modify it."""
        if key not in self._calls:
            return None
        if key not in self._requests:
            chain = self._chain(key, lambda call: call.messages_parent_seq if call.messages_prefix_len else None)
            request = self._calls[key].request
            if len(chain) > 1:
                root = (self._calls[chain[0]].request or {}).get("messages")
                messages = list(root) if isinstance(root, list) else None
                for parent, child in zip(chain, chain[1:]):
                    stored = self._calls[child].request
                    own = (stored or {}).get("messages")
                    prefix_len = self._calls[child].messages_prefix_len or 0
                    if messages is None or len(messages) < prefix_len or not isinstance(own, list):
                        raise LookupError(
                            f"call at seq {child[0]} refers to the messages of seq {parent[0]}, which are missing"
                        )
                    del messages[prefix_len:]
                    messages.extend(own)
                request = {**(request or {}), "messages": messages}
            self._requests[key] = request
        return self._requests[key]

    def every_call(self) -> dict[_Key, tuple[list[int] | None, dict[str, Any] | None]]:
        """Every call's full prompt and request, rebuilt in (seq, choice) order by `Rebuilder`: for rebuilding them
        all, where walking each call's chain from its root would take the square of the calls in steps. Raises
        LookupError at the first broken chain, as `Rebuilder` does."""
        rebuilder, every = Rebuilder(), {}
        for key in sorted(self._calls):
            call = self._calls[key]
            prompt = rebuilder.prompt(
                *key, decode_ids(call.prompt), decode_ids(call.completion), call.parent_seq, call.prefix_len
            )
            every[key] = (
                prompt,
                rebuilder.request(*key, call.request, call.messages_parent_seq, call.messages_prefix_len),
            )
        return every

    def _chain(self, key: _Key, parent_of: Callable[[StoredCall], int | None]) -> list[_Key]:
        """The call's storage parents, from the first that is stored whole down to the call itself."""
        chain = [key]
        while (parent_seq := parent_of(self._calls[chain[-1]])) is not None:
            parent = (parent_seq, 0)
            if parent >= chain[-1] or parent not in self._calls:  # Rebuilder: fed first, or missing
                raise LookupError(f"call at seq {chain[-1][0]} refers to seq {parent_seq}, which is missing")
            chain.append(parent)
        chain.reverse()
        return chain
