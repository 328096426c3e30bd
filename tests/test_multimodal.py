"""Images in prompts on a multimodal Gemma 4 target (issue 17).

The checkpoint is ``fixtures/gemma4_vision`` (a tiny random vision tower on pair_e's language
model, see its README), the drafter pair_e's assistant; references are transformers' own greedy
``generate`` and prefill logits, and mlx-vlm's ``generate``.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm", reason="the 'vision' extra (mlx-vlm) is not installed")

import mm_fixture as F  # noqa: E402

REF = F.reference()
MAX = 24
FIX = Path(__file__).parent / "fixtures" / "hf_gemma4"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return F.build(tmp_path_factory.mktemp("gemma4_vision"))


@pytest.fixture(scope="module")
def ckpt_bidir(tmp_path_factory) -> Path:
    return F.build(tmp_path_factory.mktemp("gemma4_vision_bidir"), bidirectional=True)


def session(path, drafter=True, **ov):
    from mtpflow.config import load_config
    from mtpflow.engine import load_session
    from mtpflow.logs import null_logger

    model = {"model": str(path)}
    if drafter:
        model["draft_model"] = str(F.drafter())
    o = {"model": model, "draft": {"block_size": 5}, "generation": {"max_tokens": MAX}}
    for k, v in ov.items():
        o.setdefault(k, {}).update(v)
    return load_session(load_config(overrides=o), log=null_logger())


@pytest.fixture(scope="module")
def spec(ckpt):
    return session(ckpt)


@pytest.fixture(scope="module")
def plain(ckpt):
    return session(ckpt, drafter=False)


def request(s, case: str, rid: str = "0"):
    from mtpflow.engine import make_request
    from mtpflow.media import encode_prompt_with_media

    c = REF[case]
    ids, media = encode_prompt_with_media(s, c["prompt"], [F.image(n) for n in c["images"]])
    r = make_request(s, ids, max_tokens=MAX, request_id=rid)
    r.media = media
    return r


def run(s, reqs) -> dict[str, list[int]]:
    from mtpflow.engine import generate_stream

    out: dict[str, list[int]] = {r.id: [] for r in reqs}
    for ev in generate_stream(s, reqs):
        out[ev.request_id].extend(ev.tokens)
    return out


@pytest.mark.parametrize("case", ["gradient", "two_images", "text_only"])
def test_prompt_ids_are_the_processors(spec, case):
    c = REF[case]
    r = request(spec, case)
    assert r.prompt == c["prompt_ids"]
    assert (r.media is None) == (not c["images"])


@pytest.mark.parametrize("case", ["gradient", "checker", "two_images"])
def test_speculative_equals_target_only_equals_transformers(spec, plain, case):
    want = REF[case]["tokens"]
    assert run(plain, [request(plain, case)])["0"] == want
    spec.reset_stats()
    assert run(spec, [request(spec, case)])["0"] == want
    st = spec.stats.as_dict()
    assert st["drafts"] > 0 and st["tau"] > 1.0  # the drafter ran, on K/V that holds the image positions


def test_the_image_is_used(spec):
    with_image = run(spec, [request(spec, "gradient")])["0"]
    without = run(spec, [request(spec, "text_only")])["0"]
    assert with_image != without
    assert without == REF["text_only"]["tokens"]
    assert run(spec, [request(spec, "checker")])["0"] != with_image  # and which image it is


def test_rows_with_and_without_images_in_one_batch(spec):
    cases = ["gradient", "text_only", "checker", "two_images", "text_only"]
    reqs = [request(spec, c, rid=str(i)) for i, c in enumerate(cases)]
    out = run(spec, reqs)
    for i, c in enumerate(cases):
        assert out[str(i)] == REF[c]["tokens"], c


def test_text_rows_are_bitwise_the_text_path(spec):
    """The embedding path (what a batch with an image row runs) gives text rows exactly the
    token path's hidden states and cache."""
    import mlx.core as mx

    t = spec.target
    rows = [REF["text_only"]["prompt_ids"], REF["text_only"]["prompt_ids"][:9]]
    c_tok, h_tok = t.prefill(rows)
    c_emb, h_emb = t.multimodal.prefill(rows, [None, None])
    assert mx.array_equal(h_tok, h_emb).item()
    for a, b in zip(c_tok, c_emb):
        assert mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.positions, b.positions).item()


@pytest.mark.parametrize("bidir", [False, True])
@pytest.mark.parametrize("case", ["gradient", "two_images"])
@pytest.mark.parametrize("step", [512, 7])
def test_prefill_logits_match_transformers(ckpt, ckpt_bidir, case, bidir, step):
    """Last-position logits of the prefill against transformers' (1e-4), for the causal model
    and the ``use_bidirectional_attention = "vision"`` one (an image's soft tokens see each other
    in the sliding layers), in one chunk and in chunks of 7 (a block is never split)."""
    import numpy as np

    s = session(ckpt_bidir if bidir else ckpt, drafter=False)
    r = request(s, case)
    _, h = s.target.prefill([r.prompt], step=step, media=[r.media])
    got = np.array(s.target.logits(h)[0])
    name = case + ("_bidirectional" if bidir else "")
    np.testing.assert_allclose(got, F.reference_logits(name)[-1], atol=1e-4, rtol=0)
    other = F.reference_logits(case if bidir else case + "_bidirectional")[-1]
    assert np.abs(got - other).max() > 1e-2  # the two mask conventions are told apart


def test_equals_mlx_vlm_generate(ckpt, spec):
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_config

    model, processor = load(str(ckpt))
    config = load_config(str(ckpt))
    for case in ("gradient", "checker", "two_images"):
        c = REF[case]
        imgs = [F.image(n) for n in c["images"]]
        prompt = apply_chat_template(processor, config, c["prompt"], num_images=len(imgs))
        res = generate(model, processor, prompt, image=imgs, max_tokens=MAX, temperature=0.0, verbose=False)
        ours = run(spec, [request(spec, case)])["0"]
        assert res.text == spec.tokenizer.decode(ours), case


# -- prompt construction and bad input --------------------------------------------------------
def data_url(path: str) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def test_data_url_equals_file(spec):
    from mtpflow.media import encode_prompt_with_media

    c = REF["gradient"]
    ids, media = encode_prompt_with_media(spec, c["prompt"], [data_url(F.image("gradient.png"))])
    assert ids == c["prompt_ids"]
    from mtpflow.engine import make_request

    r = make_request(spec, ids, max_tokens=MAX)
    r.media = media
    assert run(spec, [r])[r.id] == c["tokens"]


def bad(spec, images=(), audio=(), text="beca daka"):
    from mtpflow.media import MediaError, encode_prompt_with_media

    with pytest.raises(MediaError) as e:
        encode_prompt_with_media(spec, text, images, audio)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bad_inputs(spec, tmp_path):
    junk = tmp_path / "junk.png"
    junk.write_text("not an image")
    assert "cannot read image" in bad(spec, [str(junk)])
    assert "no such file" in bad(spec, [str(tmp_path / "missing.png")])
    assert "remote URLs are not fetched" in bad(spec, ["https://example.com/cat.png"])
    assert "not valid base64" in bad(spec, ["data:image/png;base64,@@@"])
    assert "cannot read image" in bad(spec, ["data:image/png;base64," + base64.b64encode(b"junk").decode()])
    assert "no audio tower" in bad(spec, audio=[F.image("gradient.png")])
    msg = bad(spec, [F.image("checker.png")] * 40)
    assert "over the model's context of 512" in msg and "40 images" in msg


def test_image_for_a_text_only_target():
    from mtpflow.config import load_config
    from mtpflow.engine import load_session
    from mtpflow.logs import null_logger

    s = load_session(load_config(overrides={"model": {"model": str(FIX / "pair_e" / "target")}}), log=null_logger())
    assert "no vision or audio tower" in bad(s, [F.image("gradient.png")])


def test_prefill_refuses_media_without_tower(tmp_path):
    """A multimodal checkpoint without vision_config (language model only) refuses images."""
    import tiny

    from mtpflow.media import MediaError

    tgt = tiny.as_multimodal(FIX / "pair_e" / "target", tmp_path / "mm")
    s = session(tgt, drafter=False)
    assert "no vision or audio tower" in bad(s, [F.image("gradient.png")])
    with pytest.raises(MediaError, match="no vision or audio tower"):
        s.target.prefill([[2, 5, 6]], media=[{"pixel_values": None}])


def test_missing_extra_names_the_install(monkeypatch, ckpt):
    import importlib.util

    from mtpflow._extras import MissingExtra

    s = session(ckpt, drafter=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "mlx_vlm" else real(n, *a))
    with pytest.raises(MissingExtra) as e:
        s.target.multimodal.processor()
    assert 'pip install "mtpflow[vision]"' in str(e.value)


# -- the command line ---------------------------------------------------------------------------
def cli(capsys, *argv):
    from mtpflow.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_image(capsys, ckpt):
    c = REF["two_images"]
    rc, out, err = cli(capsys, "generate", "--model", ckpt, "--draft-model", F.drafter(), "--draft-block-size", 5,
                       "--max-tokens", MAX, "--prompt", c["prompt"], "--image", F.image("gradient.png"),
                       "--image", data_url(F.image("checker.png")), "--json")
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["tokens"] == c["tokens"] and obj["prompt_tokens"] == len(c["prompt_ids"])


@pytest.mark.parametrize("extra, msg", [
    (("--image", "https://example.com/a.png"), "remote URLs are not fetched"),
    (("--image", "/nonexistent/a.png"), "no such file"),
    (("--audio", "/nonexistent/a.wav"), "no such file"),
    (("--image", "{junk}"), "cannot read image"),
    (("--prompt-ids", "2,5,6", "--image", "{img}"), "--image / --audio go with --prompt"),
])
def test_cli_bad_image(capsys, ckpt, tmp_path, extra, msg):
    junk = tmp_path / "junk.png"
    junk.write_text("no")
    extra = [a.format(junk=junk, img=F.image("gradient.png")) for a in extra]
    args = ["generate", "--model", ckpt, "--max-tokens", 4, *extra]
    if "--prompt-ids" not in extra:
        args += ["--prompt", "beca"]
    rc, out, err = cli(capsys, *args)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mtpflow: error: ") and msg in lines[0], err


def test_cli_image_on_text_target(capsys):
    rc, out, err = cli(capsys, "generate", "--model", FIX / "pair_e" / "target", "--max-tokens", 4, "--prompt", "beca",
                       "--image", F.image("gradient.png"))
    assert rc == 2 and err.startswith("mtpflow: error: ") and "no vision or audio tower" in err


# -- OpenAI content parts (the server's helper) ---------------------------------------------
def test_split_content_parts():
    from mtpflow.media import split_content_parts

    url = data_url(F.image("gradient.png"))
    wav = base64.b64encode(b"RIFF....WAVE").decode()
    msgs, images, audio = split_content_parts([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "beca daka"},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
            {"type": "text", "text": "doli"},
        ]},
    ])
    assert msgs == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "beca daka\ndoli"}]
    assert images == [url] and audio == ["data:audio/wav;base64," + wav]


@pytest.mark.parametrize("part, msg", [
    ({"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}, "remote URLs are not fetched"),
    ({"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}}, "remote URLs are not fetched"),
    ({"type": "image_url", "image_url": {}}, "image_url.url: expected a string"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}}, "expected wav, mp3 or flac"),
    ({"type": "input_audio", "input_audio": {"data": "@@"}}, "not valid base64"),
    ({"type": "video_url"}, "expected text, image_url or input_audio"),
    ({"type": "text", "text": 3}, ".text: expected a string"),
])
def test_split_content_parts_refuses(part, msg):
    from mtpflow.media import MediaError, split_content_parts

    with pytest.raises(MediaError, match=msg.replace(".", r"\.").replace("(", r"\(")) as e:
        split_content_parts([{"role": "user", "content": [part]}])
    assert "\n" not in str(e.value) and "messages[0].content[0]" in str(e.value)


def test_split_content_parts_media_only_in_user_messages():
    from mtpflow.media import MediaError, split_content_parts

    url = data_url(F.image("gradient.png"))
    with pytest.raises(MediaError, match="go in user messages"):
        split_content_parts([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": url}}]}])


def test_the_server_policy_checks_sources_and_pixels_before_decoding(spec, monkeypatch):
    """The server's MediaPolicy: local files only under the allowed directory, and an image
    over the pixel limits is refused from its header, before any decoding."""
    import mlx_vlm.utils
    from test_server_media import data_url as png_url
    from test_server_media import png

    from mtpflow.media import MediaError, MediaPolicy, encode_prompt_with_media

    c = REF["gradient"]
    image = Path(F.image("gradient.png"))
    ids, _ = encode_prompt_with_media(spec, c["prompt"], [str(image)], policy=MediaPolicy(local_root=image.parent))
    assert ids == c["prompt_ids"]

    def no_decoding(*a, **kw):
        raise AssertionError("decoded")

    monkeypatch.setattr(mlx_vlm.utils, "load_image", no_decoding)
    with pytest.raises(MediaError, match="allowed-local-media-path"):
        encode_prompt_with_media(spec, c["prompt"], [str(image)], policy=MediaPolicy())
    with pytest.raises(MediaError, match="81000000 pixels.*--max-image-pixels"):
        encode_prompt_with_media(spec, c["prompt"], [png_url(png(9000, 9000))], policy=MediaPolicy())
    with pytest.raises(MediaError, match="--max-request-pixels"):
        encode_prompt_with_media(spec, c["prompt"], [png_url(png(64, 64))] * 2,
                                 policy=MediaPolicy(max_request_pixels=64 * 64 + 1))
