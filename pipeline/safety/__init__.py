"""What keeps a long run safe: the hang watchdog, signals that stop it cleanly, and the guard against
non-finite losses."""
