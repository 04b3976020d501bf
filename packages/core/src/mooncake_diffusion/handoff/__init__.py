"""Key-addressed handoff for engine adapters (keyed, mailbox, direct), inventory, handoff demo."""
