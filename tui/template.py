"""Turning a conversation into the prompt text the model continues."""

from typing import Callable, Dict, List, Optional

Messages = List[Dict[str, str]]
Template = Callable[[Messages], str]


def role_template(messages: Messages) -> str:
    """A plain "User:/Assistant:" transcript for tokenizers without a chat template.

    An assistant turn is written as "Assistant:" + content with nothing added in
    between, so the text of turn n+1 starts with exactly the prompt of turn n
    followed by its answer: the prompt cache then covers the whole history.
    """
    parts = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "system":
            parts.append(f"{content}\n\n")
        elif role == "user":
            parts.append(f"User: {content}\nAssistant:")
        else:
            parts.append(f"{content}\n\n")
    return "".join(parts)


def render_prompt(tokenizer, messages: Messages, system: Optional[str] = None,
                  template: Optional[Template] = None, template_kwargs: Optional[dict] = None) -> str:
    """Prompt text for `messages` (user/assistant turns), ending with the assistant's turn.

    `template` wins; then the tokenizer's own chat template (via the library's
    `apply_chat_template`, so the chat app and the CLI agree; `template_kwargs`: more
    arguments for it, mlx-lm's `--chat-template-config`); else `role_template`.
    """
    full = list(messages)
    if system:
        full.insert(0, {"role": "system", "content": system})
    if template is not None:
        return template(full)
    if getattr(tokenizer, "chat_template", None):
        from dflash_mlx.models.loading import apply_chat_template

        return apply_chat_template(tokenizer, full, template_kwargs=template_kwargs)
    return role_template(full)
