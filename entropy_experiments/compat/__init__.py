"""The compatibility corner: the original (seed) API, all of its code, as thin façades over the core modules.

- `offline_entropy_probe.py`: OfflineEntropyProbe and `python -m entropy_experiments.offline_entropy_probe`;
- `probe_components.py`: ProbeComponents;
- `sequence_processor.py`: SequenceProcessor (seed 004) over `entropy_experiments.policy`;
- `model_loader.py`: the seed `model_loader` names.

The legacy import paths (`entropy_experiments.offline_entropy_probe`, `.probe_components`, `.model_loader`,
`.utils.sequence_processor`, the top-level `sequence_processing` package) re-export these modules. The seed config
keys are mapped in `entropy_experiments.config` (`LEGACY_KEYS`), since every config load needs them and core code
never imports compat/. Only the seed-API tests (tests/test_seed_*.py) use this corner.
"""
