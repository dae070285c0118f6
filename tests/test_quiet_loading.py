"""Loading a model prints the probe's output only: no weight-loading bars, no FutureWarning that peft
raises by reading transformers' deprecated `is_gradient_checkpointing` (library_noise.quiet_library_loading)."""

from __future__ import annotations

import warnings

from transformers.utils import logging as hf_logging

from entropy_experiments.checkpoint.adapter import create_lora_model


def test_loading_is_quiet_and_restores_the_progress_bar_setting(tiny_model_dir, capfd):
    capfd.readouterr()
    assert hf_logging.is_progress_bar_enabled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = create_lora_model(str(tiny_model_dir), r=4, alpha=8, dropout=0.0, dtype="fp32", device_map="cpu",
                                  seed=0)
    assert any(p.requires_grad for p in model.parameters())
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # the user's setting is back


def test_other_warnings_still_pass(tiny_model_dir):
    from entropy_experiments.library_noise import quiet_library_loading

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_library_loading():
            warnings.warn("something the user must see", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something the user must see"]


def test_a_dependency_compiled_for_the_first_time_does_not_warn():
    from entropy_experiments.library_noise import quiet_source_compilation

    source = 'def f(memoize):\n    return memoize is "recursive"\n'  # cellpylib's pattern
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        compile(source, "dependency.py", "exec")
        with quiet_source_compilation(), warnings.catch_warnings(record=True) as inside:
            compile(source, "dependency.py", "exec")
    assert [w.category for w in outside] == [SyntaxWarning]  # the control: compiling does warn
    assert inside == []
