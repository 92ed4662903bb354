"""Memory plan checked by the compiler: bytes per device of the speculative cycle or a TTT training step.

    python -m infer.plan --config llama3.3-70b-eagle3 --mesh tensor=8 --batch 8 --max-len 4096 [--tpu v6e-8]
    python -m infer.plan --train --config llama3.3-70b-eagle3 --mesh fsdp=8 --batch 8 --max-len 1024 --bf16

See `cli.plan` for the flags and what the numbers mean.
"""

import sys

from cli import plan

if __name__ == "__main__":
    sys.exit(plan.main())
