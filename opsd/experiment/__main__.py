import sys

from opsd.errors import printing
from opsd.experiment.commands import main

sys.exit(printing(main))  # a closed stdout (`--print-commands | head -1`) is a normal end
