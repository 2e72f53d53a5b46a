#!/usr/bin/env python
"""Every causal LM transformers maps, built tiny from its own config's defaults, patched against unpatched (fp32, CPU).

    python scripts/sweep_families.py --out OUT                  # every model_type in MODEL_FOR_CAUSAL_LM_MAPPING
    python scripts/sweep_families.py --out OUT --types llama,exaone4,doge

For each model type, in a process of its own (an address-space cap and a timeout: some configs' defaults cannot be
shrunk and would allocate tens of GB): the config class's defaults with the common size fields shrunk (hidden 64, 2
layers of each layer kind, 4 heads, 2 KV heads, head_dim 16, vocabulary 128, 4 experts top-2, window 8, every dropout
0), built with SDPA (eager where the class refuses SDPA), in train mode. Compared, patched (``hf_accel.patch``
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
import json
import os
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
LAYER_LISTS = ("layer_types", "mlp_layer_types")
TOLERANCE = 1e-4  # of the logits' largest magnitude (at least 1): fp32 kernels that sum in another order
GRAD_TOLERANCE = 1e-3  # of each parameter gradient's largest magnitude


def tiny_config(model_type: str):
    """The config class's defaults with every size field it has shrunk, each layer kind kept (twice where the
    default list repeats), every dropout 0."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    fields = defaults.to_dict()
    fields.update({k: v for k, v in SHRUNK.items() if k in fields})
    if "qk_rope_head_dim" in fields:  # multi-head latent attention: the rotary part is what head_dim names
        fields["head_dim"] = SHRUNK["qk_rope_head_dim"]
    for key, value in list(fields.items()):
        if isinstance(value, float) and any(word in key for word in ("dropout", "pdrop", "layerdrop")):
            fields[key] = 0.0
    for key in LAYER_LISTS:
        if isinstance(fields.get(key), list) and fields[key]:
            kinds = list(dict.fromkeys(fields[key]))
            fields[key] = (kinds * LAYERS)[:max(LAYERS, len(kinds))]
    if isinstance(fields.get("layer_types"), list):
        fields["num_hidden_layers"] = len(fields["layer_types"])
    for key in ("model_type", "text_config", "vision_config"):
        fields.pop(key, None)
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
