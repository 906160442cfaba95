"""Hypothesis profiles, chosen by HYPOTHESIS_PROFILE:

- ci (default): derandomized, no example database, 60 examples (state machines: 60 runs of
  up to 20 steps); the whole directory runs in about 2.5 minutes on 2 cores.
- dev: random, with the local example database, a few more examples.
- soak: 1000 examples, 40 steps per run; tens of minutes. Run it after changing a kind.
"""

import os

from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "ci",
    max_examples=60,
    stateful_step_count=20,
    derandomize=True,
    database=None,
    # no "explain" phase: on a failing state machine it can take minutes
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "soak",
    max_examples=1000,
    stateful_step_count=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
