"""`python -m cory_lora.cli` is `cory-lora`."""

import sys

from cory_lora.cli.commands import main

sys.exit(main())
