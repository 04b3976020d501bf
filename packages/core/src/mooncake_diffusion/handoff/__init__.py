"""Key-addressed handoff for engine adapters (keyed, mailbox, direct), the store inventory, and
the handoff demo command.
"""
