import sys

from opsd.experiment.cli import main

sys.exit(main())
