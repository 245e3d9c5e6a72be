"""A model's stages in order: what a step carries and returns, the Pipeline protocol the engine
drives (local.py: stages in this process; coordinator/: stages on workers), the plan that
splits a model's blocks over devices (plan.py), and a stage built from stored tensors
(loading.py), to which backends/ attaches its runners."""

from .local import LocalPipeline, Pipeline, PipelineError, Recoverable, Row, Step, StepResult, sample_rows

__all__ = ["LocalPipeline", "Pipeline", "PipelineError", "Recoverable", "Row", "Step", "StepResult", "sample_rows"]
