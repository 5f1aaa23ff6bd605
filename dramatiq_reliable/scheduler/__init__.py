"""Scheduled jobs: schedules declared in code, stored in Postgres, each tick enqueued once through the outbox."""

from .policies import Plan, plan
from .registry import Registry, default_registry, schedule
from .spec import Schedule

__all__ = ["Plan", "Registry", "Schedule", "default_registry", "plan", "schedule"]
