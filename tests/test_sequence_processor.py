"""The policy engine's teacher forcing and generation (`entropy_experiments.policy`) on the tiny Qwen2, against
independent references."""

from __future__ import annotations

import copy
import dataclasses
import logging

import numpy as np
import pytest
import torch
from test_sp_policy import brute_force

from entropy_experiments.errors import ConfigError, DataError, NumericsError
from entropy_experiments.policy import generate, score
from entropy_experiments.policy.engine import PolicyEngine
from entropy_experiments.policy.generation_config import parse_settings
from entropy_experiments.policy.sequences import BatchedSequences
from entropy_experiments.policy.tf_batches import tf_batches

PROMPTS = ["What is 2 + 2?", "Tom has 3 apples and buys 5 more. How many apples does he have?", "Hi"]


def make_engine(model, tokenizer, precision=None, **generation):
    gen = {"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "gen_batch_size": 4, "tf_batch_size": 4,
           "rb_requires_grad": True, **generation}
    return PolicyEngine(model, tokenizer, parse_settings({"generation": gen, "precision": precision or {}}))


def lora_names(model):
    return [n for n, p in model.named_parameters() if p.requires_grad]


def random_direction(model, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, dtype=p.dtype) * scale
            for n, p in model.named_parameters() if p.requires_grad}


def prompt_and_response(seqs: BatchedSequences, b: int, g: int) -> tuple[list[int], list[int]]:
    Lp, T = seqs.prompt_lens[b], seqs.gen_lens[b][g]
    row, mask = seqs.sequences[b, g], seqs.attention_masks[b, g]
    prompt = row[:Lp][mask[:Lp].bool()].tolist()
    return prompt, row[Lp:Lp + T].tolist()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices gain nothing from threads, and on a shared 2-core machine OpenMP spinning makes
    them ~100× slower; restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def peft(tiny_peft_model_and_tokenizer):
    return tiny_peft_model_and_tokenizer


@pytest.fixture(scope="module")
def seqs(peft):
    model, tok = peft
    return make_engine(model, tok).generate_batched(PROMPTS, G=2, seed=0)


def _eager_attention_in_model_dtype(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """HF's eager attention with the softmax in the model's dtype instead of float32.

    Identical for fp32 models; for the float64 test model it keeps the whole forward in float64
    (HF's float32 softmax would add ~1e-7 noise, and turn fully masked left-pad rows into NaN).
    """
    from transformers.models.qwen2.modeling_qwen2 import repeat_kv

    k = repeat_kv(key, module.num_key_value_groups)
    v = repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1)
    return torch.matmul(weights, v).transpose(1, 2).contiguous(), weights


def _rms_norm_in_model_dtype(self, hidden_states):
    """Qwen2RMSNorm.forward without its float32 round trip (identical for fp32 models)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(scope="module")
def fp64_model(peft):
    """A float64 copy of the LoRA model whose θ-dependent maths is all float64 (HF computes the
    attention softmax and RMSNorm in float32 even for float64 models): central differences are
    then good to ~1e-9 instead of drowning in float32 rounding."""
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    model, tok = peft
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qwen2, "eager_attention_forward", _eager_attention_in_model_dtype)
        mp.setattr(qwen2.Qwen2RMSNorm, "forward", _rms_norm_in_model_dtype)
        yield copy.deepcopy(model).double(), tok


# ------------------------------------------------------------------------------ layout and stop rule
def test_packed_layout_invariants(seqs, peft):
    _, tok = peft
    B, G, L = seqs.sequences.shape
    assert (B, G) == (3, 2) and len(set(seqs.prompt_lens)) == 1
    Lp = seqs.prompt_lens[0]
    assert L == Lp + max(max(r) for r in seqs.gen_lens)
    for b in range(B):
        n_prompt = len(tok(PROMPTS[b])["input_ids"])
        for g in range(G):
            T = seqs.gen_lens[b][g]
            mask = seqs.attention_masks[b, g]
            assert mask[:Lp].sum() == n_prompt and mask[Lp - n_prompt:Lp].all()     # left padding
            assert mask[Lp:Lp + T].all() and not mask[Lp + T:].any()
            response = seqs.sequences[b, g, Lp:Lp + T].tolist()
            assert (seqs.sequences[b, g, Lp + T:] == tok.pad_token_id).all()
            # the stop rule: EOS only as the last token; otherwise a stop string or the length limit
            assert tok.eos_token_id not in response[:-1]
            text = tok.decode(response, skip_special_tokens=False)
            assert response[-1] == tok.eos_token_id or text.endswith("</answer>") or T == 12 or \
                "</answer>" in text and "</answer>" not in tok.decode(response[:-1], skip_special_tokens=False)
            assert seqs.responses_text[b][g] == tok.decode(response, skip_special_tokens=True)


def test_response_length_rule(peft):
    model, tok = peft
    engine = make_engine(model, tok)
    eos = tok.eos_token_id
    stop = tok("</answer>")["input_ids"]
    x = tok("x")["input_ids"]
    assert engine.response_length([eos, eos, eos]) == 1                     # first-token EOS ⇒ T = 1
    assert engine.response_length(x + x + [eos] + x + [eos]) == 3            # first EOS, even with pad == EOS
    assert engine.response_length(x + stop + x + x) == 1 + len(stop)        # stop string, nothing forced after it
    assert engine.response_length(x + stop + [eos, eos]) == 1 + len(stop)   # stop string before the EOS padding
    assert engine.response_length(x * 5) == 5                                # truncated
    no_stop = make_engine(model, tok, stop_strings=[])
    assert no_stop.response_length(x + stop + x) == 2 + len(stop)


# ------------------------------------------------------------------------------ teacher forcing values
@pytest.mark.parametrize("tau,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.7, 0.9)])
def test_teacher_forcing_matches_brute_force(peft, seqs, tau, top_p):
    """Per-token log q, RB entropy and log p equal a full-softmax computation on each sequence alone."""
    model, tok = peft
    engine = make_engine(model, tok, temperature=tau, top_p=top_p)
    lp = engine.teacher_force_logprobs(seqs, compute_rb=True)
    for b in range(3):
        for g in range(2):
            prompt, response = prompt_and_response(seqs, b, g)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double().numpy()
            for k, tok_k in enumerate(response):
                ref = brute_force(logits[len(prompt) + k - 1], tok_k, tau, top_p)
                assert lp.token_logqs[b][g][k].item() == pytest.approx(ref["logq"], abs=2e-5)
                assert lp.rb_entropies[b][g][k] == pytest.approx(ref["rb_entropy"], abs=2e-5)
                assert lp.logprobs[b][g][k].item() == pytest.approx(ref["logp"], abs=2e-5)
            assert lp.sequence_logqs[b][g] == pytest.approx(float(lp.token_logqs[b][g].sum()))
            np.testing.assert_allclose(lp.surprisals[b][g], -lp.token_logqs[b][g].numpy())


def _check_scores_against_tf(engine, prompts, G=2):
    """Generate G rows per prompt (sharing each prompt's prefill), keep HF's processed scores — the
    logits it actually sampled from — and compare them with teacher forcing of the packed result."""
    prompt_tokens = engine.tokenize_prompts(prompts)
    ids, mask = engine.left_pad(prompt_tokens)
    rows = torch.arange(len(prompts)).repeat_interleave(G)
    responses, scores = generate.generate_chunk(engine.policy, ids, mask, rows, output_scores=True)
    packed = engine.pack(prompt_tokens, [responses[b * G:(b + 1) * G] for b in range(len(prompts))], prompts)
    lp = engine.teacher_force_logprobs(packed, compute_rb=True)
    checked = 0
    for r, response in enumerate(responses):
        b, g = divmod(r, G)
        for k, tok_k in enumerate(response):
            logq_gen = torch.log_softmax(scores[k][r].double(), dim=-1)
            q = logq_gen.exp()
            h_gen = -(q[q > 0] * logq_gen[q > 0]).sum()
            assert lp.token_logqs[b][g][k].item() == pytest.approx(logq_gen[tok_k].item(), abs=1e-5)
            assert lp.rb_entropies[b][g][k] == pytest.approx(h_gen.item(), abs=1e-5)
            checked += 1
    return checked


def test_teacher_forced_logq_equals_the_distribution_generation_sampled_from(fp64_model):
    """Run in float64 so that KV-cache vs full-forward rounding (~2e-5 on this fp32 model's logits of
    size ~8) does not hide behind the 1e-5 tolerance; HF still hands fp32 scores to the processors."""
    model, tok = fp64_model
    engine = make_engine(model, tok)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        assert _check_scores_against_tf(engine, PROMPTS) > 10


def test_model_generation_config_cannot_leak_into_sampling(fp64_model):
    """A checkpoint's own generation_config (top_k, penalties, min_p, …) must not change the policy."""
    from transformers import GenerationConfig as HFGenerationConfig

    model, tok = fp64_model
    polluted = copy.deepcopy(model)
    bad = HFGenerationConfig(do_sample=True, temperature=0.2, top_k=3, top_p=0.5, min_p=0.3, repetition_penalty=5.0,
                             no_repeat_ngram_size=2, suppress_tokens=[5, 6], eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    polluted.generation_config = polluted.get_base_model().generation_config = bad
    engine = make_engine(polluted, tok, temperature=1.0, top_p=1.0)
    with torch.random.fork_rng():
        torch.manual_seed(2)
        assert _check_scores_against_tf(engine, PROMPTS) > 10
    assert polluted.generation_config is bad and polluted.get_base_model().generation_config is bad  # restored


def test_batch_of_different_prompt_lengths_equals_each_prompt_alone(peft, seqs):
    model, tok = peft
    engine = make_engine(model, tok)
    batched = engine.teacher_force_logprobs(seqs, compute_rb=True, tf_batch_size=6)
    for b in range(3):
        for g in range(2):
            prompt, response = prompt_and_response(seqs, b, g)
            alone = engine.teacher_force_logprobs(engine.pack([prompt], [[response]]), compute_rb=True, tf_batch_size=1)
            assert alone.token_logqs[0][0].shape == (seqs.gen_lens[b][g],)
            torch.testing.assert_close(alone.token_logqs[0][0], batched.token_logqs[b][g], rtol=0, atol=1e-5)
            torch.testing.assert_close(alone.logprobs[0][0], batched.logprobs[b][g], rtol=0, atol=1e-5)
            np.testing.assert_allclose(alone.rb_entropies[0][0], batched.rb_entropies[b][g], rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ overrides and the two paths
def test_zero_eta_override_is_bit_exact_and_shares_base_storage(peft, seqs):
    model, tok = peft
    engine = make_engine(model, tok)
    v = random_direction(model)
    mapping = engine.build_params_override(v, 0.0)
    live = dict(model.named_parameters())
    for name, tensor in mapping.items():
        if name in v:
            assert tensor.data_ptr() != live[name].data_ptr()         # θ + η·v is a new tensor
        else:
            assert tensor.data_ptr() == live[name].data_ptr()         # base weights are never copied
            assert not tensor.requires_grad
    batch = next(tf_batches(seqs, 6, engine.device))
    with torch.no_grad():
        # the live module itself, then θ + 0·v through functional_call
        base_logits = score.forward_logits(engine.policy, batch, None, engine.precision.tf_nograd)
        override_logits = score.forward_logits(engine.policy, batch, mapping, engine.precision.func_override)
    assert torch.equal(base_logits, override_logits)
    plain = engine.teacher_force_logprobs(seqs, compute_rb=True)
    via_override = engine.teacher_force_logprobs(seqs, compute_rb=True, params_override=mapping)
    for b in range(3):
        for g in range(2):
            assert torch.equal(plain.token_logqs[b][g], via_override.token_logqs[b][g])
            assert np.array_equal(plain.rb_entropies[b][g], via_override.rb_entropies[b][g])
    moved = engine.teacher_force_logprobs(seqs, compute_rb=True, params_override=engine.build_params_override(v, 1e-2))
    assert not torch.equal(moved.token_logqs[0][0], plain.token_logqs[0][0])
    assert all(torch.equal(p, live[n]) for n, p in model.named_parameters())  # live model untouched


def test_override_rejects_unknown_names_and_shapes(peft):
    model, tok = peft
    engine = make_engine(model, tok)
    name = lora_names(model)[0]
    with pytest.raises(ConfigError, match="unknown parameter 'lora_A_typo'"):
        engine.build_params_override({"lora_A_typo": torch.zeros(1)}, 1.0)
    with pytest.raises(ConfigError, match="has shape"):
        engine.build_params_override({name: torch.zeros(1)}, 1.0)


def test_with_grad_and_no_grad_paths_agree(peft, seqs):
    model, tok = peft
    engine = make_engine(model, tok)
    nograd = engine.teacher_force_logprobs(seqs, compute_rb=True)
    withgrad = engine.teacher_force_logprobs(seqs, with_grad=True, compute_rb=True, return_baseline_features=True)
    for b in range(3):
        for g in range(2):
            assert withgrad.token_logqs[b][g].requires_grad and withgrad.logprobs[b][g].requires_grad
            assert withgrad.rb_entropies_torch[b][g].requires_grad
            torch.testing.assert_close(withgrad.token_logqs[b][g].detach(), nograd.token_logqs[b][g], rtol=0, atol=1e-12)
            torch.testing.assert_close(withgrad.logprobs[b][g].detach(), nograd.logprobs[b][g], rtol=0, atol=1e-12)
            np.testing.assert_allclose(withgrad.rb_entropies_torch[b][g].detach().numpy(), nograd.rb_entropies[b][g],
                                       rtol=0, atol=1e-12)
            feats = withgrad.baseline_feats_torch[b][g]
            assert feats.shape == (seqs.gen_lens[b][g], 7) and not feats.requires_grad
            np.testing.assert_allclose(feats[:, 0].numpy(), nograd.rb_entropies[b][g], atol=1e-12)
    with pytest.raises(ValueError, match="with_grad"):
        engine.teacher_force_logprobs(seqs, with_grad=True, params_override={})


def _fp64_engine(fp64_model):
    model, tok = fp64_model
    return make_engine(model, tok, precision={"func_override": {"dtype": "float64"}, "entropy_fp64": True})


def _fd_totals(engine, seqs, v, eta):
    plus = engine.teacher_force_logprobs(seqs, compute_rb=True, params_override=engine.build_params_override(v, eta))
    minus = engine.teacher_force_logprobs(seqs, compute_rb=True, params_override=engine.build_params_override(v, -eta))
    return plus, minus


def test_rb_entropy_gradient_matches_central_difference(fp64_model, seqs):
    engine = _fp64_engine(fp64_model)
    model = fp64_model[0]
    v = random_direction(model, seed=3, scale=0.3)
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    names = lora_names(model)
    lp = engine.teacher_force_logprobs(seqs, with_grad=True, compute_rb=True)
    weights = torch.linspace(0.5, 1.5, 6, dtype=torch.float64)   # a generic combination of sequences
    total_h = sum(w * lp.rb_entropies_torch[b][g].sum() for w, (b, g) in zip(weights, [(b, g) for b in range(3) for g in range(2)]))
    grads = torch.autograd.grad(total_h, params)
    autograd_dir = sum(float((gr * v[n]).sum()) for gr, n in zip(grads, names))
    eta = 1e-5
    plus, minus = _fd_totals(engine, seqs, v, eta)
    fd = sum(float(w) * (plus.rb_entropies[b][g].sum() - minus.rb_entropies[b][g].sum()) / (2 * eta)
             for w, (b, g) in zip(weights, [(b, g) for b in range(3) for g in range(2)]))
    assert abs(autograd_dir) > 1e-3
    assert autograd_dir == pytest.approx(fd, rel=1e-6)


def test_jvp_directional_derivatives_match_central_difference(fp64_model, seqs):
    engine = _fp64_engine(fp64_model)
    v = random_direction(fp64_model[0], seed=4, scale=0.3)
    out = engine.teacher_force_directional(seqs, v, tf_batch_size=4)
    eta = 1e-5
    plus, minus = _fd_totals(engine, seqs, v, eta)
    base = engine.teacher_force_logprobs(seqs, compute_rb=True)
    for b in range(3):
        for g in range(2):
            d = out[b][g]
            assert all(d[k].dtype == torch.float64 and d[k].shape == (seqs.gen_lens[b][g],) for k in d)
            fd_logq = (plus.token_logqs[b][g] - minus.token_logqs[b][g]) / (2 * eta)
            fd_h = torch.from_numpy((plus.rb_entropies[b][g] - minus.rb_entropies[b][g]) / (2 * eta))
            torch.testing.assert_close(d["d_logq"], fd_logq, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(d["d_rb_entropy"], fd_h, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(d["logq"], base.token_logqs[b][g], rtol=0, atol=1e-12)


def test_jvp_matches_backward_pass_on_the_fp32_model(peft, seqs):
    """Forward mode (jvp) and reverse mode (autograd) give the same D_v Σ log q on the live fp32 model."""
    model, tok = peft
    engine = make_engine(model, tok)
    v = random_direction(model, seed=5)
    out = engine.teacher_force_directional(seqs, v)
    jvp_total = sum(float(out[b][g]["d_logq"].sum() + out[b][g]["d_rb_entropy"].sum()) for b in range(3) for g in range(2))
    lp = engine.teacher_force_logprobs(seqs, with_grad=True, compute_rb=True)
    total = sum(lp.token_logqs[b][g].sum() + lp.rb_entropies_torch[b][g].sum() for b in range(3) for g in range(2))
    names = lora_names(model)
    grads = torch.autograd.grad(total, [p for n, p in model.named_parameters() if p.requires_grad])
    backward_total = sum(float((gr.double() * v[n].double()).sum()) for gr, n in zip(grads, names))
    assert jvp_total == pytest.approx(backward_total, rel=1e-4)


# ------------------------------------------------------------------------------ precision profiles
def _values(lp):
    return torch.cat([t.detach().double().flatten() for row in lp.token_logqs for t in row])


@pytest.mark.parametrize("fp64", [True, False])
def test_entropy_fp64_sets_the_output_dtype_in_both_paths(peft, seqs, fp64):
    model, tok = peft
    engine = make_engine(model, tok, precision={"entropy_fp64": fp64})
    want = torch.float64 if fp64 else torch.float32
    for with_grad in (False, True):
        lp = engine.teacher_force_logprobs(seqs, with_grad=with_grad, compute_rb=True)
        assert lp.token_logqs[0][0].dtype == lp.logprobs[0][0].dtype == want


def test_autocast_profiles_are_honoured_by_their_own_path(peft, seqs):
    model, tok = peft
    ref_engine = make_engine(model, tok)
    ref = {wg: _values(ref_engine.teacher_force_logprobs(seqs, with_grad=wg)) for wg in (False, True)}
    bf16 = {"autocast": True, "dtype": "bfloat16"}
    for section, affected in (("tf_nograd", False), ("tf_withgrad", True)):
        engine = make_engine(model, tok, precision={section: bf16})
        for with_grad in (False, True):
            diff = (_values(engine.teacher_force_logprobs(seqs, with_grad=with_grad)) - ref[with_grad]).abs().max()
            assert (diff > 1e-4) == (with_grad == affected), (section, with_grad, float(diff))
    # func_override governs forwards under a params_override mapping
    engine = make_engine(model, tok, precision={"func_override": bf16})
    mapping = engine.build_params_override(random_direction(model), 0.0)
    diff = (_values(engine.teacher_force_logprobs(seqs, params_override=mapping)) - ref[False]).abs().max()
    assert diff > 1e-4
    assert torch.equal(_values(engine.teacher_force_logprobs(seqs)), ref[False])


# ------------------------------------------------------------------------------ errors
def test_non_finite_logits_name_batch_and_sequence(tiny_model_and_tokenizer, seqs):
    model, tok = tiny_model_and_tokenizer
    broken = copy.deepcopy(model)
    bad_token = next(t for t in range(len(tok)) if not (seqs.sequences == t).any())
    poisoned = copy.deepcopy(seqs)
    poisoned.sequences[1, 1, seqs.prompt_lens[1]] = bad_token        # row 3 = the 2nd row of batch 1
    with torch.no_grad():
        broken.model.embed_tokens.weight[bad_token] = float("nan")
    engine = make_engine(broken, tok)
    # (0 × NaN in attention poisons the whole row, so its first scored token is reported)
    with pytest.raises(NumericsError, match=r"batch 1, sequence b=1 g=1, token 0"):
        engine.teacher_force_logprobs(poisoned, tf_batch_size=2)
    with pytest.raises(NumericsError, match=r"batch 1, sequence b=1 g=1, token 0"):
        engine.teacher_force_logprobs(poisoned, tf_batch_size=2, with_grad=True)
    v = {"lm_head.weight": torch.ones_like(broken.lm_head.weight)}
    with pytest.raises(NumericsError, match=r"batch 1, sequence b=1 g=1, token 0"):
        engine.teacher_force_directional(poisoned, v, tf_batch_size=2)


def test_prompt_overflow_error_or_truncate(peft, caplog):
    model, tok = peft
    with pytest.raises(DataError, match=r"prompt 1 has \d+ tokens, more than generation.max_prompt_tokens=5"):
        make_engine(model, tok, max_prompt_tokens=5).generate_batched(["Hi", PROMPTS[1]], G=1, seed=0)
    engine = make_engine(model, tok, max_prompt_tokens=5, prompt_overflow="truncate")
    with caplog.at_level(logging.WARNING):
        out = engine.generate_batched(["Hi", PROMPTS[1]], G=1, seed=0)
    assert out.prompt_lens == [5, 5] and "keeping its last 5" in caplog.text
    assert out.sequences[1, 0, :5].tolist() == tok(PROMPTS[1])["input_ids"][-5:]


def test_config_errors():
    with pytest.raises(ConfigError, match="generation.top_pp"):
        parse_settings({"generation": {"top_pp": 0.9}})
    with pytest.raises(ConfigError, match="generation.top_p: must be in"):
        parse_settings({"generation": {"top_p": 1.5}})
    with pytest.raises(ConfigError, match="precision.entropy_fp6"):
        parse_settings({"precision": {"entropy_fp6": True}})


# ------------------------------------------------------------------------------ containers and RNG
def test_to_dict_round_trip_subset_and_weights_only_load(peft, seqs, tmp_path):
    from entropy_experiments.data.datasets import Example

    model, tok = peft
    full = copy.deepcopy(seqs)
    full.examples = [Example(question=p, answer=str(i), text=p, meta={"global_prompt_id": 10 + i}) for i, p in enumerate(PROMPTS)]
    full.prompt_ids = [10, 11, 12]
    torch.save(full.to_dict(), tmp_path / "batch.pt")
    back = BatchedSequences.from_dict(torch.load(tmp_path / "batch.pt", weights_only=True))
    assert torch.equal(back.sequences, full.sequences) and torch.equal(back.attention_masks, full.attention_masks)
    saved_examples = [dataclasses.asdict(ex) for ex in full.examples]   # records come back as the dicts saved
    assert (back.prompt_lens, back.gen_lens, back.responses_text, back.prompts, back.prompt_ids, back.examples) == \
        (full.prompt_lens, full.gen_lens, full.responses_text, full.prompts, full.prompt_ids, saved_examples)
    sub = full.subset([2, 0])
    assert sub.prompt_ids == [12, 10] and sub.examples[0].answer == "2" and sub.sequences.shape[2] == full.sequences.shape[2]
    engine = make_engine(model, tok)
    lp_full, lp_sub = engine.teacher_force_logprobs(full), engine.teacher_force_logprobs(sub, tf_batch_size=4)
    for i, b in enumerate([2, 0]):
        for g in range(2):
            torch.testing.assert_close(lp_sub.token_logqs[i][g], lp_full.token_logqs[b][g], rtol=0, atol=1e-5)


def test_generation_seed_is_reproducible_and_local(peft):
    model, tok = peft
    engine = make_engine(model, tok)
    state = torch.get_rng_state()
    a = engine.generate_batched(PROMPTS[:2], G=2, seed=7)
    assert torch.equal(torch.get_rng_state(), state)          # the caller's RNG is untouched
    b = engine.generate_batched(PROMPTS[:2], G=2, seed=7)
    c = engine.generate_batched(PROMPTS[:2], G=2, seed=8)
    assert torch.equal(a.sequences, b.sequences) and a.gen_lens == b.gen_lens
    assert not torch.equal(a.sequences, c.sequences) if a.sequences.shape == c.sequences.shape else True
