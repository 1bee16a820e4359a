"""python -m grpo_kernels.compile_check --arch N [--quick] [--verbose] [--report] [--jobs J]"""

import sys

from .check import main

if __name__ == "__main__":
    sys.exit(main())
