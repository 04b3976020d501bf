"""The wire schema (typed, versioned msgspec) and the classes a handoff carries by type tag."""
