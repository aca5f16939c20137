"""The DeepSeek-V2/V3 forward: MLA attention over the paged latent cache and the MoE FFN (dense
MLP in the first first_k_dense_replace layers). DeepseekModel is the fp32 CPU model; the fp16
GPU model (half_deepseek.HalfDeepseekModel) reuses its layers and step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcore import kernels
from kvcore.cache.kv_cache import KVCache
from kvcore.config import ModelConfig
from kvcore.model.llama import DeviceBatch, LlamaModel, _linear
from kvcore.model.mla import MLA_MODES, MLAWeights, mla_attention, mla_weights, plan_step
from kvcore.model.moe import MoEWeights, moe_ffn


@dataclass(slots=True)
class DeepseekLayer:
    input_norm: Any  # (hidden,)
    attn: MLAWeights
    post_norm: Any  # (hidden,)
    dense: tuple[Any, Any] | None  # ((2 I, hidden), (hidden, I)) before the MoE layers
    moe: MoEWeights | None


class DeepseekModel(LlamaModel):
    """LlamaModel's embedding, final norm, LM head, rope tables and step checks, with MLA and
    MoE layers. This fp32 model runs on the CPU; on the GPU, HalfDeepseekModel (fp16).

    mla_mode: "auto" picks the absorbed or decompressed form per sequence and step by their
    multiply-adds; "absorbed" / "decompressed" force one (tests, benchmarks)."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray],
                 device: str = "cpu", mla_mode: str = "auto") -> None:
        if config.mla is None or config.moe is None:
            raise ValueError(f"DeepseekModel needs an MLA + MoE config, got {config.architecture}")
        if mla_mode not in MLA_MODES:
            raise ValueError(f"mla_mode must be one of {MLA_MODES}, got {mla_mode!r}")
        self.mla_mode = mla_mode
        super().__init__(config, weights, self._model_device(device))
        mla = config.mla
        self.scale = 1.0 / math.sqrt(mla.qk_head_dim)
        if config.rope_scaling is not None:
            self.scale *= config.rope_scaling.softmax_factor  # DeepSeek's yarn mscale

    def _model_device(self, device: str) -> str:
        """The fp32 model's device: the CPU (the GPU's MLA kernel takes 16-bit activations)."""
        if device not in ("cpu", "auto"):
            raise ValueError(f"device {device!r}: the fp32 DeepseekModel runs on the CPU; on the "
                             "GPU use the fp16 model (load_model on cuda, or the engine on cuda)")
        return "cpu"

    def _layer(self, w: dict[str, np.ndarray], p: str) -> DeepseekLayer:
        c, moe = self.config, self.config.moe
        assert c.mla is not None and moe is not None
        layer_id = int(p.split(".")[2])
        m = p + "mlp."
        dense = moe_weights = None
        if not moe.is_moe_layer(layer_id):
            dense = (self._put(np.concatenate([w[m + "gate_proj.weight"],
                                               w[m + "up_proj.weight"]])),
                     self._put(w[m + "down_proj.weight"]))
        else:
            experts = range(moe.num_experts)
            shared = moe.num_shared_experts > 0
            moe_weights = MoEWeights(
                # the router stays float32 (its choices are discrete); the bias lives on the host
                gate=self.xp.asarray(np.ascontiguousarray(w[m + "gate.weight"], np.float32)),
                score_bias=np.array(w[m + "gate.e_score_correction_bias"], dtype=np.float32)
                if moe.has_score_bias else None,
                gate_up=self._put(np.stack([np.concatenate(
                    [w[f"{m}experts.{e}.gate_proj.weight"], w[f"{m}experts.{e}.up_proj.weight"]])
                    for e in experts])),
                down=self._put(np.stack([w[f"{m}experts.{e}.down_proj.weight"]
                                         for e in experts])),
                shared_gate_up=self._put(np.concatenate(
                    [w[m + "shared_experts.gate_proj.weight"],
                     w[m + "shared_experts.up_proj.weight"]])) if shared else None,
                shared_down=self._put(w[m + "shared_experts.down_proj.weight"])
                if shared else None,
            )
        return DeepseekLayer(
            input_norm=self._put(w[p + "input_layernorm.weight"]),
            attn=mla_weights(w, p, c.mla, c.num_heads, self._put,
                             decompress=self.mla_mode != "absorbed"),
            post_norm=self._put(w[p + "post_attention_layernorm.weight"]),
            dense=dense,
            moe=moe_weights,
        )

    def run(self, batch: DeviceBatch, kv_cache: KVCache) -> Any:
        """The step: (L, vocab) logits; the rope tables must cover every position."""
        c = self.config
        assert c.mla is not None and c.moe is not None
        step = plan_step(batch.positions, batch.slot_mapping, batch.block_tables,
                         batch.context_lens, batch.query_start_loc, c.mla, self.mla_mode)
        h = self.embed[batch.input_ids]  # (T, hidden) residual stream
        layer: DeepseekLayer
        for layer_id, layer in enumerate(self.layers):
            cache, _, scale, _ = kv_cache.layer(layer_id)
            x = kernels.rms_norm(h, layer.input_norm, c.rms_norm_eps)
            h += mla_attention(x, layer.attn, step, cache, scale, self._cos, self._sin, c.mla,
                               c.num_heads, c.rms_norm_eps, self.scale)
            x = kernels.rms_norm(h, layer.post_norm, c.rms_norm_eps)
            if layer.dense is not None:
                gate_up, down = layer.dense
                h += _linear(kernels.silu_and_mul(_linear(x, gate_up)), down)
            else:
                assert layer.moe is not None
                h += moe_ffn(x, layer.moe, c.moe)
        h = kernels.rms_norm(h[batch.logits_indices], self.norm, c.rms_norm_eps)
        return _linear(h, self.lm_head)  # (L, vocab)
