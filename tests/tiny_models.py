"""Tiny random-init models of every supported family variant, built from configs in code (no hub), and the
training-step comparison the CPU tests make between them."""
from __future__ import annotations

import torch
from transformers import (
    FalconConfig,
    FalconForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, attn_implementation="sdpa")


def _llama(**kw):
    cfg = dict(_COMMON, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    cfg.update(kw)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def _neox(**kw):
    cfg = dict(_COMMON, intermediate_size=96, num_attention_heads=4, rotary_pct=0.25)
    cfg.update(kw)
    return GPTNeoXForCausalLM(GPTNeoXConfig(**cfg))


def _falcon(**kw):
    cfg = dict(_COMMON, num_attention_heads=4, new_decoder_architecture=False, multi_query=False, parallel_attn=True)
    cfg.update(kw)
    return FalconForCausalLM(FalconConfig(**cfg))


_LLAMA_LIKE = dict(_COMMON, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=False)
WINDOW = 4  # sliding windows shorter than the test sequences (5-17 tokens), so they change what a query sees
# Gemma: scores large enough for soft-capping to matter (at init 0.02 and cap 50 it changes them by ~2e-7), a
# query_pre_attn_scalar other than head_dim, a sliding layer then a global one (Gemma 3's default is 5 : 1)
_GEMMA = dict(_LLAMA_LIKE, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
              layer_types=["sliding_attention", "full_attention"], initializer_range=0.2)


def _gemma2(**kw):
    # transformers refuses SDPA for Gemma 2 (soft-capping): eager is the stock reference
    cfg = dict(_GEMMA, attn_implementation="eager", attn_logit_softcapping=1.0, final_logit_softcapping=2.0)
    cfg.update(kw)
    return Gemma2ForCausalLM(Gemma2Config(**cfg))


def _auto(model_type: str, **kw):
    """A causal LM of ``model_type`` from its config class, Llama-like tiny sizes unless ``kw`` says otherwise."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = dict(_LLAMA_LIKE, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(kw)
    return AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**cfg))


_MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.01)  # top-2 of 4 experts, the aux loss on
# The 2026 families (transformers 5.17+): each tiny config turns on what the family adds to Llama
FAMILIES_2026 = {
    # per-layer head_dim (global layers 32, sliding 16), one kv head on global layers whose values are their keys
    # (attention_k_eq_v), the last two layers reusing earlier layers' keys and values, per-layer embeddings, a sliding
    # window shorter than the sequences, final soft-capping
    "gemma4-text": lambda: _auto(
        "gemma4_text", head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        final_logit_softcapping=2.0, initializer_range=0.2, attn_implementation="eager"),
    # attention sinks (s_aux), sliding and full layers, 4 experts top-2 with its clamped SwiGLU
    "gpt-oss": lambda: _auto("gpt_oss", head_dim=16, num_local_experts=4, layer_types=["sliding_attention",
                             "full_attention"], sliding_window=WINDOW, attn_implementation="eager",
                             **_MOE),
    "qwen3-moe": lambda: _auto("qwen3_moe", head_dim=16, num_experts=4, moe_intermediate_size=32, **_MOE),
    "mixtral": lambda: _auto("mixtral", num_local_experts=4, **_MOE),
    # chunked layers (chunks of 4 tokens, shorter than the sequences) and a NoPE global layer, q/k norm, MoE
    "llama4-text": lambda: _auto(
        "llama4_text", head_dim=16, intermediate_size_mlp=96, num_local_experts=2, num_experts_per_tok=1,
        attention_chunk_size=WINDOW, layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0],
        use_qk_norm=True),
    "ministral3": lambda: _auto("ministral3", head_dim=16, sliding_window=WINDOW),
    "olmo2": lambda: _auto("olmo2"),  # q/k norm over all heads, norms after attention and MLP
    "olmo3": lambda: _auto("olmo3", sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "smollm3": lambda: _auto("smollm3", no_rope_layers=[1, 0]),  # a NoPE layer
    "phi3": lambda: _auto("phi3"),  # fused qkv_proj and gate_up_proj
    # linear-attention (Gated DeltaNet) layers beside a full-attention layer: head_dim 16, gated attention output
    "qwen3.5-text": lambda: _auto(
        "qwen3_5_text", head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8),
    "gpt2": lambda: _auto("gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0),  # Conv1D linears (dropout off: the tests compare training steps)
}

VARIANTS = {
    "llama-gqa": lambda: _llama(),
    "llama-mqa": lambda: _llama(num_key_value_heads=1),
    "llama-rope-linear": lambda: _llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "llama-rope-llama3": lambda: _llama(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0}),
    "llama-rope-yarn": lambda: _llama(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                        "original_max_position_embeddings": 512}),
    "neox-parallel": lambda: _neox(use_parallel_residual=True),
    "neox-sequential": lambda: _neox(use_parallel_residual=False),
    "falcon-7b-mqa": lambda: _falcon(multi_query=True),
    "falcon-40b-newarch": lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2),
    "falcon-rw-alibi": lambda: _falcon(alibi=True, bias=True, parallel_attn=False),
    "falcon-mha": lambda: _falcon(),
    "qwen2-qkv-bias": lambda: Qwen2ForCausalLM(Qwen2Config(**_LLAMA_LIKE)),
    "qwen3-qk-norm": lambda: Qwen3ForCausalLM(Qwen3Config(**_LLAMA_LIKE, head_dim=16)),
    "mistral-window": lambda: MistralForCausalLM(MistralConfig(**_LLAMA_LIKE, sliding_window=WINDOW)),
    "gemma2-softcap": lambda: _gemma2(),
    "gemma3-text": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**_GEMMA)),
}
VARIANTS.update(FAMILIES_2026)


def slow_2026(names) -> list:
    """Parametrize values with the 2026 families' cases marked slow: the README's fast suite keeps their core
    equivalence cases (padded, packed, LoRA, unpatch; tests/test_patch.py), CI's slow run takes the rest."""
    import pytest

    return [pytest.param(n, marks=pytest.mark.slow) if n in FAMILIES_2026 else n for n in names]
NEW_FAMILIES = ["qwen2-qkv-bias", "qwen3-qk-norm", "mistral-window", "gemma2-softcap", "gemma3-text"]


def make(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = VARIANTS[name]()
    model.config.use_cache = False
    return model.float().eval()


def loss_and_grads(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    """One training forward and backward on ``batch``: the loss and a copy of every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_and_grads_hook_in_forward(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    """As ``loss_and_grads``, the forward under a global forward hook that is gone before backward (a profiler's
    module tracker around the forward only)."""
    model.zero_grad(set_to_none=True)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        loss = model(**batch).loss
    finally:
        handle.remove()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(ours, ref, batch, *, loss_rtol: float, grad_rtol: float) -> None:
    """``ours`` and ``ref`` take the same step on ``batch``: the loss within ``loss_rtol`` and, per parameter, the
    gradient's largest difference within ``grad_rtol`` of the reference gradient's largest entry."""
    import pytest

    loss, grads = loss_and_grads(ours, batch)
    ref_loss, ref_grads = loss_and_grads(ref, batch)
    assert loss == pytest.approx(ref_loss, rel=loss_rtol)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        err = ((grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        assert err < grad_rtol, (name, err)


def layer_inputs_alive_after_forward(model, batch) -> list[bool]:
    """Per decoder layer, whether its input is still alive after a training forward (what a checkpoint policy kept
    on the device), then the backward that frees them."""
    import weakref

    from hf_accel.memory.targets import decoder_layers

    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
             for layer in decoder_layers(model)]
    loss = model(**batch).loss
    for hook in hooks:
        hook.remove()
    alive = [ref() is not None for ref in inputs]
    loss.backward()
    return alive


def gemma3_multimodal():
    """Gemma3ForConditionalGeneration (what AutoModelForCausalLM builds for Gemma 3 4B-27B): a one-layer SigLIP tower,
    the projector and the ``_GEMMA`` text model."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    config = Gemma3Config(text_config=dict(_GEMMA), mm_tokens_per_image=4, vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))
    return Gemma3ForConditionalGeneration(config)


def gemma4_multimodal():
    """Gemma4ForConditionalGeneration around the "gemma4-text" model (its config's defaults build no towers)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = FAMILIES_2026["gemma4-text"]().config
    torch.manual_seed(0)
    return Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict()))
