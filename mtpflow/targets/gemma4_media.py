"""Images and audio for multimodal ``gemma4`` targets, through mlx-vlm.

The towers are mlx-vlm's (``mlx_vlm.models.gemma4``: ``VisionModel``, ``AudioEncoder``, the
``MultimodalEmbedder`` projections) and so are the processor (``Gemma4Processor``), the chat
formatting (``mlx_vlm.prompt_utils.apply_chat_template``), the input preparation
(``mlx_vlm.utils.prepare_inputs``) and the input embeddings (``Model.get_input_embeddings``: soft
tokens scattered into the image / audio placeholders, per-layer inputs of the text tokens with the
placeholders as pad).  Nothing here re-implements a tower: this module loads the tower weights of
the checkpoint (lazily, on the first prompt with media), hands mlx-vlm a view of mtpflow's own
language model for the embeddings, and runs the prefill on them (:meth:`Gemma4Media.prefill`).

One convention is the reference's rather than mlx-vlm's: with ``use_bidirectional_attention =
"vision"`` (26B / 31B), an image's soft tokens see each other in the *sliding* layers only, as in
transformers' ``create_masks_for_vision_model`` (mlx-vlm 0.7.10 also opens the full layers).
"""

from __future__ import annotations

import io
import warnings
import wave
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..media import MediaError, data_url_bytes
from .base import SLIDING, TargetError, load_safetensors

TOWER_PREFIXES = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")


def _require():
    from .._extras import require

    require("vision", "mlx_vlm", "PIL")


class _LanguageView:
    """What mlx-vlm's ``get_input_embeddings`` reads of its language model, on mlx-lm's."""

    def __init__(self, inner):
        self.embed_tokens = inner.embed_tokens
        self.embed_scale = inner.embed_scale
        self.hidden_size_per_layer_input = inner.hidden_size_per_layer_input
        self.get_per_layer_inputs = inner._get_per_layer_inputs


class _Towers(nn.Module):
    def __init__(self, config, inner):
        super().__init__()
        from mlx_vlm.models.gemma4.audio import AudioEncoder
        from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder, VisionModel

        self.config = config
        self.vision_tower = VisionModel(config.vision_config)
        self.embed_vision = MultimodalEmbedder(config.vision_config.hidden_size, config.text_config.hidden_size,
                                               eps=config.vision_config.rms_norm_eps)
        if config.audio_config is not None:
            self.audio_tower = AudioEncoder(config.audio_config)
            self.embed_audio = MultimodalEmbedder(config.audio_config.output_proj_dims or config.audio_config.hidden_size,
                                                  config.text_config.hidden_size, eps=config.audio_config.rms_norm_eps)
        else:
            self.audio_tower = None
            self.embed_audio = None
        self._lm = _LanguageView(inner)

    @property
    def language_model(self):  # read by mlx-vlm's get_input_embeddings as language_model.model.*
        return _Holder(self._lm)


class _Holder:
    def __init__(self, model):
        self.model = model


class Gemma4Media:
    """The multimodal side of a :class:`~mtpflow.targets.gemma4.Gemma4Target`."""

    def __init__(self, target):
        self.target = target
        cfg = target.config
        self.vision = cfg.get("vision_config") is not None
        self.audio = cfg.get("audio_config") is not None
        self.image_token_id = cfg.get("image_token_id")
        self.audio_token_id = cfg.get("audio_token_id")
        self.video_token_id = cfg.get("video_token_id")
        self.bidirectional = target.tc.get("use_bidirectional_attention") == "vision"
        self.context = int(target.tc.get("max_position_embeddings") or 0)
        self._towers = None
        self._processor = None

    # -- prompt construction -----------------------------------------------------------
    def processor(self):
        if self._processor is None:
            _require()
            from mlx_vlm.models.gemma4 import Gemma4Processor

            try:
                with warnings.catch_warnings():  # its default audio feature extractor warns about an empty mel filter
                    warnings.filterwarnings("ignore", message="At least one mel filter")
                    self._processor = Gemma4Processor.from_pretrained(str(self.target.path))
            except (OSError, ValueError) as exc:
                raise TargetError(f"{self.target.path}: cannot load the processor ({exc})") from None
        return self._processor

    def _check(self, images, audio):
        path = self.target.path
        if images and not self.vision:
            raise MediaError(f"{path}: this checkpoint has no vision tower (no vision_config); drop the images")
        if audio and not self.audio:
            raise MediaError(f"{path}: this checkpoint has no audio tower (no audio_config); drop the audio")

    def encode(self, text, images=(), audio=(), chat=None, system=None, max_tokens=0):
        """``(prompt ids, media)`` as ``mlx_vlm.generate`` prepares them (see
        :func:`mtpflow.media.encode_prompt_with_media`)."""
        self._check(images, audio)
        proc = self.processor()
        from mlx_vlm.prompt_utils import apply_chat_template
        from mlx_vlm.utils import load_image, prepare_inputs, should_add_special_tokens

        pil = []
        for src in images:
            try:
                pil.append(load_image(src))
            except Exception as exc:
                raise MediaError(f"cannot read image {_short(src)}: {_first_line(exc)}") from None
        waves = [self._load_audio(src) for src in audio]
        has_template = getattr(proc, "chat_template", None) is not None
        if chat and not has_template:
            raise MediaError("this checkpoint has no chat template; drop --chat-template")
        if chat is not False and has_template:
            msgs = text if isinstance(text, list) else [{"role": "user", "content": text}]
            if system is not None:
                msgs = [{"role": "system", "content": system}] + msgs
            prompt = apply_chat_template(proc, self.target.config, msgs if len(msgs) > 1 else msgs[0]["content"],
                                         num_images=len(pil), num_audios=len(waves))
        else:  # plain text: the placeholders first, as mlx-vlm's formatting does
            if isinstance(text, list):
                text = "\n".join(str(m.get("content") or "") for m in text)
            prompt = proc.image_token * len(pil) + proc.audio_token * len(waves) + text
        try:
            inputs = prepare_inputs(
                proc, images=pil or None, audio=waves or None, prompts=prompt,
                image_token_index=self.image_token_id, add_special_tokens=should_add_special_tokens("gemma4", proc),
            )
        except ValueError as exc:
            raise MediaError(f"cannot prepare the images / audio: {_first_line(exc)}") from None
        ids = [int(t) for t in inputs["input_ids"][0].tolist()]
        if self.context and len(ids) + max(max_tokens, 0) > self.context:
            n_soft = sum(1 for t in ids if t in (self.image_token_id, self.audio_token_id))
            raise MediaError(
                f"the prompt is {len(ids)} tokens ({len(pil)} images, {len(waves)} audio: {n_soft} soft tokens)"
                f"{f' + {max_tokens} to generate' if max_tokens else ''}, over the model's context of {self.context}; "
                "use fewer or smaller images / shorter audio"
            )
        media = {k: inputs[k] for k in ("pixel_values", "input_features", "input_features_mask")
                 if inputs.get(k) is not None}
        return ids, (media or None)

    def _load_audio(self, src: str):
        """A mono float32 waveform at the feature extractor's rate: WAV (PCM) is read here;
        other formats / rates go through mlx-vlm's ``load_audio`` (mlx-audio)."""
        proc = self.processor()
        sr = getattr(getattr(proc, "feature_extractor", None), "sampling_rate", 16000)
        raw = data_url_bytes(src) if src.startswith("data:") else Path(src).read_bytes()
        import numpy as np

        try:
            with wave.open(io.BytesIO(raw)) as w:
                if w.getframerate() == sr and w.getsampwidth() in (1, 2, 4):
                    width = w.getsampwidth()
                    frames = w.readframes(w.getnframes())
                    dt = {1: np.uint8, 2: np.int16, 4: np.int32}[width]
                    a = np.frombuffer(frames, dt).astype(np.float32)
                    a = (a - 128) / 128 if width == 1 else a / float(2 ** (8 * width - 1))
                    return a.reshape(-1, w.getnchannels()).mean(axis=1)
        except (wave.Error, EOFError):
            pass
        try:
            from mlx_vlm.utils import load_audio

            return load_audio(io.BytesIO(raw) if src.startswith("data:") else src, sr=sr)
        except ImportError as exc:
            raise MediaError(f"audio {_short(src)}: only {sr} Hz PCM WAV is read without mlx-audio ({exc.name} missing); "
                             'run: pip install "mtpflow[vision]"') from None
        except Exception as exc:
            raise MediaError(f"cannot read audio {_short(src)}: {_first_line(exc)}") from None

    # -- towers ------------------------------------------------------------------------
    def towers(self) -> _Towers:
        if self._towers is None:
            _require()
            from mlx_vlm.models import gemma4 as vlm
            from mlx_vlm.utils import update_module_configs

            config = dict(self.target.config)
            mc = update_module_configs(vlm.ModelConfig.from_dict(config), vlm, config, ["text", "vision", "audio"])
            towers = _Towers(mc, self.target.inner)
            weights = {}
            for k, v in load_safetensors(self.target.path).items():
                key = k[len("model."):] if k.startswith("model.") else k
                if key.startswith(TOWER_PREFIXES):
                    weights["model." + key] = v
            weights = vlm.Model.sanitize(towers, weights)  # mlx-vlm's own key / layout fixes
            if not any(k.startswith("vision_tower.") for k in weights):
                raise TargetError(f"{self.target.path}: config.json has a vision_config but the weights hold no vision tower")
            quant = config.get("quantization")
            if quant:
                nn.quantize(towers, group_size=quant["group_size"], bits=quant["bits"],
                            class_predicate=lambda p, m: f"{p}.scales" in weights)
            dtype = self.target.inner.embed_tokens.weight.dtype
            if not quant and mx.issubdtype(dtype, mx.floating):
                weights = {k: (v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in weights.items()}
            try:
                towers.load_weights(list(weights.items()), strict=True)
            except ValueError as exc:
                raise TargetError(f"{self.target.path}: tower weights do not match config.json ({exc})") from None
            mx.eval(towers.parameters())
            self._towers = towers
        return self._towers

    def input_embeddings(self, ids: list[int], media) -> tuple[mx.array, mx.array | None]:
        """mlx-vlm's ``(inputs_embeds [1, L, D] (scaled), per_layer_inputs)`` of one (padded) row."""
        from mlx_vlm.models import gemma4 as vlm

        towers = self.towers() if media is not None else None
        x = mx.array([ids], dtype=mx.int32)
        kw = {}
        if media is not None:
            self._check(media.get("pixel_values") is not None, media.get("input_features") is not None)
            pv = media.get("pixel_values")
            n_img = sum(1 for t in ids if t == self.image_token_id)
            if pv is not None:
                feats = vlm.Model.encode_image(towers, pv)
                if feats.shape[1] != n_img:
                    raise MediaError(f"the prompt holds {n_img} image tokens but its images give {feats.shape[1]} soft tokens; "
                                     "build the prompt with the checkpoint's processor (mtpflow.media.encode_prompt_with_media)")
                kw.update(pixel_values=pv, cached_image_features=feats)
            elif n_img:
                raise MediaError(f"the prompt holds {n_img} image tokens but no image")
            for k in ("input_features", "input_features_mask"):
                if media.get(k) is not None:
                    kw[k] = media[k]
            out = vlm.Model.get_input_embeddings(towers, input_ids=x, **kw)
        else:
            out = vlm.Model.get_input_embeddings(_TextOnly(self.target), input_ids=x)
        return out.inputs_embeds, out.per_layer_inputs

    # -- prefill -----------------------------------------------------------------------
    def vision_blocks(self, row: list[int]) -> list[int]:
        """Per position: the index of the run of image / video soft tokens it is in, else -1."""
        ids = {t for t in (self.image_token_id, self.video_token_id) if t is not None}
        out, block, prev = [], -1, False
        for t in row:
            v = t in ids
            if v and not prev:
                block += 1
            out.append(block if v else -1)
            prev = v
        return out

    def prefill(self, seqs, media, extra=16, step=512, pad_id=0, taps=()):
        """:meth:`TargetAdapter.prefill <mtpflow.targets.base.TargetAdapter.prefill>` of rows
        whose ``media`` entry (dict from :meth:`encode`, or ``None``) gives their images / audio."""
        _require()
        t = self.target
        lens = [len(p) for p in seqs]
        if min(lens) < 1:
            raise ValueError("every prompt needs at least one token")
        L = max(lens)
        padded = [[pad_id] * (L - n) + list(p) for p, n in zip(seqs, lens)]
        embs, ples = zip(*(self.input_embeddings(row, m) for row, m in zip(padded, media)))
        embeds = mx.concatenate(embs, axis=0)
        ple = mx.concatenate(ples, axis=0) if ples[0] is not None else None
        tokens = mx.array(padded, dtype=mx.int32)
        blocks = mx.array([self.vision_blocks(r) for r in padded], dtype=mx.int32) if self.bidirectional else None
        cache = t.make_cache(extra=extra)
        offsets = mx.array([n - L for n in lens], dtype=mx.int32)
        t.set_offsets(cache, offsets)
        chunks: dict = {lid: [] for lid in taps}
        bl = blocks.tolist() if blocks is not None else None
        # the prompt's last token runs alone, as in the text path (unless it is an image's soft token)
        cut = L - 1 if t.prefill_last_alone and L > 1 and (bl is None or all(r[-1] < 0 for r in bl)) else L
        s = 0
        while s < L:
            e = min(cut, s + step) if s < cut else L
            if bl is not None:  # a bidirectional image block is never split over two chunks
                while e < L and any(r[e - 1] >= 0 and r[e] == r[e - 1] for r in bl):
                    e += 1
            sl = slice(s, e)
            inputs = (embeds[:, sl], ple[:, sl] if ple is not None else None)
            if blocks is not None:
                self._open_blocks(cache, offsets + s, blocks[:, sl])
            try:
                hidden, got = t.forward_with_taps(tokens[:, sl], cache, taps, inputs=inputs)
            finally:
                for c in cache:
                    c._tree = None
            for lid, h in got.items():
                chunks[lid].append(h)
            if e < cut:  # between chunks of the prompt (the lone last token follows lazily)
                mx.eval([c.keys for c in cache] + [c.values for c in cache] + [h for hs in chunks.values() for h in hs])
                t.compact(cache, n_valid_max=L, min_positions=[n - L + e for n in lens])
            s = e
        if not taps:
            return cache, hidden[:, -1]
        return cache, hidden[:, -1], {lid: mx.concatenate(hs, axis=1) if len(hs) > 1 else hs[0] for lid, hs in chunks.items()}

    def _open_blocks(self, cache, start: mx.array, blocks: mx.array) -> None:
        """Sliding layers: this chunk's queries also see the later soft tokens of their own image
        (transformers' AND(sliding window, OR(causal, same block))); full layers stay causal."""
        n = blocks.shape[1]
        q = start[:, None] + mx.arange(n, dtype=mx.int32)[None]  # [B, n]
        causal = (q[:, None, :] >= 0) & (q[:, None, :] <= q[:, :, None])
        same = (blocks[:, :, None] >= 0) & (blocks[:, :, None] == blocks[:, None, :])
        visible = causal | same | mx.eye(n, dtype=mx.bool_)[None]
        for c, lt in zip(cache, self.target.cache_layer_types):
            if lt == SLIDING:
                c._tree = (q, visible)


class _TextOnly:
    """``get_input_embeddings``'s view of a target for a row without media (no towers loaded)."""

    def __init__(self, target):
        from mlx_vlm.models.gemma4 import ModelConfig

        cfg = target.config
        self.config = ModelConfig(image_token_id=cfg.get("image_token_id", -1), audio_token_id=cfg.get("audio_token_id", -1),
                                  video_token_id=cfg.get("video_token_id"))
        self.language_model = _Holder(_LanguageView(target.inner))
        self.audio_tower = self.embed_audio = None


def _short(src: str) -> str:
    return (src[:40] + "...") if src.startswith("data:") else repr(src)


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()] or [type(exc).__name__]
    return lines[-1].strip() if len(lines) > 1 and lines[0].startswith("Failed to load") else lines[0].strip()
