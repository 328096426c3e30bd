"""Prompts: text, chat messages or token ids into the token ids of a request.

:func:`prompt_ids` is the one place the CLI and :func:`mtpflow.engine.generate`
encode prompts (as ``mlx_lm.generate`` does); :func:`make_request` wraps them
in a :class:`~mtpflow.state.Request` with the session's sampling defaults.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from .state import Request, SamplingParams

if TYPE_CHECKING:
    from .session import Session


def encode_prompt(tokenizer, text, chat: bool = True, system: str | None = None) -> list[int]:
    """Token ids of one prompt: ``text`` (one user turn) or a list of chat
    messages (``{"role", "content"}`` dicts).  With ``chat`` and a tokenizer
    that has a chat template, rendered with the generation prompt (after a
    ``system`` message, if given), as ``mlx_lm.generate`` does by default;
    otherwise ``text`` is plainly encoded."""
    if isinstance(text, str):
        messages = [{"role": "user", "content": text}]
    else:
        messages = list(text)
    if chat and getattr(tokenizer, "chat_template", None):
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    if not isinstance(text, str):
        why = "chat_template=False turns it off" if getattr(tokenizer, "chat_template", None) else "this tokenizer has none"
        raise ValueError(f"chat messages need the tokenizer's chat template ({why}); pass text or token ids")
    return list(tokenizer.encode(text))


def prompt_ids(tokenizer, prompt, chat_template: bool | None = None, system_prompt: str | None = None) -> list[int]:
    """The token ids of a prompt, as ``mlx_lm.generate`` builds them (the one
    place the CLI and :func:`generate` encode prompts).

    ``prompt``: token ids (used as they are), text (one user turn) or chat
    messages (a list of ``{"role": ..., "content": ...}``).  ``chat_template``:
    ``None`` = text goes through the tokenizer's chat template when it has
    one; ``True`` = it must (an error when the tokenizer has none);
    ``False`` = text is encoded plainly.  ``system_prompt``: a system message
    before the user turn (needs the template)."""
    if not isinstance(prompt, str) and not any(isinstance(m, dict) for m in prompt):
        if system_prompt is not None:
            raise ValueError("system_prompt goes with a text prompt or messages, not token ids")
        return list(prompt)
    if tokenizer is None:
        raise ValueError("this model has no tokenizer; pass token ids")
    if not isinstance(prompt, str) and not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise ValueError("a prompt is text, token ids or a list of {'role': ..., 'content': ...} messages")
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template and not has:
        raise ValueError("this tokenizer has no chat template; leave chat_template unset (or False) to encode plain text")
    if system_prompt is not None and not has:
        raise ValueError("system_prompt needs a chat template, and this tokenizer has none")
    if chat_template is False and system_prompt is not None:
        raise ValueError("system_prompt needs the chat template; drop chat_template=False")
    return encode_prompt(tokenizer, prompt, chat_template is not False, system=system_prompt)


def make_request(
    session: Session,
    prompt: list[int],
    max_tokens: int | None = None,
    sampling: SamplingParams | None = None,
    request_id: str | None = None,
    speculative: bool = True,
) -> Request:
    if not prompt:
        raise ValueError("the prompt is empty; pass at least one token")
    sc = session.config.sampling
    sampling = sampling or SamplingParams(
        temperature=sc.temperature, top_p=sc.top_p, top_k=sc.top_k, min_p=sc.min_p,
        repetition_penalty=sc.repetition_penalty, seed=sc.seed,
    )
    return Request(
        id=request_id or uuid.uuid4().hex[:12],
        prompt=list(prompt),
        max_tokens=max_tokens or session.config.generation.max_tokens,
        sampling=sampling,
        stop_ids=frozenset(session.target.eos_ids),
        speculative=speculative,
    )


__all__ = ["encode_prompt", "prompt_ids", "make_request"]
