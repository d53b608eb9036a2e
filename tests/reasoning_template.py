"""A Qwen3-like chat template that strips reasoning (`<think>...</think>`) from the assistant turns before the last
user message, on the tiny character tokenizer of tests/chat_tokenizer.py: the kind of template that rewrites
earlier turns, for the per-turn sample tests (rollout.turn_samples)."""
from tests.chat_tokenizer import chat_tokenizer

REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{%- if tools %}<|im_start|>system\ntools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}{% set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def reasoning_tokenizer():
    return chat_tokenizer(REASONING_TEMPLATE)
