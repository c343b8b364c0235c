"""Shared pytest setup: hypothesis profiles.

"ci" (the default under CI=true) uses a fixed seed (derandomize) and bounded examples so the
whole suite stays well inside CI time on 2 cores; "dev" explores more; pick with
HYPOTHESIS_PROFILE=dev.
"""
import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, max_examples=25, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=100, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
