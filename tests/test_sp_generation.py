"""Generation by the policy engine: stop rules, the sampling distribution, the reference sampler.

Most tests use a *Markov* Qwen2 whose next-token logits depend only on the current token (one layer
with zeroed outputs, identity embeddings), so the test decides exactly what the model can say.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from test_sp_policy import brute_force

from entropy_experiments.policy.engine import PolicyEngine
from entropy_experiments.policy.generation_config import GenerationConfig, parse_settings
from entropy_experiments.policy.reference_sampler import sample_one_at_a_time

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


def engine_for(model, tok, **generation):
    settings = parse_settings({"generation": {"max_new_tokens": 8, "gen_batch_size": 16, **generation}})
    return PolicyEngine(model, tok, settings)


SURE = 40.0  # logit gap making a transition certain (other tokens ~e-40)


# ------------------------------------------------------------------------------ stop rules
def test_first_token_eos_gives_T_equal_1(tok):
    last = ids(tok, "Q:")[-1]
    model = markov_model(tok, {last: {tok.eos_token_id: SURE}})
    engine = engine_for(model, tok)
    seqs = engine.generate_batched(["Q:", "Tom Q:"], G=3, seed=0)
    Lp = seqs.prompt_lens[0]
    assert seqs.gen_lens == [[1, 1, 1], [1, 1, 1]] and seqs.sequences.shape[2] == Lp + 1
    assert (seqs.sequences[:, :, Lp] == tok.eos_token_id).all() and seqs.attention_masks[:, :, Lp].all()
    lp = engine.teacher_force_logprobs(seqs, compute_rb=True)
    assert lp.token_logqs[0][0].shape == (1,) and lp.token_logqs[0][0].item() == pytest.approx(0.0, abs=1e-6)


def test_eos_ends_the_response_and_is_scored_with_pad_equal_eos(tok):
    assert tok.pad_token_id == tok.eos_token_id
    last, x, y, z = ids(tok, "Q:")[-1], ids(tok, "x")[0], ids(tok, "y")[0], ids(tok, "z")[0]
    eos = tok.eos_token_id
    model = markov_model(tok, {last: {x: SURE}, x: {eos: SURE, y: SURE}, y: {z: SURE}, z: {eos: SURE}})
    engine = engine_for(model, tok)
    seqs = engine.generate_batched(["Q:"], G=24, seed=0)
    lp = engine.teacher_force_logprobs(seqs, compute_rb=True)
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
    engine = engine_for(model, tok)
    seqs = engine.generate_batched(["Q:"], G=2, seed=0)
    assert seqs.gen_lens == [[len(close)] * 2] and seqs.responses_text[0] == ["</answer>"] * 2
    no_stop = engine_for(model, tok, stop_strings=[]).generate_batched(["Q:"], G=1, seed=0)
    assert no_stop.gen_lens == [[8]]                                     # truncated at max_new_tokens


def test_stop_string_in_the_prompt_does_not_stop_the_response(tok):
    prompt = "<answer>8</answer>"
    last, x, y = ids(tok, prompt)[-1], ids(tok, "x")[0], ids(tok, "y")[0]
    model = markov_model(tok, {last: {x: SURE}, x: {y: SURE}, y: {x: SURE}})
    seqs = engine_for(model, tok, max_new_tokens=5).generate_batched([prompt], G=1, seed=0)
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
    seqs = engine_for(model, tok, max_new_tokens=1, temperature=tau, top_p=top_p, gen_batch_size=n,
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
    batched = engine_for(model, tok).generate_batched(prompts, G=2, seed=0)
    reference = sample_one_at_a_time(model, tok, prompts, 2, GenerationConfig(max_new_tokens=8), seed=0)
    assert torch.equal(batched.sequences, reference.sequences)
    assert torch.equal(batched.attention_masks, reference.attention_masks)
    assert (batched.prompt_lens, batched.gen_lens, batched.responses_text) == \
        (reference.prompt_lens, reference.gen_lens, reference.responses_text)
    assert batched.gen_lens == [[3, 3], [3, 3], [1, 1]]
