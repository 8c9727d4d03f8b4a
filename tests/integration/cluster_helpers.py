"""The names test modules imported from here before the helpers moved to `support`.

Kept for modules not yet switched to `support.cluster` and `support.waiting`; new code
imports from there.
"""

from support.cluster import Cluster
from support.waiting import wait_for

__all__ = ["Cluster", "wait_for"]
