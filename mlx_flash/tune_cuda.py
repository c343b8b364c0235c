"""The CUDA kernels' candidate space for the tuner (see tune_spaces.py for the interface).

mma.sync rows: P, T (multiples of 16), H (output columns per warp) halved or doubled, warps 4 <-> 8.
wgmma rows (sm_90): T by 16 either way and halved / doubled (a forward row's t<T>_from<N> T
instead, and that option dropped, where the timed problem has N keys or more); the forward and
dQ between two (P = 128) and three (P = 192) consumer warpgroups; dK/dV between P = 128 and 64;
the forward's pingpong and scale_fold options (and mma_sums at D = 49..64) on and off; the dK/dV
rows past D = 256 with and without roles. A row the kernels cannot take is rejected by
make_variant's own checks.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple

from . import planner
from .tune_spaces import _halve_double


class CudaSpace:
    target = "cuda"

    def __init__(self, family: Optional[str] = None, make_backend: Optional[Callable] = None):
        """Args:
            family: a kernels/families_cuda.txt name; None = this GPU's (or MLX_FLASH_CUDA_CAPABILITY's).
            make_backend: Tuning -> backend object; None = CUDABackend(tuning=...) (tests pass the
                CPU emulator's).
        """
        from .backends import cuda, cuda_source

        self._make_backend = make_backend or (lambda tuning: cuda.CUDABackend(tuning=tuning))
        self._backends = {}  # table -> backend: a candidate's kernels are built once per tuning
        backend = cuda.CUDABackend()
        self._family = cuda_source.family_named(family) if family else backend.family()
        if self._family is None:
            raise ValueError(f"no CUDA kernel family for compute capability {backend.capability()} "
                             f"(kernels/families_cuda.txt)")
        self._real_sm90 = backend.real_sm90()

    def family(self) -> str:
        return self._family.name

    def row_family(self, kernel: str, head_dim: int) -> str:
        from .backends import cuda_source

        wgmma = cuda_source.uses_wgmma(kernel, head_dim, self._family, cuda_source.Tuning(), self._real_sm90)
        return self._family.name + ("_wgmma" if wgmma else "")

    def candidates(self, row: planner.Row, head_dim: int, quick: bool, length: int = 0) -> List[planner.Row]:
        if row.family.endswith("_wgmma"):
            return self._wgmma_candidates(row, head_dim, quick, length)
        most_columns = -(-head_dim // 16) * 16
        out = [dataclasses.replace(row, traversal_block=t) for t in _halve_double(row.traversal_block, 16, 16, 128)]
        out += [dataclasses.replace(row, parallel_block=p) for p in _halve_double(row.parallel_block, 16, 16, 256)]
        out += [dataclasses.replace(row, warps=8 if (row.warps or 4) == 4 else 4)]
        if not quick:
            out += [dataclasses.replace(row, head_block=h)
                    for h in _halve_double(row.head_block, 16, 16, min(256, most_columns))]
            out += [dataclasses.replace(row, parallel_block=p, warps=8 if (row.warps or 4) == 4 else 4)
                    for p in _halve_double(row.parallel_block, 16, 16, 256)]
        return out

    def _wgmma_candidates(self, row: planner.Row, head_dim: int, quick: bool,
                          length: int = 0) -> List[planner.Row]:
        from .backends import cuda_source

        most = 256 if row.kernel == "forward" else 128
        # A forward row's t<T>_from<N>: a problem of N keys or more runs that T, so the T moves
        # move it (and one candidate drops it); a shorter one runs the row's T.
        long_keys = cuda_source.long_keys_option(row.cached, f"the {row.family} {row.kernel} row")
        wide = long_keys is not None and length >= long_keys[1]
        t = long_keys[0] if wide else row.traversal_block
        steps = [t - 16, t + 16] + ([] if quick else [t // 2, t * 2])
        moved = [v for v in dict.fromkeys(steps) if v % 16 == 0 and 16 <= v <= most and v != t]
        if wide:
            option = next(o for o in row.cached if cuda_source.LONG_KEYS.fullmatch(o))
            out = [dataclasses.replace(row, cached=row.cached - {option} | {f"t{v}_from{long_keys[1]}"})
                   for v in moved]
            out.append(dataclasses.replace(row, cached=row.cached - {option}))
        else:
            out = [dataclasses.replace(row, traversal_block=v) for v in moved]
        if row.kernel in ("forward", "backward_query"):
            shapes = [(128, 8), (192, 12)]
        else:
            shapes = [(128, 8), (64, 8)]
        out += [dataclasses.replace(row, parallel_block=p, warps=w) for p, w in shapes
                if (p, w) != (row.parallel_block, row.warps)]
        if row.kernel == "forward":
            # mma_sums only where it applies: O one 64-column V panel (D = 49..64)
            sums = (cuda_source.MMA_SUMS,) if -(-head_dim // 16) * 16 == 64 else ()
            out += [dataclasses.replace(row, cached=row.cached ^ {option})
                    for option in (cuda_source.PINGPONG, cuda_source.SCALE_FOLD, *sums)]
        if row.kernel == "backward_key_value" and row.max_head_dim > 256:
            out.append(dataclasses.replace(row, cached=row.cached ^ {cuda_source.ROLES}))
        return out

    def gate_keys(self, row: planner.Row) -> Tuple[int, ...]:
        """A wgmma forward row's t<T>_from<N>: N + 19 keys (a partial last block), where it runs."""
        from .backends import cuda_source

        if not row.family.endswith("_wgmma") or row.kernel != "forward":
            return ()
        long_keys = cuda_source.long_keys_option(row.cached, f"the {row.family} {row.kernel} row")
        return () if long_keys is None else (long_keys[1] + 19,)

    def invalid_reason(self, table: planner.Table, point) -> Optional[str]:
        from .backends import cuda_source
        from .tune import spec_for

        try:
            for long_keys in (False, True):  # the row's T and its t<T>_from<N>'s (the same variant without one)
                cuda_source.make_variant(point.kernel, spec_for(point, "none", 1, 1), None, self._family,
                                         cuda_source.Tuning(table=table), self._real_sm90, long_keys=long_keys)
        except ValueError as error:
            return str(error)
        return None

    def backend(self, table: planner.Table):
        from .backends import cuda_source

        if table not in self._backends:
            self._backends[table] = self._make_backend(cuda_source.Tuning(table=table))
        return self._backends[table]
