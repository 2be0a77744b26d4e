"""The model creator's sampling defaults: what a request that does not set them samples with, as vLLM's
`--generation-config` gives them.

"auto" (the default) reads the model folder's generation_config.json, a folder path reads that folder's, and
"vllm" keeps the neutral defaults (temperature 1, no top-k/p); `--override-generation-config` overrides any of
them. Only the values a file sets away from transformers' own defaults count (GenerationConfig.to_diff_dict),
and of those only the sampling fields vLLM takes from it; its max_new_tokens is the default max_tokens and caps
a request's. A request or SamplingParams that sets a field keeps its own value."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("jaxpaged.engine")

# generation_config.json's fields that set a sampling default (vLLM's list); max_new_tokens is max_tokens here
FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def check_generation_config(generation_config: str, override: dict[str, Any] | None) -> None:
    """EngineArgs' check, before anything starts: a clear error for a bad value."""
    if generation_config not in ("auto", "vllm") and not Path(generation_config).is_dir():
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding a generation_config.json, "
                         f"got {generation_config!r}")
    if override is not None and not isinstance(override, dict):
        raise ValueError(f"override_generation_config must be a dict of fields, got {override!r}")
    unknown = sorted(set(override or {}) - set(FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown fields {unknown}; it takes {list(FIELDS)}")


def default_sampling_fields(model_path: str, generation_config: str = "auto",
                            override: dict[str, Any] | None = None) -> dict[str, Any]:
    """{SamplingParams field: value} for the fields the model's generation config sets."""
    if generation_config == "vllm":
        config: dict[str, Any] = {}
    else:
        config = _diff_dict(model_path if generation_config == "auto" else generation_config)
    config.update(override or {})
    fields = {k: config[k] for k in FIELDS if config.get(k) is not None}
    if "max_new_tokens" in fields:
        fields["max_tokens"] = fields.pop("max_new_tokens")
    if fields:
        logger.warning("Default sampling parameters have been overridden by the model's generation config (%s), as "
                       "its creator recommends; relaunch with `--generation-config vllm` if this is not intended.",
                       ", ".join(f"{k}={v}" for k, v in fields.items()))
    return fields


def _diff_dict(folder: str) -> dict[str, Any]:
    """The folder's generation_config.json as GenerationConfig.to_diff_dict gives it; {} without one."""
    from transformers import GenerationConfig
    try:
        return GenerationConfig.from_pretrained(folder).to_diff_dict()
    except OSError:           # no generation_config.json there
        return {}
