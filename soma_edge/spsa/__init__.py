"""The estimator: SPSA from forward passes only, regenerated from keys and replayable bit for bit.

- `noise`: keyed directions (`noise`, `noise_bits`, `probe_mask`, rank-1 `rank1_factors`) and the tables a
  device expands them with;
- `optim`: the schedule (`schedule`, `decoder_lr`), optimizer state (`OptState`, `State`), the update every
  step and replay runs (`apply_update`), the plateau rule;
- `stepper`: one step (`Stepper`, `Objective`, `Probes`, `StepResult`, `Population`);
- `log`: update logs (`UpdateLog`, `record_log`, `replay`);
- `quant`: a float32 change as int8 codes (the delta-rule decoder in a log).

Depends on the basics only.
"""
