"""The experiments behind the measured numbers of docs/ (docs/measurements.md lists every result file), each run
from the repository root as a module:

    python -m experiments.NAME [options]        # e.g. python -m experiments.bench_loss --quick

``experiments.common`` holds what they share: step timing, equal-time training, and results written with their
provenance to experiments/results/NAME.json.
"""
