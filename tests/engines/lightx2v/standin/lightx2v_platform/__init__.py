"""Stand-in for ``lightx2v_platform`` (LightX2V f8aee98b): only what the adapter meets."""
