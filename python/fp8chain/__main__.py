import sys

from fp8chain.cli import main

sys.exit(main())
