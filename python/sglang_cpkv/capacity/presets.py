"""The planner's named inputs: models (a ``config.json`` each, package data) and GPUs (vendor figures).

Models (``models/<name>/config.json``): ``glm-5.1-fp8`` (the GLM-5 DSA config of the test fixtures with an FP8
``quantization_config``; assumed: GLM-5.1 keeps GLM-5's architecture) and ``deepseek-v3.2`` (its public card),
each with its published parameter count for the weights estimate. GPUs: HBM capacity and bandwidth, NVLink
bandwidth per GPU per direction (NVIDIA's data sheets); the planner's times at these peaks are lower bounds. Used by
:mod:`.planner`, :mod:`.cli` and the launcher's dry-run (:mod:`sglang_cpkv.pd_launch.startup_check`). Sources and
assumptions: ``docs/operations.md``, "The capacity planner".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODELS_DIR = Path(__file__).with_name("models")


@dataclass(frozen=True)
class ModelPreset:
    name: str
    parameters: float  # total parameters, for the weights-per-GPU estimate
    source: str

    @property
    def model_dir(self) -> str:
        return str(MODELS_DIR / self.name)


MODELS = {
    "glm-5.1-fp8": ModelPreset(
        "glm-5.1-fp8", 744e9, "GLM-5 DSA config of the test fixtures + FP8 quantization (GLM-5.1 assumed equal)"
    ),
    "deepseek-v3.2": ModelPreset("deepseek-v3.2", 685e9, "DeepSeek-V3.2 public model card values, FP8"),
}


@dataclass(frozen=True)
class GpuPreset:
    """One GPU's vendor figures.

    Attributes:
        hbm_bytes: HBM capacity. hbm_bandwidth: HBM bytes/s. link_bandwidth: NVLink bytes/s per direction.
        capability: the CUDA compute capability upstream's resolution sees.
    """

    name: str
    hbm_bytes: float
    hbm_bandwidth: float
    link_bandwidth: float
    capability: tuple[int, int]
    source: str


GPUS = {
    "h200": GpuPreset("h200", 141e9, 4.8e12, 450e9, (9, 0), "H200 SXM: 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s"),
    "b200": GpuPreset(
        "b200", 180e9, 8e12, 900e9, (10, 0), "B200: 192 GB HBM3e nominal (180 GB usable), 8 TB/s, NVLink5 1.8 TB/s"
    ),
    "b300": GpuPreset("b300", 288e9, 8e12, 900e9, (10, 3), "B300: 288 GB HBM3e, 8 TB/s, NVLink5 1.8 TB/s"),
}
