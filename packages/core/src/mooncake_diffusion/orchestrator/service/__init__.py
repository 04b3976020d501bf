"""The running service: driver, worker channel, journal, stalls, status, metrics, bridge."""
