"""The engine: one shared base model with an adapter per agent (`model`), our batched sampler
(`generation`), prompts and data sets (`data`), the toy model for tests (`tiny`) and the memory
plan (`plan`). Reward functions live beside it in `cory_lora.rewards`, the public plug-in point."""
