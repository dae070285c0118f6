"""One batch type: what generation returns is the `Batch` the probe saves, and the dicts saved before the two
batch types were merged (E_batch.pt / U_batch.pt, and the seed API's sequences dict) still load."""

from __future__ import annotations

import pytest
import torch

from entropy_experiments.data.batch import Batch, BatchContractError
from entropy_experiments.policy.engine import PolicyEngine
from entropy_experiments.policy.generation_config import GenerationConfig, PolicySettings

# E_batch.pt's keys in the order the probe has always written them (required keys, then the optional ones set)
SAVED_KEYS = ["sequences", "attention_masks", "prompt_lens", "gen_lens", "advantages", "rewards", "max_lengths",
              "prompt_ids", "num_prompts", "num_responses_per_prompt", "prompts", "responses_text"]


def layout() -> tuple[torch.Tensor, torch.Tensor]:
    """[B=2, G=2, L=5]: prompts of 2 and 3 tokens left-padded to Lp = 3, responses of 1, 2, 2, 1 tokens."""
    seqs = torch.tensor([[[0, 5, 6, 7, 0], [0, 5, 6, 8, 9]], [[1, 2, 3, 4, 4], [1, 2, 3, 9, 0]]])
    masks = torch.tensor([[[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]], [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]])
    return seqs, masks


def old_u_batch_dict() -> dict:
    """A U_batch.pt dict exactly as the probe wrote it before the merge (written out by hand)."""
    seqs, masks = layout()
    return {"sequences": seqs, "attention_masks": masks, "prompt_lens": [3, 3], "gen_lens": [[1, 2], [2, 1]],
            "advantages": torch.tensor([[0.5, -0.5], [0.0, 0.0]]), "rewards": [[1.0, 0.0], [1.0, 1.0]],
            "max_lengths": [2, 2], "prompt_ids": [7, 3], "num_prompts": 2, "num_responses_per_prompt": 2,
            "prompts": ["p7", "p3"], "responses_text": [["a", "bc"], ["de", "f"]],
            "rewards_per_function": {"gold": [[1.0, 0.0], [1.0, 1.0]]}, "reward_weights": {"gold": 1.0}}


def test_an_old_saved_batch_loads_and_saves_back_to_the_same_dict(tmp_path):
    torch.save(old_u_batch_dict(), tmp_path / "U_batch.pt")
    loaded = torch.load(tmp_path / "U_batch.pt", weights_only=True)
    batch = Batch.from_dict(loaded, "U_batch")
    again = batch.to_dict()
    assert list(again) == list(old_u_batch_dict())
    for key, value in old_u_batch_dict().items():
        assert torch.equal(again[key], value) if isinstance(value, torch.Tensor) else again[key] == value, key
    assert batch.examples is None and batch.zero_advantage_prompts() == 1


def test_an_old_saved_batch_with_a_wrong_count_is_still_refused():
    d = old_u_batch_dict()
    d["max_lengths"] = [2, 1]
    with pytest.raises(BatchContractError, match=r"U_batch: max_lengths\[1\]=1 != max\(gen_lens\)=2"):
        Batch.from_dict(d, "U_batch")


def test_the_seed_apis_older_sequences_dict_loads_with_zero_rewards(tmp_path):
    seqs, masks = layout()
    old = {"sequences": seqs, "attention_masks": masks, "prompt_lens": [3, 3], "gen_lens": [[1, 2], [2, 1]],
           "responses_text": [["a", "bc"], ["de", "f"]], "prompts": ["p7", "p3"],
           "examples": [{"question": "q7", "answer": "1"}, {"question": "q3", "answer": "2"}], "prompt_ids": None}
    torch.save(old, tmp_path / "batch.pt")
    batch = Batch.from_dict(torch.load(tmp_path / "batch.pt", weights_only=True))
    assert torch.equal(batch.sequences, seqs) and torch.equal(batch.attention_masks, masks)
    assert batch.rewards == [[0.0, 0.0], [0.0, 0.0]] and torch.equal(batch.advantages, torch.zeros(2, 2))
    assert batch.examples == old["examples"] and batch.prompt_ids is None and batch.max_lengths == [2, 2]
    sub = batch.subset([1])
    assert sub.examples == [old["examples"][1]] and sub.gen_lens == [[2, 1]]
    with pytest.raises(BatchContractError, match="batch: missing key 'gen_lens'"):
        Batch.from_dict({k: v for k, v in old.items() if k != "gen_lens"})


def test_generation_returns_the_batch_the_probe_packs_and_saves(tiny_model_and_tokenizer, one_torch_thread):
    model, tok = tiny_model_and_tokenizer
    engine = PolicyEngine(model, tok, PolicySettings(GenerationConfig(max_new_tokens=4, stop_strings=[])),
                          apply_precision=False)
    drawn = engine.generate_batched(["Hi", "What is 2 + 2?"], 2, 2, seed=3)
    assert type(drawn) is Batch and drawn.rewards == [[0.0, 0.0], [0.0, 0.0]] and drawn.prompt_ids is None
    packed = Batch.pack(drawn, None)
    assert list(packed.to_dict()) == SAVED_KEYS
    assert torch.equal(packed.sequences, drawn.sequences) and packed.prompt_ids == [0, 1]
    assert packed.responses_text == drawn.responses_text and packed.gen_lens == drawn.gen_lens
