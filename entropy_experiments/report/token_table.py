"""The E token table of a run directory (docs/attribution.md): one row per realised E token with the columns
`sequence` (row in E_batch.pt's order, n = b·G + g), `position` (0-based in the response), `token_id`, `token`
(decoded text), `H` (entropy of q at that prefix, nats) and `dH` (lr·D_v H, its predicted change along the step,
nats), H and dH float64. Written as E_tokens.parquet when pyarrow is installed, else as E_tokens.jsonl (strict
JSON, one object per token); written atomically like every run file.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from .. import io_utils
from ..errors import OutputError, output_error_on_os_error
from .results_schema import dumps_strict
from .run_dir import E_TOKENS_FILES

COLUMNS = ("sequence", "position", "token_id", "token", "H", "dH")
INT_COLUMNS = ("sequence", "position", "token_id")


def has_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def write_token_table(run_dir: str | Path, columns: dict) -> Path:
    """Write the table (`columns`: {name: [n] values} for exactly COLUMNS) into `run_dir`; returns its path."""
    if set(columns) != set(COLUMNS):
        raise ValueError(f"token table columns must be {COLUMNS}, got {sorted(columns)}")
    parquet, jsonl = (Path(run_dir) / name for name in E_TOKENS_FILES)
    ints = {c: np.asarray(columns[c], dtype=np.int64) for c in INT_COLUMNS}
    floats = {c: np.asarray(columns[c], dtype=np.float64) for c in ("H", "dH")}
    tokens = [str(t) for t in columns["token"]]
    if has_pyarrow():
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"sequence": ints["sequence"], "position": ints["position"], "token_id": ints["token_id"],
                          "token": pa.array(tokens, pa.string()), "H": floats["H"], "dH": floats["dH"]})
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        path, data = parquet, buffer.getvalue()
    else:
        rows = zip(*(ints[c].tolist() for c in INT_COLUMNS), tokens, floats["H"].tolist(), floats["dH"].tolist())
        path, data = jsonl, "".join(dumps_strict(dict(zip(COLUMNS, row))) + "\n" for row in rows).encode()
    with output_error_on_os_error(f"cannot write {path}"):
        io_utils.atomic_write_bytes(path, data)
    return path


def read_token_table(run_dir: str | Path) -> dict | None:
    """{column: list} of a run directory's token table (parquet first, then jsonl); None when it has none."""
    parquet, jsonl = (Path(run_dir) / name for name in E_TOKENS_FILES)
    try:
        if parquet.exists():
            import pyarrow.parquet as pq

            return {c: list(v) for c, v in pq.read_table(parquet).to_pydict().items()}
        if jsonl.exists():
            rows = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines() if line.strip()]
            return {c: [row[c] for row in rows] for c in COLUMNS}
    except ImportError as err:
        raise OutputError(f"cannot read {parquet}: pyarrow is not installed") from err
    except (OSError, ValueError, KeyError) as err:
        raise OutputError(f"cannot read the E token table in {run_dir}: {err}") from err
    return None
