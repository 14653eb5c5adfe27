"""The planner's named inputs: models (a ``config.json`` each, package data) and GPUs (vendor figures).

Models (``models/<name>/config.json``, the fields upstream's ``ModelConfig`` and the DSA pool sizing read):

* ``glm-5.1-fp8``: the GLM-5 DSA config of the test fixtures (``test/registered/upstream/fixtures/glm5_dsa``,
  the one the existing GLM-5.1-FP8 reservation figures used: 78 layers, kv_lora_rank 512 + qk_rope_head_dim 64,
  index_head_dim 128, index_topk 2048, max_position_embeddings 202752) with an FP8 ``quantization_config``
  (e4m3, 128 x 128 weight blocks). Assumed: GLM-5.1 keeps GLM-5's architecture and sizes (not checked against
  the published card here: nothing is downloaded). Weights: 744e9 parameters (GLM-5's published total).
* ``deepseek-v3.2``: DeepSeek-V3.2's public card values (61 layers, kv_lora_rank 512, qk_rope_head_dim 64,
  index_head_dim 128, index_n_heads 64, index_topk 2048, max_position_embeddings 163840; the rest as
  ``testing/dsa_kit.DSA_CONFIG``), one MTP layer, FP8 weights. Weights: 685e9 parameters (671e9 + the 14e9 MTP
  module, the card's total).

Weights per GPU are estimated as one byte per parameter (FP8 weights; the block scales add 1/4096) over the
tensor-parallel width: an estimate, overridable (``--weights-gib``).

GPUs: vendor figures (NVIDIA's data sheets): HBM capacity and bandwidth, NVLink bandwidth per GPU (the per
direction half of the bidirectional figure is what one all-gather receives at). The planner's times are lower
bounds at these peaks; measured copies reach less (the H200 of ``benchmark/results/2026-12-01-h200-serving-path/``: 4211 GB/s for a plain
device copy, 88% of 4.8 TB/s).
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
