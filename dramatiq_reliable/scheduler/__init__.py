"""Scheduled jobs: schedules declared in code, stored in Postgres, each tick enqueued once through the outbox."""

from .loop import Scheduler, SchedulerPass, ScheduleTickSkipped, ScheduleTicksMissed, tick_message_id
from .policies import Plan, plan
from .registry import Registry, default_registry, schedule
from .spec import Schedule

__all__ = [
    "Plan",
    "Registry",
    "Schedule",
    "ScheduleTickSkipped",
    "ScheduleTicksMissed",
    "Scheduler",
    "SchedulerPass",
    "default_registry",
    "plan",
    "schedule",
    "tick_message_id",
]
