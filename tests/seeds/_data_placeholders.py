# What the Ray Data seed leaves to the reader, in the notebook: its bucket is a local
# parquet folder of 4 files x 64 rows of text, and `tokenize_function` turns a row
# into token ids.
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

PARQUET_PATH = os.path.abspath("tokens")
os.makedirs(PARQUET_PATH, exist_ok=True)
_rng = np.random.default_rng(0)
for _part in range(4):
    _text = [" ".join(map(str, _rng.integers(0, 50, 16))) for _ in range(64)]
    pq.write_table(pa.table({"text": _text}), f"{PARQUET_PATH}/part-{_part}.parquet")


def tokenize_function(row):
    ids = [int(t) for t in row["text"].split()]
    return {"input_ids": ids, "labels": ids}
