"""The tool agent's task without vLLM: the fact base, the reward, and the agent's tool loop against a scripted
OpenAI-compatible server whose replies have the shape real vLLM gave (tests/fixtures/vllm, recorded with the hermes
parser). The agent learning through the gateway runs against real vLLM in tests/e2e/test_demo_e2e.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.scripted_server import Scripted, agent, person_of, text_reply, tool_reply


def test_fact_base_is_deterministic_by_seed() -> None:
    a, b, other = agent.Directory.generate(0), agent.Directory.generate(0), agent.Directory.generate(1)
    assert a.people == b.people and a.train == b.train and a.held_out == b.held_out
    assert a.examples == b.examples
    assert {p.name for p in a.people} != {p.name for p in other.people}
    assert agent.DIRECTORY.train == a.train  # what the agent trains on is seed 0's


def test_held_out_questions_are_about_people_no_training_question_mentions() -> None:
    d = agent.Directory.generate(0)
    trained = {q.person_id for q in d.train}
    held = {q.person_id for q in d.held_out}
    assert trained and held and not trained & held
    assert not {q.text for q in d.train} & {q.text for q in d.held_out}
    asked = trained | held
    assert asked == {p.id for p in d.people}  # every person is asked about, in one split only
    assert not asked & {p.id for p in d.examples}  # the prompt's worked episodes answer no question
    assert len(d.train) + len(d.held_out) == 2 * len(d.people)


def test_every_answer_is_made_up_and_reachable_only_through_the_tools() -> None:
    d = agent.Directory.generate(0)
    prompt = agent.SYSTEM + json.dumps(agent.example_messages(d)) + json.dumps(agent.TOOLS)
    people = {p.id: p for p in d.people}
    for question in d.train + d.held_out:
        person = people[question.person_id]
        assert question.answer in (person.city, person.extension)
        assert question.answer.lower() not in agent.words(question.text)  # not in the question ...
        assert question.answer not in prompt  # ... nor in the prompt around it
        found = d.search(person.name)
        assert found[0] == person.record()  # the full name finds the person first, with the answer
        assert d.lookup(person.id) == person.record()
        assert d.lookup(person.id.lower()) == person.record()
    answers = [p.city for p in d.people] + [p.extension for p in d.people]
    assert len(set(answers)) == len(answers)  # an answer names one person: no guessing right from another


def test_tools_refuse_calls_they_cannot_run() -> None:
    d = agent.Directory.generate(0)
    person = d.people[0]
    assert json.loads(d.call("search", json.dumps({"query": person.name})))[0]["id"] == person.id
    assert json.loads(d.call("lookup", json.dumps({"id": person.id}))) == person.record()
    assert "error" in json.loads(d.call("lookup", json.dumps({"id": "P1"})))  # a wrong id is an answer, not a fault
    assert json.loads(d.call("search", json.dumps({"query": "nobody here"}))) == []
    for name, arguments in [("weather", '{"city": "Paris"}'), ("search", '{"name": "x"}'), ("lookup", '{"id": 5}'),
                            ("search", '{"query": '), ("search", '["x"]')]:  # fmt: skip
        with pytest.raises(agent.MalformedCall):
            d.call(name, arguments)


@pytest.mark.parametrize("looked_up", [False, True])
def test_reward_is_1_for_the_right_final_answer_and_a_little_for_a_lookup(looked_up: bool) -> None:
    for final, answer in [("4309", "4309"), ("The extension is 4309.", "4309"), ("Naxmibre", "Naxmibre"),
                          ("naxmibre.", "Naxmibre")]:  # fmt: skip
        assert agent.right(final, answer)
        assert agent.reward(final, answer, looked_up) == 1.0  # a right answer from its head earns it all too
    wrong = agent.LOOKUP_CREDIT if looked_up else 0.0
    for final in ["43090", "1234", "", None]:  # a longer number that contains it is another number; None: no answer
        assert not agent.right(final, "4309")
        assert agent.reward(final, "4309", looked_up) == wrong
    assert not agent.right("Naxmibreton", "Naxmibre") and agent.reward("Naxmibreton", "Naxmibre", looked_up) == wrong
    assert 0 < agent.LOOKUP_CREDIT < 1


# --- the agent's loop against a scripted server -----------------------------------------------------------------


def play(start: Callable[[list[dict[str, Any]]], Scripted], replies: list[dict[str, Any]],
         question_index: int = 0) -> tuple[Any, Scripted]:  # fmt: skip
    server = start(replies)
    question = agent.DIRECTORY.train[question_index]
    return agent.run_episode(server.client(), "demo", agent.DIRECTORY, question), server


def test_search_then_answer_is_right_and_the_loop_sends_back_what_agents_send(scripted: Any) -> None:
    question = agent.DIRECTORY.train[0]
    person = person_of(question)
    episode, server = play(scripted, [tool_reply("search", json.dumps({"query": person.name})), text_reply(question.answer)])
    assert (episode.outcome, episode.reward, episode.calls, episode.tool_calls) == ("right", 1.0, 2, 1)
    assert episode.policy_version == 3
    first, second = server.requests
    assert first["tools"] == agent.TOOLS and first["max_tokens"] == agent.MAX_TOKENS
    assert first["messages"][-1] == {"role": "user", "content": question.text}
    # Turn 2 is turn 1 plus the assistant's call as the SDK returned it and the tool's result for that call id.
    assert second["messages"][: len(first["messages"])] == first["messages"]
    assistant, tool = second["messages"][len(first["messages"]):]
    call = assistant["tool_calls"][0]
    assert assistant["role"] == "assistant" and call["function"]["name"] == "search"
    assert tool == {"role": "tool", "tool_call_id": call["id"], "content": json.dumps([person.record()])}
    scored = episode.scored()
    assert scored.correct and scored.reward == 1.0 and scored.text == question.answer
    assert scored.stats == {"tool_call": 1.0, "calls": 2.0, "malformed": 0.0}


def test_search_lookup_answer_takes_three_calls(scripted: Any) -> None:
    question = agent.DIRECTORY.train[1]
    person = person_of(question)
    episode, server = play(scripted, [tool_reply("search", json.dumps({"query": person.name})),
                            tool_reply("lookup", json.dumps({"id": person.id})),
                            text_reply(f"{question.answer}.")], question_index=1)  # fmt: skip
    assert (episode.outcome, episode.reward, episode.calls, episode.tool_calls) == ("right", 1.0, 3, 2)
    assert json.loads(server.requests[2]["messages"][-1]["content"]) == person.record()


@pytest.mark.parametrize(
    ("replies", "outcome", "calls", "earned"),
    [
        (lambda q: [text_reply("1234")], "wrong", 1, 0.0),  # answered from its head: made-up facts are not there
        (lambda q: [tool_reply("search", '{"query": "x"}'), text_reply("I do not know")], "wrong", 2, "credit"),
        (lambda q: [tool_reply("phone_book", '{"name": "x"}')], "malformed", 1, 0.0),  # no such tool
        (lambda q: [tool_reply("search", '{"name": "x"}')], "malformed", 1, 0.0),  # wrong arguments
        (lambda q: [tool_reply("search", '{"query": "x"}'), tool_reply("lookup", '{"id": 5}')], "malformed", 2, 0.0),
        (lambda q: [text_reply('<tool_call>\n{"name": "search", "arguments": {"query"')], "malformed", 1, 0.0),
        (lambda q: [tool_reply("search", '{"query": "x"}')] * agent.MAX_CALLS, "no_answer", agent.MAX_CALLS, "credit"),
    ],
    ids=["no_tool", "wrong_after_search", "unknown_tool", "bad_arguments", "bad_call_after_search", "unparsed_markup",
         "never_answers"],  # fmt: skip
)
def test_episodes_without_the_right_answer_earn_at_most_the_lookup_credit(
    scripted: Any, replies: Callable[[Any], list[dict[str, Any]]], outcome: str, calls: int, earned: float | str
) -> None:
    expected = agent.LOOKUP_CREDIT if earned == "credit" else earned
    question = agent.DIRECTORY.train[0]
    episode, server = play(scripted, replies(question))
    assert (episode.outcome, episode.reward, episode.calls) == (outcome, expected, calls)
    assert len(server.requests) == calls and not server.replies  # the loop stopped where the episode ended
    scored = episode.scored()
    assert not scored.correct and scored.reward == expected
    assert scored.stats["malformed"] == (1.0 if outcome == "malformed" else 0.0)
