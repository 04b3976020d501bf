"""What the service and its workers both speak: the wire schema, finding the leader, and the
inbox that wakes a loop.
"""
