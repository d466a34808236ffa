"""The quantized bidirectional (Vision Mamba "v2") mixer, in every SSM mode of quamba.layers.modes.

QMambaMixer's in_proj and out_proj, shared by two SSM branches: the forward one ("") over the
sequence and the backward one ("_b", its own conv1d, x_proj, dt_proj, A, D and activation scales)
over the sequence reversed:

    h (int8) ─ in_proj W8A8 → x, z (int8) ─┬─ branch ""  (qconv1d → x_proj → dt_proj → QSScan) → y
                                            └─ reversed → branch "_b" → reversed → y_b
    (y + y_b) / 2 (fp16) ─ Hadamard + quantize → int8 ─ out_proj → fp16 out
"""
from __future__ import annotations

from quamba.errors import QuambaError
from quamba.layers.qmixer import QMambaMixer, suffixed

BACKWARD = "_b"
BRANCH_SCALES = ("u_scale", "xdbl_scale", "dt_scale")
# Activation scales of a bidirectional mixer (no SSM state scale: it keeps no state).
BI_ACTIVATION_SCALES = ("xz_scale", *BRANCH_SCALES,
                        *(suffixed(name, BACKWARD) for name in BRANCH_SCALES), "y_scale")


class QBiMambaMixer(QMambaMixer):
    """Quantized BiMambaMixer (bimamba "v2"); ``forward(h, **kwargs)`` as the FP one: no decode
    step, no cache, other keyword arguments accepted and ignored."""

    def __init__(self, d_model: int, d_inner: int, d_state: int, d_conv: int, dt_rank: int,
                 scales: dict[str, float], h_scale: float, hadamard: bool, out_dtype,
                 device=None, weight_bits: int = 8, group_size: int = 128, divide_out: bool = True):
        super().__init__(d_model, d_inner, d_state, d_conv, dt_rank, scales, h_scale, hadamard,
                         out_dtype, device, weight_bits, group_size)
        self.divide_out = divide_out
        self._add_branch(BACKWARD, scales, device)

    @classmethod
    def from_float(cls, mixer, h_scale: float, scales: dict[str, float], hadamard: bool,
                   weight_bits: int = 8, group_size: int = 128):
        """Quantize an FP BiMambaMixer (bimamba "v2", already rotated if ``hadamard``)."""
        if mixer.bimamba != "v2":
            raise QuambaError(f"only bimamba 'v2' mixers (shared in_proj and out_proj) can be "
                              f"quantized, not {mixer.bimamba!r}")
        weight = mixer.in_proj.weight
        q = cls(weight.shape[1], mixer.d_inner, mixer.d_state, mixer.d_conv, mixer.dt_rank, scales,
                h_scale, hadamard, weight.dtype, weight.device, weight_bits, group_size,
                mixer.divide_out)
        for name in ("in_proj", "out_proj"):
            getattr(q, name).load_float_weight(getattr(mixer, name).weight)
        q._load_branch("", mixer.conv1d, mixer.x_proj, mixer.dt_proj, mixer.A_log, mixer.D)
        q._load_branch(BACKWARD, *mixer.backward_branch())
        for module in q.modules():
            module.refresh_scales()
        return q

    def allocate_state(self, batch_size: int, device=None):
        raise QuambaError("a bidirectional Mamba mixer keeps no decode state")

    def forward(self, h, state=None, step: bool = False, inference_params=None, **kwargs):
        if step or state is not None or inference_params is not None:
            raise QuambaError("a bidirectional Mamba mixer reads the whole sequence: it has no decode "
                              "step and no cache (got step, state or inference_params)")
        x, z = self._in_proj_prefill(h)
        branch = self._branch_simulated if self.simulate else self._branch
        y = branch(x, z, "")[0]
        y_b = branch(x.flip(-1), z.flip(-1), BACKWARD)[0].flip(-1)
        y = y + y_b
        if self.divide_out:
            y = y / 2
        y = y.transpose(1, 2)
        self._tap("y", y)
        return self._out(y)
