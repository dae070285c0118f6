"""The tiny test model round-trips through the standard HF loaders and behaves like an LM."""

import torch


def test_tiny_model_loads_and_scores(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    batch = tokenizer(["User: Tom has 3 apples", "Hi"], return_tensors="pt", padding=True)
    assert batch.attention_mask[1, 0] == 0, "left padding expected"
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch.input_ids.shape[1], len(tokenizer))
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    # Peaked but not degenerate distributions: strictly between 0 and log|V|.
    assert 0.5 < entropy.mean().item() < torch.log(torch.tensor(float(len(tokenizer)))).item() - 0.5


def test_tiny_peft_adapter_changes_outputs(tiny_model_and_tokenizer, tiny_peft_model_and_tokenizer):
    base, tokenizer = tiny_model_and_tokenizer
    peft_model, _ = tiny_peft_model_and_tokenizer
    batch = tokenizer(["User: Tom has 3 apples"], return_tensors="pt")
    with torch.no_grad():
        diff = (base(**batch).logits - peft_model(**batch).logits).abs().max().item()
    assert diff > 1e-4, "random lora_B must make the adapter non-trivial"
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
