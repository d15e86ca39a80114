"""Top-level pytest configuration: markers live in pyproject.toml, Hypothesis profiles here."""
import os

from hypothesis import HealthCheck, settings

# `ci`: reproducible and cheap enough for 2 CPU cores; `thorough`: nightly, many more examples.
settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, max_examples=25)
settings.register_profile(
    "thorough", deadline=None, max_examples=500,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
