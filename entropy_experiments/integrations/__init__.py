"""The probe inside other tools' training loops (TRL's GRPOTrainer: `trl_callback.EntropyProbeCallback`).

Import the callback from its module: `from entropy_experiments.integrations.trl_callback import
EntropyProbeCallback` (it needs transformers' TrainerCallback and, at construction, trl).
"""
