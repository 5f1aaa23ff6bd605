"""Scheduled jobs: schedules declared in code, stored in Postgres, each tick enqueued once through the outbox."""

from .admin import ScheduleStatus, list_schedules, pause_schedule, resume_schedule, trigger_schedule
from .loop import (
    Scheduler,
    SchedulerClock,
    SchedulerPass,
    ScheduleTickSkipped,
    ScheduleTicksMissed,
    tick_message_id,
)
from .policies import Plan, plan
from .registry import Registry, default_registry, schedule
from .runs import ScheduleRuns
from .spec import Schedule
from .worker import WorkerScheduler

__all__ = [
    "Plan",
    "Registry",
    "Schedule",
    "ScheduleRuns",
    "ScheduleStatus",
    "ScheduleTickSkipped",
    "ScheduleTicksMissed",
    "Scheduler",
    "SchedulerClock",
    "SchedulerPass",
    "WorkerScheduler",
    "default_registry",
    "list_schedules",
    "pause_schedule",
    "plan",
    "resume_schedule",
    "schedule",
    "tick_message_id",
    "trigger_schedule",
]
