import sys

from opsd.experiment.commands import main

sys.exit(main())
