"""Issue 6 at unit level: out-of-memory halving, per-chunk seeds and saved generation chunks,
non-finite values named by phase / batch / sequence, and result-changing warnings in results.json."""

from __future__ import annotations

import logging

import pytest
import torch

from entropy_experiments.data.rewards.weighted import RewardSet
from entropy_experiments.errors import DeviceError, NumericsError
from entropy_experiments.estimators.entropy_gradient import E_BACKWARD
from entropy_experiments.estimators.sequence_scores import E_SCORING
from entropy_experiments.policy.engine import PolicyEngine
from entropy_experiments.policy.generate import chunk_seed
from entropy_experiments.policy.generation_config import parse_settings
from entropy_experiments.probe.sampling import BatchDraw, SamplingSpec, prompt_examples, sample_batch
from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts

PROMPTS = ["User: Tom has 3 apples", "Hi", "What is 2 + 2?"]


# One intra-op thread for the whole module (runs here are compared number for number).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_sp(model, tok, **generation) -> PolicyEngine:
    return PolicyEngine(model, tok, parse_settings({"generation": {"max_new_tokens": 6, "gen_batch_size": 4,
                                                                   "tf_batch_size": 4, **generation}}))


def oom(*_args, **_kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


def _same(a, b) -> bool:
    return torch.equal(a.sequences, b.sequences) and a.gen_lens == b.gen_lens


# ------------------------------------------------------------------------------- out of memory

def test_generation_oom_halves_rows_down_to_what_fits(tiny_peft_model_and_tokenizer, caplog, monkeypatch):
    model, tok = tiny_peft_model_and_tokenizer
    sp = make_sp(model, tok)
    real, sizes = sp._generate_chunk, []

    def fits_two(ids, mask, prompt_index, **kw):
        sizes.append(len(prompt_index))
        return oom() if len(prompt_index) > 2 else real(ids, mask, prompt_index, **kw)

    monkeypatch.setattr(sp, "_generate_chunk", fits_two)
    with caplog.at_level(logging.WARNING):
        out = sp.generate_batched(PROMPTS, G=2, seed=0, seed_per_chunk=True)
    assert out.num_prompts == 3 and out.num_responses_per_prompt == 2
    assert sizes == [4, 2, 2, 2], sizes  # chunk 0: 4 rows fail, then 2 + 2; chunk 1 starts at the new limit
    assert "out of memory during generation (chunk 0, rows 0-3) at 4 rows per forward; retrying with 2" \
        in caplog.text
    # a retried chunk restarts from its own seed: an OOM that strikes after the failed attempt has
    # drawn random numbers gives the same batch as one that strikes before
    def fails_late(ids, mask, prompt_index, **kw):
        rows = real(ids, mask, prompt_index, **kw)
        return oom() if len(prompt_index) > 2 else rows

    monkeypatch.setattr(sp, "_generate_chunk", fails_late)
    assert _same(out, sp.generate_batched(PROMPTS, G=2, seed=0, seed_per_chunk=True))


def test_generation_oom_at_one_row_is_a_clear_device_error(tiny_peft_model_and_tokenizer, monkeypatch):
    model, tok = tiny_peft_model_and_tokenizer
    sp = make_sp(model, tok)
    monkeypatch.setattr(sp, "_generate_chunk", oom)
    with pytest.raises(DeviceError) as info:
        sp.generate_batched(PROMPTS, G=2, seed=0)
    message = str(info.value)
    assert message.startswith("out of memory during generation (chunk 0, rows 0-3) at 1 row(s) per forward")
    assert "generation.max_new_tokens" in message and "\n" not in message


def test_teacher_forcing_oom_halves_and_gives_the_same_numbers(tiny_peft_model_and_tokenizer, caplog, monkeypatch):
    model, tok = tiny_peft_model_and_tokenizer
    sp = make_sp(model, tok)
    seqs = sp.generate_batched(PROMPTS, G=2, seed=1)
    want = sp.teacher_force_logprobs(seqs, compute_rb=True)
    real = sp._forward_logits
    monkeypatch.setattr(sp, "_forward_logits",
                        lambda batch, *a: oom() if len(batch.pairs) > 1 else real(batch, *a))
    with caplog.at_level(logging.WARNING):
        got = sp.teacher_force_logprobs(seqs, compute_rb=True, phase=E_SCORING)
        got_grad = sp.teacher_force_logprobs(seqs, with_grad=True, compute_rb=True, phase=E_BACKWARD)
    assert "out of memory during teacher forcing (E scoring) (batch 0) at 4 rows per forward; retrying with 2" \
        in caplog.text
    assert "retrying with 1" in caplog.text
    # fp32 forwards of 4, 2 and 1 rows pad and add differently: 3.9e-6 apart on torch's scalar kernels
    # (ATEN_CPU_CAPABILITY=default); a dropped or misaligned row moves a log-prob by O(1)
    for b in range(3):
        for g in range(2):
            torch.testing.assert_close(got.token_logqs[b][g], want.token_logqs[b][g], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(torch.as_tensor(got.rb_entropies[b][g]),
                                       torch.as_tensor(want.rb_entropies[b][g]), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_grad.token_logqs[b][g].detach(), want.token_logqs[b][g],
                                       rtol=1e-5, atol=1e-5)


def test_teacher_forcing_oom_that_cannot_split_names_the_phase(tiny_peft_model_and_tokenizer, monkeypatch):
    model, tok = tiny_peft_model_and_tokenizer
    sp = make_sp(model, tok)
    seqs = sp.generate_batched(PROMPTS, G=2, seed=1)
    monkeypatch.setattr(sp, "_forward_logits", oom)
    with pytest.raises(DeviceError, match=r"^out of memory during teacher forcing \(E scoring\) \(batch 0\) at "
                                          r"1 row\(s\) per forward"):
        sp.teacher_force_logprobs(seqs, compute_rb=True, phase=E_SCORING)
    # the E backward needs each microbatch in one forward (row hooks): no split, a pointer to the knob
    with pytest.raises(DeviceError, match=r"with grad \(E backward\).*lower estimator\.microbatch_size"):
        sp.teacher_force_logprobs(seqs, with_grad=True, compute_rb=True, tf_batch_size=6, phase=E_BACKWARD)


# ------------------------------------------------------------------------------- chunk seeds, saved chunks

def test_chunks_are_seeded_on_their_own_and_saved_chunks_are_reused(tiny_peft_model_and_tokenizer, monkeypatch):
    model, tok = tiny_peft_model_and_tokenizer
    sp = make_sp(model, tok, gen_batch_size=2)
    saved = {}
    full = sp.generate_batched(PROMPTS, G=2, seed=9, seed_per_chunk=True,
                               on_chunk=lambda i, rows: saved.__setitem__(i, rows))
    assert sorted(saved) == [0, 1, 2]
    assert chunk_seed(9, 0) == 9 and len({chunk_seed(9, i) for i in range(50)}) == 50
    # chunk 0 of a per-chunk call is exactly the plain seeded call's first chunk
    assert _same(sp.generate_batched(PROMPTS[:1], G=2, seed=9), sp.generate_batched(PROMPTS[:1], G=2, seed=9,
                                                                                     seed_per_chunk=True))
    # a "killed" run saved chunks 0 and 2: only chunk 1 is generated again, and the batch is identical
    calls = []
    real = sp._generate_chunk
    monkeypatch.setattr(sp, "_generate_chunk", lambda *a, **k: calls.append(1) or real(*a, **k))
    resumed = sp.generate_batched(PROMPTS, G=2, seed=9, seed_per_chunk=True,
                                  done_chunks={0: saved[0], 2: saved[2]})
    assert len(calls) == 1 and _same(resumed, full)


def test_chunk_store_round_trip(tmp_path):
    from entropy_experiments.report.run_dir import GenerationChunkStore, RunDirectory

    run = RunDirectory.prepare(tmp_path / "run", "seed: 1\n", "h", overwrite=False, resume=False)
    store = GenerationChunkStore(run)
    done, save = store.open({"seed": 1, "prompts": [[1, 2]]})
    assert done == {}
    save(0, [[5, 6], [7]])
    save(1, [[8]])
    assert store.open({"seed": 1, "prompts": [[1, 2]]})[0] == {0: [[5, 6], [7]], 1: [[8]]}
    assert store.open({"seed": 2, "prompts": [[1, 2]]})[0] == {}, "chunks of another call are never reused"
    assert run.has_partial_chunks()
    store.clear()
    assert not run.has_partial_chunks()


# ------------------------------------------------------------------------------- non-finite values

@pytest.fixture
def data(tmp_path):
    return write_prompts(tmp_path / "prompts.jsonl", SHORT_PROMPTS)


@pytest.mark.e2e
def test_non_finite_in_generation_names_chunk_and_sequence(tiny_model_dir, data):
    probe = make_probe(tiny_model_dir, data, {"batch_config": {"B_E": 2, "B_U": 2}})
    with torch.no_grad():
        probe.model.get_base_model().lm_head.weight[5, 0] = float("nan")
    with pytest.raises(NumericsError) as info:
        probe.run()
    assert str(info.value) == "non-finite logits in generation: chunk 0, sequence b=0 g=0, token 0"


@pytest.mark.e2e
def test_non_finite_in_the_u_gradient_names_phase_batch_and_sequence(tiny_model_dir, data):
    probe = make_probe(tiny_model_dir, data, {"batch_config": {"B_E": 2, "B_U": 2}})
    sp, examples = probe.engine, prompt_examples(probe.config.batch_config)
    spec = SamplingSpec.choose(sp)
    E = sample_batch(spec, examples, BatchDraw([0, 1], 1, 1))
    U = sample_batch(spec, examples, BatchDraw([2, 3], 2, 2, RewardSet.resolve([probe.config.reward.name])))
    lora_A = next(p for n, p in probe.model.named_parameters() if "lora_A" in n)
    with torch.no_grad():
        lora_A[0, 0] = float("inf")
    with pytest.raises(NumericsError, match=r"^non-finite logits in teacher forcing with grad \(U gradient\): "
                                            r"batch 0, sequence b=\d+ g=\d+, token \d+$"):
        probe.run(batches=(E, U))


@pytest.mark.e2e
def test_non_finite_in_delta_h_scoring_names_the_phase(tiny_model_dir, data, monkeypatch):
    probe = make_probe(tiny_model_dir, data, {"batch_config": {"B_E": 2, "B_U": 2}})
    real = PolicyEngine.build_params_override

    def poisoned(self, v_named, eta):
        mapping = real(self, v_named, eta)
        name = next(n for n in mapping if n.endswith("lm_head.weight"))
        mapping[name] = mapping[name].clone()
        mapping[name][:, 0] = float("nan")
        return mapping

    monkeypatch.setattr(PolicyEngine, "build_params_override", poisoned)
    with pytest.raises(NumericsError, match=r"^non-finite logits in teacher forcing at θ \+ η·v \(ΔH\(η\) scoring\): "
                                            r"batch 0, sequence b=0 g=0, token 0$"):
        probe.run()


# ------------------------------------------------------------------------------- warnings in results.json

@pytest.mark.e2e
def test_result_changing_warnings_reach_results_json(tiny_model_dir, tmp_path):
    """No gold answers → zero rewards → all-zero advantages; no optimizer.pt + allow_fresh_optimizer.
    All three are in results.json `warnings`, and a resumed run keeps them."""
    import json

    from entropy_experiments.config import config_from_dict
    from entropy_experiments.probe.runner import run_probe
    from tests.run_helpers import base_config, make_run_setup

    _, config = make_run_setup(tmp_path / "setup", tiny_model_dir)
    no_gold = tmp_path / "no_gold.jsonl"
    no_gold.write_text("".join(json.dumps({"question": p}) + "\n" for p in SHORT_PROMPTS))
    config = base_config(tiny_model_dir, no_gold, reward={"name": "tag_pref"},
                         checkpoint={"checkpoint_path": config["checkpoint"]["checkpoint_path"],
                                     "optimizer_path": str(tmp_path / "missing" / "optimizer.pt"),
                                     "allow_fresh_optimizer": True})
    cfg = config_from_dict(config)
    out = tmp_path / "run"
    first = run_probe(cfg, out=str(out))
    stored = json.loads((out / "results.json").read_text())["warnings"]
    assert stored == first["warnings"]
    text = " | ".join(stored)
    assert "FRESH OPTIMIZER" in text and "optimizer.pt" in text
    assert "every U prompt has all-zero advantages" in text
    assert "no gold answer" in text
    resumed = run_probe(cfg, resume=str(out))
    assert resumed["warnings"] == stored
