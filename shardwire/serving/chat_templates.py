"""`--chat-template` and `--chat-template-file`: a template in place of the model's own, named
like llama.cpp's built-in ones or given as Jinja text."""

from __future__ import annotations

from pathlib import Path

from .chat import CHATML_TEMPLATE, render_chat

BUILTIN = {
    "chatml": CHATML_TEMPLATE,
    "llama3": (
        "{{ bos_token }}{% for m in messages %}"
        "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + (m['content'] | trim) + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    # Gemma has no system role: a system message becomes a user turn.
    "gemma": (
        "{{ bos_token }}{% for m in messages %}"
        "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
        "{{ '<start_of_turn>' + role + '\n' + (m['content'] | trim) + '<end_of_turn>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
    "phi3": (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
    "zephyr": (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
}


def chosen_template(name_or_text: str | None, file: str | None) -> str | None:
    """The template the flags ask for, checked by rendering one exchange; None: the model's own.
    Raises ValueError for an unknown name, an unreadable file or a template that fails."""
    if name_or_text and file:
        raise ValueError("give --chat-template or --chat-template-file, not both")
    if file:
        try:
            template = Path(file).read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--chat-template-file: {e}") from None
    elif name_or_text is None:
        return None
    elif name_or_text in BUILTIN:
        template = BUILTIN[name_or_text]
    elif "{{" in name_or_text or "{%" in name_or_text:
        template = name_or_text
    else:
        raise ValueError(
            f"--chat-template: no built-in template named {name_or_text!r} (built in: {', '.join(BUILTIN)}); "
            "Jinja text is also accepted"
        )
    render_chat(template, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    return template
