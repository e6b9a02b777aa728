"""What connects a run to other tools: experiment trackers (`trackers`) and export to merged
models and model cards (`export`)."""
