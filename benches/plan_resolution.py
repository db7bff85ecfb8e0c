"""Plan resolution against the baselines; see meshbind/bench.py (also run by ``meshbind bench``).

    python benches/plan_resolution.py --sizes 8x16,61x256,61x1024,1M --plans deep,shallow,per_layer,globstar,typo,moe \
        --json bench-results/plan_resolution.json --plot docs/plan_resolution.png --readme README.md
"""

import sys

from meshbind.bench import main

if __name__ == "__main__":
    sys.exit(main())
