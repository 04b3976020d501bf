"""Stand-in for ``lightx2v_platform.base.global_var``: ``None`` until
``set_ai_device`` runs, as in LightX2V (modules that ``from ... import AI_DEVICE``
before that see ``None``)."""

AI_DEVICE = None
PLATFORM = None
