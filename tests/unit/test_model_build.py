"""The model is made in its own dtype (common/engine/runner.py `build_model`): made in float32
and converted after its weights were loaded, a bfloat16 model needed twice its size on the
GPU to load. Its RoPE tables stay float32, as before."""

from __future__ import annotations

import dataclasses

import torch

from pdserve.common.engine.runner import build_model
from pdserve.common.model.config import load_model_config, resolve_model


def test_parameters_are_made_in_the_model_s_dtype_and_rope_in_float32():
    cfg = dataclasses.replace(load_model_config(resolve_model(None)), num_layers=2)
    meta = build_model(cfg, 64, torch.device("meta"), torch.bfloat16)  # a GPU's stand-in
    assert {p.dtype for p in meta.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored
    made = build_model(cfg, 64, torch.device("cpu"), torch.bfloat16)
    before = build_model(cfg, 64, torch.device("cpu"), torch.float32)
    for name in ("cos", "sin"):
        table = getattr(made.rotary, name)
        assert table.dtype == torch.float32
        assert torch.equal(table, getattr(before.rotary, name))
