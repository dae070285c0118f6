"""A run's outputs: the run directory, the results.json schema, the console summary and the ΔH(η) plot.

    run_dir.py          RunDirectory (files, saved batches, update vector, partial state) and GenerationChunkStore
    results_schema.py   REQUIRED_SCHEMA, validate_results_schema, strict JSON, load_results
    summary.py          render_summary / print_summary
    plot.py             plot_delta_h

Atomic writes live in `entropy_experiments.io_utils` (shared with checkpoints).
"""
