"""Workflows whose steps commit with the jobs' own writes: batches with a completion callback."""

from __future__ import annotations

from .batch import BATCH_OPTION, Batch, Batches
from .status import BatchStatus, batch_status

__all__ = ["BATCH_OPTION", "Batch", "BatchStatus", "Batches", "batch_status"]
