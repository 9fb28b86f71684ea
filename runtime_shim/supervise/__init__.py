"""Supervision of the node daemon: start it (as a module), health-check it, stop it, wait for it."""
