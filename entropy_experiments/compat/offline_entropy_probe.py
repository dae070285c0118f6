"""OfflineEntropyProbe (the seeds' API) — a thin façade over `entropy_experiments.probe.recipe`.

It keeps the seeds' entry points (`from_config_file`, `run_mixed_probe`, `load`, `_ensure_sequence_processor`,
`_sample_EU_via_sequence_processor`, `_pack_E_from_sequences`, `_pack_U_from_sequences`) and the attributes
the seeds read (`model`, `tokenizer`, `optimizer`, `_sequence_processor`, `update_vector`, `index_plan`,
`warnings`, `checkpoint_info`), each filled from the typed results of the recipe's phases, and the seeds' command line
`python -m entropy_experiments.offline_entropy_probe --config FILE [--dryrun]` (`main`). New code calls
`entropy_experiments.recipe.run(config)` (or `entropy-probe run`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from ..cli import interrupt_hint, run_with_clean_errors
from ..config import ProbeConfig, config_from_dict, load_config
from ..data.batch import Batch
from ..estimators.objective_gradient import Trainable
from ..estimators.objectives import batch_advantages
from ..probe import recipe
from ..probe.runner import run_probe
from .sequence_processor import SequenceProcessor

__all__ = ["OfflineEntropyProbe", "main"]

log = logging.getLogger("entropy_experiments.probe")


class OfflineEntropyProbe:
    """Loads the checkpoint, samples E and U, and runs the probe phases (`probe.recipe`)."""

    def __init__(self, config: ProbeConfig | dict, logger: logging.Logger | None = None, *,
                 dist=None):
        self.config = config if isinstance(config, ProbeConfig) else config_from_dict(config)
        self.logger = logger or log
        self.dist = dist  # this process's place in a torchrun job; None: recipe.process_context at the first run
        self.notes = recipe.WarningLog(self.logger)
        self.model = None  # the seeds may set model, tokenizer and optimizer themselves instead of load()
        self.tokenizer = None
        self.optimizer = None
        self._sequence_processor = None
        self.checkpoint_info: dict | None = None  # layout, files, base model, lr source (load())
        self.index_plan = None  # the IndexPlan of the last fresh sampling
        self.update_vector = None  # v of the last run, keyed by parameter name

    @classmethod
    def from_config_file(cls, path: str | Path, overrides: list[str] | None = None) -> OfflineEntropyProbe:
        return cls(load_config(path, overrides))

    @property
    def warnings(self) -> list[str]:
        return self.notes.messages

    def _ensure_dist(self):
        if self.dist is None:
            self.dist = recipe.process_context(self.config)
        return self.dist

    def _ensure_sequence_processor(self) -> SequenceProcessor:
        if self._sequence_processor is None:
            self._sequence_processor = SequenceProcessor(self.model, self.tokenizer, logger=self.logger,
                                                         config=self.config.sequence_processor_settings())
        return self._sequence_processor

    def _policy(self) -> recipe.Policy | None:
        """The loaded (or seed-assigned) model, optimizer and SequenceProcessor; None before either."""
        if self.model is None:
            return None
        return recipe.Policy(self._ensure_sequence_processor(), Trainable.of(self.model), self.optimizer,
                            self.tokenizer, self.checkpoint_info)

    def _adopt(self, policy: recipe.Policy) -> None:
        self.model, self.tokenizer, self.optimizer = policy.trainable.model, policy.tokenizer, policy.optimizer
        self._sequence_processor, self.checkpoint_info = policy.engine, policy.checkpoint_info

    def _use_checkpoint(self, checkpoint_path: str | None) -> None:
        if checkpoint_path is not None:
            ck = self.config.checkpoint.model_copy(update={"checkpoint_path": checkpoint_path, "adapter_path": None,
                                                           "optimizer_path": None})
            self.config = self.config.model_copy(update={"checkpoint": ck})

    # ------------------------------------------------------------------ the seeds' entry points
    def load(self, checkpoint_path: str | None = None) -> None:
        """Load model, tokenizer, optimizer and engine (`recipe.load_phase`); a `checkpoint_path` given here
        replaces the config's, and its layout decides every file."""
        self._use_checkpoint(checkpoint_path)
        self._adopt(recipe.load_phase(self.config, self._ensure_dist(), self.notes, self.logger))

    def _pack_E_from_sequences(self, seqs) -> dict:
        return Batch.pack(seqs, None).to_dict()

    def _pack_U_from_sequences(self, seqs, rewards: list[list[float]]) -> dict:
        return Batch.pack(seqs, rewards, batch_advantages(rewards)).to_dict()

    def _sample_EU_via_sequence_processor(self, *, B_E: int, B_U: int, G_U: int) -> tuple[dict, dict]:
        """E: B_E prompts with replacement × 1 (or distinct × G); U: B_U distinct prompts × G."""
        bc = self.config.batch_config.model_copy(update={"B_E": B_E, "B_U": B_U, "G": G_U})
        config = self.config.model_copy(update={"batch_config": bc})
        samples = recipe.sample_phase(config, self._ensure_sequence_processor(), self._ensure_dist(), self.logger)
        self.index_plan = samples.plan
        return samples.E.to_dict(), samples.U.to_dict()

    def run_mixed_probe(self, checkpoint_path: str | None = None, *, batches: tuple[dict, dict] | None = None,
                        on_batches=None) -> dict[str, Any]:
        """Every phase (`recipe.run`); returns the results dict (docs/outputs.md "results.json").

        `batches` = (E, U) reuses saved batch dicts (resume); `on_batches(E, U)` gets the batch dicts right
        after sampling so that the caller can save them before the long phases start.
        """
        if self.model is None:
            self._use_checkpoint(checkpoint_path)  # recipe.run loads it (and times the load)
        typed = None if batches is None else (Batch.from_dict(batches[0], "E_batch"), Batch.from_dict(batches[1], "U_batch"))
        as_dicts = None if on_batches is None else (lambda E, U: on_batches(E.to_dict(), U.to_dict()))
        outcome = recipe.run(self.config, dist=self._ensure_dist(), policy=self._policy(), batches=typed,
                            on_batches=as_dicts, notes=self.notes, logger=self.logger)
        self._adopt(outcome.policy)
        self.update_vector = outcome.update_vector
        if outcome.plan is not None:
            self.index_plan = outcome.plan
        return outcome.results


def main(argv: list[str] | None = None) -> int:
    """`python -m entropy_experiments.offline_entropy_probe --config FILE [--dryrun]` (the seeds' command line)."""
    parser = argparse.ArgumentParser(prog="python -m entropy_experiments.offline_entropy_probe",
                                     description="Run the offline entropy probe on a config file.")
    parser.add_argument("--config", required=True)
    parser.add_argument("--dryrun", action="store_true", help="minimal sizes, print the summary, write nothing")
    args = parser.parse_args(argv)
    return run_with_clean_errors(lambda: run_probe(load_config(args.config), dryrun=args.dryrun),
                                 on_interrupt=interrupt_hint("run", args.dryrun))
