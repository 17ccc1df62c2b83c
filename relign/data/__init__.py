"""Read records, normalize formats, chat templates and loss masks, collation and packing."""

from .readers import DataError, read_records

__all__ = ["DataError", "read_records"]
