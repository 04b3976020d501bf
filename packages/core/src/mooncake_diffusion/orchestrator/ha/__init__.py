"""High availability on etcd: the leader election and the service that follows the leader with
an etcd journal.
"""
