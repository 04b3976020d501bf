"""The typed, versioned wire schema (msgspec) and the classes a keyed handoff carries by type
tag.
"""
