"""Flow control in Postgres: rate limits per key that learn from a provider's 429s."""

from .middleware import RateLimitPaused, RateLimitPostponed, RateLimits
from .rate_limit import KeyState, RateLimit, limited_keys

__all__ = ["KeyState", "RateLimit", "RateLimitPaused", "RateLimitPostponed", "RateLimits", "limited_keys"]
