"""Fused q/k/v and gate/up GEMMs: the startup check grades the toggle on the device in use, and on this
device the tokens follow the grade (R0 -> bitwise-equal states)."""

from __future__ import annotations

import torch

from looptrace.engine import SamplingParams
from looptrace.engine.projections import fused_gemm_is_exact
from tests.helpers import Recorder, build_engine


def run(fused: bool):
    rec = Recorder(hidden=True)
    engine = build_engine("ouro-tiny", observers=(rec,), kernels__fused_projections=fused)
    out = engine.generate([[5, 9, 13, 7, 21], [40, 41, 42]], SamplingParams(max_tokens=5))
    return engine, out, rec.states


def test_fused_projections_are_graded_by_the_startup_check_and_keep_checkpoint_names():
    plain, plain_out, plain_states = run(False)
    fused, fused_out, fused_states = run(True)
    grade = fused.checked_rungs["kernels.fused_projections"]
    assert grade == ("R0" if fused_gemm_is_exact(fused.spec, fused.device, fused.dtype) else "R3")
    assert plain.checked_rungs == {}
    assert fused.model.state_dict().keys() == plain.model.state_dict().keys()
    attn = fused.model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv.data_ptr()  # views of the fused weight
    if grade == "R0":
        assert fused_out == plain_out
        assert all(torch.equal(fused_states[k], plain_states[k]) for k in plain_states)
    else:
        torch.testing.assert_close(
            torch.stack(list(fused_states.values())), torch.stack(list(plain_states.values()))
        )
