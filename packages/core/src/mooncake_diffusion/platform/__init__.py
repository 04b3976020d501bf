"""The process and host around the library: settings, deployment checks, ELF probes, etcd,
child processes and the bind shim.
"""
