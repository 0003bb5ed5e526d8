"""What keeps a long run safe and observed: the hang watchdog, signals, non-finite losses, peak memory,
the metrics log and where a step's time goes."""
