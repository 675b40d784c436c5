"""Triggers: what starts runs besides `enqueue`. Each kind lives in its own module, with its
decorator, its registry and the controller duty that keeps it."""
