"""What the service and its workers both speak: the wire, the leader's address, the inbox."""
