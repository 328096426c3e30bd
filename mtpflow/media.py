"""Images and audio in prompts: where they may come from, and how a prompt with them is encoded.

* :func:`check_source` accepts a local file or a ``data:`` URL and refuses remote URLs (nothing is
  ever fetched).  Given a :class:`MediaPolicy` (the server's) it refuses local files unless they
  lie under the policy's ``local_root`` (``mtpflow serve --allowed-local-media-path DIR``; symlinks
  are resolved first), with one message whatever the file system holds;
* :func:`check_pixels` reads the width and height from each image's header (Pillow opens lazily:
  nothing is decoded) and refuses images over the policy's pixel limits, per image and per request,
  before anything decodes them (a small PNG can hold a huge image);
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
import io
import os
import re
from pathlib import Path
from typing import Any

from attrs import field, frozen

_REMOTE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")

#: the server's default limit on one image: 4096 x 4096 pixels (``--max-image-pixels``)
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
#: the server's default limit on the images of one request together (``--max-request-pixels``)
DEFAULT_MAX_REQUEST_PIXELS = 4 * DEFAULT_MAX_IMAGE_PIXELS


class MediaError(ValueError):
    """A bad image / audio input (one line; the CLI exits 2 with it, the server answers 400)."""


def _root(value) -> Path | None:
    return None if value is None else Path(os.path.realpath(Path(value).expanduser()))


@frozen(kw_only=True)
class MediaPolicy:
    """What a request may use as media (the server's rules; the CLI's local user has none).

    ``local_root``: local files are accepted only under this directory (resolved, symlinks
    included); ``None`` refuses every local file.  ``max_image_pixels`` / ``max_request_pixels``:
    width x height of one image / the sum over a request's images.
    """

    local_root: Path | None = field(default=None, converter=_root)
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS


def _local_refused(kind: str) -> MediaError:
    # one message for every refused local path: a request learns nothing about the file system
    return MediaError(f"{kind}: local file paths are not accepted here (only files under the server's "
                      "--allowed-local-media-path); send the image inline as a data: URL")


def _allowed_local(src: str, kind: str, root: Path | None) -> str:
    """The resolved path of ``src`` if it is a regular file under ``root``, else the one refusal."""
    if root is None:
        raise _local_refused(kind)
    try:
        path = Path(os.path.realpath(root / src))  # an absolute src replaces root; symlinks resolved
        if path.is_relative_to(root) and path.is_file():
            return str(path)
    except (OSError, ValueError):
        pass
    raise _local_refused(kind)


def check_source(src: str, kind: str = "image", policy: MediaPolicy | None = None) -> str:
    """``src`` if it is a ``data:`` URL or an existing local file (``file://`` URLs become
    paths); remote URLs are refused.  With a ``policy`` (the server), local files are
    refused unless they lie under ``policy.local_root`` (then their resolved path is
    returned; a relative path is taken relative to that directory)."""
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
    if policy is not None:
        return _allowed_local(src, kind, policy.local_root)
    if not Path(src).is_file():
        raise MediaError(f"{kind} {src!r}: no such file")
    return src


def data_url_bytes(src: str) -> bytes:
    """The bytes of a (checked) ``data:`` URL."""
    return base64.b64decode(src.partition(",")[2])


def image_size(src: str, kind: str = "image") -> tuple[int, int] | None:
    """``(width, height)`` of a checked image source, from its header only (nothing is
    decoded); ``None`` for an image so large that Pillow refuses to open it."""
    import warnings

    try:
        from PIL import Image
    except ImportError:
        from ._extras import require

        require("vision", "PIL")
        raise
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's DecompressionBombWarning: the limits are checked here
            fh = io.BytesIO(data_url_bytes(src)) if src.startswith("data:") else src
            with Image.open(fh) as im:
                return tuple(im.size)
    except Image.DecompressionBombError:
        return None
    except Exception:  # not an image Pillow can identify
        raise MediaError(f"{kind}: cannot read the image (not a PNG, JPEG or other image format Pillow reads)") from None


def check_pixels(images: list[str], policy: MediaPolicy, kinds: list[str] | None = None) -> None:
    """Refuse images over ``policy``'s pixel limits (each, and all together), reading only their headers."""
    total = 0
    for i, src in enumerate(images):
        kind = kinds[i] if kinds else f"image {i}"
        size = image_size(src, kind)
        if size is None:
            raise MediaError(f"{kind}: the image has more pixels than Pillow opens, over this server's limit of "
                             f"{policy.max_image_pixels} per image (--max-image-pixels); send a smaller image")
        w, h = size
        if w * h > policy.max_image_pixels:
            raise MediaError(f"{kind}: {w}x{h} = {w * h} pixels, over this server's limit of "
                             f"{policy.max_image_pixels} per image (--max-image-pixels); send a smaller image")
        total += w * h
    if total > policy.max_request_pixels:
        raise MediaError(f"the request's {len(images)} images hold {total} pixels, over this server's limit of "
                         f"{policy.max_request_pixels} per request (--max-request-pixels); send fewer or smaller images")


def encode_prompt_with_media(
    session, text: str | list[dict], images=(), audio=(), *, chat: bool | None = None, system: str | None = None,
    policy: MediaPolicy | None = None,
) -> tuple[list[int], Any]:
    """``(prompt ids, media)`` of one prompt with images / audio (paths or ``data:`` URLs), as
    ``mlx_vlm.generate`` builds it: the checkpoint's chat template with one image / audio item per
    input, placeholders expanded by its processor.  ``text``: a user prompt, or a list of chat
    messages (``{"role", "content"}``, content a string).  ``chat=False`` skips the template
    (the text must then hold the placeholders itself).  ``policy`` (the server's): where
    local files may come from, and the pixel limits, checked on the images' headers before
    anything decodes them."""
    images = [check_source(s, "image", policy) for s in images]
    audio = [check_source(s, "audio", policy) for s in audio]
    encode = getattr(session.target, "encode_media", None)
    if encode is None:
        raise MediaError("this target takes text only (no vision or audio tower); drop the images / audio")
    if policy is not None and images:
        check_pixels(images, policy)
    return encode(text, images=images, audio=audio, chat=chat, system=system,
                  max_tokens=session.config.generation.max_tokens)


def split_content_parts(messages: list[dict], policy: MediaPolicy | None = None) -> tuple[list[dict], list[str], list[str]]:
    """OpenAI chat ``messages`` -> ``(messages, images, audio)``, under ``policy``
    (default: :class:`MediaPolicy`'s defaults -- no local files).

    Content given as a list of parts is joined into text and each ``image_url`` /
    ``input_audio`` part becomes one media input (in order; they are placed in the prompt
    by the checkpoint's chat template, as mlx-vlm does).  Images: ``{"image_url": {"url":
    "data:image/...;base64,..."}}`` (or a local path / ``file://``); audio: ``{"input_audio":
    {"data": BASE64, "format": "wav"}}``.  Remote URLs and unknown part types raise
    :class:`MediaError`; media outside a ``user`` message too.
    """
    policy = MediaPolicy() if policy is None else policy
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
                images.append(check_source(url, f"{where} image", policy))
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


__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS", "DEFAULT_MAX_REQUEST_PIXELS", "MediaError", "MediaPolicy", "check_pixels",
    "check_source", "data_url_bytes", "encode_prompt_with_media", "image_size", "split_content_parts",
]
