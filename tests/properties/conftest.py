"""Hypothesis settings for the property tests: modest in `make test`, many more under `make reliability`.

``HYPOTHESIS_PROFILE=reliability`` selects the long profile. No example database is written (the
tests must not leave files in the checkout), and no deadline: a loaded CI machine is not a bug.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=30, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("reliability", max_examples=500, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
