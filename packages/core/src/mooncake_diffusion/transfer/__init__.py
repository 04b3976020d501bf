"""A stage's outputs moved: the connector, its transports, chunks, staging, side channel, leases."""
