"""The HTTP store service: FastAPI in front of any store backend (see docs/service.md)."""
