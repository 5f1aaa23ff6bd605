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
from .status import BatchStatus, batch_status
from .workflow import WORKFLOW_OPTION, Group, Workflow, Workflows

__all__ = [
    "BATCH_OPTION",
    "WORKFLOW_OPTION",
    "Batch",
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
    "cancel_workflow",
    "list_workflows",
    "workflow_status",
]
