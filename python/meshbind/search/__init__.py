"""``meshbind plan``: every layout of a cluster, refused by check's rules or traced and priced as
check traces and prices it, ranked by tokens per second per GPU."""

from meshbind.search.result import Candidate, LayoutSearch
from meshbind.search.search import plan_layouts
from meshbind.search.space import Choices, Layout

__all__ = ["Candidate", "Choices", "Layout", "LayoutSearch", "plan_layouts"]
