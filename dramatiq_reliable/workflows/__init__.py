"""Workflows whose steps commit with the jobs' own writes: batches with a completion callback, chains and groups."""

from __future__ import annotations

from .batch import BATCH_OPTION, Batch, Batches
from .state import (
    WorkflowCancel,
    WorkflowStatus,
    WorkflowStep,
    WorkflowSummary,
    cancel_workflow,
    list_workflows,
    workflow_status,
)
from .status import BatchCancel, BatchStatus, batch_status, cancel_batch
from .workflow import WORKFLOW_OPTION, Group, Workflow, Workflows

__all__ = [
    "BATCH_OPTION",
    "WORKFLOW_OPTION",
    "Batch",
    "BatchCancel",
    "BatchStatus",
    "Batches",
    "Group",
    "Workflow",
    "WorkflowCancel",
    "WorkflowStatus",
    "WorkflowStep",
    "WorkflowSummary",
    "Workflows",
    "batch_status",
    "cancel_batch",
    "cancel_workflow",
    "list_workflows",
    "workflow_status",
]
