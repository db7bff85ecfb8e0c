"""Binding against the baselines; see meshbind/binding_bench.py.

python benches/binding.py --layers 2,61,1024 --world-size 2
"""

import sys

from meshbind.binding_bench import main

if __name__ == "__main__":
    sys.exit(main())
