"""`torchrun --nproc-per-node N -m asyncrl.learner --config R [overrides]`: the learner, one process per rank."""
import sys

from asyncrl.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(["learner", *sys.argv[1:]]))
