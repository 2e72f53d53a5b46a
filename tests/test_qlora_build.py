"""benchlib.quantized_base: the 4-bit model built one weight at a time on the device (the 70B QLoRA bench's
route, where a bf16 copy fits neither disk nor RAM) against the file route on the same weights (save_pretrained, then
from_pretrained with a BitsAndBytesConfig): the same quantized data and states, the same logits, the same marks of a
4-bit model; and it trains through PEFT's recipe and hf_accel.patch. On bitsandbytes' CPU backend, tiny shapes."""
from __future__ import annotations

import weakref

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install 'hf_accel[qlora]')")

from benchlib.quantized_base import build_4bit_model  # noqa: E402

VOCAB = 128


def quant_config(**kw):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16,
                              **{"bnb_4bit_quant_type": "nf4", **kw})


def llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**{**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False), **kw})


@pytest.mark.parametrize("tied, nested", [(False, False), (True, True)])
def test_built_model_is_what_the_file_route_loads(tmp_path, tied, nested):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(tie_word_embeddings=tied)).to(torch.bfloat16).save_pretrained(tmp_path)
    quant = quant_config(bnb_4bit_use_double_quant=nested)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant, dtype=torch.bfloat16,
                                                  attn_implementation="sdpa", device_map={"": "cpu"})
    saved = load_file(next(tmp_path.glob("*.safetensors")))
    made = []

    def from_file(name, shape, module):
        # the bf16 copy of each quantized matrix is gone before the next weight is made
        assert all(ref() is None for ref in made), name
        value = saved["model.embed_tokens.weight" if name == "lm_head.weight" and tied else name].clone()
        if isinstance(module, bnb.nn.Linear4bit):
            made.append(weakref.ref(value))
        return value

    built = build_4bit_model(llama_config(tie_word_embeddings=tied), quant, "cpu", weights=from_file)
    assert len(made) == 2 * 7  # every decoder linear, not the LM head
    want, got = loaded.state_dict(), built.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)  # data + quant states
    assert (built.lm_head.weight is built.model.embed_tokens.weight) == tied
    assert {type(m) for m in built.modules()} == {type(m) for m in loaded.modules()}
    for attr in ("is_quantized", "quantization_method", "is_loaded_in_4bit"):
        assert getattr(built, attr) == getattr(loaded, attr), attr
    assert type(built.hf_quantizer) is type(loaded.hf_quantizer)
    assert built.config.quantization_config.to_dict() == loaded.config.quantization_config.to_dict()
    ids = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(built.train()(input_ids=ids).logits, loaded.train()(input_ids=ids).logits)


def test_random_built_model_trains_through_peft_and_hf_accel():
    import hf_accel
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    first = build_4bit_model(llama_config(), quant_config(), "cpu", seed=3)
    again = build_4bit_model(llama_config(), quant_config(), "cpu", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    model = prepare_model_for_kbit_training(first, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    assert sum(type(m).__module__ == "peft.tuners.lora.bnb" for m in model.modules()) == 2 * 7
    hf_accel.patch(model, backend="reference")
    ids = torch.randint(1, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    model.train()(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_refuses_an_8bit_config():
    from transformers import BitsAndBytesConfig

    with pytest.raises(ValueError, match="4-bit BitsAndBytesConfig"):
        build_4bit_model(llama_config(), BitsAndBytesConfig(load_in_8bit=True), "cpu")


def test_flop_model_counts_4bit_linears_at_their_full_size():
    """MFU for QLoRA rows: a Linear4bit stores two weights a byte, but its matmul is in x out (the QLoRA rows'
    MFU was half the real figure while the FLOP model counted storage)."""
    from transformers import LlamaForCausalLM

    from hf_accel.training.flops import FlopModel

    built = FlopModel.from_model(build_4bit_model(llama_config(), quant_config(), "cpu"))
    plain = LlamaForCausalLM(llama_config())
    plain.model.layers.requires_grad_(False)  # the quantized decoder linears are frozen; the bf16 LM head is not
    assert built == FlopModel.from_model(plain) and built.frozen_matmul_params > 0
