"""layergc: the store's garbage collector (docs/gc.md). The folder is `gc/`; it is imported as
`layergc` (a package named `gc` would shadow CPython's built-in module)."""

from .collector import RunLost, collect
from .report import Report, last_report
from .retention import RetentionPolicy, parse_duration

__all__ = ["Report", "RetentionPolicy", "RunLost", "collect", "last_report", "parse_duration"]
