"""Chat templates for GGUF files that carry none (no `tokenizer.chat_template`), as llama.cpp
falls back on its built-in ones: picked by the file's architecture, and only where the
vocabulary holds the template's turn markers as tokens of their own.
"""

from __future__ import annotations

from collections.abc import Callable

# Gemma's turns: `<start_of_turn>user` / `<start_of_turn>model`, each closed by `<end_of_turn>`;
# no system role: a system message opens the first user turn, followed by a blank line. Contents
# are trimmed, as Gemma's own template trims them (the system message's too, here, so that it is
# spliced back like every other content: see `Tokenizer.apply_chat_template`).
GEMMA = """{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] | trim + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
{{- message['content'] | trim }}{{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

_GEMMA_MARKERS = ("<start_of_turn>", "<end_of_turn>")
# architecture -> (template, the tokens it needs)
_BUILTIN: dict[str, tuple[str, tuple[str, ...]]] = {
    arch: (GEMMA, _GEMMA_MARKERS) for arch in ("gemma", "gemma2", "gemma3")
}


def builtin_template(architecture: str, token_id: Callable[[str], int | None]) -> str | None:
    """The built-in template for a GGUF of this architecture whose vocabulary (`token_id`)
    has its markers, else None."""
    template, markers = _BUILTIN.get(architecture, (None, ()))
    if template is None or any(token_id(m) is None for m in markers):
        return None
    return template
