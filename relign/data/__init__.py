"""Read records, normalize formats, chat templates and loss masks, collation and packing."""

from .readers import DataError, read_records
from .stats import DataStats, describe

__all__ = ["DataError", "DataStats", "describe", "read_records"]
