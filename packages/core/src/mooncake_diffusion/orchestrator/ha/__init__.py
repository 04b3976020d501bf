"""High availability on etcd: leader election and the service that follows the leader."""
