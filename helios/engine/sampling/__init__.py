"""Token sampling: the `Sampler` (`sampler.py`, the numerics contract in its docstring) and its parts.

- `rows.py`: `SamplingRow` (one row's parameters and tokens), `RowParams` (the vectorised path's
  per-row tensors), `RowMasks` (a step's grammar masks), `StopMasks` (the stops min_tokens masks);
- `logprobs.py`: logprob records and prompt scores from the raw logits;
- `penalties.py`: logit bias and repetition, frequency and presence penalties;
- `filters.py`: top-k, top-p and min-p;
- `draw.py`: greedy picks, inverse-CDF draws, and the generators and uniforms they consume;
- `tensors.py`: the row-selection and host-to-device helpers they share.
"""

from helios.engine.sampling.draw import consume_uniforms, draws_uniform
from helios.engine.sampling.logprobs import (
    MAX_LOGPROB_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    NONFINITE_LOGPROB,
    PromptScore,
    prompt_logprobs,
    prompt_scores,
)
from helios.engine.sampling.penalties import apply_penalties
from helios.engine.sampling.rows import RowParams, SamplingRow, row_log_min_p, row_temperature
from helios.engine.sampling.sampler import Sampler

__all__ = [
    "MAX_LOGPROB_TOKEN_IDS",
    "MAX_TOP_LOGPROBS",
    "NONFINITE_LOGPROB",
    "PromptScore",
    "RowParams",
    "Sampler",
    "SamplingRow",
    "apply_penalties",
    "consume_uniforms",
    "draws_uniform",
    "prompt_logprobs",
    "prompt_scores",
    "row_log_min_p",
    "row_temperature",
]
