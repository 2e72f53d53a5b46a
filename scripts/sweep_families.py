#!/usr/bin/env python
"""Every causal LM transformers maps, built tiny from its own config's defaults, patched against unpatched (fp32, CPU).

    python scripts/sweep_families.py --out OUT                  # every model_type in MODEL_FOR_CAUSAL_LM_MAPPING
    python scripts/sweep_families.py --out OUT --types llama,exaone4,doge

For each model type, in a process of its own (an address-space cap and a timeout: some configs' defaults cannot be
shrunk and would allocate tens of GB): the config class's defaults with the common size fields shrunk (hidden 64, 2
layers of each layer kind, 4 heads, 2 KV heads, head_dim 16, vocabulary 128, 4 experts top-2, window 8, every dropout
0), its sub-configs (text, vision, audio, attention, ...) shrunk the same way, every per-layer list, layer-index list
and per-layer dict cut to the layers kept, the widths that depend on the hidden size (Mamba heads, MLA, rotary_dim,
...) kept consistent with it, and a few per-type fixes (``PRE``/``POST``) where a class's own defaults cannot run;
built with SDPA (eager where the class refuses SDPA), in train mode. Compared, patched (``hf_accel.patch``
with its defaults) against the unpatched copy: a full row's logits, a row of two documents packed by position_ids
against each document alone and against the unpatched packed row, and every parameter's gradient. A verdict per
type:

- ``ok``: equal within fp32 rounding (a packed row equal to each document alone).
- ``ok-as-stock``: the patched packed row equals the unpatched one and stock does not keep packed documents apart
  (a bidirectional or position-less model: patched computes what stock computes).
- ``refused``: ``patch`` raised UnsupportedModel (its message says why).
- ``not built``: the shrunk config does not construct or the unpatched model does not run (the sweep's limit, not
  hf_accel's).
- ``MISMATCH``, ``PATCH-FAILED``, ``RUN-FAILED``, ``CRASHED``: what to look at.

Writes OUT/sweep.json (one record per type) and OUT/sweep.md (the table). Not part of the test suite: ~10 s a
type, ~40 minutes for all of transformers 5.25's 200 on a 2-core machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2, 4, 2, 16, 128
SHRUNK = dict(
    hidden_size=64, n_embd=64, d_model=64, intermediate_size=128, ffn_hidden_size=128, n_inner=128,
    num_hidden_layers=LAYERS, n_layer=LAYERS, num_layers=LAYERS, num_attention_heads=HEADS, n_head=HEADS,
    num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB, max_position_embeddings=256, n_positions=256,
    moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, shared_expert_intermediate_size=32, sliding_window=8, global_head_dim=32,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2, use_cache=False,
    topk_group=1, n_group=1, num_nextn_predict_layers=0, mtp_num_hidden_layers=0,
)
TOLERANCE = 1e-4  # of the logits' largest magnitude (at least 1): fp32 kernels that sum in another order
GRAD_TOLERANCE = 1e-3  # of each parameter gradient's largest magnitude
# Further size fields some (sub-)configs name otherwise: encoder-decoder stacks, other spellings of the layer count,
# heads and widths, per-layer-input embeddings, Mamba state, a sparse-attention indexer (its top-k is the window).
MORE_SHRUNK = dict(
    encoder_layers=LAYERS, decoder_layers=LAYERS, n_layers=LAYERS, num_blocks=LAYERS,
    encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, n_heads=HEADS, num_heads=HEADS, attention_heads=HEADS,
    encoder_ffn_dim=128, decoder_ffn_dim=128, d_inner=128, ffn_dim=128, feed_forward_size=128,
    intermediate_size_mlp=128, expert_ffn_hidden_size=32, mlp_only_intermediate_size=128, embedding_dim=64,
    hidden_size_global=64, d_head=HEAD_DIM, attention_head_size=HEAD_DIM, index_head_dim=HEAD_DIM,
    index_n_heads=HEADS // KV_HEADS, index_num_heads=HEADS // KV_HEADS, index_topk=8, attention_chunk_size=8,
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, laurel_rank=8, mamba_d_state=16,
    state_size=16, num_expert_group=1, zero_expert_num=2, out_hidden_size=64, projector_input_dim=64,
    projector_output_dim=64, vision_output_dim=64,
)
TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k")  # never above the default
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_blocks")
PREFIX_COUNTS = ("first_k_dense_replace", "num_dense_layers")  # the first k layers are of another kind
SUFFIX_COUNTS = ("num_kv_shared_layers",)  # the last k layers are of another kind
WIDTHS = ("hidden_size", "n_embd", "d_model")
NOT_A_WIDTH = re.compile(r"vocab|position|window|chunk|token|image|patch|kernel|batch|group|layer")
INDEX_KEY = re.compile(r"layer|idxs|indexes|indices")  # a sorted list of layer indices (moe_layers, ...)
# The few a general rule does not serve: fields the class's own defaults lack (or get wrong) to run at all, applied to
# the defaults before they are shrunk (``PRE``), or fields set after (``POST``); keyed by the (sub-)config's model_type.
PRE = {
    # layer_types defaults to None, which the decoder layers index: LFM2's conv/attention pattern
    "lfm2_moe": dict(layer_types=["conv", "conv", "full_attention"] * 10 + ["conv", "conv"]),
    # its indexed-attention layers build a QSA indexer whose fields all default to None
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=8,
                           indexer_compress_ratio=2),
    # all-Mamba by default; the released checkpoints interleave attention layers (Bamba 9B's indices)
    "bamba": dict(attn_layer_indices=[9, 18, 27]),
    "granitemoehybrid": dict(layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8),
    # the (pattern, repeats) spec attention_layers is expanded from
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2, window_size=8),
}
POST = {
    # DbrxAttention reads attn_config.rope_theta, a field DbrxAttentionConfig does not declare, and clamps q, k, v by
    # clip_qkv, which it cannot do with the default None
    "dbrx": dict(attn_config={"rope_theta": 10000.0, "clip_qkv": 8.0}),
    # its sliding-window layers' head_dim is their q.k width (nope + rope), a quarter of it rotary
    "dots3_note_text": lambda f: dict(head_dim=4 * f["qk_rope_head_dim"], per_layer_config={
        i: {**e, "qk_nope_head_dim": 3 * f["qk_rope_head_dim"]} if "qk_nope_head_dim" in e else e
        for i, e in f["per_layer_config"].items()}),
    # XmodForCausalLM needs a language for its adapters
    "xmod": dict(default_language="en_XX"),
    # ReformerModelWithLMHead asserts is_decoder; axial position embeddings need the sequence to fill their shape
    "reformer": dict(is_decoder=True, axial_pos_embds=False, hash_seed=0),
    # released configs list (attention, mlp) blocks; input, recurrent (looped) and output stacks of one layer kind each
    "dory": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                 num_hidden_layers=4, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1),
    # the local encoder's and decoder's width times cross_attn_k is the global transformer's
    "blt_local_encoder": dict(hidden_size=32), "blt_local_decoder": dict(hidden_size=32, head_dim=HEAD_DIM // 2),
    "blt": dict(encoder_hash_byte_group_vocab=VOCAB),
}


def _is_config(value) -> bool:
    return isinstance(value, dict) and "model_type" in value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layer_plan(fields: dict) -> tuple[list[int], dict] | None:
    """Which of the default layers to keep: the first of each kind, a kind being the layer's entry in every
    per-layer list (``layer_types``, ``mlp_layer_types``, ``no_rope_layers``, ...), its membership in every list of
    layer indices (``moe_layers``, ``cross_attention_layers``, ...), its ``per_layer_config`` entry, and whether it
    falls in a prefix or suffix count (``first_k_dense_replace``, ``num_kv_shared_layers``) or reads another layer's
    K/V; two layers where every layer is alike. None where nothing is per-layer."""
    count = next((fields[k] for k in LAYER_COUNTS if isinstance(fields.get(k), int)), None)
    if not count or count <= LAYERS:
        return None
    per_layer, indices, sources, dicts = {}, {}, {}, {}
    for key, value in fields.items():
        if isinstance(value, list) and value and all(_is_int(v) for v in value) and INDEX_KEY.search(key) \
                and all(0 <= v < count for v in value) and value == sorted(set(value)):
            indices[key] = set(value)
        elif isinstance(value, list) and len(value) == count:
            (sources if "source" in key else per_layer)[key] = value
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()) \
                and all(str(k).isdigit() and int(k) < count for k in value):
            dicts[key] = {int(k): v for k, v in value.items()}
    prefix = {k: fields[k] for k in PREFIX_COUNTS if _is_int(fields.get(k)) and fields[k] > 0}
    suffix = {k: fields[k] for k in SUFFIX_COUNTS if _is_int(fields.get(k)) and fields[k] > 0}
    if not (per_layer or indices or sources or dicts or prefix or suffix):
        return None
    # a per-layer list of many distinct values (a schedule, not a kind) is cut but does not tell kinds apart
    kinds = {k: v for k, v in per_layer.items() if len({json.dumps(x, sort_keys=True) for x in v}) <= 4}

    def kind(i):
        return (tuple(json.dumps(v[i], sort_keys=True) for v in kinds.values()),
                tuple(i in v for v in indices.values()), tuple(v[i] == i for v in sources.values()),
                tuple(json.dumps(v.get(i), sort_keys=True) for v in dicts.values()),
                tuple(i < v for v in prefix.values()), tuple(i >= count - v for v in suffix.values()))

    first: dict = {}
    for i in range(count):
        first.setdefault(kind(i), i)
    keep = set(first.values()) if len(first) > 1 else set(range(LAYERS))
    keep |= {v[i] for v in sources.values() for i in list(keep)}  # a layer whose K/V another kept layer reads
    keep = sorted(keep)
    new = {old: i for i, old in enumerate(keep)}
    cut = {k: [v[i] for i in keep] for k, v in per_layer.items()}
    cut.update({k: [new[v[i]] for i in keep] for k, v in sources.items()})
    cut.update({k: [new[i] for i in keep if i in v] for k, v in indices.items()})
    cut.update({k: {new[i]: v[i] for i in keep if i in v} for k, v in dicts.items()})
    cut.update({k: sum(i < v for i in keep) for k, v in prefix.items()})
    cut.update({k: sum(i >= count - v for i in keep) for k, v in suffix.items()})
    cut.update({k: len(keep) for k in LAYER_COUNTS if isinstance(fields.get(k), int)})
    return keep, cut


def _derived(cls) -> set[str]:
    """The attributes ``cls`` computes in its ``__post_init__`` without declaring them as fields (GPT-Neo's
    attention_layers, Zamba 2's mamba_headdim, ...): passed back from ``to_dict`` they would override what the class
    computes from the shrunk fields."""
    from transformers import PreTrainedConfig

    names = set()
    for klass in getattr(cls, "__mro__", ())[:-1]:
        if klass is PreTrainedConfig or "__post_init__" not in vars(klass):
            continue
        try:
            names |= set(re.findall(r"\bself\.(\w+)\s*=[^=]", inspect.getsource(vars(klass)["__post_init__"])))
        except (OSError, TypeError):
            pass
    return names - {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def _widths(defaults: dict) -> set[int]:
    """Every (sub-)config's default width."""
    return {v for k, v in defaults.items() if k in WIDTHS and _is_int(v)} | {
        w for v in defaults.values() if _is_config(v) for w in _widths(v)}


def _shrink(defaults: dict, cls=None, widths: frozenset = frozenset()) -> dict:
    """One (sub-)config's fields shrunk; its sub-configs shrunk the same way. A ``*_dim`` or ``*_size`` field that
    equals some (sub-)config's width (a vision adapter's input, its output into the text model) takes the shrunk
    width."""
    from transformers import CONFIG_MAPPING

    model_type = defaults.get("model_type")
    defaults = {**defaults, **PRE.get(model_type, {})}
    sub_classes = getattr(cls, "sub_configs", None) or {}
    fields = {k: _shrink(v, sub_classes.get(k) if isinstance(sub_classes.get(k), type) and sub_classes[k].__name__ !=
                         "AutoConfig" else CONFIG_MAPPING.get(v["model_type"]), widths)
              if _is_config(v) else v for k, v in defaults.items()}
    plan = _layer_plan(defaults)
    sizes = {**SHRUNK, **MORE_SHRUNK}
    fields.update({k: SHRUNK["hidden_size"] for k, v in fields.items() if _is_int(v) and v in widths
                   and re.search(r"(_dim|_size)$", k) and not NOT_A_WIDTH.search(k)})
    fields.update({k: v for k, v in SHRUNK.items() if k in fields and k not in TOP_K})
    fields.update({k: min(fields[k], v) for k, v in MORE_SHRUNK.items() if _is_int(fields.get(k))})
    fields.update({k: min(fields[k], 2) if _is_int(fields[k]) else SHRUNK.get(k, fields[k]) for k in TOP_K
                   if k in fields})
    if plan:  # every per-layer list or dict cut to the kept layers
        keep, cut = plan
        for key, value in cut.items():
            base = next((b for b in sorted(sizes, key=len, reverse=True) if key.startswith(b)), None)
            if isinstance(value, list) and (key in sizes or base and isinstance(defaults.get(base), int)) \
                    and all(_is_int(v) for v in value):  # per-layer sizes: the shrunk size, to scale
                old = defaults[base] if base and isinstance(defaults.get(base), int) else None
                value = [max(1, round(fields[base] * v / old)) if old else sizes[key] for v in value]
            fields[key] = value
    elif isinstance(fields.get("layer_types"), list) and fields["layer_types"]:  # at most LAYERS layers by default
        fields["num_hidden_layers"] = len(fields["layer_types"])
    if "qk_rope_head_dim" in fields:  # multi-head latent attention: the rotary part is what head_dim names
        fields["head_dim"] = SHRUNK["qk_rope_head_dim"]
    if "kv_lora_rank" in fields:  # MLA: the latent expands to every head, a field of its own for the q.k width
        if "num_key_value_heads" in fields and "num_attention_heads" in fields:
            fields["num_key_value_heads"] = fields["num_attention_heads"]
        if "qk_head_dim" in fields:
            fields["qk_head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
    for key, value in list(fields.items()):  # per-layer overrides: scaled as the field they override
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()) \
                and all(str(k).isdigit() for k in value):
            fields[key] = {i: {f: max(1, round(fields[f] * x / defaults[f]))
                               if _is_int(x) and _is_int(defaults.get(f)) and defaults[f] and _is_int(fields.get(f))
                               else x for f, x in entry.items()}
                           for i, entry in value.items()}
    for key, value in list(fields.items()):
        if isinstance(value, float) and any(word in key for word in ("dropout", "pdrop", "layerdrop")):
            fields[key] = 0.0
    hidden = next((fields[k] for k in ("hidden_size", "n_embd", "d_model") if isinstance(fields.get(k), int)), None)
    old_hidden = next((defaults[k] for k in ("hidden_size", "n_embd", "d_model")
                       if isinstance(defaults.get(k), int)), None)
    heads = next((fields[k] for k in ("num_attention_heads", "n_head") if isinstance(fields.get(k), int)), None)
    old_heads = next((defaults[k] for k in ("num_attention_heads", "n_head") if isinstance(defaults.get(k), int)), 0)
    if isinstance(fields.get("rotary_dim"), int) and hidden and heads:  # a partial rotary part within the head
        head, old_head = fields.get("head_dim") or hidden // heads, defaults.get("head_dim") or old_hidden // old_heads
        if fields["rotary_dim"] > head:
            fields["rotary_dim"] = max(2, min(head, 2 * round(fields["rotary_dim"] * head / old_head / 2)))
    if hidden and isinstance(fields.get("mamba_expand"), int) and fields.get("mamba_d_ssm", None) is None:
        inner = fields["mamba_expand"] * hidden  # Mamba 2 heads of head_dim width fill expand * hidden
        if isinstance(fields.get("mamba_d_head"), int) and isinstance(fields.get("mamba_n_heads"), int):
            fields["mamba_d_head"], fields["mamba_n_heads"] = HEAD_DIM, inner // HEAD_DIM
    if hidden and isinstance(fields.get("expand"), int) and isinstance(fields.get("n_groups"), int) \
            and isinstance(fields.get("num_heads"), int):  # Mamba 2: num_heads * head_dim = expand * hidden
        fields["num_heads"] = fields["expand"] * hidden // (fields.get("head_dim") or HEAD_DIM)
        fields["n_groups"] = 1
    for key in ("mamba_dt_rank", "time_step_rank"):  # the "auto" rank of the shrunk width
        if hidden and isinstance(fields.get(key), int):
            fields[key] = -(-hidden // 16)
    if hidden and old_hidden and isinstance(fields.get("attention_hidden_size"), int):  # Zamba's attention width
        fields["attention_hidden_size"] = hidden * defaults["attention_hidden_size"] // old_hidden
        if isinstance(fields.get("attention_head_dim"), int) and heads:
            fields["attention_head_dim"] = fields["attention_hidden_size"] // heads
    if fields.get("rope_parameters") == {} and isinstance(fields.get("layer_types"), list):  # one per layer kind
        fields["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": 10000.0}
                                     for t in dict.fromkeys(fields["layer_types"])}
    post = POST.get(model_type, {})
    for key, value in (post(fields) if callable(post) else post).items():
        fields[key] = {**fields[key], **value} if isinstance(value, dict) and isinstance(fields.get(key), dict) \
            else value
    # what the class computes again from the shrunk fields (but what SHRUNK sets stays set, as it always was)
    for key in _derived(cls) - set(PRE.get(model_type, {})) - set(SHRUNK):
        fields.pop(key, None)
    return fields


def tiny_config(model_type: str):
    """The config class's defaults with every size field it has shrunk (its sub-configs too: text, vision, ...),
    each layer kind kept (twice where all layers are alike) with every per-layer list, index list and per-layer dict
    cut to the kept layers, the dimensions that depend on the width kept consistent with it, every dropout 0."""
    from transformers import AutoConfig

    from transformers import CONFIG_MAPPING

    defaults = AutoConfig.for_model(model_type).to_dict()
    widths = _widths(defaults)  # a model of several widths (text, vision, audio): the fields that join them
    fields = _shrink(defaults, CONFIG_MAPPING[model_type], frozenset(widths if len(widths) > 1 else ()))
    fields.pop("model_type", None)
    return AutoConfig.for_model(model_type, **fields)


def verdict(full: float, packed_alone: float, packed_stock: float, stock_alone: float, grad: float,
            scale: float) -> str:
    """The record's verdict from its largest differences (see the module docstring)."""
    tol = TOLERANCE * max(scale, 1.0)
    if full > tol or grad > GRAD_TOLERANCE:
        return "MISMATCH"
    if packed_alone <= tol:
        return "ok"
    if packed_stock <= tol and stock_alone > tol:
        return "ok-as-stock"
    return "MISMATCH"


def check(model_type: str) -> dict:
    """One model type's record (run in its own process by ``main``)."""
    import copy
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    import hf_accel
    from hf_accel.errors import UnsupportedModel

    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = tiny_config(model_type)
            try:
                ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
            except ValueError as e:  # a class that refuses SDPA (Gemma 2, gpt-oss): eager, its own reference
                if "scaled_dot_product_attention" not in str(e):
                    raise
                torch.manual_seed(0)
                ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
        ref.train()
        ids = torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref(input_ids=ids)
    except Exception as e:  # noqa: BLE001 - the sweep's own limit: say it and go on
        return {"verdict": "not built", "why": f"{type(e).__name__}: {str(e)[:200]}"}
    ours = copy.deepcopy(ref)
    try:
        hf_accel.patch(ours)
    except UnsupportedModel as e:
        return {"verdict": "refused", "why": str(e)[:300]}
    except Exception as e:  # noqa: BLE001
        return {"verdict": "PATCH-FAILED", "why": f"{type(e).__name__}: {str(e)[:300]}"}
    try:
        pos = torch.cat([torch.arange(6), torch.arange(8)])[None]
        with torch.no_grad():
            full_ref, full_ours = ref(input_ids=ids).logits, ours(input_ids=ids).logits
            alone = torch.cat([ref(input_ids=ids[:, :6]).logits, ref(input_ids=ids[:, 6:]).logits], dim=1)
            packed = ours(input_ids=ids, position_ids=pos).logits
            try:
                packed_ref = ref(input_ids=ids, position_ids=pos).logits
            except Exception:  # noqa: BLE001 - stock refuses the packed row: nothing to compare it with
                packed_ref = torch.full_like(packed, float("nan"))
        for model in (ref, ours):
            model(input_ids=ids, labels=ids).loss.backward()
        grads = dict(ref.named_parameters())
        grad = max((((p.grad - grads[n].grad).abs().max() / (grads[n].grad.abs().max() + 1e-12)).item()
                    for n, p in ours.named_parameters() if p.grad is not None and grads[n].grad is not None),
                   default=0.0)
    except UnsupportedModel as e:  # found by the seam at the first training call (a model the probe could not run)
        return {"verdict": "refused", "why": f"at the first training call: {str(e)[:300]}"}
    except Exception as e:  # noqa: BLE001
        return {"verdict": "RUN-FAILED", "why": f"{type(e).__name__}: {str(e)[:300]}"}
    figures = dict(full=(full_ours - full_ref).abs().max().item(), packed_alone=(packed - alone).abs().max().item(),
                   packed_stock=(packed - packed_ref).abs().max().item(),
                   stock_alone=(packed_ref - alone).abs().max().item(), grad=grad, scale=full_ref.abs().max().item())
    return {"verdict": verdict(**figures), **figures}


def run_one(model_type: str, timeout: float, address_space_gib: float) -> dict:
    """``check(model_type)`` in a child process under an address-space cap and a timeout."""
    code = (f"import json, resource, sys; sys.path.insert(0, {str(REPO / 'scripts')!r}); "
            f"cap = int({address_space_gib} * 2**30); resource.setrlimit(resource.RLIMIT_AS, (cap, cap)); "
            f"import sweep_families as s; print('SWEEP ' + json.dumps(s.check({model_type!r})))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"verdict": "CRASHED", "why": f"no result within {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("SWEEP ")]
    if not lines:
        return {"verdict": "CRASHED", "why": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
    return json.loads(lines[-1][len("SWEEP "):])


def table(records: dict[str, dict]) -> str:
    counts: dict[str, int] = {}
    for record in records.values():
        counts[record["verdict"]] = counts.get(record["verdict"], 0) + 1
    rows = [f"| `{name}` | {r['verdict']} | " + (r.get("why") or ", ".join(
        f"{k} {r[k]:.1e}" for k in ("full", "packed_alone", "packed_stock", "grad"))).replace("|", "/").replace(
        "\n", " ") + " |" for name, r in sorted(records.items())]
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    return "\n".join([f"{len(records)} model types: {summary}.", "", "| model_type | verdict | details |",
                      "|---|---|---|", *rows]) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="a new folder for sweep.json and sweep.md")
    parser.add_argument("--types", help="comma-separated model types (default: every causal LM transformers maps)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per model type")
    parser.add_argument("--address-space-gib", type=float, default=12.0, help="each child's address-space cap")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        parser.error(f"--out {out} holds files of an earlier run; name a new folder")
    out.mkdir(parents=True, exist_ok=True)
    if args.types:
        types = [t.strip() for t in args.types.split(",") if t.strip()]
    else:
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

        types = sorted({config.model_type for config in MODEL_FOR_CAUSAL_LM_MAPPING.keys()})
    records = {}
    for model_type in types:
        records[model_type] = run_one(model_type, args.timeout, args.address_space_gib)
        print(f"{model_type}: {records[model_type]['verdict']}", flush=True)
        (out / "sweep.json").write_text(json.dumps(records, indent=1))
    (out / "sweep.md").write_text(table(records))
    print(f"wrote {out / 'sweep.md'}")


if __name__ == "__main__":
    main()
