"""Plain helpers that tests of more than one family import (``from tests.helpers import ...``); fixtures live in
the conftest.py files."""
import importlib.util
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[1]  # the repository (or the unpacked sdist)


def load_script(path):
    """A script of the repository (``path`` from its root, e.g. "scripts/asv_backfill.py") as a module: the scripts
    are no package."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def oracle_cache(op, device, latest_only=False):
    """get(case, seed=0) -> (inputs, float64 oracle, eager reference in the case dtype) of ``op``'s case, computed
    once. ``latest_only``: only the latest case is kept (a float64 oracle at real sizes on a GPU is large)."""
    cache = {}

    def get(case, seed=0):
        if (case, seed) not in cache:
            if latest_only:
                cache.clear()
                if torch.device(device).type == "cuda":
                    torch.cuda.empty_cache()
            x = op.make_inputs(case, device, seed)
            cache[case, seed] = (x, op.oracle(case, x), op.oracle(case, x, dtype=case.torch_dtype))
        return cache[case, seed]

    return get


def tied_scores(queries, *keys, exponent, generator, lowest=0):
    """Query and key tensors (shapes ``queries``, ``keys``; float32 on the CPU) whose scores q . k are powers of two,
    -2^(2 exponent + a) with a drawn from {lowest, ..., 2} per key: many keys tie for each row's
    largest score, far from zero, with nothing but rounding between them and the next level (docs/methodology.md,
    "Score range"). Only column 0 carries the score; the queries' other columns are noise against keys that are
    zero there."""
    q = torch.randn(*queries, generator=generator)
    q[..., 0] = -(2.0 ** exponent)
    ks = []
    for shape in keys:
        k = torch.zeros(*shape)
        k[..., 0] = 2.0 ** (exponent + lowest + torch.randint(0, 3 - lowest, shape[:-1], generator=generator).float())
        ks.append(k)
    return (q, *ks)


def far_scores(queries, *keys, generator):
    """``tied_scores`` below -1e31: -2^104 at key 0 of the first key tensor (every row's largest, so its answer is
    that V's key 0) and -2^105 or -2^106 at the others. The GPU kernels take one fused multiply-add per score,
    fma(s, c, -m) with m the rounded c * max(s): its exact residual is ulp-sized, about 2^78 at scores near 2^100, so
    random scores that large read as NaN on a GPU. A power of two times c is exact, so the residual is 0 and the
    scores test what they should: rows whose scores all lie below -1e30 are attended
    (kernels/precision.ROW_MAX_START), not read as empty. The largest is unique: at |LSE| near 1e30 not even a
    float64 LSE holds log(ties) (docs/methodology.md, "Score range")."""
    q, *ks = tied_scores(queries, *keys, exponent=52, generator=generator, lowest=1)
    ks[0][..., 0, 0] = 2.0 ** 52
    return (q, *ks)
