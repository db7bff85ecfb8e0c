"""What each rank will hold under a resolved plan, before any weight exists (``plan_report``).

Everything comes from the model's parameters (on ``meta`` or anywhere) and the plan's named
placements; no process group is needed. Resolution refuses uneven shards (balanced
layouts), so a parameter's local shape is the same on every rank: each dimension divided by the
product of the sizes of the axes that shard it. Under FSDP (``plan.fsdp``) every rank
allocates the same padded chunk of that local tensor's dim 0. Every rank of the world therefore
holds the same bytes: the report keeps ranks alike as one group, so a world of 10^11 ranks costs
what one of 8 does, and gives any rank's row (its coordinates, which is what a launch script
names) on demand.
"""

from meshbind.report.build import PlanReport, plan_report
from meshbind.report.rows import ParameterRow, RankGroup, RankRow, RankRows, WholeGroup

__all__ = ["ParameterRow", "PlanReport", "RankGroup", "RankRow", "RankRows", "WholeGroup", "plan_report"]
