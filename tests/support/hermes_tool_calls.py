"""Reading a tool call out of a model's raw text the way vLLM's hermes parser does: what the e2e tests compare the
tool calls the client got (chat or Messages API) against, from the completion ids the gateway recorded."""

from __future__ import annotations

import json
import re


def tool_call_in(text: str) -> dict | None:
    """The first hermes `<tool_call>{...}</tool_call>` block of a reply, parsed the way vLLM's hermes parser does (an
    unterminated block at the end counts): what `message.tool_calls` must have been derived from."""
    match = re.search(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL)
    return json.loads((match.group(1) or match.group(2)).strip()) if match else None
