"""Plots training and validation loss of a run: see tools/plot_metrics.py or --help."""

from fathom.tools.plot_metrics import main

if __name__ == "__main__":
    main()
