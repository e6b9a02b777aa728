"""The run: the training loop (`train`), checkpoints and resume (`checkpoint`, `resume`), signals
(`interrupts`), the in-training held-out evaluator (`heldout`) and the run directory (`outputs`)."""
