"""The run: the training loop (`train`), checkpoints and resume (`checkpoint`, `resume`), signals
(`interrupts`), the in-training held-out evaluator (`heldout`) and the run directory: its layout
and owner (`rundir`), its lock (`lock`), atomic writes (`atomic`) and its record files
(`records`)."""
