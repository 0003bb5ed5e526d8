"""What a run reports about itself as it trains: the metrics log, peak memory, and where a step's time goes."""
