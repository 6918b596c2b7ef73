"""Chat tokenizers built on the spot (no download): a byte-level BPE trained on a little chat text, with ChatML's
special tokens and a chat template, in the tiny Llama's vocabulary (tests/support/tiny_models.py, 512 ids).

Real merges, so a merge across the generation prompt's boundary can happen as with a real tokenizer; two templates
of the shapes real ones have: ChatML with tool calls in <tool_call> tags and tool results as user turns (the
Qwen2.5 / Hermes shape), and one that drops past assistant turns' reasoning (the Qwen3 shape), which rewrites history.
The SFT-data e2e test uses the real SmolLM2 tokenizer and template besides."""

from __future__ import annotations

from typing import Any

from tests.support.tiny_models import VOCAB

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TOOLS = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Tools:{% for tool in tools %}
{{ tool | tojson }}{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

DROPS_REASONING = """\
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{% if loop.index0 > ns.last_user and message.reasoning_content %}<think>{{ message.reasoning_content }}</think>
{% endif %}{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CORPUS = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
    "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n",
    "<|im_start|>assistant\nIt is sunny in Paris.<|im_end|>\n",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<tool_response>\n{\"temperature\": 21}\n</tool_response> The answer is 42. Hello! How are you today?",
] * 20


def chat_tokenizer(template: str = CHATML_TOOLS) -> Any:
    """A ``PreTrainedTokenizerFast`` with ``template`` as its chat template, ids below VOCAB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
    )
