"""Generation: stop rules, sampling distribution, reference sampler, rewards and replacement sampling.

Most tests use a *Markov* Qwen2 whose next-token logits depend only on the current token (one layer
with zeroed outputs, identity embeddings), so the test decides exactly what the model can say.
"""

from __future__ import annotations

import itertools
import json
import logging

import numpy as np
import pytest
import torch
from test_sp_policy import brute_force

from entropy_experiments.policy.reference_sampler import sample_one_at_a_time
from entropy_experiments.utils.sequence_processor import GenerationConfig, SequenceProcessor

# One intra-op thread for the whole module (runs here are compared number for number).
pytestmark = pytest.mark.usefixtures("one_torch_thread")
# χ² goodness of fit: a correct sampler gives p below this once in 10⁶ seeds (was 1e-3: once in 1000); the
# temperature left out of the sampler (τ = 0.7 drawn at 1) gives p ≈ 2e-21 on these 4000 draws
CHI2_P_FLOOR = 1e-6


@pytest.fixture(scope="module")
def tok(tiny_model_and_tokenizer):
    return tiny_model_and_tokenizer[1]


def markov_model(tok, transitions: dict[int, dict[int, float]]):
    """Qwen2 with next-token logits M[:, current token] (≈ the given values, 0 elsewhere)."""
    from transformers import GenerationConfig as HFGenerationConfig
    from transformers import Qwen2Config, Qwen2ForCausalLM

    V = len(tok)
    config = Qwen2Config(vocab_size=V, hidden_size=V, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         attn_implementation="eager")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    M = torch.zeros(V, V)
    for i, row in transitions.items():
        for j, logit in row.items():
            M[j, i] = logit
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(V))
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(M / V ** 0.5)   # RMSNorm maps a one-hot row to √V · one-hot
    model.generation_config = HFGenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model.eval()


def ids(tok, text):
    return tok(text)["input_ids"]


def sp_for(model, tok, **generation):
    return SequenceProcessor(model, tok, {"generation": {"max_new_tokens": 8, "gen_batch_size": 16, **generation}})


SURE = 40.0  # logit gap making a transition certain (other tokens ~e-40)


# ------------------------------------------------------------------------------ stop rules
def test_first_token_eos_gives_T_equal_1(tok):
    last = ids(tok, "Q:")[-1]
    model = markov_model(tok, {last: {tok.eos_token_id: SURE}})
    sp = sp_for(model, tok)
    seqs = sp.generate_batched(["Q:", "Tom Q:"], G=3, seed=0)
    Lp = seqs.prompt_lens[0]
    assert seqs.gen_lens == [[1, 1, 1], [1, 1, 1]] and seqs.sequences.shape[2] == Lp + 1
    assert (seqs.sequences[:, :, Lp] == tok.eos_token_id).all() and seqs.attention_masks[:, :, Lp].all()
    lp = sp.teacher_force_logprobs(seqs, compute_rb=True)
    assert lp.token_logqs[0][0].shape == (1,) and lp.token_logqs[0][0].item() == pytest.approx(0.0, abs=1e-6)


def test_eos_ends_the_response_and_is_scored_with_pad_equal_eos(tok):
    assert tok.pad_token_id == tok.eos_token_id
    last, x, y, z = ids(tok, "Q:")[-1], ids(tok, "x")[0], ids(tok, "y")[0], ids(tok, "z")[0]
    eos = tok.eos_token_id
    model = markov_model(tok, {last: {x: SURE}, x: {eos: SURE, y: SURE}, y: {z: SURE}, z: {eos: SURE}})
    sp = sp_for(model, tok)
    seqs = sp.generate_batched(["Q:"], G=24, seed=0)
    lp = sp.teacher_force_logprobs(seqs, compute_rb=True)
    Lp = seqs.prompt_lens[0]
    assert set(seqs.gen_lens[0]) == {2, 4}
    for g, T in enumerate(seqs.gen_lens[0]):
        response = seqs.sequences[0, g, Lp:Lp + T].tolist()
        assert response == ([x, eos] if T == 2 else [x, y, z, eos])      # first EOS, not "last non-pad"
        assert not seqs.attention_masks[0, g, Lp + T:].any()
        expected = [0.0, np.log(0.5)] if T == 2 else [0.0, np.log(0.5), 0.0, 0.0]
        np.testing.assert_allclose(lp.token_logqs[0][g].numpy(), expected, atol=1e-6)
        assert lp.rb_entropies[0][g][1] == pytest.approx(np.log(2), abs=1e-6)


def test_stop_string_ends_the_response_without_forcing_a_token(tok):
    last = ids(tok, "Q:")[-1]
    close, x, y = ids(tok, "</answer>"), ids(tok, "x")[0], ids(tok, "y")[0]
    chain = [last, *close, x, y]
    model = markov_model(tok, {a: {b: SURE} for a, b in itertools.pairwise(chain)} | {y: {x: SURE}})
    sp = sp_for(model, tok)
    seqs = sp.generate_batched(["Q:"], G=2, seed=0)
    assert seqs.gen_lens == [[len(close)] * 2] and seqs.responses_text[0] == ["</answer>"] * 2
    no_stop = sp_for(model, tok, stop_strings=[]).generate_batched(["Q:"], G=1, seed=0)
    assert no_stop.gen_lens == [[8]]                                     # truncated at max_new_tokens


def test_stop_string_in_the_prompt_does_not_stop_the_response(tok):
    prompt = "<answer>8</answer>"
    last, x, y = ids(tok, prompt)[-1], ids(tok, "x")[0], ids(tok, "y")[0]
    model = markov_model(tok, {last: {x: SURE}, x: {y: SURE}, y: {x: SURE}})
    seqs = sp_for(model, tok, max_new_tokens=5).generate_batched([prompt], G=1, seed=0)
    assert seqs.gen_lens == [[5]] and seqs.responses_text[0][0] == "xyxyx"


# ------------------------------------------------------------------------------ the sampling distribution
@pytest.mark.parametrize("tau,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampling_matches_the_policy_chi_square(tok, tau, top_p):
    """First-token frequencies of 4000 draws against q computed from the model's own logits."""
    from scipy.stats import chisquare

    last = ids(tok, "Q:")[-1]
    targets = [ids(tok, c)[0] for c in "abcdef"]
    row = {t: -8.0 for t in range(len(tok))} | dict(zip(targets, [2.0, 1.5, 1.0, 0.5, 0.2, -0.5]))
    model = markov_model(tok, {last: row})   # ~0.7 % of the mass on the rest of the vocabulary
    n = 4000
    seqs = sp_for(model, tok, max_new_tokens=1, temperature=tau, top_p=top_p, gen_batch_size=n,
                  stop_strings=[]).generate_batched(["Q:"], G=n, seed=123)
    drawn = seqs.sequences[0, :, seqs.prompt_lens[0]].numpy()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids(tok, "Q:")])).logits[0, -1].double().numpy()
    q = brute_force(logits, 0, tau, top_p)["q"]
    bins = [t for t in targets if q[t] > 0]
    observed = [int((drawn == t).sum()) for t in bins] + [int((~np.isin(drawn, bins)).sum())]
    expected = [n * q[t] for t in bins] + [n * (1 - sum(q[t] for t in bins))]
    if expected[-1] < 5:   # the rest of the vocabulary is (nearly) never sampled: merge or check it is empty
        assert observed[-1] <= 2
        observed, expected = observed[:-1], np.array(expected[:-1]) * n / sum(expected[:-1])
    assert chisquare(observed, expected).pvalue > CHI2_P_FLOOR
    if top_p < 1:
        assert len(bins) < len(targets) and np.isin(drawn, bins).all()   # nothing outside the nucleus


# ------------------------------------------------------------------------------ reference sampler
def test_reference_sampler_gives_the_same_layout_as_batched_generation(tok):
    a, b = ids(tok, "Q:")[-1], ids(tok, "x")[0]
    eos, y = tok.eos_token_id, ids(tok, "y")[0]
    model = markov_model(tok, {a: {b: SURE}, b: {y: SURE}, y: {eos: SURE}, ids(tok, "Hi")[-1]: {eos: SURE}})
    prompts = ["Q:", "Tom has 3 apples. Q:", "Hi"]
    batched = sp_for(model, tok).generate_batched(prompts, G=2, seed=0)
    reference = sample_one_at_a_time(model, tok, prompts, 2, GenerationConfig(max_new_tokens=8), seed=0)
    assert torch.equal(batched.sequences, reference.sequences)
    assert torch.equal(batched.attention_masks, reference.attention_masks)
    assert (batched.prompt_lens, batched.gen_lens, batched.responses_text) == \
        (reference.prompt_lens, reference.gen_lens, reference.responses_text)
    assert batched.gen_lens == [[3, 3], [3, 3], [1, 1]]


# ------------------------------------------------------------------------------ end-to-end with rewards
@pytest.fixture()
def qa_file(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(3)))
    return path


@pytest.fixture()
def rigged_reward(monkeypatch):
    """A reward that returns the gold answer as a number: non-zero only if gold answers arrive."""
    from entropy_experiments.data.rewards import REWARD_REGISTRY

    monkeypatch.setitem(REWARD_REGISTRY, "rigged_gold_number",
                        lambda prompt, responses, example: [float(example.answer)] * len(responses))
    return "rigged_gold_number"


def _sp_with_data(tiny_peft_model_and_tokenizer, qa_file, reward):
    model, tok = tiny_peft_model_and_tokenizer
    return SequenceProcessor(model, tok, {"generation": {"max_new_tokens": 6, "gen_batch_size": 4},
                                          "reward": {"name": reward}, "batch_config": {"dataset_path": str(qa_file)}})


def test_replacement_sampling_keeps_gold_answers_and_counts(tiny_peft_model_and_tokenizer, qa_file, rigged_reward, caplog):
    sp = _sp_with_data(tiny_peft_model_and_tokenizer, qa_file, rigged_reward)
    with caplog.at_level(logging.INFO):
        seqs, lp, diags = sp.generate_with_replacement_sampling(7, "jsonl", seed=0, G=4, compute_rb=True)
    assert seqs.sequences.shape[:2] == (7, 1) and len(lp.rewards) == 7 and len(diags.diagnostics) == 7
    for b in range(7):
        example = seqs.examples[b]
        assert seqs.prompts[b] == example.question and seqs.prompt_ids[b] == example.meta["global_prompt_id"]
        assert lp.rewards[b] == [float(example.answer)] and lp.rewards[b][0] > 0
    unique = len(set(seqs.prompts))
    assert f"pool 3 prompts, 7 draws, {unique} unique, largest repeat" in caplog.text
    assert "G=4 ignored, forced to 1" in caplog.text
    assert len(lp.rb_entropies[0][0]) == seqs.gen_lens[0][0]


def test_generate_with_logprobs_from_a_data_set_and_explicit_examples(tiny_peft_model_and_tokenizer, qa_file,
                                                                      rigged_reward):
    sp = _sp_with_data(tiny_peft_model_and_tokenizer, qa_file, rigged_reward)
    seqs, lp, diags = sp.generate_with_logprobs(dataset_name="jsonl", num_prompts=2, G=2, seed=1)
    assert seqs.sequences.shape[:2] == (2, 2)
    assert [r[0] for r in lp.rewards] == [float(ex.answer) for ex in seqs.examples]
    assert diags.diagnostics[1][1].seq.T == seqs.gen_lens[1][1]
    prompts, examples = sp.sample_prompts("jsonl", "train", 2, seed=5)
    _, lp2, _ = sp.generate_with_logprobs(prompts=prompts, examples=examples, G=1, seed=2)
    assert [r[0] for r in lp2.rewards] == [float(ex.answer) for ex in examples]


def test_missing_examples_give_zero_rewards_with_one_warning(tiny_peft_model_and_tokenizer, qa_file, rigged_reward,
                                                             caplog):
    sp = _sp_with_data(tiny_peft_model_and_tokenizer, qa_file, rigged_reward)
    with caplog.at_level(logging.WARNING):
        _, lp, _ = sp.generate_with_logprobs(prompts=["a", "b"], G=1, seed=0)
        sp.generate_with_logprobs(prompts=["c"], G=1, seed=0)
    assert lp.rewards == [[0.0], [0.0]]
    assert caplog.text.count("no data-set example") == 1
