"""QLoRA (`checkpoint.use_qlora: true`) on CPU, when the optional bitsandbytes extra is installed.

The whole module skips cleanly without bitsandbytes (tests/test_model_loader.py checks the error
message for that case). With it:
- the base's projections are nf4 `Linear4bit` layers whose dequantised weights are the fp32 weights up
  to nf4 rounding (compared with the fp32 model loaded independently);
- the adapter is loaded, trainable, and its logits follow the fp32 model's;
- the probe's pattern works: a no-grad forward (teacher forcing) and then a backward through the
  4-bit base give finite, non-zero LoRA gradients (the CPU repacking trap of bitsandbytes).
"""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from entropy_experiments.checkpoint.adapter import load_peft_for_probe
from entropy_experiments.testing.tiny_model import add_random_lora


@pytest.fixture(scope="module")
def fp32_and_adapter(tiny_model_dir, tmp_path_factory):
    """(fp32 PEFT model loaded independently, adapter directory) for the tiny Qwen2."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager", dtype=torch.float32)
    model = add_random_lora(base, seed=3).eval()
    adapter_dir = tmp_path_factory.mktemp("qlora") / "adapter"
    model.save_pretrained(adapter_dir)
    return model, adapter_dir


@pytest.fixture(scope="module")
def qlora_model(tiny_model_dir, fp32_and_adapter):
    return load_peft_for_probe(str(tiny_model_dir), fp32_and_adapter[1], use_qlora=True, device_map="cpu")


def test_base_layers_are_nf4_and_dequantise_to_the_fp32_weights(qlora_model, fp32_and_adapter):
    fp32_weights = dict(fp32_and_adapter[0].get_base_model().named_parameters())
    layers = {n: m for n, m in qlora_model.get_base_model().named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert layers, "no 4-bit layer: the base was not quantised"
    for name, layer in layers.items():
        ref = fp32_weights[name + ".weight"]  # both models carry the same LoRA wrappers: same names
        deq = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
        assert deq.shape == ref.shape
        rel = (deq - ref.detach()).norm() / ref.detach().norm()
        assert rel < 0.15, (name, float(rel))  # nf4: ~0.1 relative error on Gaussian weights


def test_adapter_is_trainable_and_logits_follow_the_fp32_model(qlora_model, fp32_and_adapter):
    trainable = [n for n, p in qlora_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids = torch.tensor([[5, 17, 42, 8, 99, 3]])
    with torch.no_grad():
        got = qlora_model(input_ids=ids).logits.float()
        ref = fp32_and_adapter[0](input_ids=ids).logits
    assert torch.isfinite(got).all()
    corr = torch.corrcoef(torch.stack([got.flatten(), ref.flatten()]))[0, 1]
    assert corr > 0.9, float(corr)


def test_backward_after_a_no_grad_forward(qlora_model):
    ids = torch.tensor([[5, 17, 42, 8, 99, 3]])
    with torch.no_grad():
        qlora_model(input_ids=ids)  # teacher forcing first: must not repack the 4-bit weights
    qlora_model.eval()
    logp = torch.log_softmax(qlora_model(input_ids=ids).logits[0, :-1].float(), -1)
    loss = -logp.gather(-1, ids[0, 1:, None]).sum()
    params = [p for p in qlora_model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    assert all(torch.isfinite(g).all() for g in grads)
    assert max(g.abs().max().item() for g in grads) > 0
