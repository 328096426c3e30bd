"""Native MTP: the multi-token-prediction head shipped inside the target checkpoint.

DeepSeek-V3 / V3.2, GLM-4.x MoE and GLM-5 checkpoints carry ``D``
(``num_nextn_predict_layers``) extra MTP layers; this kind drafts with them,
so a user gives ``--model`` only (``--draft-kind native_mtp``, or
``--draft-kind mtp``, or nothing: a target that carries a head is detected).

Modules: :mod:`.module` (the MTP layer -- ``eh_proj([enorm(e); hnorm(h)])``,
one decoder block, ``shared_head.norm`` -- and the native key layout),
:mod:`.families` (family adapters), :mod:`.config` (settings, checks before
any weight is read), :mod:`.drafter` (the kind), :mod:`.train` (``mtpflow train --kind mtp``).

Family adapter interface (:class:`.families.Family`, class methods only; add
one to :data:`.families.FAMILIES`):

==================  =======================================================================
member              what it says
==================  =======================================================================
``model_types``     target ``model_type`` values served
``depth_field``     config field with the layer count (``num_nextn_predict_layers``;
                    Qwen3.5 / Qwen3-Next: ``mtp_num_hidden_layers``)
``caches_per_layer`` SlotKVCaches one layer keeps (2 for DSA sparse attention)
``selects(key, cfg)`` whether a checkpoint tensor belongs to the head (read from the
                    safetensors directly: mlx-lm's ``sanitize`` drops them)
``expected(cfg)``   tensor-name prefixes that must exist (else: "stripped by a converter")
``to_module(w, cfg, model)`` head tensors -> :class:`.module.NativeMTP` names
                    ``layers.i.{enorm,hnorm,eh_proj,shared_head.norm}.weight`` and
                    ``layers.i.block.*`` (the family's conversions go here: expert
                    stacking, MLA splits, zero-centred ``1 + w`` norms; a family whose
                    fusion is shared across layers, Qwen's ``mtp.fc`` /
                    ``mtp.pre_fc_norm_embedding`` / ``mtp.pre_fc_norm_hidden`` /
                    ``mtp.norm``, maps it to every layer ``i``)
``make_block(model, cfg, i)`` the decoder block of layer ``i``: the family's mlx-lm
                    decoder-layer class, called ``block(x, mask, cache)`` (a tuple
                    return uses its first item)
``block_cache(caches)`` what the block takes as ``cache``
==================  =======================================================================

Mapping for the families served: DeepSeek-V3 (``deepseek_v3``), GLM-4.x MoE
(``glm4_moe``, ``glm4_moe_lite``): :class:`.families.NativeLayout` --
``model.layers.{N+i}.*``, ``DeepseekV3DecoderLayer`` / ``DecoderLayer`` /
``Glm4MoeLiteDecoderLayer`` built for layer index ``N + i``, the target's own
``sanitize``.  DeepSeek-V3.2 / GLM-5 (``deepseek_v32``, ``glm_moe_dsa``):
:class:`.families.SparseNativeLayout`, the same with two caches per layer.
Qwen3.5 / 3.6 and Qwen3-Next: :class:`.qwen.QwenLayout` (``mtp.*``).  Nemotron-H
(``nemotron_h``): :class:`.nemotron.NemotronHLayout` (``mtp.layers.<j>.*``, the
``mtp_hybrid_override_pattern`` blocks as one MTP layer).
The target's embedding (unscaled, ``target.embed``) and LM head are shared.

Loader contract for trained modules (what ``mtpflow export`` of an MTP module
writes, and ``--draft-kind native_mtp --draft-model FOLDER`` loads, for any
mlx-lm target whose decoder-layer class takes ``(args)`` or ``(args,
layer_idx)``): ``FOLDER/config.json`` is the target's config.json plus
``"num_nextn_predict_layers": D``; ``FOLDER/*.safetensors`` holds, for ``i <
D`` and ``N = num_hidden_layers``, ``model.layers.{N+i}.enorm.weight``,
``.hnorm.weight``, ``.eh_proj.weight`` (``[H, 2H]``, input ``[enorm(e);
hnorm(h)]``), ``.shared_head.norm.weight`` and the decoder block under the
target family's own layer key names (as the target's ``model.layers.{j}.*``,
e.g. ``self_attn.q_proj.weight``, ``mlp.gate_proj.weight``,
``input_layernorm.weight``).  Float tensors in any float dtype; an mlx
quantized module adds ``.scales`` / ``.biases`` and the config's
``quantization`` (``group_size``, ``bits``).  Hidden and vocabulary sizes
must equal the target's.  ``h`` is the target's post-norm last hidden state;
depth ``i > 0`` reads layer ``i - 1``'s output after ``shared_head.norm``.
:func:`.module.to_native` / :func:`.module.from_native` convert names.
"""
