"""The command line (`cory-lora ...`, `python -m cory_lora`): commands in `commands`, the rich
display in `console`."""

from cory_lora.cli.commands import app, main
from cory_lora.config import describe_keys

__all__ = ["app", "describe_keys", "main"]
