# What the Hugging Face seeds leave to the reader, small and on CPU: `model`,
# `train_ds`/`eval_ds`/`train_dataset` (token ids, different on each rank, so only
# DDP keeps the ranks' weights equal), `config`, and LOCAL_GPT2: a tiny GPT-2 and a
# word-level tokenizer saved to a folder, where the seeds name "gpt2" (a download).
import os

import torch
from accelerate import PartialState
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

import rtnb


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        seed = i + 1000 * rtnb.get_context().world_rank
        ids = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": ids, "labels": ids}


torch.manual_seed(0)
tiny = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16,
                  bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(tiny)
train_ds = eval_ds = train_dataset = Tokens()
config = {"batch_size": 4, "epochs": 2, "lr": 1e-3}

LOCAL_GPT2 = os.path.abspath("tiny-gpt2")
if rtnb.get_context().world_rank == 0:  # transformers saves from the main process only
    GPT2LMHeadModel(tiny).save_pretrained(LOCAL_GPT2)
    words = Tokenizer(models.WordLevel({str(i): i for i in range(50)}, unk_token="0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="0").save_pretrained(LOCAL_GPT2)
torch.distributed.barrier()


def trainer_world_size():
    return PartialState().num_processes


def weights(m):
    return round(float(sum(p.detach().sum() for p in m.parameters())), 4)
