"""What a request may use as media: no local files unless the operator allows a
directory (``--allowed-local-media-path``), one message whatever the file system
holds, and image sizes read from headers (no decoding) against pixel limits."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest

from mtpflow.media import MediaError, MediaPolicy, check_pixels, check_source, image_size, split_content_parts


def _refusal(src, policy):
    with pytest.raises(MediaError) as e:
        check_source(src, "messages[0].content[1] image", policy)
    return str(e.value)


def test_local_paths_are_refused_by_default_with_one_message(tmp_path):
    real = tmp_path / "cat.png"
    real.write_bytes(b"x")
    sources = [str(real), f"file://{real}", str(tmp_path / "missing.png"), "/etc/passwd", "/etc", "cat.png",
               "../../etc/passwd", "file:///nonexistent", str(tmp_path)]
    messages = {_refusal(s, MediaPolicy()) for s in sources}
    assert len(messages) == 1, messages  # no oracle: existing, missing, directory, relative: the same answer
    (msg,) = messages
    assert "--allowed-local-media-path" in msg and str(tmp_path) not in msg and "\n" not in msg
    # the local user of the CLI (no policy) keeps reading files
    assert check_source(str(real)) == str(real) and check_source(f"file://{real}") == str(real)


def test_an_allowed_directory(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(b"x")
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"x")
    (root / "link.png").symlink_to(secret)  # inside by name, outside once resolved
    (root / "dirlink").symlink_to(tmp_path)
    policy = MediaPolicy(local_root=root)
    inside = str((root / "sub" / "a.png").resolve())
    assert check_source(str(root / "sub" / "a.png"), policy=policy) == inside
    assert check_source(f"file://{root}/sub/a.png", policy=policy) == inside
    assert check_source("sub/a.png", policy=policy) == inside  # relative to the directory
    refused = {_refusal(s, policy) for s in (str(secret), str(root / "link.png"), "link.png", "../secret.png",
                                            f"{root}/sub/../../secret.png", "dirlink/secret.png", "sub",
                                            "sub/missing.png", "/etc/passwd")}
    assert len(refused) == 1 and str(root) not in refused.pop()
    # a symlinked root works as its target
    (tmp_path / "rootlink").symlink_to(root)
    assert check_source("sub/a.png", policy=MediaPolicy(local_root=tmp_path / "rootlink")) == inside


def test_split_content_parts_applies_the_policy(tmp_path):
    img = tmp_path / "a.png"
    img.write_bytes(b"x")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "image_url", "image_url": {"url": str(img)}}]}]
    with pytest.raises(MediaError, match="allowed-local-media-path"):
        split_content_parts(msgs)
    assert split_content_parts(msgs, MediaPolicy(local_root=tmp_path))[1] == [str(img.resolve())]


def png(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims ``width x height`` (a decompression bomb's header)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, format="PNG")
    raw = bytearray(buf.getvalue())
    ihdr = raw[12:29]  # chunk type + data
    ihdr[4:12] = struct.pack(">II", width, height)
    raw[12:29] = ihdr
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)) & 0xFFFFFFFF)
    return bytes(raw)


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def test_pixel_limits_read_the_header_only(monkeypatch):
    pytest.importorskip("PIL")
    from PIL import ImageFile

    def no_decoding(*a, **kw):
        raise AssertionError("the image was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    bomb = data_url(png(90_000, 90_000))  # 8.1e9 pixels: past Pillow's own bomb limit too
    assert image_size(data_url(png(9000, 9000))) == (9000, 9000)
    policy = MediaPolicy()
    with pytest.raises(MediaError, match=r"9000x9000 = 81000000 pixels, over this server's limit of 16777216 per image"):
        check_pixels([data_url(png(9000, 9000))], policy)
    with pytest.raises(MediaError, match="--max-image-pixels"):
        check_pixels([bomb], policy)
    check_pixels([data_url(png(4096, 4096))] * 4, policy)  # at the limits
    with pytest.raises(MediaError, match="5 images hold 83886080 pixels.*--max-request-pixels"):
        check_pixels([data_url(png(4096, 4096))] * 5, policy)
    with pytest.raises(MediaError, match="cannot read the image"):
        check_pixels([data_url(b"not an image")], policy)
