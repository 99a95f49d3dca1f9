"""What every operator's cases share: dtype names, the case-set lookup and seeded inputs.

An operator (``registry.Operator``) owns named case sets and draws its inputs from a seed. The pieces
that do not depend on the operator live here, once: the dtype names a case carries (``"bfloat16"``)
with the torch dtype and the short form its label ends in (``bf16``), the lookup of a case set by name
(with the error that names the known sets), and the normal draws made on the CPU from a seeded
generator, so that a seed gives the same inputs on every device.
"""
import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}


def shard(cases, index: int, count: int) -> list:
    """Part ``index`` of ``count`` of a case list: every count-th case, so that sizes mix across parts (a warm
    worker's share, or a ``--shard`` run that one device call has room for)."""
    return list(cases)[index::count]


def base_case_set(name):
    """The case set a run's ``case_set`` names, without what narrowed it (" matching '<regex>'", " shard K/N")."""
    return (name or "").split(" matching ")[0].split(" shard ")[0]


def label_dtype(label):
    """The dtype name (a key of DTYPES) a case label ends in, or None (every operator's labels end in SHORT_DTYPE's)."""
    return {short: name for name, short in SHORT_DTYPE.items()}.get(label.split()[-1]) if label else None


class DtypeNamed:
    """For a case dataclass whose ``dtype`` field is a key of DTYPES: the torch dtype and the label's form."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def short_dtype(self) -> str:
        """How the case's label names its dtype: fp16, bf16, fp32 or fp64."""
        return SHORT_DTYPE[self.dtype]


def case_set(op_name: str, sets: dict, set_name: str) -> list:
    """The cases of ``sets[set_name]()`` (``sets``: set name -> () -> cases); a ValueError naming the known
    sets for any other name."""
    if set_name not in sets:
        raise ValueError(f"{op_name}: case set must be one of {sorted(sets)}, got {set_name!r}")
    return sets[set_name]()


def case_rows(case_type, rows, dtypes) -> list:
    """``case_type(*row, dtype=dtype)`` for each row of a shape table and, within a row, each of ``dtypes``."""
    return [case_type(*row, dtype=dt) for row in rows for dt in dtypes]


def table_sets(case_type, tiny, gpu, anchor, tiny_dtypes=("float32", "float16")) -> dict:
    """The three case sets every operator builds from shape tables, with the dtypes each set is for: ``tiny``
    (the CPU gate, through the interpreter: ``tiny_dtypes``), ``gpu`` (real sizes in both 16-bit dtypes) and
    ``anchor`` (the timed cases, bf16)."""
    return {"tiny": lambda: case_rows(case_type, tiny, tiny_dtypes),
            "gpu": lambda: case_rows(case_type, gpu, ("bfloat16", "float16")),
            "anchor": lambda: case_rows(case_type, anchor, ("bfloat16",))}


def seeded_normal(seed: int):
    """randn(*shape) -> float32 standard normals on the CPU, drawn in call order from one generator seeded
    with ``seed``: the same values on every device the caller then moves them to."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    return randn


def seeded_inputs(seed: int, shapes: dict, device, dtype) -> dict:
    """{name: tensor} for ``shapes`` ({name: shape}, drawn in that order by ``seeded_normal(seed)``), each
    moved to ``device`` and cast to ``dtype``."""
    randn = seeded_normal(seed)
    return {name: randn(*shape).to(device=device, dtype=dtype) for name, shape in shapes.items()}
