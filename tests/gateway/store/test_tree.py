"""A trajectory is a tree of calls (gateway.store.tree): each call's parent is the recorded call whose prompt +
completion its prompt extends the furthest, whatever arrived in between, in whichever order the records reach the
database and from however many gateway processes. The calls here come from a toy chat template with the property
that matters (a history's rendering followed by its assistant reply is the rendering of the history with that reply
appended); the e2e tests check the same shapes against real vLLM."""

from __future__ import annotations

import itertools
import threading
from typing import Any
from unittest import mock

import pytest
from sqlalchemy import Engine, select, update

from gateway.store import db
from gateway.store import records as store_records
from gateway.store.call_record import CallRecord
from gateway.store.export import iter_trajectories
from gateway.store.models import Call, Trajectory
from gateway.store.reads import trajectory_view
from gateway.store.records import LineageCache, write_calls
from gateway.store.training import load_groups
from gateway.store.tree import Candidate, LookupWork, branches, find_parent, own_key, place
from tests.support.factories import make_record

ROLES = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
START, END = 100, 101


def _text(content: str) -> list[int]:
    return [1000 + ord(c) for c in content]


def render(messages: list[dict[str, str]]) -> list[int]:
    """ChatML-like: each message is START role text END, then the generation prompt START assistant."""
    ids: list[int] = []
    for message in messages:
        ids += [START, ROLES[message["role"]], *_text(message["content"]), END]
    return ids + [START, ROLES["assistant"]]


def sys(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def bot(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def call(seq: int, messages: list[dict[str, str]], reply: str, trajectory_id: str = "traj-1", **kw: Any) -> CallRecord:
    completion = [*_text(reply), END]
    return make_record(
        trajectory_id,
        seq,
        request={"model": "run-a", "messages": messages},
        response={"choices": [{"index": 0, "message": bot(reply), "finish_reason": "stop"}]},
        prompt_token_ids=render(messages),
        completion_token_ids=completion,
        completion_logprobs=[-0.5] * len(completion),
        **kw,
    )


def supervisor(trajectory_id: str = "traj-1") -> list[CallRecord]:
    """A supervisor hands a task to a sub-agent (its own system prompt, two turns), then resumes with the result."""
    boss = [sys("You are the supervisor."), user("Find the capital of France.")]
    helper = [sys("You are a researcher."), user("What is the capital of France?")]
    return [
        call(1, boss, "ask researcher", trajectory_id),
        call(2, helper, "Paris?", trajectory_id),
        call(3, [*helper, bot("Paris?"), user("Be sure.")], "Paris.", trajectory_id),
        call(4, [*boss, bot("ask researcher"), user("researcher: Paris.")], "Paris", trajectory_id),
    ]


def _tree(engine: Engine, trajectory_id: str = "traj-1") -> list[tuple[int, str, tuple[int, int] | None]]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(Call.seq, Call.merge_reason, Call.tree_parent_seq, Call.tree_parent_choice)
            .where(Call.trajectory_id == trajectory_id)
            .order_by(Call.seq, Call.choice_index)
        ).all()
    return [(r.seq, r.merge_reason, None if r.tree_parent_seq is None else (r.tree_parent_seq, r.tree_parent_choice))
            for r in rows]


SUPERVISOR_TREE = [(1, "first_call", None), (2, "new_root", None), (3, "extends", (2, 0)), (4, "extends", (1, 0))]


def test_a_sub_agent_is_a_new_root_and_the_supervisor_resumes_its_own_call(engine: Engine) -> None:
    calls = supervisor()
    for record in calls:
        write_calls(engine, [record])
    assert _tree(engine) == SUPERVISOR_TREE
    with engine.connect() as conn:
        keys = conn.execute(select(Call.tokens_len, Call.tokens_key).order_by(Call.seq)).all()
    assert [tuple(k) for k in keys] == [own_key(c.prompt_token_ids, c.completion_token_ids) for c in calls]

    with engine.begin() as conn:
        conn.execute(update(Trajectory).values(reward=1.0))
    view = trajectory_view(engine, "traj-1", include_tokens=True)
    assert view is not None
    assert [(c["parent"], c["branch"]) for c in view["calls"]] == [
        (None, 1),
        (None, 2),
        ({"seq": 2, "choice_index": 0}, 2),
        ({"seq": 1, "choice_index": 0}, 1),
    ]
    assert [c["prompt_token_ids"] for c in view["calls"]] == [c.prompt_token_ids for c in calls]
    [exported] = list(iter_trajectories(engine, "run-a"))
    assert [(c["parent"], c["branch"]) for c in exported["calls"]] == [(c["parent"], c["branch"]) for c in view["calls"]]
    [group] = load_groups(engine, ["group-1"])
    assert [c["prompt_token_ids"] for c in group["trajectories"][0]["calls"]] == [c.prompt_token_ids for c in calls]


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_any_arrival_order_gives_the_same_tree(engine: Engine, order: tuple[int, ...]) -> None:
    # A later call can reach the database first (another gateway's writer, a record replayed from the spool).
    calls = supervisor()
    for i in order:
        write_calls(engine, [calls[i]])  # no predecessor cache: as if each came from another gateway
    assert _tree(engine) == SUPERVISOR_TREE


def test_two_gateway_processes_on_one_database_agree(db_url: str) -> None:
    """The supervisor's calls go through one gateway, the sub-agent's through another, at the same time."""
    db.upgrade(db_url)
    engines = [db.make_engine(db_url), db.make_engine(db_url)]
    try:
        trajectories = [f"traj-{i}" for i in range(6)]
        by_process: list[list[CallRecord]] = [[], []]
        for trajectory_id in trajectories:
            first, sub1, sub2, resumed = supervisor(trajectory_id)
            by_process[0] += [first, resumed]
            by_process[1] += [sub1, sub2]
        # The second process writes its records in reverse: resumptions and sub-agent turns before their parents.
        by_process[1].reverse()
        threads = [
            threading.Thread(target=lambda e=e, rs=rs: [write_calls(e, [r]) for r in rs])
            for e, rs in zip(engines, by_process)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for trajectory_id in trajectories:
            assert _tree(engines[0], trajectory_id) == SUPERVISOR_TREE
    finally:
        for engine in engines:
            engine.dispose()


def test_parallel_branches_each_hang_off_the_call_they_continue(engine: Engine) -> None:
    plan = [sys("Plan then split."), user("Two parts.")]
    base = [*plan, bot("split")]
    calls = [
        call(1, plan, "split"),
        call(2, [*base, user("part a")], "A"),
        call(3, [*base, user("part b")], "B"),
        call(4, [*base, user("part a"), bot("A"), user("join with B")], "AB"),
    ]
    write_calls(engine, calls)
    assert _tree(engine) == [(1, "first_call", None), (2, "extends", (1, 0)), (3, "extends", (1, 0)),
                             (4, "extends", (2, 0))]
    view = trajectory_view(engine, "traj-1")
    assert view is not None
    # Part b forks off the plan: a branch of its own; the join continues part a's.
    assert [c["branch"] for c in view["calls"]] == [1, 1, 3, 1]


def test_a_turn_retried_with_an_edited_prompt_is_a_sibling_of_the_first_try(engine: Engine) -> None:
    first = [sys("Be brief."), user("Hi")]
    calls = [
        call(1, first, "Hello"),
        call(2, [*first, bot("Hello"), user("What is 2+2?")], "5"),
        call(3, [*first, bot("Hello"), user("What is 2+2? Think.")], "4"),
    ]
    write_calls(engine, calls)
    assert _tree(engine) == [(1, "first_call", None), (2, "extends", (1, 0)), (3, "extends", (1, 0))]


def test_compacted_truncated_and_edited_histories_are_roots_with_their_reason(engine: Engine) -> None:
    system = sys("Agent.")
    long = [system, user("u1"), bot("a1"), user("u2"), bot("a2"), user("u3")]
    calls = [
        call(1, [system, user("u1")], "a1"),
        call(2, [system, user("u1"), bot("a1"), user("u2")], "a2"),
        call(3, long, "a3"),
        # The agent summarised its history to make room: a message the previous request never held.
        call(4, [system, user("Summary: u1 u2."), user("u4")], "a4"),
        call(5, [system, user("Summary: u1 u2."), user("u4"), bot("a4"), user("u5")], "a5"),
    ]
    write_calls(engine, calls)
    assert _tree(engine) == [
        (1, "first_call", None),
        (2, "extends", (1, 0)),
        (3, "extends", (2, 0)),
        (4, "compacted", None),
        (5, "extends", (4, 0)),
    ]
    # Old messages only dropped: truncated; a message changed in place: history_edited.
    write_calls(engine, [call(6, [system, user("u3"), bot("a3"), user("u6")], "a6", "traj-2"),
                         call(7, [system, user("u3"), bot("a3"), user("u6"), bot("a6"), user("u7")], "a7", "traj-2"),
                         call(8, [system, user("u6"), bot("a6"), user("u8")], "a8", "traj-2"),
                         call(9, [system, user("u6"), bot("a6"), user("u8"), bot("a8"), user("X9")], "x", "traj-2"),
                         call(10, [system, user("u6"), bot("a7"), user("u8"), bot("a8"), user("X9")], "y", "traj-2")])
    assert [reason for _, reason, _ in _tree(engine, "traj-2")] == [
        "first_call", "extends", "truncated", "extends", "history_edited"
    ]


def test_one_reason_per_cause_whatever_the_ids_length(engine: Engine) -> None:
    """The ids only say a root's prompt is shorter or not; the messages say why. An earlier message shortened in place
    is `history_edited` although the prompt got shorter, and old messages dropped by a sliding window that appends as
    many are `truncated` although the prompt got longer."""
    system = sys("Agent.")
    history = [system, user("first question, asked at length"), bot("a1"), user("u2")]
    edited = [system, user("first q"), bot("a1"), user("u2")]  # shorter ids, as many messages
    window = [system, bot("a1"), user("u2"), bot("a2"), user("a much longer third question than the first")]
    write_calls(engine, [call(1, history, "a2"), call(2, edited, "a2'"),
                         call(3, history, "a2", "traj-2"), call(4, [*history, bot("a2")], "x", "traj-2"),
                         call(5, window, "a3", "traj-2")])  # fmt: skip
    assert len(render(edited)) < len(render(history)) < len(render(window))
    assert [reason for _, reason, _ in _tree(engine)] == ["first_call", "history_edited"]
    assert [reason for _, reason, _ in _tree(engine, "traj-2")] == ["first_call", "extends", "truncated"]


def test_ties_go_to_the_lowest_seq_in_any_arrival_order(engine: Engine) -> None:
    first = [sys("S"), user("q")]
    specs = [(1, first, "same"), (2, first, "same"), (3, [*first, bot("same"), user("next")], "r")]
    for i, order in enumerate(itertools.permutations(range(3))):
        trajectory_id = f"traj-{i}"
        for j in order:
            seq, messages, reply = specs[j]
            write_calls(engine, [call(seq, messages, reply, trajectory_id)])
        assert _tree(engine, trajectory_id)[2] == (3, "extends", (1, 0)), order


def test_a_call_continuing_choice_1_of_an_n2_call_hangs_off_that_choice(engine: Engine) -> None:
    first = [sys("S"), user("q")]
    other = call(1, first, "two", choice_index=1)
    calls = [call(1, first, "one"), other, call(2, [*first, bot("two"), user("go on")], "three")]
    write_calls(engine, calls)
    assert _tree(engine) == [(1, "first_call", None), (1, "first_call", None), (2, "extends", (1, 1))]


def test_branch_ids_follow_first_children() -> None:
    parents = {(1, 0): None, (2, 0): (1, 0), (3, 0): (1, 0), (4, 0): (3, 0), (5, 0): None, (6, 0): (2, 0)}
    assert branches(parents) == {(1, 0): 1, (2, 0): 1, (3, 0): 3, (4, 0): 3, (5, 0): 5, (6, 0): 1}


def test_the_lookup_hashes_each_prompt_id_once_however_many_turns_came_before() -> None:
    """Work per call, counted: ids hashed never exceed the new prompt's own length (no earlier call's ids are read),
    and a turn that extends the newest call (the longest that fits) takes one digest, not one per earlier call."""
    messages = [sys("A long-running agent.")]
    candidates: list[Candidate] = []
    for turn in range(1, 65):
        messages.append(user(f"step {turn}"))
        prompt = render(messages)
        work = LookupWork()
        parent = find_parent(prompt, candidates, work)
        assert (parent.seq if parent else None) == (turn - 1 if turn > 1 else None)
        assert work.ids_hashed <= len(prompt)
        assert work.digests == min(len(candidates), 1)
        reply = f"done {turn}"
        completion = [*_text(reply), END]
        key = own_key(prompt, completion)
        assert key is not None
        candidates.append(Candidate(turn, 0, key[0], key[1]))
        messages.append(bot(reply))


def test_a_call_that_does_not_extend_the_longest_candidate_still_finds_its_parent() -> None:
    """A supervisor resuming after its sub-agent's longer call: the longest candidate that fits is the sub-agent's,
    which it does not extend, so the shorter lengths are tried (one digest each) and its own last call is the parent,
    the lowest (seq, choice) among equal ids; its own key is the same whichever way it was found."""
    system = sys("Supervisor.")
    first = render([system, user("q")])
    first_reply = [*_text("delegate"), END]
    supervisor = own_key(first, first_reply)
    twin = own_key(first, first_reply)  # the same ids recorded again (a retry): a tie on the lowest (seq, choice)
    helper_prompt = render([sys("Helper."), user("task")])
    helper = own_key(helper_prompt, [*_text("the result"), END])
    assert supervisor is not None and twin is not None and helper is not None
    prompt = render([system, user("q"), bot("delegate"), user("the helper says: result")])
    assert supervisor[0] < helper[0] <= len(prompt)
    candidates = [Candidate(3, 0, *helper), Candidate(2, 1, *twin), Candidate(2, 0, *supervisor)]
    work = LookupWork()
    parent, key = place(prompt, [7], candidates, work)
    assert parent == Candidate(2, 0, *supervisor)
    assert work.digests == 1 + 2  # the longest first, then each distinct length
    assert work.ids_hashed <= 2 * len(prompt)
    assert key == place(prompt, [7], [], None)[1] == own_key(prompt, [7])
    # Without the helper's call the longest candidate is its parent: found at once, the tie still to the lowest.
    work = LookupWork()
    tied = [Candidate(2, 1, *twin), Candidate(2, 0, *supervisor)]
    assert place(prompt, [7], tied, work) == (Candidate(2, 0, *supervisor), key)
    assert work.digests == 1


def compacted_after_a_sub_agent(trajectory_id: str = "traj-1") -> list[CallRecord]:
    """An agent hands a task to a sub-agent (its own system prompt), then compacts its history and goes on."""
    system = sys("Agent.")
    return [
        call(1, [system, user("u1")], "a1", trajectory_id),
        call(2, [system, user("u1"), bot("a1"), user("u2")], "a2", trajectory_id),
        call(3, [sys("Helper."), user("task")], "done", trajectory_id),
        # Straight after the sub-agent: a summary in place of the agent's own history, not a new root.
        call(4, [system, user("Summary: u1 u2; helper done."), user("u3")], "a3", trajectory_id),
        call(5, [system, user("Summary: u1 u2; helper done."), user("u3"), bot("a3"), user("u4")], "a4", trajectory_id),
    ]


COMPACTED_AFTER_SUB_AGENT_TREE = [
    (1, "first_call", None),
    (2, "extends", (1, 0)),
    (3, "new_root", None),
    (4, "compacted", None),
    (5, "extends", (4, 0)),
]


@pytest.mark.parametrize("order", [(0, 1, 2, 3, 4), (3, 4, 2, 1, 0), (2, 3, 0, 4, 1), (0, 1, 3, 4, 2)])
def test_a_history_compacted_right_after_a_sub_agent_call_is_compacted_not_a_new_root(
    engine: Engine, order: tuple[int, ...]
) -> None:
    # The root's reason is told against the agent's own last call (the latest one sharing its system prompt), not
    # against the sub-agent's call that arrived just before it; whichever order the records reach the database in.
    calls = compacted_after_a_sub_agent()
    for i in order:
        write_calls(engine, [calls[i]])  # no predecessor cache: as if each came from another gateway
    assert _tree(engine) == COMPACTED_AFTER_SUB_AGENT_TREE
    write_calls(engine, compacted_after_a_sub_agent("traj-2"))  # all in one batch
    assert _tree(engine, "traj-2") == COMPACTED_AFTER_SUB_AGENT_TREE


def test_a_sub_agent_started_again_on_a_new_task_stays_a_new_root(engine: Engine) -> None:
    # Its request starts like its last run's, but it compacts nothing (as many messages): told against the supervisor's
    # call before it, as any sub-agent's first call.
    boss = [sys("Supervisor."), user("Two tasks.")]
    calls = [
        call(1, boss, "task one"),
        call(2, [sys("Helper."), user("task one")], "done one"),
        call(3, [*boss, bot("task one"), user("helper: done one")], "task two"),
        call(4, [sys("Helper."), user("task two")], "done two"),
    ]
    write_calls(engine, calls)
    assert _tree(engine) == [(1, "first_call", None), (2, "new_root", None), (3, "extends", (1, 0)), (4, "new_root", None)]


def test_roots_find_their_own_agent_without_rebuilding_the_trajectory(engine: Engine) -> None:
    """Written in order by one process, a root's own agent's last call comes from the lineage cache (one entry per
    agent) and the stored first messages: no call rebuilds the trajectory's ids, however long it is."""
    calls = [*compacted_after_a_sub_agent()[:4], call(5, [sys("Helper."), user("task two")], "done two")]
    cache = LineageCache()  # the writer's
    with mock.patch.object(store_records, "rebuild_calls", wraps=store_records.rebuild_calls) as rebuilds:
        for record in calls:
            write_calls(engine, [record], cache)
    assert rebuilds.call_count == 0
    assert [reason for _, reason, _ in _tree(engine)] == ["first_call", "extends", "new_root", "compacted", "new_root"]


def test_a_supervisor_resuming_on_a_re_rendered_reply_after_a_sub_agent_says_so(engine: Engine) -> None:
    # The resumption holds the supervisor's whole first prompt, but its reply comes back re-rendered (as a chat
    # template may): not an extension, and told against the supervisor's call, not the researcher's before it.
    boss = [sys("Supervisor."), user("Find it.")]
    calls = [
        call(1, boss, "ask researcher"),
        call(2, [sys("Researcher."), user("Find it.")], "found"),
        call(3, [*boss, bot("ask  researcher"), user("researcher: found")], "done"),
    ]
    write_calls(engine, calls)
    assert _tree(engine) == [(1, "first_call", None), (2, "new_root", None), (3, "completion_rerendered", None)]
