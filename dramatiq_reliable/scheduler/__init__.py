"""Scheduled jobs: schedules declared in code, stored in Postgres, each tick enqueued once through the outbox."""

from .loop import Scheduler, SchedulerPass, ScheduleTickSkipped, ScheduleTicksMissed, tick_message_id
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
    "ScheduleTickSkipped",
    "ScheduleTicksMissed",
    "Scheduler",
    "SchedulerPass",
    "WorkerScheduler",
    "default_registry",
    "plan",
    "schedule",
    "tick_message_id",
]
