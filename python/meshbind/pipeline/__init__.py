"""Pipeline parallelism over the ``pp`` axis: the stages split from the model index, torch's
schedules and what each needs, and the stages and schedule built by torch."""

from meshbind.pipeline.build import StagePart, pipeline_parts, pipeline_schedule, runnable_stage, stage_loss, stage_model
from meshbind.pipeline.schedules import SCHEDULES, Schedule, schedule_named
from meshbind.pipeline.stages import Pipeline, PipelineStages, split_stages, stages_text

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "PipelineStages",
    "Schedule",
    "StagePart",
    "pipeline_parts",
    "pipeline_schedule",
    "runnable_stage",
    "schedule_named",
    "split_stages",
    "stage_loss",
    "stage_model",
    "stages_text",
]
