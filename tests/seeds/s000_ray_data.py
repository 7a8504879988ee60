# Seed 000, "Data Ingestion with Ray Data" (indentation restored): the notebook's
# pipeline (the bucket path is a local parquet folder the corpus writes) and the
# train_func that reads its shard.
import ray

# Create a streaming dataset (doesn't load all data into memory)
ds = ray.data.read_parquet(PARQUET_PATH)
# Preprocessing pipeline
ds = ds.map(tokenize_function)
ds = ds.random_shuffle()

def train_func(config):
    train_ds = ray.train.get_dataset_shard("train")
    for epoch in range(num_epochs):
        # Iterate with batches — streaming, memory-efficient
        for batch in train_ds.iter_torch_batches(batch_size=32, device="cuda"):
            loss = model(batch["input_ids"], batch["labels"])
            ...
