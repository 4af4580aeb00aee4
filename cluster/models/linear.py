"""One projection weight of our forward pass, applied as ``x @ W (+ add)``.

Owns: the weight's storage and the kernel that applies it. Float32 weights on CPU are packed for
the skinny-GEMM kernel (``cluster.kernels.skinny_gemm``: the weight is streamed once per call
whatever the row count, so verifying K+1 tokens costs little more than decoding one, and a row's
result does not depend on the batch). Other dtypes/devices, or a machine without the kernel,
keep the plain [in, out] tensor and use ``torch.addmm``. A weight whose values are all bfloat16
(``narrow_copy``: an EAGLE head, stored in bfloat16) also keeps a bfloat16 packing that calls of
at most ``NARROW_ROWS`` rows stream instead: half the bytes, the same result bit for bit (the
kernel widens each weight exactly and sums in the same order); more rows (a head's catch-up over
a prompt) are compute-bound and stay on float32 tiles, which need no widening.
Ignores: what the projection means (``cluster.models.llama``).
"""
from __future__ import annotations

import torch

from cluster.kernels import skinny_gemm


NARROW_ROWS = 8  # calls of at most this many rows use a bfloat16 packing where there is one


class Linear:
    __slots__ = ("in_features", "out_features", "dtype", "_packed", "_plain", "_narrow")

    def __init__(self, w_in_out: torch.Tensor, narrow_copy: bool = False) -> None:  # [in, out]
        assert w_in_out.dim() == 2, "a projection weight is 2-D [in, out]"
        self.in_features, self.out_features = (int(s) for s in w_in_out.shape)
        self.dtype = w_in_out.dtype
        packable = w_in_out.dtype == torch.float32 and w_in_out.device.type == "cpu"
        if packable and skinny_gemm.available():
            self._packed: torch.Tensor | None = skinny_gemm.pack(w_in_out.contiguous())  # [T, in, 64]
            self._plain: torch.Tensor | None = None
        else:
            self._packed = None
            self._plain = w_in_out.contiguous()  # [in, out]
        self._narrow: torch.Tensor | None = None  # [T, in, 64] bfloat16, the same values
        if narrow_copy and self._packed is not None:
            narrow = w_in_out.to(torch.bfloat16)
            if torch.equal(narrow.float(), w_in_out):  # exactly representable: nothing changes but speed
                self._narrow = skinny_gemm.pack(narrow.contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return (self.in_features, self.out_features)

    @property
    def packed(self) -> bool:
        return self._packed is not None

    @property
    def narrow(self) -> bool:
        """Whether few-row calls stream a bfloat16 copy of the weight (see the module docstring)."""
        return self._narrow is not None

    def __call__(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] (+ add [M, out] or a bias [out]) -> [M, out]."""
        if self._packed is not None:
            packed = self._narrow if self._narrow is not None and x.shape[0] <= NARROW_ROWS else self._packed
            if add is not None and add.dim() == 1:
                add = add.expand(x.shape[0], self.out_features)  # bias: row stride 0
            if x.stride(-1) != 1:
                x = x.contiguous()
            return skinny_gemm.linear(x, packed, self.out_features, add)
        return x @ self._plain if add is None else torch.addmm(add, x, self._plain)

    def weight(self) -> torch.Tensor:
        """The weight as a plain [in, out] tensor (a copy when packed)."""
        if self._plain is not None:
            return self._plain
        t, k, nb = self._packed.shape
        return self._packed.permute(1, 0, 2).reshape(k, t * nb)[:, : self.out_features].contiguous()

    def select_outputs(self, keep: torch.Tensor) -> "Linear":
        """A new projection onto the output columns ``keep`` (e.g. a vocabulary-trimmed head)."""
        return Linear(self.weight()[:, keep])

    @property
    def nbytes(self) -> int:
        t = self._packed if self._packed is not None else self._plain
        return t.numel() * t.element_size()

    def data_ptr(self) -> int:
        return (self._packed if self._packed is not None else self._plain).data_ptr()
