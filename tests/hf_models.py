"""transformers model skeletons built from configs written here (no hub access): small ones that run
a forward pass, and the real sizes, built on ``meta``."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

SMALL: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4, vocab_size=128),
    "mixtral": dict(
        hidden_size=64, intermediate_size=32, num_attention_heads=8, num_key_value_heads=4, vocab_size=128,
        num_local_experts=4, num_experts_per_tok=2,
    ),
    "qwen3_moe": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=8, num_key_value_heads=4,
        head_dim=8, vocab_size=128, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "deepseek_v3": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=8, num_key_value_heads=8,
        vocab_size=128, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    ),
}  # fmt: skip
"""Small configs of each model class: every sharded size divisible by 2 and 4."""

DENSE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4, vocab_size=128)
MOE = DENSE | dict(moe_intermediate_size=32, num_experts_per_tok=2)
THREE_KV_HEADS = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8)
"""Three key/value heads: what a gathered output keeps whole at tp=2, and a plain column split cannot split."""
CURATED: dict[str, dict[str, Any]] = {
    "qwen3_tied": DENSE | dict(head_dim=8, tie_word_embeddings=True),
    "gemma3_text": DENSE | dict(head_dim=8, tie_word_embeddings=True, sliding_window=4),
    "phi3": DENSE | dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "phi3_kv3": DENSE | THREE_KV_HEADS | dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "olmoe": MOE | dict(intermediate_size=32, num_experts=4, eos_token_id=2),
    "olmoe_kv3": MOE | THREE_KV_HEADS | dict(intermediate_size=32, num_experts=4, eos_token_id=2),
    "qwen2_moe": MOE | dict(
        shared_expert_intermediate_size=64, num_experts=4, decoder_sparse_step=1, mlp_only_layers=[]
    ),
    "mistral": DENSE | dict(head_dim=8),
    "granitemoe": MOE | dict(intermediate_size=32, num_local_experts=4),
    "gpt_oss": MOE | dict(intermediate_size=32, head_dim=8, num_local_experts=4, sliding_window=4),
    "deepseek_v2": MOE | dict(
        num_key_value_heads=8, n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    ),
    "glm4_moe": MOE | dict(
        head_dim=8, n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
    ),
}  # fmt: skip
"""Small configs of ten more architectures than SMALL's: tied embeddings (Qwen3, Gemma 3), gathered
outputs (Phi-3, OLMoE), shared experts (Qwen2-MoE, DeepSeek-V2, GLM-4-MoE), packed expert projections
(OLMoE, Qwen2-MoE, GraniteMoE), biased experts (gpt-oss) and MLA attention (DeepSeek-V2)."""

REAL: dict[str, dict[str, Any]] = {
    "llama": dict(
        num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
        vocab_size=128256,
    ),
    "mixtral": dict(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
    ),
    "qwen3_moe": dict(
        num_hidden_layers=48, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "deepseek_v3": dict(
        num_hidden_layers=61, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_attention_heads=128, num_key_value_heads=128, vocab_size=129280, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    ),
}  # fmt: skip
REAL["qwen3_moe_235b"] = REAL["qwen3_moe"] | dict(
    num_hidden_layers=94, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_attention_heads=64
)
REAL["llama_405b"] = REAL["llama"] | dict(
    num_hidden_layers=126, hidden_size=16384, intermediate_size=53248, num_attention_heads=128
)
"""Llama-3 70B (80 layers), Mixtral 8x7B, Qwen3-30B-A3B (48 layers, 128 experts), DeepSeek-V3 (61 layers, 256
experts, 671B), Qwen3-235B-A22B (94 layers) and Llama 3.1 405B (126 layers), from their published configs."""
MODEL_TYPES = {
    "qwen3_moe_235b": "qwen3_moe", "llama_405b": "llama", "qwen3_tied": "qwen3", "phi3_kv3": "phi3", "olmoe_kv3": "olmoe",
}  # fmt: skip
"""The transformers model type of a config named otherwise."""


def hf_model(name: str, *, layers: int = 2, real: bool = False, seed: int = 0, **changes: Any) -> PreTrainedModel:
    """The model class of ``name`` from its small config (``layers`` decoder layers, on the CPU with
    seeded weights) or, with ``real``, its real config on ``meta``; ``changes`` edit the config."""
    values = dict(REAL[name]) if real else {"num_hidden_layers": layers, **(SMALL | CURATED)[name]}
    config = AutoConfig.for_model(MODEL_TYPES.get(name, name), **(values | changes))
    config._attn_implementation = "eager"
    if real:
        with torch.device("meta"):
            model: PreTrainedModel = AutoModelForCausalLM.from_config(config)
        return model
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


TINY = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, max_position_embeddings=256,
)  # fmt: skip
"""What every architecture's config is shrunk to, for each of these fields its class has."""
TINY_BUILDER = {"embedding_gemma2_text": dict(num_global_key_value_heads=2, global_head_dim=16)}
"""Arguments a config class takes only while building (its wider full-attention layers)."""


def planned_model_types() -> list[str]:
    """Every model type of the installed transformers whose config class declares a tp or ep plan."""
    from transformers import CONFIG_MAPPING

    return [
        name
        for name in CONFIG_MAPPING
        if getattr(CONFIG_MAPPING[name], "base_model_tp_plan", None) or getattr(CONFIG_MAPPING[name], "base_model_ep_plan", None)
    ]


HEAD_SIZES = ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def tiny_model(model_type: str) -> PreTrainedModel:
    """The model of ``model_type`` on ``meta``, from its config class's defaults with the fields of
    ``TINY`` it has shrunk. A config class whose validators refuse that is tried again: with as
    many key/value heads as heads, then keeping its own head sizes, then keeping every field the
    refusal names. Raises the last refusal for a type that cannot be built so."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    fields = config_class().to_dict()
    shrunk = {key: value for key, value in TINY.items() if key in fields}
    attempts = [
        shrunk,
        shrunk | {"num_key_value_heads": shrunk.get("num_attention_heads")},
        {key: value for key, value in shrunk.items() if key not in HEAD_SIZES and key != "num_key_value_heads"},
    ]
    error: Exception | None = None
    for values in [*attempts, None]:
        if values is None:  # keep every field the last refusal names
            named = {key for key in shrunk if key in str(error)}
            values = {key: value for key, value in attempts[-1].items() if key not in named}
        try:
            return _built(config_class(**{k: v for k, v in values.items() if v is not None}, **TINY_BUILDER.get(model_type, {})))
        except Exception as refused:
            error = refused
    assert error is not None
    raise error


def _built(config: Any) -> PreTrainedModel:
    from transformers import AutoModel

    with torch.device("meta"):
        try:
            model: PreTrainedModel = AutoModelForCausalLM.from_config(config)
        except ValueError:  # no causal LM head for this type: its base model
            model = AutoModel.from_config(config)
    return model
