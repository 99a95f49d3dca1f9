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
