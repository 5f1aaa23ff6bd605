"""Scheduled jobs: schedules declared in code, stored in Postgres, each tick enqueued once through the outbox."""

from .admin import ScheduleStatus, list_schedules, pause_schedule, resume_schedule, trigger_schedule
from .loop import Scheduler, SchedulerPass, ScheduleTickSkipped, ScheduleTicksMissed, tick_message_id
from .policies import Plan, plan
from .registry import Registry, default_registry, schedule
from .spec import Schedule

__all__ = [
    "Plan",
    "Registry",
    "Schedule",
    "ScheduleStatus",
    "ScheduleTickSkipped",
    "ScheduleTicksMissed",
    "Scheduler",
    "SchedulerPass",
    "default_registry",
    "list_schedules",
    "pause_schedule",
    "plan",
    "resume_schedule",
    "schedule",
    "tick_message_id",
    "trigger_schedule",
]
