"""`entropy-probe` command line: run, sweep, demo, make-checkpoint, report, config.

Every user mistake ends as ONE line on stderr and exit code 2 (a `ProbeError`); bugs keep their traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .config import load_config, packaged_config_path
from .errors import ConfigError, ProbeError
from .library_noise import quiet_bitsandbytes_kernels_notice
from .make_checkpoint.synthetic import synthetic_base_dir, with_synthetic_base
from .make_checkpoint.trained import DEMO_CHECKPOINT_STEPS, ensure_demo_checkpoint, make_checkpoint
from .models.synthetic import SYNTHETIC_SPECS
from .probe.lifecycle import interruptible
from .probe.runner import run_probe
from .probe.what_if import parse_request, what_if_text
from .report.html_report import write_html_report
from .report.plot import plot_delta_h
from .report.results_schema import load_results
from .report.summary import print_summary
from .sweep import run_sweep
from .sweep.sweep_dir import SweepDirectory
from .threads import add_threads_option, apply_threads

log = logging.getLogger("entropy_experiments")


def setup_logging(verbose: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("entropy_experiments")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False
    for noisy in ("transformers", "peft", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    quiet_bitsandbytes_kernels_notice()


# What to do after an interrupt (SIGTERM / SIGINT), by command; a dry run writes nothing, so it has nothing to resume.
RESUME_HINTS = {"run": "finish a run with --resume RUN_DIR", "demo": "finish a run with --resume RUN_DIR",
                "sweep": "finish a sweep with --resume SWEEP_DIR"}
DRYRUN_INTERRUPTED = "a dry run writes nothing, so there is nothing to resume: start it again"


def interrupt_hint(command: str, dryrun: bool = False) -> str | None:
    """The line printed after an interrupted `command` (None: the interrupt alone)."""
    return DRYRUN_INTERRUPTED if dryrun else RESUME_HINTS.get(command)


def run_with_clean_errors(fn: Callable[[], object], on_interrupt: str | None = RESUME_HINTS["run"]) -> int:
    """Call fn; a ProbeError becomes `error: <one line>` on stderr and its exit code (2); an interrupt prints
    `on_interrupt` (what to do next) and exits 128 + signal."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with interruptible():  # SIGTERM / SIGINT: the run is marked failed (resumable), exit 128 + signal
            fn()
        return 0
    except ProbeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        print(f"{exc or 'interrupted'}" + (f"; {on_interrupt}" if on_interrupt else ""), file=sys.stderr)
        return getattr(exc, "exit_code", 130)


def _load(args) -> object:
    return load_config(getattr(args, "config", None), getattr(args, "set", None) or [])


def cmd_run(args) -> None:
    if args.resume and args.out and Path(args.resume) != Path(args.out):
        raise ConfigError("--resume and --out name different directories; pass only --resume RUN_DIR")
    if args.reuse_samples and args.resume:
        raise ConfigError("--reuse-samples starts a new run directory (--out); it cannot be combined with --resume")
    if args.config is None:
        if not args.resume:
            raise ConfigError("run needs --config FILE (or --resume RUN_DIR to finish a run with its saved config)")
        args.config = str(Path(args.resume) / "config.yaml")  # the resolved config the run directory holds
    config = _load(args)
    what_if = parse_request(config, args.what_if, args.solve, args.solve_target)
    run_probe(config, out=args.out, resume=args.resume, overwrite=args.overwrite, dryrun=args.dryrun,
              reuse_samples=args.reuse_samples, what_if=what_if)


def cmd_sweep(args) -> None:
    if args.resume and args.out and Path(args.resume) != Path(args.out):
        raise ConfigError("--resume and --out name different directories; pass only --resume SWEEP_DIR")
    meta = {}
    if args.resume:
        meta = SweepDirectory(Path(args.resume)).read_meta()
        if meta is None:
            raise ConfigError(f"--resume {args.resume}: nothing to resume (no sweep_meta.json there)")
    if args.config is None:
        if not args.resume:
            raise ConfigError("sweep needs --config FILE (or --resume SWEEP_DIR to finish a sweep with its config)")
        args.config = str(Path(args.resume) / "config.yaml")
    checkpoints = args.checkpoints or meta.get("checkpoints_dir")
    if checkpoints is None:
        raise ConfigError("sweep needs --checkpoints DIR (the directory holding checkpoint-N/ or step_N/)")
    every = args.every if args.every is not None else int(meta.get("every", 1))
    run_sweep(_load(args), checkpoints, out=args.out, resume=args.resume, every=every)


def cmd_make_checkpoint(args) -> None:
    config = _load(args)
    if args.synthetic:  # a random model of a real architecture as the base (make_checkpoint/synthetic.py)
        config = with_synthetic_base(config, synthetic_base_dir(args.out, args.synthetic, seed=config.seed))
    make_checkpoint(args.out, config, steps=args.steps, save_every=args.save_every)


def cmd_demo(args) -> None:
    """Embedded default end to end: cached make-checkpoint, then the probe with the shipped demo config."""
    config = load_config(packaged_config_path("demo"), args.set or [])
    ckpt = ensure_demo_checkpoint(config, DEMO_CHECKPOINT_STEPS if args.steps is None else args.steps)
    # The probe recognises the make-checkpoint layout (model/ + optimizer.pt + names) under checkpoint_path.
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={
        "checkpoint_path": str(ckpt)})})
    out = args.out or str(Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    run_probe(config, out=out, overwrite=args.overwrite)


def cmd_report(args) -> None:
    results = load_results(args.run_dir)
    print_summary(results)
    if results.get("what_if_baseline") is not None:
        print(what_if_text(results))
    run_dir = Path(args.run_dir)
    run_dir = run_dir.parent if run_dir.is_file() else run_dir
    plot_delta_h(results, run_dir / "delta_h_vs_eta.png")
    log.info("report: %s", write_html_report(run_dir))


def cmd_config(args) -> None:
    """Print a config shipped with the package, comments included (`--path`: where it is installed)."""
    path = packaged_config_path(args.name)
    sys.stdout.write(f"{path}\n" if args.path else path.read_text(encoding="utf-8"))


def add_config_command(sub) -> None:
    """`entropy-probe config [default|demo] [--show | --path]`."""
    config = sub.add_parser("config", help="print the default config: every key, its default and what it does")
    config.add_argument("name", nargs="?", default="default", help="default (every key) or demo (the demo's)")
    shown = config.add_mutually_exclusive_group()
    shown.add_argument("--show", action="store_true", help="print the file with its comments (what it does anyway)")
    shown.add_argument("--path", action="store_true", help="print where the file is installed instead")
    config.set_defaults(func=cmd_config)


def add_what_if_arguments(run: argparse.ArgumentParser) -> None:
    """`run --what-if … --solve … --solve-target …` (probe/what_if.py)."""
    run.add_argument("--what-if", action="append", metavar="objective.<key>=<value>", help="also δH₁ of the objective "
                     "with KEY=VALUE on the same E and U, and its paired difference from the run's (repeatable)")
    run.add_argument("--solve", metavar="objective.<key>", help="the value of a coefficient (objective.entropy_coef) "
                     "at which δH₁ reaches --solve-target, with the interval of its ± SE band")
    run.add_argument("--solve-target", type=float, default=None, metavar="X", help="δH₁ for --solve (default 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="entropy-probe", description=(
        "Offline entropy probe: predicted (δH₁) vs measured (ΔH) entropy change of one AdamW step."))
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the probe on a config file")
    run.add_argument("--config", help="probe config YAML (default with --resume: RUN_DIR/config.yaml)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    run.add_argument("--out", help="run directory (default: output.run_dir or runs/<timestamp>)")
    run.add_argument("--resume", metavar="RUN_DIR", help="finish a run directory, reusing its saved batches")
    run.add_argument("--overwrite", action="store_true", help="replace a run directory that holds another config")
    run.add_argument("--dryrun", action="store_true", help="minimal sizes, print the summary, write nothing")
    run.add_argument("--reuse-samples", metavar="RUN_DIR", help="analyse RUN_DIR's saved E/U samples with this "
                     "config's analysis settings, in a new run directory (sampling settings must match)")
    add_what_if_arguments(run)
    run.set_defaults(func=cmd_run)

    sweep = sub.add_parser("sweep", help="probe every checkpoint of a training run; sweep.json + plots")
    sweep.add_argument("--config", help="probe config YAML (default with --resume: SWEEP_DIR/config.yaml)")
    sweep.add_argument("--checkpoints", metavar="DIR",
                       help="directory holding the run's checkpoint-N/ (Trainer) or step_N/ directories")
    sweep.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    sweep.add_argument("--out", help="sweep directory (default: runs/sweep-<timestamp>)")
    sweep.add_argument("--every", type=int, default=None, metavar="K",
                       help="probe every K-th checkpoint in step order, and the last (default 1)")
    sweep.add_argument("--resume", metavar="SWEEP_DIR", help="finish a sweep, keeping the checkpoints it finished")
    sweep.set_defaults(func=cmd_sweep)

    demo = sub.add_parser("demo", help="the embedded default model end to end")
    demo.add_argument("--out")
    demo.add_argument("--steps", type=int, default=None,
                      help=f"Dr-GRPO steps for the cached demo checkpoint (default: {DEMO_CHECKPOINT_STEPS})")
    demo.add_argument("--set", action="append", metavar="KEY=VALUE")
    demo.add_argument("--overwrite", action="store_true")
    demo.set_defaults(func=cmd_demo)

    mk = sub.add_parser("make-checkpoint", help="create a LoRA adapter + AdamW state with N Dr-GRPO steps")
    mk.add_argument("--out", required=True)
    mk.add_argument("--steps", type=int, default=2)
    mk.add_argument("--save-every", type=int, default=None, metavar="K",
                    help="write OUT/step_K, step_2K, … and the last step instead of one checkpoint in OUT")
    mk.add_argument("--config")
    mk.add_argument("--set", action="append", metavar="KEY=VALUE")
    mk.add_argument("--synthetic", metavar="NAME", choices=sorted(SYNTHETIC_SPECS),
                    help="base model: random weights in the published architecture of NAME, built in OUT/"
                         "synthetic_base (" + ", ".join(sorted(SYNTHETIC_SPECS)) + ")")
    mk.set_defaults(func=cmd_make_checkpoint)

    report = sub.add_parser("report", help="re-render the summary, plot and report.html from RUN_DIR")
    report.add_argument("run_dir")
    report.set_defaults(func=cmd_report)

    add_config_command(sub)
    for command in (run, sweep, demo, mk):
        add_threads_option(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed its usage line; return its code like every other error
        return int(exc.code or 0)
    setup_logging(args.verbose)
    if hasattr(args, "threads"):
        apply_threads(args.threads)
    return run_with_clean_errors(lambda: args.func(args),
                                 on_interrupt=interrupt_hint(args.command, getattr(args, "dryrun", False)))


if __name__ == "__main__":
    sys.exit(main())
