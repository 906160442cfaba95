"""`ssm_steps` (the Mamba2 SSM keeping every state) against mlx-lm's `ssm_update`.

On the CPU `ssm_steps` runs its ops path; the CUDA and Metal kernels are checked against
the same references by benchmarks/ssm_steps.py on a GPU.

Tolerances. Both sides compute in float32 from the same dt and dt * A, but sum in different
orders (a recurrence here, exp(segment sums) times matrices in mlx-lm), so an error is a
few roundings of each term, relative to that term. `_magnitudes` bounds the sum of the
terms' absolute values: the recurrence run in float64 NumPy on |x|, |B|, |C|, |D|, |state|
(every decay and dt is positive). Then, per element:
- states: float32 throughout on both sides (mlx-lm promotes a bf16 B to float32 in its
  matmul): |error| <= 64 * eps(float32) * magnitude covers the <= 6 token sums, the <= 16
  products of a dot and exp(sum) against products of exps;
- y: as states, plus, for bf16 / f16 inputs, mlx-lm rounding C.B in the input dtype, then
  y_ssm, x * D and their sum, and our one final rounding: five roundings of at most
  eps / 2 each, so |error| <= 4 * eps(dtype) * magnitude.
Over 1500 random cases the largest error was 0.23 of its bound (bf16 y), 0.06 for states.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.ssm import ssm_update

from kvstate import ShapeError
from kvstate.adapters.kernels.ssm import ssm_steps

STATE_RTOL = 64 * float(np.finfo(np.float32).eps)


class Case(NamedTuple):
    x: mx.array
    A_log: mx.array
    B: mx.array
    C: mx.array
    D: mx.array
    dt: mx.array
    dt_bias: mx.array
    state: mx.array | None
    time_step_limit: tuple[float, float]
    mask: mx.array | None

    def prefix(self, n: int) -> Case:
        """The same call on tokens 0..n-1 only."""
        return self._replace(
            x=self.x[:, :n],
            B=self.B[:, :n],
            C=self.C[:, :n],
            dt=self.dt[:, :n],
            mask=None if self.mask is None else self.mask[:, :n],
        )


@st.composite
def cases(draw: Any) -> Case:
    """Random small Mamba2 SSM calls, as the mixers make them: bf16 or float32 activations,
    D in the activations' dtype (nemotron_h, granitemoehybrid) or float32 (mamba2), a
    left-padded mask or none, a state or None, both time step limits mlx-lm's models use."""
    b = draw(st.integers(1, 2))
    seq = draw(st.integers(1, 6))
    g = draw(st.integers(1, 2))
    h = g * draw(st.integers(1, 2))
    dh = draw(st.sampled_from([4, 8]))
    ds = draw(st.sampled_from([8, 16]))
    dtype = draw(st.sampled_from([mx.float32, mx.bfloat16]))
    d_dtype = draw(st.sampled_from([dtype, mx.float32]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def normal(*shape: int, dtype: mx.Dtype = dtype) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    state = normal(b, h, dh, ds, dtype=mx.float32) if draw(st.booleans()) else None
    mask = None
    if draw(st.booleans()):
        pads = draw(st.lists(st.integers(0, seq), min_size=b, max_size=b))
        mask = mx.array(np.arange(seq)[None, :] >= np.array(pads)[:, None])
    return Case(
        x=normal(b, seq, h, dh),
        A_log=mx.array(rng.uniform(-2.0, 1.5, h).astype(np.float32)),
        B=normal(b, seq, g, ds),
        C=normal(b, seq, g, ds),
        D=normal(h, dtype=d_dtype),
        dt=normal(b, seq, h),
        dt_bias=mx.array(rng.uniform(-2.0, 1.0, h).astype(np.float32)),
        state=state,
        time_step_limit=draw(st.sampled_from([(0.001, 100.0), (0.0, float("inf"))])),
        mask=mask,
    )


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def _magnitudes(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """(y, states) of the recurrence on absolute values, in float64: per element, the sum of
    the absolute values of the terms mlx-lm and ssm_steps add up (see the module docstring)."""
    x, B, C = np.abs(_np(case.x)), np.abs(_np(case.B)), np.abs(_np(case.C))
    b, seq, h, dh = x.shape
    ds = B.shape[-1]
    raw = _np(case.dt) + _np(case.dt_bias)
    dt = np.clip(np.logaddexp(0.0, raw), *case.time_step_limit)
    keep = np.ones((b, seq)) if case.mask is None else np.array(case.mask, dtype=np.float64)
    dt = dt * keep[..., None]
    decay = np.exp(dt * -np.exp(_np(case.A_log)))
    repeat = h // B.shape[2]
    B, C = np.repeat(B, repeat, axis=2), np.repeat(C, repeat, axis=2)
    state = np.zeros((b, h, dh, ds)) if case.state is None else np.abs(_np(case.state))
    states = np.empty((b, seq, h, dh, ds))
    for t in range(seq):
        inject = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        state = decay[:, t, :, None, None] * state + inject
        states[:, t] = state
    y = np.einsum("blhdn,blhn->blhd", states, C) + x * np.abs(_np(case.D))[:, None]
    return y, states


def _assert_close(name: str, got: mx.array, want: mx.array, magnitude: np.ndarray, rtol: float):
    error = np.abs(_np(got) - _np(want))
    bound = rtol * magnitude
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert np.all(error <= bound), (
        f"{name}: |error| {error[worst]:.3g} > {rtol:.3g} * magnitude {magnitude[worst]:.3g} "
        f"at {worst}"
    )


EPS = {mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10}  # spacing of the numbers just above 1


def _y_rtol(dtype: mx.Dtype) -> float:
    return 4 * EPS[dtype] if dtype in EPS else STATE_RTOL


@given(cases())
def test_y_and_final_state_equal_ssm_update(case: Case) -> None:
    y, states = ssm_steps(*case)
    want_y, want_state = ssm_update(*case)
    assert y.shape == case.x.shape and y.dtype == case.x.dtype
    assert states.shape == (*case.x.shape, case.B.shape[-1]) and states.dtype == mx.float32
    magnitude_y, magnitude_states = _magnitudes(case)
    _assert_close("y", y, want_y, magnitude_y, _y_rtol(case.x.dtype))
    _assert_close("states[:, -1]", states[:, -1], want_state, magnitude_states[:, -1], STATE_RTOL)


@given(cases())
def test_every_state_is_the_final_state_of_its_prefix(case: Case) -> None:
    _, states = ssm_steps(*case)
    _, magnitude = _magnitudes(case)
    for t in range(case.x.shape[1]):
        _, want = ssm_update(*case.prefix(t + 1))
        _assert_close(f"states[:, {t}]", states[:, t], want, magnitude[:, t], STATE_RTOL)


def test_mismatched_shapes_are_all_reported() -> None:
    x = mx.zeros((1, 3, 4, 8))
    B = mx.zeros((1, 3, 3, 16))  # 3 groups do not divide 4 heads
    with pytest.raises(ShapeError) as info:
        ssm_steps(
            x,
            mx.zeros(4),
            B,
            mx.zeros((1, 2, 3, 16)),
            mx.zeros(4),
            mx.zeros((1, 3, 4)),
            mx.zeros(5),
            None,
            (0.0, 1.0),
            mx.ones((1, 2), dtype=mx.bool_),
        )
    message = str(info.value)
    for part in ("C (1, 2, 3, 16)", "dt_bias (5,)", "mask (1, 2)", "H=4 is not a multiple of G=3"):
        assert part in message
