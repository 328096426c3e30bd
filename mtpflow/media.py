"""Images and audio in prompts: where they may come from, and how a prompt with them is encoded.

* :func:`check_source` accepts a local file or a ``data:`` URL and refuses remote URLs (nothing is
  ever fetched);
* :func:`encode_prompt_with_media` turns ``(text, images, audio)`` into ``(prompt ids, media)`` for
  a :class:`~mtpflow.state.Request`, through the target's processor and chat template (the target
  adapter's ``encode_media``: placeholder tokens in the ids, pixel values / audio features in
  ``media``);
* :func:`split_content_parts` reads OpenAI chat messages whose content is a list of parts
  (``text``, ``image_url``, ``input_audio``) into text messages with the media in order, for the
  server.

Nothing here imports mlx or the ``vision`` extra; the adapter does, when a prompt has media.
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path
from typing import Any

_REMOTE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


class MediaError(ValueError):
    """A bad image / audio input (one line; the CLI exits 2 with it, the server answers 400)."""


def check_source(src: str, kind: str = "image") -> str:
    """``src`` if it is a ``data:`` URL or an existing local file (``file://`` URLs become
    paths); remote URLs are refused."""
    if not isinstance(src, str) or not src:
        raise MediaError(f"{kind}: expected a file path or a data: URL")
    if src.startswith("data:"):
        head, sep, payload = src.partition(",")
        if not sep:
            raise MediaError(f"{kind}: malformed data URL (no ',' before the payload)")
        if ";base64" not in head:
            raise MediaError(f"{kind}: data URLs must be base64-encoded (data:<type>;base64,...)")
        try:
            base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError(f"{kind}: the data URL's payload is not valid base64") from None
        return src
    if src.startswith("file://"):
        src = src[len("file://"):]
    elif _REMOTE.match(src):
        raise MediaError(f"{kind} {src[:80]!r}: remote URLs are not fetched; pass a local file or a data: URL")
    if not Path(src).is_file():
        raise MediaError(f"{kind} {src!r}: no such file")
    return src


def data_url_bytes(src: str) -> bytes:
    """The bytes of a (checked) ``data:`` URL."""
    return base64.b64decode(src.partition(",")[2])


def encode_prompt_with_media(
    session, text: str | list[dict], images=(), audio=(), *, chat: bool | None = None, system: str | None = None,
) -> tuple[list[int], Any]:
    """``(prompt ids, media)`` of one prompt with images / audio (paths or ``data:`` URLs), as
    ``mlx_vlm.generate`` builds it: the checkpoint's chat template with one image / audio item per
    input, placeholders expanded by its processor.  ``text``: a user prompt, or a list of chat
    messages (``{"role", "content"}``, content a string).  ``chat=False`` skips the template
    (the text must then hold the placeholders itself)."""
    images = [check_source(s, "image") for s in images]
    audio = [check_source(s, "audio") for s in audio]
    encode = getattr(session.target, "encode_media", None)
    if encode is None:
        raise MediaError(f"{session.target.path}: this target takes text only (no vision or audio tower); drop the images / audio")
    return encode(text, images=images, audio=audio, chat=chat, system=system,
                  max_tokens=session.config.generation.max_tokens)


def split_content_parts(messages: list[dict]) -> tuple[list[dict], list[str], list[str]]:
    """OpenAI chat ``messages`` -> ``(messages, images, audio)``.

    Content given as a list of parts is joined into text and each ``image_url`` /
    ``input_audio`` part becomes one media input (in order; they are placed in the prompt
    by the checkpoint's chat template, as mlx-vlm does).  Images: ``{"image_url": {"url":
    "data:image/...;base64,..."}}`` (or a local path / ``file://``); audio: ``{"input_audio":
    {"data": BASE64, "format": "wav"}}``.  Remote URLs and unknown part types raise
    :class:`MediaError`; media outside a ``user`` message too.
    """
    if not isinstance(messages, list):
        raise MediaError("messages: expected a list")
    out, images, audio = [], [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise MediaError(f"messages[{i}]: expected an object")
        content = m.get("content")
        if content is None or isinstance(content, str):
            out.append(dict(m))
            continue
        if not isinstance(content, list):
            raise MediaError(f"messages[{i}].content: expected a string or a list of parts")
        texts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "input_text"):
                t = part.get("text")
                if not isinstance(t, str):
                    raise MediaError(f"{where}.text: expected a string")
                texts.append(t)
            elif kind in ("image_url", "input_image"):
                spec = part.get("image_url", part.get("url"))
                url = spec.get("url") if isinstance(spec, dict) else spec
                if not isinstance(url, str):
                    raise MediaError(f"{where}.image_url.url: expected a string")
                images.append(check_source(url, f"{where} image"))
            elif kind == "input_audio":
                spec = part.get("input_audio")
                if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
                    raise MediaError(f"{where}.input_audio: expected {{\"data\": BASE64, \"format\": \"wav\"|\"mp3\"}}")
                fmt = spec.get("format", "wav")
                if fmt not in ("wav", "mp3", "flac"):
                    raise MediaError(f"{where}.input_audio.format: expected wav, mp3 or flac (got {fmt!r})")
                audio.append(check_source(f"data:audio/{fmt};base64,{spec['data']}", f"{where} audio"))
            else:
                raise MediaError(f"{where}.type: expected text, image_url or input_audio (got {kind!r})")
            if kind not in ("text", "input_text") and m.get("role") != "user":
                raise MediaError(f"{where}: images and audio go in user messages (this one is {m.get('role')!r})")
        out.append({**m, "content": "\n".join(texts)})
    return out, images, audio


__all__ = ["MediaError", "check_source", "data_url_bytes", "encode_prompt_with_media", "split_content_parts"]
