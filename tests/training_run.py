"""A real HF Trainer run of the tiny model with `save_total_limit=2`, as a user runs one beside `bema --follow`.

A callback copies every checkpoint aside as soon as the Trainer saved it (before a later save
rotates it away), so tests can compare what `bema stabilize --follow` produced against a
one-shot run over the whole copied trajectory. `pause` seconds after each save stand in for
the training time between checkpoints of a real run.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path


def chat_examples(tokenizer, n: int = 16) -> list[dict]:
    from bema_cli.demo.tinymodel import default_corpus
    from bema_cli.demo.training import encode_text

    return encode_text(tokenizer, default_corpus(n=n, seed=1), max_len=64)


def train_with_rotation(
    base_dir: Path, run_dir: Path, copies_dir: Path, *, steps: int, save_every: int, pause: float = 0.0
) -> list[int]:
    """Fine-tune the model in base_dir with the HF Trainer (save_total_limit=2); returns the saved steps."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from bema_cli.demo.training import _ListDataset, _pad_collator

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    saved: list[int] = []

    class CopyAside(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            name = f"checkpoint-{state.global_step}"
            shutil.copytree(run_dir / name, copies_dir / name)
            saved.append(state.global_step)
            time.sleep(pause)

    args = TrainingArguments(
        output_dir=str(run_dir),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        save_strategy="steps",
        save_steps=save_every,
        save_total_limit=2,
        save_only_model=True,
        logging_steps=1000,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        data_seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_ListDataset(chat_examples(tokenizer)),
        data_collator=_pad_collator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=[CopyAside()],
    )
    trainer.train()
    return saved
