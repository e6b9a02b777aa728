"""`python -m cory_lora` is `cory-lora` (what torchrun launches: torchrun ... -m cory_lora run)."""

import sys

from cory_lora.cli import main

sys.exit(main())
