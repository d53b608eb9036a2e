"""`torchrun --nproc-per-node N -m asyncrl.learner --config R [overrides]`: the learner, one process per rank.

The one module of learner/ that imports launch/ (an exception docs/architecture.md §2 states): it is the entry
point torchrun runs, and only forwards to the CLI's `learner` command."""
import sys

from asyncrl.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(["learner", *sys.argv[1:]]))
