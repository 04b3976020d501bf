"""The host around the library: settings, deployment, ELF, etcd, child processes, bind shim."""
